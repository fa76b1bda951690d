"""Training and evaluating the runs of the claim runner.

Models are built from the seed objectives of :mod:`convex_eq.models` (registry :data:`MODELS`),
wrapped in :class:`lowering.runtime.classifier.EquilibriumClassifier` and trained by the shared loop
:func:`convex_eq_app.training.fit` on the data of :mod:`convex_eq_app.data`; the trained model is
then measured by the evaluators its runs ask for (registry :data:`EVALUATORS`).  Runs go to
``budget.workers`` spawned processes (one torch thread each) or run in this process.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convex_eq.errors import ConvergenceWarning, OptionError

from .registry import Budget, Results, RunSpec

#: MNIST-1D signals have one channel of 40 positions; the dense layers see them flat
SIGNAL = 40


# ----------------------------------------------------------------------------- data
@lru_cache(maxsize=2)
def dataset(budget: Budget) -> Any:
    """The budget's data set (:func:`convex_eq_app.data.load`), cut to ``budget.train`` /
    ``budget.test`` samples (the first ones: the generator's order is already random)."""
    from convex_eq_app.data import load

    d = load(budget.dataset)
    return replace(d, x_train=d.x_train[:budget.train], y_train=d.y_train[:budget.train],
                   x_test=d.x_test[:budget.test], y_test=d.y_test[:budget.test])


def flat(d: Any) -> Any:
    """The data set with every sample flattened (the dense layers' input ``x ∈ R^40``)."""
    return replace(d, x_train=d.x_train.flatten(1), x_test=d.x_test.flatten(1))


def _registrar(table: dict[str, Any]) -> Callable[[str], Callable[[Any], Any]]:
    """``@register(name)``: put the decorated function into ``table`` under ``name``."""
    def register(name: str) -> Callable[[Any], Any]:
        def deco(fn: Any) -> Any:
            table[name] = fn
            return fn
        return deco
    return register


# ----------------------------------------------------------------------------- models
#: model name → builder ``(params, budget, seed) → nn.Module``
ModelBuilder = Callable[[dict[str, Any], Budget, int], nn.Module]
MODELS: dict[str, ModelBuilder] = {}
register_model = _registrar(MODELS)


def _classifier(objective: Any, **settings: Any) -> nn.Module:
    """``EquilibriumClassifier`` (flattened state → linear head) with the shared training
    settings; ``unroll_steps`` (K of ``backward="unroll"``) is passed to the module."""
    import lowering
    from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

    k = settings.pop("unroll_steps", None)
    ts = TrainingSettings(**settings)
    derived = lowering.lower(objective)
    if k is not None:
        base = ts.module_options

        def with_k(d: Any) -> dict[str, Any]:
            return {**base(d), "unroll_steps": int(k)}

        ts.module_options = with_k  # type: ignore[method-assign]
    return EquilibriumClassifier(derived, ts, pool="none")


@register_model("opteq")
def _opteq(kw: dict[str, Any], b: Budget, seed: int) -> nn.Module:
    """OptEq (canonical form, dense ``W: w×w``); ``reg``: ``"l1"`` adds ``λ||z||₁``, ``"l2"``
    adds ``λ||z||²`` to the hidden objective (TPAMI §5.1, the implicit regulariser R*_z)."""
    from convex_eq import models
    from convex_eq.objective import Objective
    from convex_eq.terms import L1

    obj = models.opteq(n=b.width, m=b.width, d=SIGNAL, seed=seed)
    z = obj.states[0]
    reg, lam = kw.get("reg"), float(kw.get("lam", 0.0))
    if reg == "l1":
        obj = obj + lam * L1(z)
    elif reg == "l2":
        # G + λ||z||² = Σf_σ(z) + (1+2λ)·½||z||² − <q,z> − ½||Wz||² has the minimizers of
        # Σf_σ(z) + ½||z||² − s<q,z> − s·½||Wz||², s = 1/(1+2λ) (f_σ of ReLU is an indicator,
        # unchanged by scaling): the layer z = σ(s(WᵀWz + q)), a contraction for every λ ≥ 0.
        # (Adding 2λ·SqNorm(z) to G lowers to z = σ(q + WᵀWz − 2λz), Lip ||W||² + 2λ, which
        # does not converge for λ = 10.)
        potential, sq, lin, quad = obj.terms
        s = 1.0 / (1.0 + 2.0 * lam)
        obj = Objective([potential, sq, lin * s, quad * s], name=f"opteq+{lam:g}||z||²")
    elif reg is not None:
        raise OptionError(f"unknown regulariser {reg!r}", term="reproduce", hint="l1 or l2")
    return _classifier(obj)


@register_model("deep_opteq")
def _deep_opteq(kw: dict[str, Any], b: Budget, seed: int) -> nn.Module:
    """Deep OptEq with ``L`` layers and fixed ``alpha``; ``backward="unroll"`` trains through
    ``K`` plain iterations (forward = those K iterations), ``"implicit"`` solves to ``tol``."""
    from convex_eq import models

    obj = models.deep_opteq(L=int(kw.get("L", 3)), n=b.width, m=b.width, d=SIGNAL,
                            alpha=float(kw["alpha"]), seed=seed)
    if kw.get("backward", "unroll") == "unroll":
        return _classifier(obj, backward="unroll", unroll_steps=int(kw.get("K", 20)))
    return _classifier(obj, backward="implicit", tol=float(kw["tol"]),
                       max_iter=int(kw.get("max_iter", 100)))


@register_model("geq")
def _geq(kw: dict[str, Any], b: Budget, seed: int) -> nn.Module:
    """GEQ (dense Gaussian kernel, ``p = w``) with ``γ = c/w``: at initialization
    ``E||Ux + b||² ≈ w`` for standardized inputs, so ``c ≈ γ·E||Ux+b||²`` (GEQ sets
    ``γ = 0.2/M`` with M the smallest squared kernel argument)."""
    from convex_eq import models

    gamma = float(kw["c"]) / b.width
    obj = models.geq(n=b.width, p=b.width, d=SIGNAL, gamma=gamma, seed=seed)
    return _classifier(obj, weight_bounds={"W": 1.0})


@register_model("mopteq")
def _mopteq(kw: dict[str, Any], b: Budget, seed: int) -> nn.Module:
    """MOptEq (:func:`convex_eq.models.conv_mopteq`): two 1-D conv branches of ``max(2, w/16)``
    channels at scales 1 and 2 (kernels 3 and 7), ``λ = 0.05``, ``||W_i||₂ ≤ ζ`` as in the
    MNIST-1D table; ``fusion`` ``"HD"`` | ``"H"`` | ``"none"`` (POptEq); ``pe`` > 0: the
    perturbation-enhanced layer of that ε (:func:`lowering.perturbation_enhanced`)."""
    import lowering
    from convex_eq import models
    from convex_eq_app.configs import TableConfig
    from convex_eq_app.table import branch_bounds
    from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

    pe, fusion = float(kw.get("pe", 0.0)), str(kw.get("fusion", "HD"))
    obj = models.conv_mopteq(image=(1, SIGNAL), channels=max(2, b.width // 16), kernels=(3, 7),
                             scales=(1, 2), lam=0.05, fusion=fusion, seed=seed,
                             branch_inputs=pe > 0)
    layer = lowering.lower(obj)
    if pe > 0:
        layer = lowering.perturbation_enhanced(layer, pe)
    settings = TrainingSettings(weight_bounds=branch_bounds(TableConfig()))
    return EquilibriumClassifier(layer, settings, pool="none")


@register_model("mlp")
def _mlp(kw: dict[str, Any], b: Budget, seed: int) -> nn.Module:
    """``40 → h → 10`` ReLU MLP with about ``params`` parameters (``51h + 10``)."""
    torch.manual_seed(seed)
    h = max(4, round((int(kw["params"]) - 10) / (SIGNAL + 11)))
    return nn.Sequential(nn.Linear(SIGNAL, h), nn.ReLU(), nn.Linear(h, 10))


# ----------------------------------------------------------------------------- evaluators
#: evaluation name → ``(trained model, budget, spec) → metrics``
Evaluator = Callable[[nn.Module, Budget, RunSpec], dict[str, Any]]
EVALUATORS: dict[str, Evaluator] = {}
register_evaluator = _registrar(EVALUATORS)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _test(b: Budget, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    d = flat(dataset(b))
    dev = _device(model)
    return d.x_test.to(dev), d.y_test.to(dev)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    from convex_eq_app.training import accuracy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return accuracy(model, x, y)


@register_evaluator("features")
def _features(model: nn.Module, b: Budget, spec: RunSpec) -> dict[str, Any]:
    """Mean ``|z_j|`` and mean ``z_j²`` over every entry of the test equilibria (TPAMI Tab. 3:
    "the mean values are taken on the whole feature tensor")."""
    x, _ = _test(b, model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.eval()
        z = model.features(x)  # type: ignore[operator]
    z = torch.cat([t.flatten(1) for t in z], 1) if isinstance(z, tuple) else z.flatten(1)
    return {"mean_abs": float(z.abs().mean()), "mean_sq": float((z * z).mean())}


#: TPAMI Tab. 8 times 80 steps at batch 125; a miniature times ``TIMED_BATCHES`` of them
TIMED_BATCH, TIMED_BATCHES = 125, 8


@register_evaluator("timing")
def _timing(model: nn.Module, b: Budget, spec: RunSpec) -> dict[str, Any]:
    """TPAMI Tab. 8 in miniature: inference time (forward, no gradient) and back-propagation
    time (``loss.backward()`` alone) summed over ``TIMED_BATCHES`` batches of 125, and the
    relative residual ``||T(z) − z||/||T(z)||`` of the returned state averaged over the test
    set."""
    d = flat(dataset(b))
    dev = _device(model)
    xs = [d.x_test[i:i + TIMED_BATCH].to(dev) for i in range(0, len(d.x_test), TIMED_BATCH)]
    starts = range(0, min(len(d.x_train), TIMED_BATCH * TIMED_BATCHES), TIMED_BATCH)
    xt = [d.x_train[i:i + TIMED_BATCH].to(dev) for i in starts]
    yt = [d.y_train[i:i + TIMED_BATCH].to(dev) for i in starts]
    eq = model.eq  # type: ignore[attr-defined]
    res, infer, bp = [], 0.0, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.eval()
        with torch.no_grad():
            for x in xs:
                _, st = eq(x, return_stats=True)
                res.append(st.final_residual.double())
            for x in xs[:TIMED_BATCHES]:
                _sync(dev)
                t0 = time.perf_counter()
                model(x)
                _sync(dev)
                infer += time.perf_counter() - t0
        model.train()
        for x, y in zip(xt, yt):
            loss = nn.functional.cross_entropy(model(x), y)
            _sync(dev)
            t0 = time.perf_counter()
            loss.backward()
            _sync(dev)
            bp += time.perf_counter() - t0
        model.zero_grad()
    return {"residual": float(torch.cat(res).mean()), "infer_s": infer, "backprop_s": bp,
            "batches": min(len(xs), TIMED_BATCHES)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


#: perturbation sizes ε (ℓ∞, standardized input units) of MOptEq Fig. 3(a)'s x axis
EPSILONS = (0.05, 0.1, 0.2, 0.3)
#: ε at which PE's robustness is compared (PE's training ε on CIFAR-10, MOptEq A.6.1)
EPS_ROBUST = 0.1
#: random directions averaged per ε (MOptEq Fig. 3(a): "averaged for five trials")
TRIALS = 5


def reconstructed_input(model: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x − δ`` with ``δ = argmax_{||δ||∞≤ε} G(z*; x − δ) = −ε·sign(∇_x G(z*; x))`` derived
    from the model's hidden objective (:func:`lowering.perturbation.perturbation`; MOptEq
    Proposition 2), ``z*`` the equilibrium of ``x``; a layer with one input per branch (all fed
    the same x) gets the gradient summed over its inputs."""
    from lowering.perturbation import perturbation

    eq = model.eq  # type: ignore[attr-defined]
    pert = perturbation(eq.derived.source, eps)
    env = eq.env()  # the trained (effective) weights
    with torch.no_grad():
        z = model.features(x)  # type: ignore[operator]
        blocks = z if isinstance(z, tuple) else (z,)
        values = {b.name: t.flatten(1) for b, t in zip(eq.blocks, blocks)}
        flat_x = x.flatten(1)
        values.update({s.name: flat_x for s in eq.input_syms})
        grad = torch.zeros_like(flat_x)
        for t in pert.terms:
            for g in t.grad(values, env, wrt="input").values():
                grad = grad + g
    return x + eps * torch.sign(grad).reshape(x.shape)


@register_evaluator("perturbation")
def _perturbation(model: nn.Module, b: Budget, spec: RunSpec) -> dict[str, Any]:
    """Test accuracy under the objective-derived perturbation and under random ±ε (binomial)
    and uniform [−ε, ε] noise of the same ℓ∞ size (mean of ``TRIALS`` draws), for each ε."""
    x, y = _test(b, model)
    g = torch.Generator().manual_seed(spec.seed + 1000)
    out: dict[str, Any] = {"clean": _accuracy(model, x, y), "eps": list(EPSILONS),
                           "reconstructed": [], "binomial": [], "uniform": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.eval()
        for eps in EPSILONS:
            out["reconstructed"].append(_accuracy(model, reconstructed_input(model, x, eps), y))
            acc_b, acc_u = [], []
            for _ in range(TRIALS):
                sign = torch.randint(0, 2, x.shape, generator=g).to(x) * 2 - 1
                acc_b.append(_accuracy(model, x + eps * sign, y))
                unif = (torch.rand(x.shape, generator=g).to(x) * 2 - 1) * eps
                acc_u.append(_accuracy(model, x + unif, y))
            out["binomial"].append(sum(acc_b) / TRIALS)
            out["uniform"].append(sum(acc_u) / TRIALS)
    return out


@register_evaluator("robustness")
def _robustness(model: nn.Module, b: Budget, spec: RunSpec) -> dict[str, Any]:
    """Test accuracy under the objective-derived perturbation at ``EPS_ROBUST`` (one pass)."""
    x, y = _test(b, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.eval()
        return {"eps": EPS_ROBUST,
                "accuracy": _accuracy(model, reconstructed_input(model, x, EPS_ROBUST), y)}


#: corruption levels: Gaussian noise σ (standardized units) and blur σ (positions)
CORRUPTION_LEVELS = {"noise": (0.25, 0.5, 1.0), "blur": (0.5, 1.0, 2.0)}


@register_evaluator("corruptions")
def _corruptions(model: nn.Module, b: Budget, spec: RunSpec) -> dict[str, Any]:
    """Test accuracy on the corrupted test sets of :func:`convex_eq_app.data.corrupted`
    (seeded noise, Gaussian blur along the signal) at each level of ``CORRUPTION_LEVELS``."""
    from convex_eq_app.data import corrupted

    d = dataset(b)
    dev = _device(model)
    out: dict[str, Any] = {}
    for kind, levels in CORRUPTION_LEVELS.items():
        accs = []
        for level in levels:
            c = flat(corrupted(d, kind, level, seed=0))
            accs.append(_accuracy(model, c.x_test.to(dev), c.y_test.to(dev)))
        out[kind] = accs
    out["levels"] = {k: list(v) for k, v in CORRUPTION_LEVELS.items()}
    return out


# ----------------------------------------------------------------------------- running
def train_one(spec: RunSpec, budget: Budget, state: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Build, train (shared loop) and evaluate one run; returns its metrics (picklable) and
    fills ``state`` with the trained model's ``state_dict`` when given.  A run with the
    parameter ``reduced=True`` uses :meth:`Budget.reduced`."""
    from convex_eq_app.progress import cpu_state, report_epoch
    from convex_eq_app.training import TrainConfig, fit

    if spec.kwargs.get("reduced"):
        budget = budget.reduced()

    if budget.device == "cpu":
        torch.set_num_threads(1)
    if spec.model not in MODELS:
        raise OptionError(f"unknown model {spec.model!r}", term="reproduce",
                          hint=f"one of {sorted(MODELS)}")
    torch.manual_seed(spec.seed)  # the head's initialization: the same in any process order
    model = MODELS[spec.model](spec.kwargs, budget, spec.seed)
    cfg = TrainConfig(epochs=budget.epochs, batch=budget.batch, lr=budget.lr, seed=spec.seed,
                      device=budget.device)
    data = flat(dataset(budget))
    res = fit(model, data, cfg, spec.label(),
              on_epoch=lambda row: report_epoch(spec.label(), row))
    hist = res.history[-1] if res.history else {}
    steps = budget.epochs * math.ceil(len(data.y_train) / budget.batch)
    out: dict[str, Any] = {
        "accuracy": res.accuracy, "params": res.params, "train_time": res.train_time,
        "fwd_iters": res.mean_iterations, "final_residual": res.final_residual,
        "capped_steps": list(res.nonconvergence), "steps": steps,
        "capped_fraction": res.nonconvergence[0] / steps, "last_epoch": hist,
    }
    for e in spec.evals:
        if e not in EVALUATORS:
            raise OptionError(f"unknown evaluation {e!r}", term="reproduce",
                              hint=f"one of {sorted(EVALUATORS)}")
        out[e] = EVALUATORS[e](model, budget, spec)
    if state is not None:
        state.update(cpu_state(model))
    return _finite(out)


def _finite(v: Any) -> Any:
    """NaN → None (JSON-safe), recursively."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(a) for k, a in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(a) for a in v]
    return v


def merge(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """One spec per trained model, with the union of the evaluations asked for (first-seen
    order)."""
    out: dict[tuple[Any, ...], RunSpec] = {}
    for s in specs:
        if s.key in out:
            old = out[s.key]
            evals = old.evals + tuple(e for e in s.evals if e not in old.evals)
            out[s.key] = replace(old, evals=evals)
        else:
            out[s.key] = s
    return list(out.values())


class RunCache:
    """Finished runs appended to ``path`` (one JSON line each: the budget's identity, the run's
    key and evaluations, its metrics and wall seconds), so that an interrupted or split full run
    can be resumed (``convex-eq reproduce --resume``): a run is reused only for the same budget
    (workers aside) and when it holds every evaluation asked for."""

    def __init__(self, path: Path | None, budget: Budget):
        self.path = path
        self.ident = repr(replace(budget, workers=1))
        self.entries: dict[str, dict[str, Any]] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e.get("budget") == self.ident:
                    self.entries[e["key"]] = e

    def get(self, spec: RunSpec) -> dict[str, Any] | None:
        e = self.entries.get(repr(spec.key))
        if e is None or not set(spec.evals) <= set(e["evals"]):
            return None
        return e

    def put(self, spec: RunSpec, metrics: dict[str, Any], seconds: float) -> None:
        if self.path is None:
            return
        e = {"budget": self.ident, "key": repr(spec.key), "evals": list(spec.evals),
             "metrics": metrics, "seconds": seconds}
        with self.path.open("a") as f:
            f.write(json.dumps(e) + "\n")


def _timed(job: tuple[RunSpec, Budget]) -> tuple[dict[str, Any], float, dict[str, Any]]:
    spec, budget = job
    t0 = time.perf_counter()
    state: dict[str, Any] = {}
    m = train_one(spec, budget, state)
    return m, time.perf_counter() - t0, state


def epochs_of(spec: RunSpec, budget: Budget) -> int:
    """Epochs run ``spec`` trains for (the reduced budget's for a ``reduced`` run)."""
    return (budget.reduced() if spec.kwargs.get("reduced") else budget).epochs


def execute(specs: Sequence[RunSpec], budget: Budget, log: Callable[[str], None] = print,
            cache: RunCache | None = None, progress: bool = True,
            checkpoints: Path | None = None) -> Results:
    """Train every run not in ``cache`` (in ``budget.workers`` processes when > 1, a progress
    bar counting epochs); logs one line per run and, with ``checkpoints`` (a folder), writes
    each trained model's ``state_dict`` to ``checkpoints/checkpoints/<run>.pt``.
    ``Results.reused_seconds``: the recorded wall seconds of the reused runs."""
    from convex_eq_app.progress import run_all, save_checkpoint

    cache = cache or RunCache(None, budget)
    results = Results()
    todo = []
    for s in merge(specs):
        hit = cache.get(s)
        if hit is None:
            todo.append(s)
        else:
            results.by_key[s.key] = hit["metrics"]
            results.reused.append(hit["seconds"])
    if results.reused:
        log(f"reusing {len(results.reused)} finished runs from {cache.path}")
    t0 = time.perf_counter()
    count = [0]

    def done(job: tuple[RunSpec, Budget], res: tuple[dict[str, Any], float, dict]) -> None:
        spec, (m, sec, state) = job[0], res
        count[0] += 1
        results.by_key[spec.key] = m
        cache.put(spec, m, sec)
        if checkpoints is not None:
            save_checkpoint(state, checkpoints, spec.label())
        log(f"[{count[0]:3d}/{len(todo)} {time.perf_counter() - t0:6.0f} s] {spec.label()}: "
            f"acc {100 * m['accuracy']:.1f} % ({m['train_time']:.1f} s)")

    run_all(_timed, [(s, budget) for s in todo], workers=budget.workers,
            epochs=sum(epochs_of(s, budget) for s in todo), desc="reproduce",
            enabled=progress, on_done=done)
    return results
