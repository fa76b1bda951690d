"""The main demo: declare → derive → verify → edit the objective three ways → train on digits.

``convex-eq demo [--quick] [--out DIR]``: derives the OptEq layer (conv, Theorem 1), verifies it
against CVXPY, edits the objective (ℓ1 feature regularizer via prox, Moreau-envelope skip
connection, Gaussian kernel), trains every derived model and an MLP with the same parameter count
on scikit-learn's bundled ``load_digits`` (8×8 images), and writes plots and a Markdown report.
"""

from __future__ import annotations

import difflib
import json
import math
import multiprocessing
import queue
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceWarning
from convex_eq.terms import L1, moreau

IMAGE = (1, 8, 8)
MLP = "MLP (same #params)"
#: the equilibrium layers are trained and compared in this dtype (named in plot titles)
DTYPE = torch.float32
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
#: training order (longest first, so that two workers finish close together)
TRAIN_ORDER = ("OptEq + ℓ1", "OptEq Moreau skip", "OptEq", "GEQ (Gaussian kernel)", MLP)


@dataclass
class DemoConfig:
    """Sizes and budgets (``quick`` shrinks them for the < 1 minute smoke run)."""

    channels: int = 32
    epochs: int = 15
    batch: int = 64
    lr: float = 1e-2
    tol: float = 1e-4
    max_iter: int = 40
    l1: float = 0.01
    alpha: float = 0.5
    gamma: float = 0.05
    verify_inputs: int = 1
    pool: str = "max"
    quick: bool = False
    seed: int = 0
    #: processes training the models in parallel (each single-threaded); 1 = in this process
    workers: int = 2

    @classmethod
    def quick_config(cls) -> DemoConfig:
        return cls(channels=4, epochs=1, verify_inputs=1, quick=True)


@dataclass
class Result:
    name: str
    accuracy: float = 0.0
    params: int = 0
    mean_iterations: float = float("nan")
    final_residual: float = float("nan")
    verification: str = "—"
    train_time: float = 0.0
    #: convergence warnings raised while training: (forward, backward adjoint) counts
    nonconvergence: tuple[int, int] = (0, 0)
    history: list[dict[str, float]] = field(default_factory=list)


# ----------------------------------------------------------------------------- data
def load_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``load_digits`` (bundled with scikit-learn), standardized, 80/20 stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32).reshape(-1, *IMAGE)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mu, sd = xtr.mean(), xtr.std()
    return (torch.as_tensor((xtr - mu) / sd), torch.as_tensor(ytr),
            torch.as_tensor((xte - mu) / sd), torch.as_tensor(yte))


# ----------------------------------------------------------------------------- objectives
def objectives(cfg: DemoConfig) -> dict[str, Any]:
    """The base OptEq objective (conv, canonical form) and its three edits."""
    base = models.opteq(conv=(cfg.channels, 3), image=IMAGE, seed=cfg.seed)
    z = base.states[0]
    return {
        "OptEq": base,
        "OptEq + ℓ1": base + cfg.l1 * L1(z),
        "OptEq Moreau skip": cfg.alpha * moreau(base, 1.0 - cfg.alpha),
        "GEQ (Gaussian kernel)": models.geq(conv=(cfg.channels, 3), image=IMAGE, patch=2, h=8,
                                           gamma=cfg.gamma, seed=cfg.seed),
    }


#: weights kept at spectral norm ≤ bound during training (convexity / contraction certificates)
WEIGHT_BOUNDS = {"GEQ (Gaussian kernel)": {"W": 1.0, "W_h": 1.0}}


def derivation_diff(base: Any, other: Any) -> str:
    """Unified diff of two printed derivations (what the edit changed)."""
    a = base.describe().splitlines()
    b = other.describe().splitlines()
    return "\n".join(difflib.unified_diff(a, b, "base", "edited", lineterm="", n=0))


# ----------------------------------------------------------------------------- models
class EquilibriumClassifier(nn.Module):
    """Derived equilibrium layer → 2×2 average pool → linear head."""

    def __init__(self, derived: Any, cfg: DemoConfig, solver: str = "anderson",
                 weight_bounds: dict[str, float] | None = None):
        super().__init__()
        certified = derived.certificate is not None and derived.certificate.kind == "conditional"
        wc = "spectral_norm" if certified or weight_bounds else None
        self.eq = derived.torch_module(solver=solver, tol=cfg.tol, max_iter=cfg.max_iter,
                                       backward_max_iter=2 * cfg.max_iter,
                                       on_nonconvergence="warn", weight_control=wc,
                                       weight_bounds=weight_bounds, margin=0.02,
                                       dtype=DTYPE)
        c = derived.blocks[0].shape[0]
        pool = nn.MaxPool2d(2) if cfg.pool == "max" else (
            nn.AvgPool2d(2) if cfg.pool == "avg" else nn.Identity())
        k = 16 if cfg.pool in ("max", "avg") else 64
        self.head = nn.Sequential(pool, nn.Flatten(), nn.Linear(c * k, 10))
        self.stats: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, self.stats = self.eq(x, return_stats=True)
        return self.head(z)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.eq(x)


def mlp_with(params: int) -> nn.Module:
    """``64 → h → 10`` MLP with about ``params`` parameters (``75h + 10``)."""
    h = max(4, round((params - 10) / 75))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- training
def train(model: nn.Module, data: tuple[torch.Tensor, ...], cfg: DemoConfig, name: str,
          progress: bool = True,
          on_epoch: Callable[[dict[str, float]], None] | None = None) -> Result:
    """Adam + cross-entropy (cosine learning rate); records loss/accuracy per epoch."""
    from tqdm import tqdm

    xtr, ytr, xte, yte = data
    torch.manual_seed(cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    res = Result(name, params=n_params(model))
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.epochs), desc=f"{name:<24}", disable=not progress, leave=True)
    for epoch in bar:
        model.train()
        perm = torch.randperm(len(xtr))
        tot, its, nb = 0.0, 0.0, 0
        for i in range(0, len(xtr), cfg.batch):
            idx = perm[i:i + cfg.batch]
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += float(loss.detach())
            st = getattr(model, "stats", None)
            its += st.mean_iterations if st is not None else 0.0
            nb += 1
        sched.step()
        acc = accuracy(model, xte, yte)
        res.history.append({"epoch": epoch + 1, "loss": tot / nb, "test_acc": acc,
                            "iterations": its / nb})
        bar.set_postfix(loss=f"{tot / nb:.3f}", acc=f"{acc:.3f}")
        if on_epoch is not None:
            on_epoch(res.history[-1])
    res.train_time = time.perf_counter() - t0
    res.accuracy = accuracy(model, xte, yte)
    if isinstance(model, EquilibriumClassifier):
        with torch.no_grad():
            model(xte)
        res.mean_iterations = model.stats.mean_iterations
        res.final_residual = model.stats.max_residual
    return res


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ----------------------------------------------------------------------------- jobs
_QUEUE: Any = None


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q
    torch.set_num_threads(1)


def train_job(name: str, cfg: DemoConfig, mlp_params: int, progress: bool = False) -> dict:
    """Train model ``name`` on digits, verify its equilibrium layer on test inputs; returns the
    ``Result``, the layer's effective weights and its test features (picklable)."""
    torch.set_num_threads(1)
    data = load_data(cfg.seed)
    torch.manual_seed(cfg.seed)
    if name == MLP:
        model: nn.Module = mlp_with(mlp_params)
    else:
        model = EquilibriumClassifier(lowering.lower(objectives(cfg)[name]), cfg,
                                      weight_bounds=WEIGHT_BOUNDS.get(name))
    q = _QUEUE
    report = None if q is None else (lambda h: q.put((name, h)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        res = train(model, data, cfg, name, progress, on_epoch=report)
    msgs = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    res.nonconvergence = (sum(m.startswith("forward") for m in msgs),
                          sum(m.startswith("backward") for m in msgs))
    out: dict[str, Any] = {"result": res}
    if isinstance(model, EquilibriumClassifier):
        res.verification = verify_model(model, data[2], cfg.verify_inputs)
        with torch.no_grad():
            out["features"] = model.features(data[2]).numpy().ravel()
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


# ----------------------------------------------------------------------------- verification
def verify_model(model: EquilibriumClassifier, x: torch.Tensor, k: int) -> str:
    """Worst verification gap of the trained layer on ``k`` test inputs (docs/theory.md §9
    reference):
    relative state error vs CVXPY / the local reference, and the verdict."""
    from verify.check import check  # not at the top: the training workers never verify

    rep = check(model.eq, x[:k].double())
    errs = [s.rel_error if s.rel_error is not None else s.residual for s in rep.samples]
    verdict = "pass" if rep.passed else f"FAIL: {'; '.join(rep.failures)[:90]}"
    return f"{max(errs):.1e} ({rep.reference.kind}: {rep.label}, {verdict})"


# ----------------------------------------------------------------------------- plots & report
def effective_weights(eq: Any) -> dict[str, torch.Tensor]:
    """The weights a module actually uses (after spectral-norm control), as a state dict."""
    with torch.no_grad():
        return {f"weights.{k}": v.detach().clone() for k, v in eq.env().items()
                if k in eq.weights}


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
        import warnings

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
    fig.suptitle(f"training on load_digits (equilibrium layers in {DTYPE_NAME})", fontsize=10)
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
        workers: int | None = None) -> dict:
    """Run the whole demo; returns the results (also written to ``out``).  ``workers``:
    training processes (default ``DemoConfig.workers`` = 2; 1 trains in this process)."""
    # the layers are small: one thread avoids OpenMP hand-off/spin costs that dominate tiny
    # convolutions (and make them 100x slower when the machine is busy)
    torch.set_num_threads(1)
    cfg = DemoConfig.quick_config() if quick else DemoConfig()
    if workers is not None:
        cfg.workers = int(workers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    objs = objectives(cfg)
    derived = {name: lowering.lower(o) for name, o in objs.items()}
    base = derived["OptEq"]
    trainer = Trainer(cfg, n_params(EquilibriumClassifier(base, cfg)), progress)
    trainer.start()  # workers train while this process prints and verifies
    print("=" * 78)
    print("1. OptEq hidden objective (conv W, Theorem 1) and its derived layer")
    print("=" * 78)
    print(base.describe())
    _phase("derive", t_start)
    data = load_data(cfg.seed)
    xte = data[2]
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
    print("3. Training every derived layer on load_digits (1437 train / 360 test)")
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
    lines += ["## Training on load_digits", "", table(results), "",
              nonconvergence_note(results, cfg), "",
              "![training curves](training_curves.png)", "",
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
