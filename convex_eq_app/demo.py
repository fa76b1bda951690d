"""The main demo: declare → derive → verify → edit the objective three ways → train on MNIST-1D.

``convex-eq demo [--quick] [--out DIR] [--device DEV]``: derives the OptEq layer (conv, Theorem
1), verifies it against CVXPY, edits the objective (ℓ1 feature regularizer via prox,
Moreau-envelope skip connection, Gaussian kernel), trains every derived model and an MLP with the
same parameter count on MNIST-1D (1-D signals of length 40, generated locally by the ``mnist1d``
package) with the shared training loop (``convex_eq_app.training``), and writes plots and a
Markdown report.
"""

from __future__ import annotations

import difflib
import json
import math
import multiprocessing
import queue
import time
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import lowering
from convex_eq import models
from convex_eq.terms import L1, moreau
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

from .data import Dataset, mnist1d
from .table import mlp_with
from .training import (
    Result,
    TrainConfig,
    effective_weights,
    fit,
    n_params,
    resolve_device,
    verify_layer,
)

#: one MNIST-1D sample: a 1-channel signal of length 40
SIGNAL = (1, 40)
#: the GEQ patch kernel reads the signal as a 1-row image
ROW = (1, 1, 40)
MLP = "MLP (same #params)"
#: the equilibrium layers are trained and compared in this dtype (named in plot titles)
DTYPE = torch.float32
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
#: training order (longest first, so that two workers finish close together)
TRAIN_ORDER = ("OptEq + ℓ1", "OptEq Moreau skip", "OptEq", "GEQ (Gaussian kernel)", MLP)


@dataclass
class DemoConfig:
    """Sizes and budgets (``quick`` shrinks them for the < 1 minute smoke run)."""

    channels: int = 12
    kernel: int = 5
    epochs: int = 8
    batch: int = 64
    lr: float = 1e-2
    tol: float = 1e-4
    max_iter: int = 40
    l1: float = 0.01
    alpha: float = 0.5
    gamma: float = 0.05
    verify_inputs: int = 1
    pool: str = "max"
    pooled: int = 8
    quick: bool = False
    seed: int = 0
    #: processes training the models in parallel (each single-threaded); 1 = in this process
    workers: int = 2
    #: ``cpu``, ``cuda`` or ``auto`` (CUDA when present)
    device: str = "cpu"
    #: training samples used (0 = all 4000; the quick run uses a subset)
    train_subset: int = 0

    @classmethod
    def quick_config(cls) -> DemoConfig:
        return cls(channels=4, kernel=3, epochs=1, verify_inputs=1, quick=True,
                   train_subset=512)

    def settings(self, name: str) -> TrainingSettings:
        """The module options model ``name`` trains under: Anderson forward, the adjoint by
        the module's ``auto`` choice (conjugate gradients where the adjoint system is
        symmetric, as the conv OptEq's: 6 % less time per training step than an Anderson
        adjoint at the start of training, 11 % less after 250 steps, where the layer is
        stiffer; docs/theory.md §8)."""
        return TrainingSettings(tol=self.tol, max_iter=self.max_iter, backward_solver="auto",
                                weight_bounds=WEIGHT_BOUNDS.get(name))

    def train_config(self) -> TrainConfig:
        return TrainConfig(epochs=self.epochs, batch=self.batch, lr=self.lr, seed=self.seed,
                           device=self.device)


# ----------------------------------------------------------------------------- data
def load_data(cfg: DemoConfig) -> Dataset:
    """MNIST-1D (generated locally, standardised from the training part)."""
    data = mnist1d()
    if cfg.train_subset:
        k = cfg.train_subset
        data = Dataset(data.name, data.x_train[:k], data.y_train[:k], data.x_test, data.y_test)
    return data


# ----------------------------------------------------------------------------- objectives
def objectives(cfg: DemoConfig) -> dict[str, Any]:
    """The base OptEq objective (conv, canonical form) and its three edits."""
    base = models.opteq(conv=(cfg.channels, cfg.kernel), image=SIGNAL, seed=cfg.seed)
    z = base.states[0]
    return {
        "OptEq": base,
        "OptEq + ℓ1": base + cfg.l1 * L1(z),
        "OptEq Moreau skip": cfg.alpha * moreau(base, 1.0 - cfg.alpha),
        "GEQ (Gaussian kernel)": models.geq(conv=(cfg.channels, (1, cfg.kernel)), image=ROW,
                                           patch=(1, 4), h=8, gamma=cfg.gamma, seed=cfg.seed),
    }


#: the layout each model reads a signal in (None: as it comes)
INPUT_SHAPES = {"GEQ (Gaussian kernel)": ROW}


#: weights kept at spectral norm ≤ bound during training (convexity / contraction certificates)
WEIGHT_BOUNDS = {"GEQ (Gaussian kernel)": {"W": 1.0, "W_h": 1.0}}


def derivation_diff(base: Any, other: Any) -> str:
    """Unified diff of two printed derivations (what the edit changed)."""
    a = base.describe().splitlines()
    b = other.describe().splitlines()
    return "\n".join(difflib.unified_diff(a, b, "base", "edited", lineterm="", n=0))


# ----------------------------------------------------------------------------- models
def classifier(name: str, derived: Any, cfg: DemoConfig) -> EquilibriumClassifier:
    """Model ``name``: its derived layer, max-pooled to ``cfg.pooled`` positions, linear head."""
    return EquilibriumClassifier(derived, cfg.settings(name), pool=cfg.pool, pooled=cfg.pooled,
                                 input_shape=INPUT_SHAPES.get(name))


# ----------------------------------------------------------------------------- jobs
_QUEUE: Any = None


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q
    torch.set_num_threads(1)


def train_job(name: str, cfg: DemoConfig, mlp_params: int, progress: bool = False) -> dict:
    """Train model ``name`` on MNIST-1D, verify its equilibrium layer on test inputs; returns the
    ``Result``, the layer's effective weights and its test features (picklable, on the CPU)."""
    torch.set_num_threads(1)
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    if name == MLP:
        model: nn.Module = mlp_with(mlp_params, SIGNAL[-1])
    else:
        model = classifier(name, lowering.lower(objectives(cfg)[name]), cfg)
    q = _QUEUE
    report = None if q is None else (lambda h: q.put((name, h)))
    res = fit(model, data, cfg.train_config(), name, progress, on_epoch=report)
    out: dict[str, Any] = {"result": res}
    if isinstance(model, EquilibriumClassifier):
        with _quiet():
            res.verification = verify_layer(model, data.x_test, cfg.verify_inputs)
            with torch.no_grad():
                out["features"] = model.features(data.x_test.cpu()).numpy().ravel()
        out["eq_weights"] = effective_weights(model.eq)
    return out


class Trainer:
    """Runs ``train_job`` for every model: in ``cfg.workers`` spawned processes (one thread
    each), with one tqdm bar per model fed by the workers, or in this process if workers ≤ 1."""

    def __init__(self, cfg: DemoConfig, mlp_params: int, progress: bool = True):
        self.cfg, self.mlp_params, self.progress = cfg, mlp_params, progress
        self.futures: dict[str, Future] = {}
        self.pool: ProcessPoolExecutor | None = None
        self.queue: Any = None

    def start(self) -> None:
        """Submit the jobs (they start training at once)."""
        if self.cfg.workers <= 1:
            return
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.pool = ProcessPoolExecutor(self.cfg.workers, mp_context=ctx,
                                        initializer=_init_worker, initargs=(self.queue,))
        self.futures = {n: self.pool.submit(train_job, n, self.cfg, self.mlp_params)
                        for n in TRAIN_ORDER}

    def collect(self) -> dict[str, dict]:
        """Wait for every job (progress bars meanwhile); results keyed by model name."""
        if self.pool is None:
            return {n: train_job(n, self.cfg, self.mlp_params, self.progress)
                    for n in TRAIN_ORDER}
        from tqdm import tqdm

        bars = {n: tqdm(total=self.cfg.epochs, desc=f"{n:<24}", position=i, leave=True,
                        disable=not self.progress) for i, n in enumerate(TRAIN_ORDER)}
        try:
            while not all(f.done() for f in self.futures.values()) or not self.queue.empty():
                try:
                    n, h = self.queue.get(timeout=0.2)
                except queue.Empty:
                    for n, f in self.futures.items():  # freeze a finished model's bar
                        if f.done() and bars[n].n >= self.cfg.epochs:
                            bars[n].close()
                    continue
                bars[n].update(1)
                bars[n].set_postfix(loss=f"{h['loss']:.3f}", acc=f"{h['test_acc']:.3f}")
            return {n: f.result() for n, f in self.futures.items()}
        finally:
            for b in bars.values():
                b.close()
            self.pool.shutdown(cancel_futures=True)


# ----------------------------------------------------------------------------- plots & report
#: the solver comparison on the trained layer (in ``DTYPE``): a tolerance float32 reaches
TRACE_TOL, TRACE_MAX_ITER = 1e-6, 60


@dataclass
class ResidualTrace:
    """One solver on the trained layer (means over the test batch).

    ``returned[k]``: residual of the iterate the module would return after ``k + 1``
    iterations (the solvers return their best iterate: a running minimum of ``last``);
    ``last[k]``: residual of the ``k + 1``-th iterate itself."""

    returned: np.ndarray
    last: np.ndarray
    iterations: float
    converged: float
    batch: int


def residual_traces(derived: Any, eq_state: dict, x: torch.Tensor) -> dict[str, ResidualTrace]:
    """Relative residual per iteration of each solver on a trained layer."""
    out = {}
    for solver in ("plain", "anderson", "broyden"):
        mod = derived.torch_module(solver=solver, tol=TRACE_TOL, max_iter=TRACE_MAX_ITER,
                                   on_nonconvergence="warn", dtype=DTYPE)
        mod.load_state_dict(eq_state, strict=False)
        with torch.no_grad(), _quiet():
            _, st = mod(x, return_stats=True)
        res = st.residuals.double().numpy()
        best = np.minimum.accumulate(res, axis=1)
        out[solver] = ResidualTrace(returned=best.mean(0), last=res.mean(0),
                                    iterations=st.mean_iterations,
                                    converged=float(st.converged.double().mean()),
                                    batch=int(x.shape[0]))
    return out


class _quiet:
    def __enter__(self) -> None:

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *a: Any) -> None:
        self._w.__exit__(*a)


def write_plots(out: Path, results: list[Result], traces: dict[str, ResidualTrace],
                sparsity: dict[str, np.ndarray]) -> list[str]:
    """``training_curves.png``, ``residuals.png``, ``sparsity.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        ep = [h["epoch"] for h in r.history]
        style = {"marker": "o", "ms": 4} if len(ep) <= 30 else {}  # one epoch: a visible point
        ax[0].plot(ep, [h["loss"] for h in r.history], label=r.name, **style)
        ax[1].plot(ep, [h["test_acc"] for h in r.history], label=r.name, **style)
    losses = [h["loss"] for r in results for h in r.history]
    log_loss = bool(losses) and max(losses) > 10 * min(losses) > 0
    ax[0].set(xlabel="epoch", ylabel="train loss (mean over the epoch)",
              yscale="log" if log_loss else "linear")
    ax[1].set(xlabel="epoch", ylabel="test accuracy")
    epochs = max((len(r.history) for r in results), default=1)
    for a in ax:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        if epochs <= 3:  # a single point needs room around it and a whole-number tick
            a.set_xlim(0.5, epochs + 0.5)
            a.set_xticks(range(1, epochs + 1))
    ax[1].legend(fontsize=7)
    fig.suptitle(f"training on MNIST-1D (equilibrium layers in {DTYPE_NAME})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "training_curves.png", dpi=120)
    files.append("training_curves.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for s, tr in traces.items():
        k = np.arange(1, len(tr.returned) + 1)
        style = {"marker": "o", "ms": 3} if len(k) <= 15 else {}
        (line,) = ax.semilogy(k, tr.returned, label=f"{s} (returned iterate)", **style)
        if np.any(tr.last > 1.5 * tr.returned):  # visibly above: the iterates went back up
            ax.semilogy(k, tr.last, ls=":", lw=1, color=line.get_color(),
                        label=f"{s} (k-th iterate itself)")
    ax.axhline(TRACE_TOL, color="k", ls="--", lw=0.8, label=f"tol {TRACE_TOL:g}")
    ax.set(xlabel="iteration k", ylabel="mean relative residual ||T(z) - z|| / ||T(z)||",
           title=f"trained OptEq layer, {DTYPE_NAME}, "
           f"{next(iter(traces.values())).batch} test inputs")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "residuals.png", dpi=120)
    files.append("residuals.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    nonzero = [np.log10(np.abs(v[v != 0])) for v in sparsity.values()]
    lo = min((float(n.min()) for n in nonzero if n.size), default=-1.0)
    hi = max((float(n.max()) for n in nonzero if n.size), default=1.0)
    bins = np.linspace(np.floor(lo), np.ceil(hi) + 1e-9, 41)
    step = bins[1] - bins[0]
    zero_x = bins[0] - 5 * step  # the exact zeros: a labelled bar left of the log axis
    for i, ((name, v), nz) in enumerate(zip(sparsity.items(), nonzero)):
        (_, _, patches) = ax.hist(nz, bins=bins, alpha=0.6, label=name)
        color = patches[0].get_facecolor() if patches else None
        zeros = int((v == 0).sum())
        ax.bar(zero_x + (i - 0.5) * step, zeros, width=step, color=color, alpha=0.9)
        ax.annotate(f"{100 * zeros / max(1, v.size):.0f}%", (zero_x + (i - 0.5) * step, zeros),
                    ha="center", va="bottom", fontsize=7)
    ticks = [t for t in ax.get_xticks() if bins[0] - 1e-9 <= t <= bins[-1]]
    ax.set_xticks([zero_x, *ticks], ["0\n(exact)", *(f"{t:g}" for t in ticks)])
    ax.axvline(bins[0] - 2.5 * step, color="0.6", lw=0.8, ls=":")
    ax.set(xlabel="log10 |z*| of the nonzero entries; left: exactly zero (test features)",
           ylabel="entries")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sparsity.png", dpi=120)
    files.append("sparsity.png")
    plt.close(fig)
    return files


def table(results: list[Result]) -> str:
    head = ("| model | test acc. | params | mean fwd iters | final rel. residual | "
            "verification gap (test inputs) | train time (s) |\n|---|---|---|---|---|---|---|")
    rows = [f"| {r.name} | {100 * r.accuracy:.2f} % | {r.params} | "
            f"{r.mean_iterations:.1f} | {r.final_residual:.1e} | {r.verification} | "
            f"{r.train_time:.1f} |" for r in results]
    return "\n".join([head, *rows]).replace("| nan |", "| — |").replace("nan", "—")


# ----------------------------------------------------------------------------- main
def run(out: str | Path = "convex_eq_out", quick: bool = False, progress: bool = True,
        workers: int | None = None, device: str = "cpu") -> dict:
    """Run the whole demo; returns the results (also written to ``out``).  ``workers``:
    training processes (default ``DemoConfig.workers`` = 2; 1 trains in this process);
    ``device``: where the models train (``cpu``, ``cuda``, ``auto``)."""
    # the layers are small: one thread avoids OpenMP hand-off/spin costs that dominate tiny
    # convolutions (and make them 100x slower when the machine is busy)
    torch.set_num_threads(1)
    cfg = DemoConfig.quick_config() if quick else DemoConfig()
    if workers is not None:
        cfg.workers = int(workers)
    cfg.device = str(resolve_device(device))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    objs = objectives(cfg)
    derived = {name: lowering.lower(o) for name, o in objs.items()}
    base = derived["OptEq"]
    trainer = Trainer(cfg, n_params(classifier("OptEq", base, cfg)), progress)
    trainer.start()  # workers train while this process prints and verifies
    print("=" * 78)
    print("1. OptEq hidden objective (conv W, Theorem 1) and its derived layer")
    print("=" * 78)
    print(base.describe())
    _phase("derive", t_start)
    data = load_data(cfg)
    xte = data.x_test
    print("\nverification of the untrained layer against CVXPY (one test input):")
    print(_verify_once(base, xte[:1]))
    _phase("verify", t_start)
    print("\n" + "=" * 78)
    print("2. Editing the objective: what each edit changes in the derivation")
    print("=" * 78)
    for name, d in derived.items():
        if name == "OptEq":
            continue
        print(f"\n--- {name}: certificate: {d.certificate.long_text() if d.certificate else '—'}")
        print(derivation_diff(base, d))
    print("\n" + "=" * 78)
    print(f"3. Training every derived layer on MNIST-1D ({len(data.y_train)} train / "
          f"{len(data.y_test)} test signals of length {data.shape[-1]}) on {cfg.device}")
    print("=" * 78)
    print(f"({max(1, cfg.workers)} worker process(es), one thread each; every trained layer is "
          f"then verified on {cfg.verify_inputs} test input(s))")
    jobs = trainer.collect()
    results = [jobs[n]["result"] for n in (*derived, MLP)]
    _phase("training + verification of the trained layers", t_start)
    print()
    print(table(results))
    print(nonconvergence_note(results, cfg))
    traces = residual_traces(base, jobs["OptEq"]["eq_weights"], xte[:64])
    sparsity = {n: jobs[n]["features"] for n in ("OptEq", "OptEq + ℓ1")}
    plots = write_plots(out, results, traces, sparsity)
    total = time.perf_counter() - t_start
    report = _report(cfg, derived, results, plots, traces, sparsity, total)
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(
        {"config": cfg.__dict__, "total_seconds": total,
         "results": [r.__dict__ for r in results]}, indent=2, default=float))
    print(f"\nwrote {out / 'report.md'} (+ {', '.join(plots)}, results.json) in {total:.0f} s")
    return {"results": results, "total_seconds": total, "out": str(out)}


def nonconvergence_note(results: list[Result], cfg: DemoConfig) -> str:
    """How many training steps hit ``max_iter`` (forward) / ``2·max_iter`` (adjoint)."""
    parts = [f"{r.name}: {f} forward / {b} adjoint" for r in results
             for f, b in [r.nonconvergence] if f or b]
    if not parts:
        return "every forward and adjoint solve during training reached its tolerance"
    return (f"training steps whose solve stopped at the iteration cap before tol {cfg.tol:g} "
            f"(the step still used the last iterate): {'; '.join(parts)}")


def _phase(name: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {name} done", flush=True)


def _verify_once(derived: Any, x: torch.Tensor) -> str:
    from verify.check import check

    return str(check(derived, x.double()))


def _zero_fraction(v: np.ndarray) -> float:
    return float((np.abs(v) < 1e-6 * max(1e-12, float(np.abs(v).max()))).mean())


def _report(cfg: DemoConfig, derived: dict, results: list[Result], plots: list[str],
            traces: dict[str, ResidualTrace], sparsity: dict[str, np.ndarray], total: float
            ) -> str:
    lines = ["# convex-eq demo report", "",
             f"Configuration: {json.dumps(cfg.__dict__)}; total time {total:.0f} s.", "",
             "## Derived layers", ""]
    for name, d in derived.items():
        lines += [f"### {name}", "", "```", d.describe(), "```", ""]
    lines += ["## Training on MNIST-1D", "", table(results), "",
              nonconvergence_note(results, cfg), "",
              "![training curves](training_curves.png)", "",
              "Per-epoch solver statistics (forward / adjoint iterations, steps at the "
              "iteration cap) are in results.json (`history`).", "",
              "## Solvers on the trained OptEq layer", "",
              f"{DTYPE_NAME}, tol {TRACE_TOL:g}, at most "
              f"{TRACE_MAX_ITER} iterations; the residual is that of the iterate the module "
              "returns (each solver returns its best iterate).", "",
              "| solver | mean iterations | converged | mean residual of the returned state |",
              "|---|---|---|---|"]
    for s, tr in traces.items():
        lines.append(f"| {s} | {tr.iterations:.1f} | {100 * tr.converged:.0f} % | "
                     f"{tr.returned[-1]:.2e} |")
    lines += ["", "![residuals](residuals.png)", "", "## Feature sparsity", ""]
    for n, v in sparsity.items():
        lines.append(f"- {n}: exactly zero {float((v == 0).mean()):.3f}, "
                     f"|z*| < 1e-6·max {_zero_fraction(v):.3f}, "
                     f"median |z*| = {float(np.median(np.abs(v))):.3e}")
    lines += ["", "![sparsity](sparsity.png)", ""]
    _ = math
    return "\n".join(lines)
