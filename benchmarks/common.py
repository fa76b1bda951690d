"""Shared pieces: the OptEq hidden QP, its exact solution and gradient, timing, machine info."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

D_STATE = 64  # the d: size of the state z (``n`` in ``convex_eq.models.opteq``)


@dataclass
class Config:
    """Sizes and repetition counts of one benchmark run (full or ``--quick``)."""

    quick: bool = False
    threads: int = 1
    seed: int = 0
    ms: tuple[int, ...] = (32, 128, 512)
    batches: tuple[int, ...] = (1, 32, 256)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    reps: int = 15  # repetitions of the fast methods (module, hand-written loop)
    cvx_reps: int = 5  # cap on cvxpylayers repetitions
    cvx_budget: float = 10.0  # seconds of cvxpylayers fwd+bwd timing per row (sets its reps)
    hand_m: tuple[int, ...] = (128,)  # m of the "overhead vs the limit" table
    norms: tuple[float, ...] = (0.5, 0.9, 0.99)
    solver_batch: int = 32
    solver_m: int = 128
    deq_batches: tuple[int, ...] = (32, 256)
    mem_batch: int = 256
    mem_ks: tuple[int, ...] = (5, 10, 20, 40)
    cost_reps: int = 5
    verify_models: tuple[str, ...] | None = None  # None: verify every seed model
    train_steps: int = 300  # Adam steps of the training case (each method)
    train_window: int = 50  # steps in its "first" and "last" median windows
    #: interleaved replays of both windows the drift target is judged on (medians over all
    #: of them): a single replay's ratio spread 1.26–1.31 over eight runs of one commit (the
    #: machine's noise); the median over three is less noisy, at ~3 s a replay
    train_replays: int = 3
    device: str = "cpu"  # where every case puts its modules and tensors (cvxpylayers: CPU)

    @classmethod
    def make(cls, quick: bool, threads: int = 1, seed: int = 0, device: str = "cpu") -> Config:
        """The full configuration, or the < 60 s smoke configuration."""
        if not quick:
            return cls(quick=False, threads=threads, seed=seed, device=device)
        return cls(quick=True, threads=threads, seed=seed, ms=(32,), batches=(1, 8),
                   reps=2, cvx_reps=1, cvx_budget=1.0, hand_m=(32,), norms=(0.9,),
                   solver_batch=8, solver_m=32, deq_batches=(8,), mem_batch=8, mem_ks=(5, 10),
                   cost_reps=1, verify_models=("opteq (canonical)",), train_steps=6,
                   train_window=3, train_replays=1, device=device)


# ---------------------------------------------------------------------------- the device
#: the device every timing synchronises with (set once per run by :func:`use_device`)
_DEVICE = torch.device("cpu")


class DeviceError(ValueError):
    """``--device`` names a device this machine does not have (the message says what to do)."""


def select_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present) as a ``torch.device``;
    a :class:`DeviceError` saying what to use instead when torch cannot run there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as err:
        raise DeviceError(f"--device {name!r} is not a torch device ({err}); use cpu, cuda, "
                          "cuda:N or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name!r}: torch sees no CUDA device "
                              f"(torch.cuda.is_available() is False; torch {torch.__version__}, "
                              f"built for CUDA {torch.version.cuda or 'none'}); run with "
                              "--device cpu, or on a machine with a GPU and a CUDA build of "
                              "torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name!r}: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); use cuda:0 … "
                              f"cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise DeviceError(f"--device {name!r}: the benchmarks run on cpu or cuda")
    return dev


def use_device(dev: torch.device | str) -> torch.device:
    """Make ``dev`` the device :func:`timed` synchronises with; returns it."""
    global _DEVICE
    _DEVICE = torch.device(dev)
    return _DEVICE


def sync() -> None:
    """Wait for the queued kernels of the run's device (a no-op on the CPU): CUDA calls return
    before their kernels finish, so a clock read without it measures the launch, not the work."""
    if _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)


# ---------------------------------------------------------------------------- the problem
def qp_weight(m: int, d: int = D_STATE, norm: float = 0.9, seed: int = 0) -> np.ndarray:
    """Random dense ``W ∈ R^{m×d}`` with ``||W||₂ = norm`` (same recipe as ``models.opteq``)."""
    from convex_eq.models import spectral_weight

    return np.asarray(spectral_weight("W", (m, d), norm, seed).value, dtype=np.float64)


def qp_objective(w: np.ndarray) -> Any:
    """``Σf_relu(z) + ½||z||² − <q, z> − ½||Wz||²`` with ``q`` an Input: the hidden QP
    ``min ½zᵀ(I − WᵀW)z − qᵀz s.t. z ≥ 0`` (canonical ReLU OptEq with ``Ux + b`` replaced by q)."""
    from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight

    m, d = w.shape
    z, q = State("z", d), Input("q", d)
    wt = Weight("W", (m, d), w)
    return Objective([Potential("relu", z), SqNorm(z), -Linear(q, z), -SqNorm(wt @ z)],
                     name=f"opteq-qp(m={m})")


def qp_inputs(batch: int, d: int = D_STATE, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``q`` (the QP's linear term) and the loss weights ``c`` of ``ℓ = Σ c ⊙ z`` (float64)."""
    g = np.random.default_rng(1000 + seed)
    return g.standard_normal((batch, d)), g.standard_normal((batch, d))


@dataclass
class Exact:
    """Exact minimizer and ``∂ℓ/∂q`` of the hidden QP for a batch (float64)."""

    z: np.ndarray
    grad: np.ndarray
    active: np.ndarray
    kkt_failures: int
    margin: float  # min over samples/coords of |preactivation|: distance to a degenerate point


def exact_qp(w: np.ndarray, q: np.ndarray, c: np.ndarray) -> Exact:
    """Exact solve by a primal–dual active-set iteration, then ``dq`` from the active set.

    With ``M = WᵀW``, ``p = Mz + q``, the KKT conditions of ``min ½zᵀ(I − M)z − qᵀz, z ≥ 0`` are
    ``z = relu(p)``: on ``A = {p > 0}`` ``(I − M_AA) z_A = q_A``, and ``z_I = 0`` with ``p_I ≤ 0``
    elsewhere. The set ``A ← {p > 0}`` is iterated to a fixed point (then KKT holds exactly, and
    ``I − M ≻ 0`` makes it the unique minimizer). Under strict complementarity the solution is
    locally ``z_A = (I − M_AA)⁻¹ q_A``, ``z_I = 0``, so for ``ℓ = Σ c ⊙ z``
    ``∂ℓ/∂q_A = (I − M_AA)⁻¹ c_A`` (symmetric) and ``∂ℓ/∂q_I = 0``."""
    mm = w.T @ w
    bsz, d = q.shape
    z = np.zeros_like(q)
    grad = np.zeros_like(q)
    act = np.zeros(q.shape, dtype=bool)
    failures = 0
    margin = np.inf
    for b in range(bsz):
        a = q[b] > 0
        zb = np.zeros(d)
        for _ in range(100):
            idx = np.flatnonzero(a)
            zb = np.zeros(d)
            if idx.size:
                k = np.eye(idx.size) - mm[np.ix_(idx, idx)]
                zb[idx] = np.linalg.solve(k, q[b, idx])
            p = mm @ zb + q[b]
            new = p > 0
            if np.array_equal(new, a):
                break
            a = new
        else:
            failures += 1
        idx = np.flatnonzero(a)
        if idx.size:
            k = np.eye(idx.size) - mm[np.ix_(idx, idx)]
            grad[b, idx] = np.linalg.solve(k, c[b, idx])
        z[b], act[b] = zb, a
        margin = min(margin, float(np.abs(mm @ zb + q[b]).min()))
    return Exact(z, grad, act, failures, margin)


def clarabel_crosscheck(obj: Any, q: np.ndarray, z_exact: np.ndarray) -> float:
    """Max relative difference between the exact solve and Clarabel (tight) on a few samples."""
    worst = 0.0
    for b in range(q.shape[0]):
        ex = obj.to_cvxpy(q=q[b])
        ex.solve()
        zc = ex.state_values()["z"].reshape(-1)
        worst = max(worst, rel_err(zc[None], z_exact[b:b + 1]))
    return worst


def rel_err(a: np.ndarray | torch.Tensor, ref: np.ndarray | torch.Tensor) -> float:
    """Worst per-sample relative error ``||a_b − ref_b|| / max(||ref_b||, 1e-12)``."""
    a_np = a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    r_np = ref.detach().cpu().double().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    a_np, r_np = a_np.reshape(a_np.shape[0], -1), r_np.reshape(r_np.shape[0], -1)
    num = np.linalg.norm(a_np - r_np, axis=1)
    den = np.maximum(np.linalg.norm(r_np, axis=1), 1e-12)
    return float((num / den).max())


# ---------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> float:
    """Wall time of one call, the run's device synchronised before each clock read (:func:`sync`),
    so that earlier queued work is not counted and this call's work is."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def interleave(methods: dict[str, Callable[[], Any]], reps: dict[str, int], seed: int = 0,
               warmup: int = 0) -> dict[str, list[float]]:
    """Round-robin timing: repetition r runs every method with ``reps[name] > r`` once, in an
    order drawn afresh each repetition (seeded: the same run repeats the same orders), after
    ``warmup`` untimed rounds of every method in drawn orders.

    Warm-up rounds: the first cells of a run measured while the process was young (its heap
    still growing, allocator bins not yet populated) — the grid's first cell read 1.09–1.21×
    where the same cell run last in the process read 1.09× and the others 1.02–1.08×.

    A fixed order, even rotated, keeps each method's predecessor: on this machine a method run
    right after another one's allocations and cache traffic measured up to ~6 % slower, and
    with a fixed cyclic order that bias always hit the same method (module ``auto`` after the
    hand loop read 3 % slower than the identical ``plain`` path).  Drawn orders spread every
    predecessor over every method."""
    out: dict[str, list[float]] = {k: [] for k in methods}
    names = list(methods)
    rng = np.random.default_rng(seed)
    for _ in range(warmup):
        for i in rng.permutation(len(names)):
            methods[names[int(i)]]()
    for r in range(max(reps.values(), default=0)):
        for i in rng.permutation(len(names)):
            name = names[int(i)]
            if r < reps[name]:
                out[name].append(timed(methods[name]))
    return out


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over interleaved rounds of ``a[r] / b[r]`` (the two methods' times in the same
    round, :func:`interleave`).  On this shared machine per-call times are bimodal (a fast and
    a ~40 % slower state that lasts for many calls; in one run the same grid cell had its
    quartiles at 2.4 and 3.6 ms): a ratio of medians then depends on where each method's median
    falls between the modes (two identical module paths read 0.97–1.06× each other), while
    calls of one round run within milliseconds of each other, mostly in the same state."""
    n = min(len(a), len(b))
    return median([x / y for x, y in zip(a[:n], b[:n])]) if n else float("nan")


def median(xs: list[float]) -> float:
    """Median (NaN for an empty list)."""
    return float(statistics.median(xs)) if xs else float("nan")


def calibrate(threads: int) -> dict[str, float]:
    """Median time of a small matmul with 1, 2 and ``threads`` threads (detects CPU contention:
    with OpenMP workers descheduled, tiny multithreaded kernels can take milliseconds)."""
    a, b = torch.randn(32, D_STATE), torch.randn(128, D_STATE)
    out = {}
    for nt in sorted({threads, 1, 2}):
        torch.set_num_threads(nt)
        for _ in range(5):
            a @ b.T
        out[f"matmul_32x64x128_us_{nt}thr"] = 1e6 * median([timed(lambda: a @ b.T)
                                                            for _ in range(50)])
    torch.set_num_threads(threads)
    return out


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _git(root: Path) -> dict[str, Any]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return {"commit": head or None, "dirty": bool(dirty)}
    except Exception:
        return {"commit": None, "dirty": None}


def machine_info(threads: int) -> dict[str, Any]:
    """Machine, versions, date, threads and load (timings are only comparable within a run)."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": {k: _version(k) for k in ("torch", "cvxpy", "cvxpylayers", "diffcp", "scs",
                                              "clarabel", "torchdeq", "numpy", "convex-eq")},
        "git": _git(Path(__file__).resolve().parent.parent),
    }
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
    except OSError:
        info["cpu_model"] = None
    info["loadavg_start"] = load_average()
    info["device"] = str(_DEVICE)
    if _DEVICE.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(_DEVICE)
        info["versions"]["cuda"] = torch.version.cuda
    return info


def load_average() -> list[float] | None:
    """1/5/15-minute load average (None where unavailable)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
