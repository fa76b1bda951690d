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
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceWarning
from lowering.perturbation import cascade
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

from .data import Dataset, mnist1d
from .training import Result, TrainConfig, fit, n_params, verify_layer

#: test accuracies published by the MNIST-1D authors (no shuffling), in %
PUBLISHED = {"logistic regression": 32.0, "MLP": 68.0, "CNN": 94.0, "GRU": 91.0, "human": 96.0}


@dataclass
class TableConfig:
    """Architecture and budget of the table's models (``quick``: the CI smoke version)."""

    channels: int = 32
    kernel: int = 5
    pooled: int = 8
    epochs: int = 30
    batch: int = 64
    lr: float = 5e-3
    weight_decay: float = 0.0
    shift: int = 2
    tol: float = 1e-4
    max_iter: int = 30
    alpha: float = 0.5
    pe_eps: float = 0.05
    lam: float = 0.05
    #: MOptEq fusion of the table's row: "H" (smooth coupling; the solves converge like
    #: POptEq's) or "HD" (with the nonsmooth decorrelation D, whose a.e. gradient stalls the
    #: solver at the iteration cap: measured about 10× the cost of a conv OptEq epoch)
    mopteq_fusion: str = "H"
    gamma: float = 0.05
    seeds: tuple[int, ...] = (0,)
    models: tuple[str, ...] = ()
    val: bool = False
    device: str = "cpu"
    workers: int = 2
    quick: bool = False
    verify_inputs: int = 1
    train_subset: int = 0  # 0 = all (the quick mode trains on a subset)

    @classmethod
    def quick_config(cls) -> TableConfig:
        return cls(channels=4, kernel=3, pooled=4, epochs=1, seeds=(0,), quick=True,
                   train_subset=256, max_iter=20)


# ----------------------------------------------------------------------------- the models
def _settings(cfg: TableConfig, bounds: dict[str, float] | None = None) -> TrainingSettings:
    return TrainingSettings(tol=cfg.tol, max_iter=cfg.max_iter, weight_bounds=bounds)


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


def _branches(cfg: TableConfig) -> dict[str, Any]:
    return {"channels": cfg.channels // 2, "kernels": (cfg.kernel, 2 * cfg.kernel + 1),
            "scales": (1, 2)}


def branch_bounds(fusion: str) -> dict[str, float]:
    """``||W_i||₂`` bounds that keep the smooth quadratic part convex: ``1 - ||W_i||² -
    ||P||₂ ≥ 0`` with the coupling (``||P||₂ = 1/√2`` for pairwise averaging), ``||W_i|| ≤ 1``
    without it (POptEq: independent OptEq branches)."""
    b = 1.0 if fusion == "none" else math.sqrt(1.0 - 1.0 / math.sqrt(2.0))
    return {"W1": b, "W2": b}


def mopteq(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Multi-scale conv MOptEq with ``cfg.mopteq_fusion`` (H or H&D) and PE training."""
    obj = models.conv_mopteq(shape, lam=cfg.lam, seed=seed, fusion=cfg.mopteq_fusion,
                             branch_inputs=True, **_branches(cfg))
    return _classifier(obj, cfg, branch_bounds(cfg.mopteq_fusion),
                       cascade=cascade(obj, cfg.pe_eps))


def popteq(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """POptEq: the same branches without fusion (MOptEq's parallel baseline)."""
    obj = models.conv_mopteq(shape, seed=seed, fusion="none", **_branches(cfg))
    return _classifier(obj, cfg, branch_bounds("none"))


def geq(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """Conv GEQ with patch and channel splitting (docs/theory.md §3 row 3) on the signal laid
    out as a 1-row image."""
    c = cfg.channels
    obj = models.geq(conv=(c, (1, cfg.kernel)), image=(shape[0], 1, shape[-1]), patch=(1, 4),
                     h=8, gamma=cfg.gamma, channel_split=max(1, c // 4), seed=seed)
    return _classifier(obj, cfg, {"W": 1.0, "W_h": 1.0}, input_shape=(shape[0], 1, shape[-1]))


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
    "deep OptEq (L=2)": deep_opteq,
    "MOptEq (PE)": mopteq,
    "POptEq": popteq,
    "GEQ (patch, channel split)": geq,
}
if hasattr(models, "mon"):
    EQ_MODELS["MON"] = mon
MLP, CNN = "MLP (same #params)", "CNN (same #params)"
#: measured cost order (most expensive first): the PE cascade solves twice and the H&D solve is
#: nonsmooth
COST_RANK = {n: i for i, n in enumerate(["MOptEq (PE)", "conv OptEq", "MON",
                                         "GEQ (patch, channel split)", "deep OptEq (L=2)",
                                         "POptEq", CNN, MLP])}


def model_names(cfg: TableConfig) -> list[str]:
    return list(cfg.models) if cfg.models else [*EQ_MODELS, MLP, CNN]


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
    data = mnist1d()
    if cfg.val:
        data = data.validation_split(0.1, seed=0)
    if cfg.train_subset:
        data = Dataset(data.name, data.x_train[:cfg.train_subset], data.y_train[:cfg.train_subset],
                       data.x_test[:cfg.train_subset], data.y_test[:cfg.train_subset])
    return data


def run_job(job: Job) -> Row:
    """Train one model on one seed (one thread), verify its layer; appends epochs to the log."""
    torch.set_num_threads(1)
    cfg = job.cfg
    data = table_data(cfg)
    model = build(job.name, cfg, data.shape, job.seed)
    tc = TrainConfig(epochs=cfg.epochs, batch=cfg.batch, lr=cfg.lr, seed=job.seed,
                     weight_decay=cfg.weight_decay, shift=cfg.shift, device=cfg.device)

    def log(row: dict[str, float]) -> None:
        if job.log:
            with open(job.log, "a") as f:
                f.write(json.dumps({"model": job.name, "seed": job.seed, **row}) + "\n")

    res = fit(model, data, tc, job.name, on_epoch=log)
    if isinstance(model, EquilibriumClassifier):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            try:
                res.verification = verify_layer(model, data.x_test, cfg.verify_inputs)
            except Exception as err:  # reported in the table, never a pass
                res.verification = f"not verified: {type(err).__name__}: {err}"[:160]
    return Row(job.name, job.seed, res)


def run(out: str | Path = "convex_eq_table", cfg: TableConfig | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Train every model on every seed (``cfg.workers`` processes), write ``table.md`` and
    ``results.json`` to ``out``; returns them."""
    cfg = cfg or TableConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "epochs.jsonl"
    log.write_text("")
    # longest first, so that the workers finish close together
    order = sorted(model_names(cfg), key=lambda n: COST_RANK.get(n, len(COST_RANK)))
    jobs = [Job(n, s, cfg, str(log)) for s in cfg.seeds for n in order]
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    done = out / "rows.jsonl"  # each finished model at once (a cut-off run keeps them)
    done.write_text("")
    rows: list[Row] = []

    def finished(r: Row) -> None:
        rows.append(r)
        with open(done, "a") as f:
            f.write(json.dumps({"name": r.name, "seed": r.seed, **asdict(r.result)},
                               default=float) + "\n")
        if progress:
            print(f"[{time.perf_counter() - t0:7.0f} s] {r.name} seed {r.seed}: "
                  f"{100 * r.result.accuracy:.1f} % ({r.result.train_time:.0f} s)", flush=True)

    if cfg.workers <= 1:
        for j in jobs:
            finished(run_job(j))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(cfg.workers, mp_context=ctx) as pool:
            for f in as_completed([pool.submit(run_job, j) for j in jobs]):
                finished(f.result())
    rank = {n: i for i, n in enumerate(model_names(cfg))}
    rows.sort(key=lambda r: (rank[r.name], r.seed))
    wall = time.perf_counter() - t0
    meta = {"wall_seconds": wall, "load_start": load0, "load_end": os.getloadavg()[0],
            "cpus": os.cpu_count(), "torch_threads_per_worker": 1, "config": asdict(cfg)}
    text = table(rows, cfg, meta)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {**meta, "rows": [{"name": r.name, "seed": r.seed, **asdict(r.result)} for r in rows]},
        indent=2, default=float))
    if progress:
        print(text)
    return {"rows": rows, "meta": meta, "table": text}


def table(rows: list[Row], cfg: TableConfig, meta: dict[str, Any]) -> str:
    """Markdown table: mean (± spread over seeds) accuracy, params, solver statistics."""
    part = "validation (10 % of train)" if cfg.val else "test"
    sizes = "3600 train / 400 validation" if cfg.val else "4000 train / 1000 test"
    if cfg.train_subset:
        sizes = f"quick mode: the first {cfg.train_subset} signals of each part"
    lines = [f"| model | {part} acc. (%) | seeds | params | mean fwd iters (test) | "
             "steps at iteration cap (fwd / adjoint) | s / epoch | verification of the trained "
             "layer |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r.name for r in rows):
        rs = [r for r in rows if r.name == name]
        accs = [100 * r.result.accuracy for r in rs]
        mean = sum(accs) / len(accs)
        spread = f" ± {(max(accs) - min(accs)) / 2:.1f}" if len(accs) > 1 else ""
        res = rs[0].result
        it = sum(r.result.mean_iterations for r in rs) / len(rs)
        capped = (f"{sum(r.result.nonconvergence[0] for r in rs)} / "
                  f"{sum(r.result.nonconvergence[1] for r in rs)}")
        ep = sum(r.result.train_time for r in rs) / max(1, sum(cfg.epochs for _ in rs))
        ver = "; ".join(r.result.verification for r in rs)
        eq = not math.isnan(it)
        lines.append(f"| {name} | {mean:.1f}{spread} | {','.join(str(r.seed) for r in rs)} | "
                     f"{res.params} | {f'{it:.1f}' if eq else '—'} | {capped if eq else '—'} | "
                     f"{ep:.1f} | {ver} |")
    for name, acc in PUBLISHED.items():
        lines.append(f"| {name} (published by the MNIST-1D authors) | {acc:.0f} | — | — | — | — "
                     "| — | — |")
    lines += ["", f"MOptEq fusion: {cfg.mopteq_fusion}, λ = {cfg.lam:g}, PE ε = {cfg.pe_eps:g}. "
              f"MNIST-1D generated locally ({sizes}), {cfg.epochs} epochs, "
              f"Adam lr {cfg.lr:g} (cosine), batch {cfg.batch}, shift augmentation ±{cfg.shift} "
              f"for every model, seeds {list(cfg.seeds)}; equilibrium layers: tol {cfg.tol:g}, "
              f"at most {cfg.max_iter} iterations (adjoint {2 * cfg.max_iter}). Wall time "
              f"{meta['wall_seconds']:.0f} s with {cfg.workers} worker process(es) of one torch "
              f"thread on {meta['cpus']} CPUs, load average {meta['load_start']:.1f} at the start "
              f"and {meta['load_end']:.1f} at the end."]
    return "\n".join(lines)
