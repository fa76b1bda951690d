"""The shared training loop of the demo and the MNIST-1D table.

Adam on the cross-entropy with a cosine learning-rate schedule, minibatches from a
``torch.utils.data.DataLoader`` (a seeded shuffle of the set's training part, or a loader of
your own yielding ``(x, y)`` or ``(x, y, index)``), optional shift augmentation (the same for
every model), optional warm starts of the equilibrium layer from each sample's last
equilibrium (``TrainConfig.warm_start``, for layers whose certificate makes it unique;
docs/guide.md, training speed); per epoch it logs the mean
loss, the accuracy on the held-out part and, for an
:class:`~lowering.runtime.classifier.EquilibriumClassifier`, the forward and backward solver
statistics (:class:`~lowering.runtime.classifier.StatsMeter`).  Convergence warnings of the
equilibrium layers are counted from those statistics, not printed per step; those of the
held-out evaluations are counted per epoch and warned once, for the final evaluation.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from convex_eq.errors import ConvergenceWarning, OptionError
from lowering.runtime.classifier import EquilibriumClassifier, StatsMeter

from .data import Dataset, random_shift


@dataclass
class TrainConfig:
    """Optimiser, schedule and budget; ``shift``: shift augmentation of ±``shift`` positions
    along the last axis (0 = off); ``device``: where the model and data live."""

    epochs: int = 15
    batch: int = 64
    lr: float = 1e-2
    weight_decay: float = 0.0
    seed: int = 0
    shift: int = 0
    device: str = "cpu"
    eval_batch: int = 1000
    #: evaluate the held-out accuracy every ``eval_every`` epochs and after the last (the other
    #: epochs' ``test_acc`` is NaN: not measured); on a large test set this dominates an epoch
    eval_every: int = 1
    #: start each training sample's solve from its equilibrium of the epoch before (an
    #: EquilibriumClassifier whose layer has a uniqueness certificate; refused otherwise)
    warm_start: bool = False
    #: γ of Jacobian regularisation: the loss is cross-entropy + γ·(Hutchinson estimate of
    #: ||∂T/∂z||_F² / (B·N) at the equilibrium), for fewer solver iterations (an
    #: EquilibriumClassifier; 0 = off; docs/guide.md, training speed)
    jacobian_reg: float = 0.0
    #: ``(start, end)``: the forward tolerance of epoch ``e`` of ``E`` is
    #: ``start·(end/start)^(e/(E−1))``, loose early and tight at the end; the adjoint follows it
    #: unless the module sets its own ``backward_tol`` (an EquilibriumClassifier; None = the
    #: module's own tolerance throughout; ``fit`` restores the module's tolerance when it ends)
    tol_schedule: tuple[float, float] | None = None


@dataclass
class Result:
    """One trained model: final accuracy on the held-out part, size, time and the per-epoch
    history (``loss`` (the cross-entropy), ``test_acc``, ``fwd_iters``, ``bwd_iters``,
    ``fwd_capped``, ``bwd_capped``, ``tol`` (the epoch's forward tolerance), ``jacobian`` (the mean
    penalty, with Jacobian regularisation), ``seconds``; in an evaluated epoch also
    ``test_unconverged`` and ``test_max_residual``, see :func:`held_out`)."""

    name: str
    accuracy: float = 0.0
    params: int = 0
    mean_iterations: float = float("nan")
    final_residual: float = float("nan")
    verification: str = "—"
    train_time: float = 0.0
    #: training steps whose (forward, adjoint) solve stopped at the iteration cap
    nonconvergence: tuple[int, int] = (0, 0)
    history: list[dict[str, float]] = field(default_factory=list)


def n_params(m: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


def resolve_device(device: str | None) -> torch.device:
    """``"auto"``/None: CUDA when available, else CPU; otherwise the named device (an error
    naming what to do when CUDA is asked for and absent)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"device {device!r} requested but torch sees no CUDA device",
                          term="--device", hint="use --device cpu (or auto)")
    return dev


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    """Fraction of correctly classified samples (evaluation mode, no gradients)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    return correct / max(1, len(x))


def held_out(model: nn.Module, eq: EquilibriumClassifier | None, x: torch.Tensor,
             y: torch.Tensor, batch: int = 1000) -> dict[str, float]:
    """``test_acc`` of ``model`` on ``(x, y)`` and, for an equilibrium model, ``test_unconverged``
    (held-out samples whose forward solve stopped at the cap before ``tol``) and
    ``test_max_residual`` (the worst relative residual): counted per batch instead of one
    warning per batch, which would flood a training log."""
    if eq is None:
        return {"test_acc": accuracy(model, x, y, batch)}
    model.eval()
    correct = unconverged = 0
    worst = 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # counted here, warned once by fit
        for i in range(0, len(x), batch):
            eq.reset_stats()
            correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
            f = eq.solver_stats().forward
            if f is not None:
                unconverged += f.unconverged
                worst = max(worst, f.max_residual)
    return {"test_acc": correct / max(1, len(x)), "test_unconverged": unconverged,
            "test_max_residual": worst}


def _warn_unconverged_test(name: str, eq: EquilibriumClassifier, row: dict[str, float],
                           n: int) -> None:
    """One :class:`ConvergenceWarning` for the last evaluation's unconverged held-out samples."""
    k = int(row.get("test_unconverged", 0))
    if k and eq.eq.backward == "unroll":  # the layer is the K-step map: no cap, no max_iter
        steps = eq.eq.config.backward.unroll_steps
        warnings.warn(ConvergenceWarning(
            f"{name}: {k}/{n} held-out samples are not at tol={eq.eq.tol:g} after the layer's "
            f"K = {steps} unrolled steps (backward='unroll' returns the K-th iterate; worst "
            f"relative residual {row['test_max_residual']:.3e}): the accuracy is that of the "
            f"K-step map, not of equilibria. Hint: a larger unroll_steps (now {steps}) comes "
            f"closer to the equilibrium"), stacklevel=3)
    elif k:
        warnings.warn(ConvergenceWarning(
            f"{name}: the forward solve of {k}/{n} held-out samples stopped at its cap of "
            f"{eq.eq.max_iter} iterations before tol={eq.eq.tol:g} in the final evaluation "
            f"(worst relative residual {row['test_max_residual']:.3e}); the accuracy is that "
            f"of those iterates, not of equilibria (per epoch: history's test_unconverged). "
            f"Hint: raise max_iter (now {eq.eq.max_iter})"), stacklevel=3)


class IndexedTensors(torch.utils.data.Dataset):
    """``(x[i], y[i], i)``: tensors as a map-style dataset that also yields each sample's index
    (what warm starts are keyed on); indexing with a list of indices returns a whole batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(i, device=self.y.device)
        return self.x[idx], self.y[idx], idx


def batches(x: torch.Tensor, y: torch.Tensor, batch: int, generator: torch.Generator
            ) -> torch.utils.data.DataLoader:
    """A loader of shuffled minibatches ``(x, y, index)`` of in-memory tensors (one tensor
    indexing per batch: a ``BatchSampler`` over a seeded ``RandomSampler``)."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    ds = IndexedTensors(x, y)
    sampler = BatchSampler(RandomSampler(ds, generator=generator), batch, drop_last=False)
    return DataLoader(ds, sampler=sampler, batch_size=None)


def fit(model: nn.Module, data: Dataset | torch.utils.data.DataLoader, cfg: TrainConfig,
        name: str, progress: bool = False,
        on_epoch: Callable[[dict[str, float]], None] | None = None,
        test: tuple[torch.Tensor, torch.Tensor] | None = None) -> Result:
    """Train ``model`` on ``data`` — a :class:`~convex_eq_app.data.Dataset` (its test part is only
    evaluated, every ``cfg.eval_every`` epochs and after the last, for the history and the final
    accuracy) or a
    ``torch.utils.data.DataLoader`` of ``(x, y)`` or ``(x, y, index)`` batches with ``test``
    the held-out ``(x, y)`` — and return the :class:`Result`."""
    from tqdm import tqdm

    dev = resolve_device(cfg.device)
    model.to(dev)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if isinstance(data, Dataset):
        data = data.to(dev)
        loader = batches(data.x_train, data.y_train, cfg.batch, gen)
        test = (data.x_test, data.y_test)
    elif test is None:
        raise OptionError("a DataLoader trains, but nothing is held out to report accuracy on",
                          term="fit", hint="pass test=(x_test, y_test)")
    else:
        loader = data
    x_test, y_test = (t.to(dev) for t in test)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    eq = model if isinstance(model, EquilibriumClassifier) else None
    if cfg.warm_start:
        if eq is None:
            raise OptionError(f"warm_start applies to an EquilibriumClassifier, not to "
                              f"{type(model).__name__}", term="TrainConfig.warm_start",
                              hint="train this model with warm_start=False")
        eq.enable_warm_start(len(loader.dataset))  # a typed error without uniqueness
    _check_speed_options(cfg, eq, model)
    if cfg.eval_every < 1:
        raise OptionError(f"eval_every = {cfg.eval_every} must be ≥ 1",
                          term="TrainConfig.eval_every", hint="1 evaluates after every epoch")
    res = Result(name, params=n_params(model))
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.epochs), desc=f"{name:<24}", disable=not progress, leave=True)
    fwd_capped = bwd_capped = 0
    saved_tol = eq.eq.config.forward.tol if eq is not None else None
    try:
        for epoch in bar:
            te = time.perf_counter()
            if cfg.tol_schedule is not None and eq is not None:
                eq.eq.config.forward.tol = scheduled_tol(cfg.tol_schedule, epoch, cfg.epochs)
            loss, meter, penalty = _epoch(model, eq, loader, opt, cfg, gen, dev)
            sched.step()
            last = epoch + 1 == cfg.epochs
            row: dict[str, float] = {"epoch": epoch + 1, "loss": loss, "test_acc": float("nan")}
            if last or (epoch + 1) % cfg.eval_every == 0:
                row.update(held_out(model, eq, x_test, y_test, cfg.eval_batch))
            acc = row["test_acc"]
            if eq is not None:
                s = meter.summary()
                row.update(s)
                row["tol"] = eq.eq.tol
                if cfg.jacobian_reg > 0:
                    row["jacobian"] = penalty
                fwd_capped += int(s["fwd_capped"])
                bwd_capped += int(s["bwd_capped"])
            row["seconds"] = time.perf_counter() - te
            res.history.append(row)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}")
            if on_epoch is not None:
                on_epoch(row)
        res.train_time = time.perf_counter() - t0
        res.accuracy = res.history[-1]["test_acc"] if res.history else \
            accuracy(model, x_test, y_test, cfg.eval_batch)
        if eq is not None:
            res.nonconvergence = (fwd_capped, bwd_capped)
            _warn_unconverged_test(name, eq, res.history[-1] if res.history else {},
                                   len(y_test))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                st = eq.measure(x_test[: cfg.eval_batch])
            res.mean_iterations = float(st.iterations.double().mean())
            res.final_residual = st.max_residual
    finally:  # the schedule is training's: the module keeps the tolerance it was built with
        if eq is not None and cfg.tol_schedule is not None:
            eq.eq.config.forward.tol = saved_tol
    return res


def _finite_number(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _check_speed_options(cfg: TrainConfig, eq: EquilibriumClassifier | None,
                         model: nn.Module) -> None:
    """Jacobian regularisation and the tolerance schedule: valid values, and only for an
    equilibrium model (refused, never ignored, for another)."""
    if not (_finite_number(cfg.jacobian_reg) and cfg.jacobian_reg >= 0):
        raise OptionError(f"jacobian_reg = {cfg.jacobian_reg!r} must be a finite number ≥ 0",
                          term="TrainConfig.jacobian_reg", hint="0 turns it off")
    sched = cfg.tol_schedule
    if sched is not None and not (len(sched) == 2 and all(_finite_number(t) and t > 0
                                                         for t in sched)):
        raise OptionError(f"tol_schedule = {sched!r} must be two tolerances (start, end) > 0",
                          term="TrainConfig.tol_schedule", hint="e.g. (1e-2, 1e-4)")
    used = [n for n, on in (("jacobian_reg", cfg.jacobian_reg > 0),
                            ("tol_schedule", sched is not None)) if on]
    if used and eq is None:
        raise OptionError(f"{', '.join(used)} applies to an EquilibriumClassifier, not to "
                          f"{type(model).__name__}", term=f"TrainConfig.{used[0]}",
                          hint="train this model without it")


def scheduled_tol(schedule: tuple[float, float], epoch: int, epochs: int) -> float:
    """``start·(end/start)^(e/(E−1))`` for epoch ``e`` (from 0) of ``E`` (one epoch: ``end``)."""
    start, end = schedule
    if epochs <= 1:
        return float(end)
    return float(start * (end / start) ** (epoch / (epochs - 1)))


def _epoch(model: nn.Module, eq: EquilibriumClassifier | None,
           loader: torch.utils.data.DataLoader, opt: torch.optim.Optimizer, cfg: TrainConfig,
           gen: torch.Generator, dev: torch.device) -> tuple[float, StatsMeter, float]:
    """One pass over ``loader``: ``(mean cross-entropy, the solver statistics of its steps,
    mean Jacobian penalty)``."""
    model.train()
    meter = StatsMeter()
    tot, pen_tot, nb = 0.0, 0.0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # counted from the stats
        for batch in loader:
            xb, yb = batch[0].to(dev), batch[1].to(dev)
            ids = batch[2] if len(batch) > 2 and cfg.warm_start else None
            if cfg.shift:
                xb = random_shift(xb, cfg.shift, gen)
            if eq is not None:
                eq.reset_stats()
            if cfg.jacobian_reg > 0:
                logits, penalty = model(xb, sample_ids=ids, jacobian_penalty=True)
                loss = nn.functional.cross_entropy(logits, yb)
                pen_tot += float(penalty.detach())
                total = loss + cfg.jacobian_reg * penalty
            else:
                logits = model(xb, sample_ids=ids) if ids is not None else model(xb)
                loss = total = nn.functional.cross_entropy(logits, yb)
            opt.zero_grad()
            total.backward()
            opt.step()
            if eq is not None:
                meter.update(eq.solver_stats())
            tot += float(loss.detach())
            nb += 1
    return tot / max(nb, 1), meter, pen_tot / max(nb, 1)


def verify_layer(model: EquilibriumClassifier, x: torch.Tensor, k: int) -> str:
    """Worst verification gap of the trained layer on ``k`` inputs against its docs/theory.md §9
    reference (CVXPY or the local reference): relative state error and the verdict (the model
    is moved to the CPU)."""
    from verify.check import check

    model.cpu()
    with torch.no_grad():  # (a stem's output needs no graph here)
        inp = model.layer_inputs(x[:k].detach().cpu())
    inp = {n: t.double() for n, t in inp.items()} if isinstance(inp, dict) else inp.double()
    rep = check(model.eq, inp)
    errs = [s.rel_error if s.rel_error is not None else s.residual for s in rep.samples]
    why = "; ".join(rep.failures)
    # a table cell: the first 90 characters, and an ellipsis where the reason was cut
    verdict = "pass" if rep.passed else f"FAIL: {why[:90]}{'…' if len(why) > 90 else ''}"
    return f"{max(errs):.1e} ({rep.reference.kind}: {rep.label}, {verdict})"


def effective_weights(eq: Any) -> dict[str, torch.Tensor]:
    """The weights a module actually uses (after spectral-norm control), as a state dict."""
    with torch.no_grad():
        return {f"weights.{k}": v.detach().cpu().clone() for k, v in eq.env().items()
                if k in eq.weights}
