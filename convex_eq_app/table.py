"""The MNIST-1D table: the seeds' equilibrium models against published baselines and an MLP and a
CNN of equal parameter count, all trained by the same loop (``convex-eq train-table``).

Every equilibrium model is an objective from ``convex_eq.models`` lowered to its layer and
wrapped in :class:`~lowering.runtime.classifier.EquilibriumClassifier`; after training, its layer is
verified on test inputs against its docs/theory.md §9 reference.  ``--val`` trains on 90 % of the
training part and reports the held-out 10 % (for architecture choices: the test part is not
looked at); otherwise the models train on the whole training part and the test part is
evaluated once per epoch (logged, never used for a choice) and reported after the last epoch.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceWarning, OptionError
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

from .configs import TableConfig
from .data import Dataset, load
from .results import PUBLISHED
from .training import Result, TrainConfig, fit, n_params, verify_layer


# ----------------------------------------------------------------------------- the models
def _settings(cfg: TableConfig, bounds: dict[str, float] | None = None) -> TrainingSettings:
    return TrainingSettings(tol=cfg.tol, max_iter=cfg.max_iter, weight_bounds=bounds,
                            backward=cfg.backward, backward_solver=cfg.backward_solver,
                            solver_options=_solver_options(cfg))


def _solver_options(cfg: TableConfig) -> dict[str, Any] | None:
    """The equilibrium rows' forward solver options (Anderson's memory where set)."""
    return {"m": cfg.anderson_m} if cfg.anderson_m is not None else None


def _classifier(obj: Any, cfg: TableConfig, bounds: dict[str, float] | None = None,
                **kw: Any) -> EquilibriumClassifier:
    return EquilibriumClassifier(lowering.lower(obj), _settings(cfg, bounds), pool="max",
                                 pooled=cfg.pooled, **kw)


def conv_opteq(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Conv OptEq (docs/theory.md §3 row 1) on the signal."""
    return _classifier(models.opteq(conv=(cfg.channels, cfg.kernel), image=shape, seed=seed), cfg)


def deep_opteq(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Deep conv OptEq, two layers, ``α = cfg.alpha`` (TPAMI §5)."""
    obj = models.deep_opteq(L=2, conv=(cfg.channels // 2, cfg.kernel), image=shape,
                            alpha=cfg.alpha, seed=seed)
    return _classifier(obj, cfg)


def stem(channels: int, shape: tuple[int, ...]) -> nn.Module:
    """``g(x) = relu(conv₃(x))``: ``shape[0] → channels`` feature maps of the same length."""
    return nn.Sequential(nn.Conv1d(shape[0], channels, 3, padding=1), nn.ReLU())


def _branch_channels(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> int:
    """Channels per branch that bring POptEq (the multi-branch family without D's parameter-free
    terms, hence all of them) closest to the conv OptEq's parameter count."""
    target = n_params(conv_opteq(cfg, shape, seed))

    def count(c: int) -> int:
        obj = models.conv_mopteq((cfg.stem, shape[-1]), channels=c, kernels=(3, cfg.kernel),
                                 scales=(1, 2), fusion="none", seed=seed)
        return n_params(EquilibriumClassifier(lowering.lower(obj), _settings(cfg), pool="max",
                                              pooled=cfg.pooled, stem=stem(cfg.stem, shape)))

    lo, hi = 2, max(4, cfg.channels)
    while lo < hi:  # the count grows with c
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
    return min((max(2, lo - 1), lo), key=lambda c: abs(count(c) - target))


def branch_bounds(cfg: TableConfig) -> dict[str, float]:
    """``||W_i||₂ ≤ ζ`` for both branches, the same for MOptEq and POptEq (H only: ``Lip(T) ≤
    ζ²·||P||₂``, docs/theory.md §3.3)."""
    return {"W1": cfg.zeta, "W2": cfg.zeta}


def multibranch(cfg: TableConfig, shape: tuple[int, ...], seed: int, *, fusion: str,
                 decorrelation: str = "smooth", pe: bool = False) -> nn.Module:
    """The MOptEq family's classifier: stem, two branches at scales 1 and 2 (kernels 3 and
    ``cfg.kernel``), ``fusion`` ``"HD"``/``"H"``/``"none"``, ``decorrelation``, PE."""
    c = _branch_channels(cfg, shape, seed)
    obj = models.conv_mopteq((cfg.stem, shape[-1]), channels=c, kernels=(3, cfg.kernel),
                             scales=(1, 2), lam=cfg.lam, fusion=fusion,
                             decorrelation=decorrelation, width=cfg.width, seed=seed,
                             branch_inputs=pe)
    layer = lowering.lower(obj)
    if pe:
        layer = lowering.perturbation_enhanced(layer, cfg.pe_eps)
    torch.manual_seed(seed)
    return EquilibriumClassifier(layer, _settings(cfg, branch_bounds(cfg)), pool="max",
                                 pooled=cfg.pooled, stem=stem(cfg.stem, shape))


def popteq(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """POptEq (MOptEq paper Eq. 10): stem, two independent conv OptEq branches at scales 1, 2."""
    return multibranch(cfg, shape, seed, fusion="none")


def mopteq_paper_d(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """MOptEq with H and the paper's D (|·|: discontinuous, no fixed point guaranteed)."""
    return multibranch(cfg, shape, seed, fusion="HD", decorrelation="sign")


def mopteq_smooth_d(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """MOptEq with H and the Huber-smoothed D (a continuous layer)."""
    return multibranch(cfg, shape, seed, fusion="HD", decorrelation="smooth")


def mopteq_pe(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """MOptEq (smoothed D) with perturbation-enhanced branches (Algorithm 2, ε = cfg.pe_eps)."""
    return multibranch(cfg, shape, seed, fusion="HD", decorrelation="smooth", pe=True)


#: GEQ branches on an MNIST-1D signal: scales 1/2/4/4 (the paper's 32/16/8/8 of its six; a
#: length-5 branch cannot hold patches of 2 at scale 8), patches of 2 positions × 8 channels
GEQ_SCALES = (1, 2, 4, 4)


def geq_with(cfg: TableConfig, shape: tuple[int, ...], seed: int, gamma: Any) -> nn.Module:
    """Multi-branch GEQ as its paper builds it (docs/theory.md §3.2): 16 channels per branch
    (the conv OptEq's parameter count), full-size ``W_h``, branch outputs averaged after
    pooling / up-sampling, weight normalisation of every ``W_i`` and phantom gradients;
    ``gamma``: a number, ``"paper"`` or ``"input"`` (:func:`convex_eq.models.conv_geq`)."""
    c = 16 if cfg.channels >= 32 else 8  # (the smoke run's small models: 8)
    obj = models.conv_geq(shape, c, scales=GEQ_SCALES, kernel=cfg.kernel, patch=2,
                          channel_split=8, gamma=gamma, seed=seed)
    wn = tuple(f"W{i + 1}" for i in range(len(GEQ_SCALES)))
    settings = TrainingSettings(tol=cfg.tol, max_iter=cfg.max_iter, backward="phantom",
                                weight_normalization=wn, solver_options=_solver_options(cfg))
    torch.manual_seed(seed)
    return EquilibriumClassifier(lowering.lower(obj), settings, fusion="average", pool="max",
                                 pooled=cfg.pooled)


def geq_paper(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Multi-branch GEQ with the paper's bandwidth γ = 0.2/M recomputed from the state."""
    return geq_with(cfg, shape, seed, "paper")


def geq_fixed(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Multi-branch GEQ with one fixed bandwidth ``cfg.gamma`` (KerDEQ's best, 0.5)."""
    return geq_with(cfg, shape, seed, cfg.gamma)


def mon(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Monotone operator network (``convex_eq.models.mon``)."""
    return _classifier(models.mon(conv=(cfg.channels, cfg.kernel), image=shape, seed=seed), cfg)


def mlp_with(params: int, d: int = 40) -> nn.Module:
    """``d → h → h → 10`` ReLU MLP with about ``params`` parameters (``h² + (d + 12)h + 10``)."""
    b = d + 12
    h = max(4, round((-b + math.sqrt(b * b + 4 * max(0, params - 10))) / 2))
    return nn.Sequential(nn.Flatten(), nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                         nn.Linear(h, 10))


def cnn_with(params: int, length: int = 40) -> nn.Module:
    """Three ReLU conv layers (kernel 5, then 3 and 3 with stride 2) and a linear head, ``c``
    channels chosen so that the parameter count is about ``params``."""
    out_len = (((length + 1) // 2) + 1) // 2

    def build(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv1d(1, c, 5, padding=2), nn.ReLU(),
                             nn.Conv1d(c, c, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv1d(c, c, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(c * out_len, 10))

    c = min(range(1, 257), key=lambda c: abs(n_params(build(c)) - params))
    return build(c)


#: the table's equilibrium models by name
EQ_MODELS: dict[str, Callable[[TableConfig, tuple[int, ...], int], nn.Module]] = {
    "conv OptEq": conv_opteq,
    "POptEq": popteq,
    "MOptEq (H&D, paper's D)": mopteq_paper_d,
    "MOptEq (H&D, smoothed D)": mopteq_smooth_d,
    "MOptEq (smoothed D) + PE": mopteq_pe,
    "GEQ (multi-branch, paper's γ)": geq_paper,
    "GEQ (multi-branch, fixed γ)": geq_fixed,
    "deep OptEq (L=2)": deep_opteq,
    "MON": mon,
}
MLP, CNN = "MLP (same #params)", "CNN (same #params)"
#: the models trained when none are named
DEFAULT_MODELS = ("conv OptEq", "POptEq", "MOptEq (H&D, paper's D)", "MOptEq (H&D, smoothed D)",
                  "MOptEq (smoothed D) + PE", "GEQ (multi-branch, paper's γ)",
                  "GEQ (multi-branch, fixed γ)", CNN, MLP)
#: measured cost order (most expensive first): the paper's D stalls the solver at its cap, PE's
#: branch input is recomputed in every evaluation
COST_RANK = {n: i for i, n in enumerate(["MOptEq (H&D, paper's D)", "MOptEq (smoothed D) + PE",
                                         "MOptEq (H&D, smoothed D)", "POptEq",
                                         "GEQ (multi-branch, paper's γ)",
                                         "GEQ (multi-branch, fixed γ)", "conv OptEq", "MON",
                                         "deep OptEq (L=2)", CNN, MLP])}


def model_names(cfg: TableConfig) -> list[str]:
    return list(cfg.models) if cfg.models else list(DEFAULT_MODELS)


def build(name: str, cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Model ``name`` (the MLP and CNN match the conv OptEq's parameter count)."""
    torch.manual_seed(seed)
    if name in (MLP, CNN):
        ref = n_params(conv_opteq(cfg, shape, seed))
        torch.manual_seed(seed)
        return mlp_with(ref, shape[-1]) if name == MLP else cnn_with(ref, shape[-1])
    if name not in EQ_MODELS:
        from convex_eq.errors import OptionError

        raise OptionError(f"unknown model {name!r}", term="train-table",
                          hint=f"use some of {[*EQ_MODELS, MLP, CNN]}")
    return EQ_MODELS[name](cfg, shape, seed)


# ----------------------------------------------------------------------------- jobs
@dataclass
class Job:
    name: str
    seed: int
    cfg: TableConfig
    log: str = ""


@dataclass
class Row:
    name: str
    seed: int
    result: Result
    extra: dict[str, Any] = field(default_factory=dict)


def table_data(cfg: TableConfig) -> Dataset:
    data = load(cfg.dataset)
    if cfg.val:
        data = data.validation_split(0.1, seed=0)
    if cfg.train_subset:
        data = Dataset(data.name, data.x_train[:cfg.train_subset], data.y_train[:cfg.train_subset],
                       data.x_test[:cfg.train_subset], data.y_test[:cfg.train_subset])
    return data


def run_job(job: Job) -> Row:
    """Train one model on one seed (one thread), verify its layer; appends epochs to the log
    and reports them to the progress bar.  The row carries the trained ``state_dict``."""
    from .progress import cpu_state, report_epoch

    torch.set_num_threads(1)
    cfg = job.cfg
    data = table_data(cfg)
    model = build(job.name, cfg, data.shape, job.seed)
    levers = ({"warm_start": cfg.warm_start, "jacobian_reg": cfg.jacobian_reg,
               "tol_schedule": cfg.tol_schedule}
              if isinstance(model, EquilibriumClassifier) else {})  # (no solve to speed up)
    tc = TrainConfig(epochs=cfg.epochs, batch=cfg.batch, lr=cfg.lr, seed=job.seed,
                     weight_decay=cfg.weight_decay, shift=cfg.shift, device=cfg.device,
                     eval_every=cfg.eval_every, **levers)

    def log(row: dict[str, float]) -> None:
        if job.log:
            with open(job.log, "a") as f:
                f.write(json.dumps({"model": job.name, "seed": job.seed, **row}) + "\n")
        report_epoch(job.name, row)

    res = fit(model, data, tc, job.name, on_epoch=log)
    if isinstance(model, EquilibriumClassifier):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            try:
                res.verification = verify_layer(model, data.x_test, cfg.verify_inputs)
            except Exception as err:  # reported in the table, never a pass
                res.verification = f"not verified: {type(err).__name__}: {err}"[:160]
    return Row(job.name, job.seed, res, {"state_dict": cpu_state(model)})


SMOKE = ("SMOKE RUN (--quick): tiny models, one epoch on 256 signals. It checks that every "
         "model builds, trains and verifies; its accuracies are not results and are not "
         "comparable with the published ones.")


def check_levers(cfg: TableConfig) -> None:
    """Refuse, before any training, iteration levers that a chosen equilibrium row cannot
    take: warm starts where the layer's equilibrium is not certified unique, an unknown
    adjoint solver or backward, a forward option its solver does not take (each model is built
    once, untrained, to ask it)."""
    if cfg.backward_solver and cfg.backward != "implicit":
        raise OptionError(f"an adjoint solver ({cfg.backward_solver!r}) applies to the implicit "
                          f"gradient, not to {cfg.backward!r} gradients", term="train-table",
                          hint="drop --backward-solver, or train with --backward implicit")
    if not (cfg.warm_start or cfg.backward != "implicit" or cfg.backward_solver
            or cfg.anderson_m is not None):
        return
    shape = table_data(cfg).shape
    refused = []
    for name in model_names(cfg):
        if name not in EQ_MODELS:
            continue
        try:
            model = build(name, cfg, shape, cfg.seeds[0])
            if cfg.warm_start:
                model.enable_warm_start(1)
        except OptionError as err:
            refused.append(f"{name}: {err}")
    if refused:
        raise OptionError("iteration levers refused by equilibrium rows:\n  "
                          + "\n  ".join(refused), term="train-table",
                          hint="choose the rows that take them with --models, or change the "
                          "option the error names")


def run(out: str | Path = "convex_eq_table", cfg: TableConfig | None = None,
        progress: bool = True, argv: list[str] | None = None) -> dict[str, Any]:
    """Train every model on every seed (``cfg.workers`` processes, a progress bar counting
    epochs), write ``table.md``, ``results.json`` and ``checkpoints/<model>-seed<k>.pt`` to
    ``out``; returns them.  ``argv``: the command line the report records (default: this
    process's)."""
    from .errors import output_dir
    from .progress import run_all, save_checkpoint
    from .provenance import collect

    cfg = cfg or TableConfig()
    check_levers(cfg)
    out = output_dir(out)
    prov = collect(argv, cfg.device)
    log = out / "epochs.jsonl"
    log.write_text("")
    # longest first, so that the workers finish close together
    order = sorted(model_names(cfg), key=lambda n: COST_RANK.get(n, len(COST_RANK)))
    jobs = [Job(n, s, cfg, str(log)) for s in cfg.seeds for n in order]
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    done = out / "rows.jsonl"  # each finished model at once (a cut-off run keeps them)
    done.write_text("")
    checkpoints: dict[tuple[str, int], str] = {}
    if cfg.quick and progress:
        print(SMOKE)

    def finished(job: Job, r: Row) -> None:
        checkpoints[(r.name, r.seed)] = save_checkpoint(r.extra.pop("state_dict"), out,
                                                        f"{r.name}-seed{r.seed}")
        with open(done, "a") as f:
            f.write(json.dumps({"name": r.name, "seed": r.seed, **asdict(r.result)},
                               default=float) + "\n")

    rows = run_all(run_job, jobs, workers=cfg.workers, epochs=len(jobs) * cfg.epochs,
                   desc="train-table", enabled=progress, on_done=finished)
    rank = {n: i for i, n in enumerate(model_names(cfg))}
    rows.sort(key=lambda r: (rank[r.name], r.seed))
    wall = time.perf_counter() - t0
    meta = {"wall_seconds": wall, "load_start": load0, "load_end": os.getloadavg()[0],
            "cpus": os.cpu_count(), "torch_threads_per_worker": 1, "config": asdict(cfg)}
    text = report(rows, cfg, meta, prov)
    (out / "table.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps(
        {"kind": "train-table", "provenance": prov, **meta, "columns": COLUMNS,
         "published": PUBLISHED,
         "rows": [{"name": r.name, "seed": r.seed, **asdict(r.result),
                   "checkpoint": checkpoints[(r.name, r.seed)]} for r in rows]},
        indent=2, default=float), encoding="utf-8")
    if progress:
        print(text)
    return {"rows": rows, "meta": meta, "table": text, "checkpoints": checkpoints}


#: what each column of the table means (printed under it)
COLUMNS = {
    "model": "the seed model (an objective of convex_eq.models lowered to its layer, max-pooled, "
             "linear head), an MLP or CNN with about the conv OptEq's parameter count, or a "
             "test accuracy published by the MNIST-1D authors",
    "acc. (%)": "share of the held-out signals (test, or the validation split with --val) "
                "classified correctly after the last epoch; mean ± sample standard deviation "
                "over the seeds when there are several",
    "seeds": "the training seeds",
    "params": "trainable parameters",
    "mean fwd iters (test)": "forward-solver iterations per held-out signal at the end of "
                             "training, mean over the seeds",
    "iters per training step, last epoch (fwd / adjoint)": "forward / adjoint solver "
                                                           "iterations per training step in "
                                                           "the last epoch, mean over its "
                                                           "steps and the seeds",
    "steps at iteration cap (fwd / adjoint)": "training steps whose forward / adjoint solve "
                                              "stopped at its iteration cap before the "
                                              "tolerance, summed over epochs and seeds",
    "s / epoch": "wall seconds of training per epoch (with the held-out evaluations the "
                 "run made, see the settings), mean over the seeds",
    "verification of the trained layer": "worst relative state error ||z − z_ref|| / "
                                         "max(||z_ref||, 0.01) against the reference "
                                         "docs/theory.md §9 prescribes, on the held-out inputs "
                                         "verified (where a reference gives no state: the "
                                         "fixed-point residual ||z − T(z)|| / max(1, ||z||)); "
                                         "the reference, the claim and the verdict",
}


def table(rows: list[Row], cfg: TableConfig, meta: dict[str, Any]) -> str:
    """Markdown table: mean (± sample std over seeds) accuracy, params, solver statistics,
    and the settings under it (:func:`convex_eq_app.results.mnist1d_table`)."""
    from .results import mnist1d_table

    return mnist1d_table([{"name": r.name, "seed": r.seed, **asdict(r.result)} for r in rows],
                         asdict(cfg), meta["wall_seconds"], meta["cpus"])


def report(rows: list[Row], cfg: TableConfig, meta: dict[str, Any],
           prov: dict[str, Any]) -> str:
    """``table.md``: where the numbers come from, the table, what each column means."""
    from .provenance import column_lines, header_lines

    return "\n".join([
        "# convex-eq train-table: the seed models on MNIST-1D", "",
        *header_lines(prov, smoke=cfg.quick), table(rows, cfg, meta), "",
        *column_lines(COLUMNS),
        "Trained weights (`state_dict`): `checkpoints/<model>-seed<k>.pt` beside this report; "
        "per-epoch losses, accuracies and solver statistics: `epochs.jsonl`.", ""])
