"""The main demo: declare → derive → verify → edit the objective three ways → train on MNIST-1D.

``convex-eq demo [--quick] [--out DIR] [--device DEV]``: derives the OptEq layer (conv, Theorem
1), verifies it against CVXPY, edits the objective (ℓ1 feature regularizer via prox,
Moreau-envelope skip connection, Gaussian kernel: the GEQ paper's multi-branch model), trains every
derived model and an MLP with the same parameter count on MNIST-1D (1-D signals of length 40,
generated locally by the ``mnist1d`` package) with the shared training loop
(``convex_eq_app.training``), and writes plots and a Markdown report.
"""

from __future__ import annotations

import difflib
import json
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
from lowering.runtime.classifier import EquilibriumClassifier

from .configs import DEMO_GEQ, DEMO_GEQ_SCALES, DemoConfig
from .data import Dataset, mnist1d
from .progress import cpu_state
from .table import mlp_with
from .training import (
    Result,
    effective_weights,
    fit,
    n_params,
    resolve_device,
    verify_layer,
)

#: one MNIST-1D sample: a 1-channel signal of length 40
SIGNAL = (1, 40)
MLP = "MLP (same #params)"
#: the equilibrium layers are trained and compared in this dtype (named in plot titles)
DTYPE = torch.float32
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
#: training order (longest first, so that two workers finish close together)
TRAIN_ORDER = (DEMO_GEQ, "OptEq + ℓ1", "OptEq Moreau skip", "OptEq", MLP)


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
        DEMO_GEQ: models.conv_geq(SIGNAL, cfg.geq_channels, scales=DEMO_GEQ_SCALES,
                                  kernel=cfg.kernel, patch=2, channel_split=cfg.geq_channels,
                                  gamma="paper", seed=cfg.seed),
    }


#: the models whose feature sparsity is plotted (the ℓ1 edit against its base)
SPARSITY = ("OptEq", "OptEq + ℓ1")
#: how each model's branch outputs are combined before pooling (GEQ: averaged, as its paper)
FUSION = {DEMO_GEQ: "average"}


def derivation_diff(base: Any, other: Any) -> str:
    """Unified diff of two printed derivations (what the edit changed)."""
    a = base.describe().splitlines()
    b = other.describe().splitlines()
    return "\n".join(difflib.unified_diff(a, b, "base", "edited", lineterm="", n=0))


# ----------------------------------------------------------------------------- models
def classifier(name: str, derived: Any, cfg: DemoConfig) -> EquilibriumClassifier:
    """Model ``name``: its derived layer, max-pooled to ``cfg.pooled`` positions, linear head."""
    return EquilibriumClassifier(derived, cfg.settings(name), pool=cfg.pool, pooled=cfg.pooled,
                                 fusion=FUSION.get(name, "concat"))


# ----------------------------------------------------------------------------- jobs
_QUEUE: Any = None


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q
    torch.set_num_threads(1)


def train_job(name: str, cfg: DemoConfig, mlp_params: int, progress: bool = False) -> dict:
    """Train model ``name`` on MNIST-1D, verify its equilibrium layer on test inputs; returns the
    ``Result``, the layer's effective weights, its test features and the trained model's
    ``state_dict`` (picklable, on the CPU)."""
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
            if name in SPARSITY:
                with torch.no_grad():
                    out["features"] = model.features(data.x_test.cpu()).numpy().ravel()
        out["eq_weights"] = effective_weights(model.eq)
    out["state_dict"] = cpu_state(model)
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
    few = max((len(tr.returned) for tr in traces.values()), default=0) <= 15
    for s, tr in traces.items():
        k = np.arange(1, len(tr.returned) + 1)
        style = {"marker": "o", "ms": 3} if few else {}  # the same style for every solver
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

    fig = sparsity_figure(sparsity)
    fig.savefig(out / "sparsity.png", dpi=120)
    files.append("sparsity.png")
    plt.close(fig)
    return files


def sparsity_figure(sparsity: dict[str, np.ndarray]) -> Any:
    """Two panels on honest axes: the share of exactly-zero entries per model (linear, %) and
    the distribution of ``log10 |z*|`` over the nonzero entries only (a zero has no logarithm,
    so it is never drawn on that axis)."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.8),
                                   gridspec_kw={"width_ratios": [1, 2.2]})
    names = list(sparsity)
    colors = [f"C{i}" for i in range(len(names))]
    zeros = [100.0 * float((v == 0).mean()) if v.size else 0.0 for v in sparsity.values()]
    bars = ax0.bar(range(len(names)), zeros, color=colors, alpha=0.8)
    for rect, z in zip(bars, zeros):
        ax0.annotate(f"{z:.0f} %", (rect.get_x() + rect.get_width() / 2, z), ha="center",
                     va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax0.set_xticks(range(len(names)), names, fontsize=8)
    ax0.set_ylim(0, 105)
    ax0.set_ylabel("entries exactly 0 (%)")
    ax0.set_title("exact zeros", fontsize=10)
    nonzero = [np.log10(np.abs(v[v != 0])) for v in sparsity.values()]
    lo = min((float(n.min()) for n in nonzero if n.size), default=-1.0)
    hi = max((float(n.max()) for n in nonzero if n.size), default=1.0)
    bins = np.linspace(np.floor(lo), np.ceil(hi) + 1e-9, 41)
    for name, nz, color in zip(names, nonzero, colors):
        ax1.hist(nz, bins=bins, histtype="step", lw=1.6, color=color,
                 label=f"{name} ({nz.size} nonzero entries)")
    ax1.set_xlabel("log10 |z*| of the nonzero entries")
    ax1.set_ylabel("entries")
    ax1.set_title("magnitude of the nonzero entries", fontsize=10)
    ax1.legend(fontsize=8)
    fig.suptitle("features z* of the trained layers on the test signals", fontsize=10)
    fig.tight_layout()
    return fig


#: what each column of the demo's table means (printed under it in the report)
COLUMNS = {
    "model": "the derived equilibrium layer (max-pooled, linear head) or the MLP baseline with "
             "about the OptEq classifier's parameter count",
    "test acc.": "share of the test signals classified correctly after the last epoch",
    "params": "trainable parameters of the whole classifier",
    "mean fwd iters": "forward-solver iterations per test signal at the end of training, mean "
                      "over the first 1000 test signals",
    "final rel. residual": "largest relative residual ||T(z) − z|| / ||T(z)|| of the returned "
                           "states over those signals (the solver's tolerance is "
                           "{tol:g})",
    "verification": "worst relative state error ||z − z_ref|| / max(||z_ref||, 0.01) of the "
                    "trained layer against the reference docs/theory.md §9 prescribes, on "
                    "{k} test input(s) (where a reference gives no state: the fixed-point "
                    "residual ||z − T(z)|| / max(1, ||z||)); in parentheses the reference "
                    "(cvxpy: a conic solve; local: multi-start local minimization), the claim "
                    "it confirmed and the verdict",
    "train time (s)": "wall time of the model's training loop in its worker process (all "
                      "epochs, with the per-epoch test evaluation)",
}


def table(results: list[Result]) -> str:
    """The Markdown table of the trained models (columns: :data:`COLUMNS`)."""
    from .results import demo_table

    return demo_table([r.__dict__ for r in results])


def column_definitions(cfg: DemoConfig) -> dict[str, str]:
    """:data:`COLUMNS` with this run's tolerance and number of verified inputs."""
    return {k: v.format(tol=cfg.tol, k=cfg.verify_inputs) for k, v in COLUMNS.items()}


# ----------------------------------------------------------------------------- main
SMOKE = ("SMOKE RUN (--quick): tiny models, one epoch on 512 signals. It checks that every "
         "step runs; its accuracies are not results.")


def run(out: str | Path = "convex_eq_out", quick: bool = False, progress: bool = True,
        workers: int | None = None, device: str = "cpu", seed: int | None = None,
        epochs: int | None = None, argv: list[str] | None = None) -> dict:
    """Run the whole demo; returns the results (also written to ``out``: ``report.md``,
    ``results.json``, three plots and ``checkpoints/<model>.pt``).  ``workers``: training
    processes (default ``DemoConfig.workers`` = 2; 1 trains in this process); ``device``: where
    the models train (``cpu``, ``cuda``, ``auto``); ``seed``/``epochs`` override the
    configuration's; ``argv``: the command line recorded in the report (default: this
    process's)."""
    from .errors import output_dir
    from .progress import save_checkpoint
    from .provenance import collect

    # the layers are small: one thread avoids OpenMP hand-off/spin costs that dominate tiny
    # convolutions (and make them 100x slower when the machine is busy)
    torch.set_num_threads(1)
    cfg = DemoConfig.quick_config() if quick else DemoConfig()
    if workers is not None:
        cfg.workers = int(workers)
    if seed is not None:
        cfg.seed = int(seed)
    if epochs is not None:
        cfg.epochs = int(epochs)
    cfg.device = str(resolve_device(device))
    out = output_dir(out)
    prov = collect(argv, cfg.device)
    t_start = time.perf_counter()
    objs = objectives(cfg)
    derived = {name: lowering.lower(o) for name, o in objs.items()}
    base = derived["OptEq"]
    trainer = Trainer(cfg, n_params(classifier("OptEq", base, cfg)), progress)
    trainer.start()  # workers train while this process prints and verifies
    if quick:
        print(SMOKE)
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
    checkpoints = {n: save_checkpoint(jobs[n]["state_dict"], out, n) for n in (*derived, MLP)}
    _phase("training + verification of the trained layers", t_start)
    print()
    if quick:
        print(SMOKE)
    print(table(results))
    print(nonconvergence_note(results, cfg))
    traces = residual_traces(base, jobs["OptEq"]["eq_weights"], xte[:64])
    sparsity = {n: jobs[n]["features"] for n in SPARSITY}
    plots = write_plots(out, results, traces, sparsity)
    total = time.perf_counter() - t_start
    report = _report(cfg, derived, results, plots, traces, sparsity, total, prov, checkpoints,
                     data)
    (out / "report.md").write_text(report, encoding="utf-8")
    (out / "results.json").write_text(json.dumps(
        {"kind": "demo", "provenance": prov, "config": cfg.__dict__, "total_seconds": total,
         "setup": setup_text(cfg, data) + f" Total time {total:.0f} s.",
         "data": {"name": "MNIST-1D", "train": len(data.y_train), "test": len(data.y_test)},
         "columns": column_definitions(cfg),
         "results": [{**r.__dict__, "checkpoint": checkpoints[r.name]} for r in results]},
        indent=2, default=float), encoding="utf-8")
    print(f"\nwrote {out / 'report.md'} (+ {', '.join(plots)}, results.json, "
          f"{len(checkpoints)} checkpoints in {out / 'checkpoints'}) in {total:.0f} s")
    return {"results": results, "total_seconds": total, "out": str(out),
            "checkpoints": checkpoints}


def nonconvergence_note(results: list[Result], cfg: DemoConfig) -> str:
    """How many training steps hit ``max_iter`` (forward) / ``2·max_iter`` (adjoint)."""
    parts = [f"{r.name}: {f} forward / {b} adjoint" for r in results
             for f, b in [r.nonconvergence] if f or b]
    if not parts:
        return "Every forward and adjoint solve during training reached its tolerance."
    return (f"Training steps whose solve stopped at the iteration cap before tol {cfg.tol:g} "
            f"(the step still used the last iterate): {'; '.join(parts)}.")


def _phase(name: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {name} done", flush=True)


def _verify_once(derived: Any, x: torch.Tensor) -> str:
    from verify.check import check

    return str(check(derived, x.double()))


def _zero_fraction(v: np.ndarray) -> float:
    return float((np.abs(v) < 1e-6 * max(1e-12, float(np.abs(v).max()))).mean())


def setup_text(cfg: DemoConfig, data: Dataset | None) -> str:
    """The run's setup in one paragraph (what a reader needs to repeat it)."""
    sizes = (f"{len(data.y_train)} train / {len(data.y_test)} test signals" if data is not None
             else "MNIST-1D")
    return (f"MNIST-1D generated locally by the `mnist1d` package ({sizes} of length 40). "
            f"Every equilibrium model is a convolutional layer of {cfg.channels} channels, "
            f"kernel {cfg.kernel}, max-pooled to {cfg.pooled} positions and read by a linear "
            f"head; ℓ1 weight {cfg.l1:g}, Moreau skip α = {cfg.alpha:g}. The GEQ has "
            f"{len(DEMO_GEQ_SCALES)} branches of {cfg.geq_channels} channels at input strides "
            f"{'/'.join(map(str, DEMO_GEQ_SCALES))}, patches of 2 positions × "
            f"{cfg.geq_channels} channels with a full-size W_h, the paper's bandwidth "
            f"γ = 0.2/M, weight normalisation, phantom gradients and branch outputs averaged "
            f"after pooling. Training: {cfg.epochs} epoch(s) of Adam, learning rate "
            f"{cfg.lr:g} with a cosine schedule, batch {cfg.batch}, seed {cfg.seed}, on "
            f"{cfg.device}, {max(1, cfg.workers)} worker process(es) of one torch thread. "
            f"Equilibrium solves: Anderson forward, tolerance {cfg.tol:g}, at most "
            f"{cfg.max_iter} iterations.")


def _report(cfg: DemoConfig, derived: dict, results: list[Result], plots: list[str],
            traces: dict[str, ResidualTrace], sparsity: dict[str, np.ndarray], total: float,
            prov: dict[str, Any] | None = None, checkpoints: dict[str, str] | None = None,
            data: Dataset | None = None) -> str:
    from .provenance import column_lines, header_lines

    lines = ["# convex-eq demo report", "",
             *header_lines(prov or {}, smoke=cfg.quick),
             setup_text(cfg, data) + f" Total time {total:.0f} s.", "",
             "## Derived layers", ""]
    for name, d in derived.items():
        lines += [f"### {name}", "", "```", d.describe(), "```", ""]
    lines += ["## Training on MNIST-1D", "", table(results), "",
              *column_lines(column_definitions(cfg)),
              nonconvergence_note(results, cfg), "",
              "![training curves](training_curves.png)", "",
              "Per-epoch solver statistics (forward / adjoint iterations, steps at the "
              "iteration cap) are in results.json (`history`)."]
    if checkpoints:
        lines += ["", "Trained weights (`state_dict`, load with "
                  "`model.load_state_dict(torch.load(path))` into the model built with the same "
                  "configuration): " + ", ".join(f"`{p}`" for p in checkpoints.values()) + "."]
    lines += ["", "## Solvers on the trained OptEq layer", "",
              f"{DTYPE_NAME}, tol {TRACE_TOL:g}, at most "
              f"{TRACE_MAX_ITER} iterations, the first {next(iter(traces.values())).batch} test "
              "signals.", "",
              "| solver | mean iterations | converged | mean residual of the returned state |",
              "|---|---|---|---|"]
    for s, tr in traces.items():
        lines.append(f"| {s} | {tr.iterations:.1f} | {100 * tr.converged:.0f} % | "
                     f"{tr.returned[-1]:.2e} |")
    lines += ["", *column_lines({
        "solver": "the forward fixed-point solver run on the trained layer's weights",
        "mean iterations": "iterations until the tolerance or the cap, mean over the signals",
        "converged": "share of the signals whose returned state meets the tolerance",
        "mean residual of the returned state": "relative residual ||T(z) − z|| / ||T(z)|| of "
        "the state the module returns (each solver returns its best iterate), mean over the "
        "signals"}),
        "![residuals](residuals.png)", "", "## Feature sparsity", ""]
    for n, v in sparsity.items():
        lines.append(f"- {n}: exactly zero {float((v == 0).mean()):.3f}, "
                     f"|z*| < 1e-6·max {_zero_fraction(v):.3f}, "
                     f"median |z*| = {float(np.median(np.abs(v))):.3e}")
    lines += ["", "Shares of the entries of the trained layers' features z* on the test "
              "signals; the left panel of the plot counts exact zeros, the right one shows the "
              "magnitudes of the nonzero entries.", "", "![sparsity](sparsity.png)", ""]
    return "\n".join(lines)
