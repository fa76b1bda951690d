"""Anderson acceleration (type II), batched, with the least-squares weights in float64
(docs/theory.md §8, Anderson acceleration).

``x_{k+1} = Σ_i α_i f(x_i)`` over the last ``m`` iterates, ``α = argmin ||Σ α_i g_i||² + ridge``
subject to ``Σ α_i = 1``, ``g_i = f(x_i) − x_i``.
"""

from __future__ import annotations

import torch

from convex_eq.errors import OptionError

from .residuals import accumulation_dtype
from .stall_guard import ANDERSON_FRUITLESS, ANDERSON_GAIN, StallGuard
from .tracker import F, Tracker


def anderson(f: F, z0: torch.Tensor, tr: Tracker, *, max_iter: int = 100, m: int = 5,
             beta: float = 1.0, lam: float = 1e-8, restart: int | None = None) -> None:
    """Anderson acceleration from ``z0``, recorded into ``tr``.

    The residual Gram matrix ``GGᵀ`` is kept incrementally (one new row per iteration) in the
    accumulation dtype (float64 for float32/16 states: in float32 the Gram matrix squares the
    round-off and the mixing stalls near a relative residual of 1e-4), with the ridge
    ``lam·||g_i||² + sqrt(tiny)`` on each diagonal entry, put there when the entry's row is
    written; ``α = A⁻¹1 / 1ᵀA⁻¹1`` (scale-free; a bordered (KKT) form of the same problem loses
    the small entries of a history spanning many scales).  Safeguard: when the worst sample's
    best residual has not improved for ``restart`` iterations (default ``2m``), the history is
    cleared and the next step is a plain one.  After ``ANDERSON_FRUITLESS`` such restarts in a
    row that gain nothing (a stall: on a slow contraction Anderson can stay far from the fixed
    point where plain iteration converges), the solve alternates checked phases of plain
    iteration with Anderson trials (:class:`~lowering.runtime.solvers.stall_guard.StallGuard`);
    a solve without such a stall runs as without it, bit for bit."""
    if m < 1:
        raise OptionError("Anderson history m must be ≥ 1", term=f"solver {tr.name}")
    tr.name = "anderson"
    iterate(f, z0, tr, max_iter, m, beta, lam, restart)


def iterate(f: F, z0: torch.Tensor, tr: Tracker, max_iter: int, m: int, beta: float,
            lam: float, restart: int | None) -> None:
    """The Anderson iteration from ``z0`` recording into ``tr`` (``tr.name`` kept: ``auto``
    continues its plain phase here)."""
    hist = _History(z0, m, beta, lam)
    watch = _Restarts(2 * m if restart is None else int(restart), m, tr.tol)
    x = z0
    for _ in range(max_iter):
        fx = f(x)
        g = fx - x
        if tr.record(x, fx, g):
            break
        row = hist.push(x, fx, g)
        if watch.guard_idle and watch.stalled(tr.top, hist.filled):
            watch.restart(tr.top, row[:, hist.slot])
            hist.restart(x, fx, g, row)
            x = fx
            continue
        hist.advance()
        if hist.filled == 1:  # (never in a guard's phase: one starts at a restart, 1 → 2)
            x = fx if beta == 1.0 else beta * fx + (1 - beta) * x
            continue
        x_new = hist.mix()
        if not watch.guard_idle:
            # the slot just written: row[:, slot before the advance] is ||f(x) − x||²
            guard = watch.guard
            assert guard is not None
            nxt = guard.step(fx, row[:, (hist.slot - 1) % m], x_new, tr.hist[-1],
                             tr.nonfinite if tr.any_nonfinite else None)
            if nxt is None:  # the phases ended: Anderson goes on, its stall test afresh
                watch.resume(tr.top)
            else:
                x_new = nxt
        x = x_new


class _History:
    """The last ``m`` iterates, images and residuals in ring buffers (only filled slots are
    read), with their Gram matrix ``A = GGᵀ + R`` (``R`` the ridge on the diagonal)."""

    __slots__ = ("F", "G", "GG", "X", "beta", "dt", "filled", "lam1", "m", "mix_bmm", "ones",
                 "slot", "tiny")

    def __init__(self, z0: torch.Tensor, m: int, beta: float, lam: float):
        b, n = z0.shape
        dt, dev = z0.dtype, z0.device
        acc = accumulation_dtype(dt)
        self.m, self.beta, self.dt = m, beta, dt
        # X only for beta ≠ 1 (the mixing of the iterates themselves)
        self.X = torch.empty(b, m, n, dtype=dt, device=dev) if beta != 1.0 else None
        self.F = torch.empty(b, m, n, dtype=dt, device=dev)
        self.G = torch.empty(b, m, n, dtype=acc, device=dev)
        self.GG = torch.zeros(b, m, m, dtype=acc, device=dev)
        self.ones = torch.ones(b, m, 1, dtype=acc, device=dev)
        #: mixing Σ α_i f_i as a batched matrix product for long states, as a broadcast sum for
        #: short ones (the faster of the two on either side of N ≈ 256)
        self.mix_bmm = n >= 256
        self.lam1, self.tiny = 1.0 + lam, torch.finfo(acc).tiny ** 0.5
        self.filled = 0  # number of valid history slots
        self.slot = 0  # the slot the next push writes

    def push(self, x: torch.Tensor, fx: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Store ``(x, f(x), g)`` in the current slot and write its row and column of the Gram
        matrix (the diagonal entry with the ridge ``(1 + lam)·||g||² + sqrt(tiny)``); returns
        the new row ``(B, filled, 1)``."""
        slot = self.slot
        if self.X is not None:
            self.X[:, slot] = x
        self.F[:, slot] = fx
        self.G[:, slot] = g
        self.filled = filled = min(self.filled + 1, self.m)
        G = self.G
        # ⟨g_i, g_new⟩ for the filled slots: one batched product for a single sample, a
        # broadcast dot product otherwise (a batched matrix–vector bmm is several times slower)
        row = torch.bmm(G[:, :filled], G[:, slot, :, None]) if G.shape[0] == 1 else \
            torch.linalg.vecdot(G[:, :filled], G[:, slot, None])[..., None]
        GG = self.GG
        GG[:, :filled, slot, None] = row
        GG[:, slot, :filled, None] = row
        GG[:, slot, slot].mul_(self.lam1).add_(self.tiny)
        return row

    def restart(self, x: torch.Tensor, fx: torch.Tensor, g: torch.Tensor,
                row: torch.Tensor) -> None:
        """Clear the history but the latest entry (``row``: its Gram row, float64 above)."""
        if self.X is not None:
            self.X[:, 0] = x
        self.F[:, 0], self.G[:, 0] = fx, g
        self.GG[:, 0, 0] = row[:, self.slot, 0] * self.lam1 + self.tiny
        self.filled = 1
        self.slot = 1 % self.m

    def advance(self) -> None:
        self.slot = (self.slot + 1) % self.m

    def mix(self) -> torch.Tensor:
        """The Anderson step ``Σ α_i f_i`` (damped by ``beta`` towards ``Σ α_i x_i``)."""
        filled, m = self.filled, self.m
        w, info = torch.linalg.solve_ex(self.GG[:, :filled, :filled], self.ones[:, :filled])
        alpha = w[..., 0] / w[..., 0].sum(dim=1, keepdim=True)
        # singular: the latest plain step for those samples (on an accelerator without the
        # host synchronisation of the test: the stop test is the only one per iteration)
        if not alpha.device.type == "cpu" or bool(info.any()):
            ok = info == 0
            last = torch.zeros_like(alpha)
            last[:, (self.slot - 1) % m] = 1.0
            alpha = torch.where(ok[:, None], alpha, last)
        a = alpha.to(self.dt)
        Fh = self.F[:, :filled]
        x_new = (a[:, None] @ Fh)[:, 0] if self.mix_bmm else (a[:, :, None] * Fh).sum(1)
        if self.X is not None:
            beta = self.beta
            x_new = beta * x_new + (1 - beta) * (a[:, None] @ self.X[:, :filled])[:, 0]
        return x_new


class _Restarts:
    """When to clear the history: the worst residual has not improved by 0.1 % for ``period``
    iterations; after ``ANDERSON_FRUITLESS`` restarts in a row that gain nothing, a
    :class:`~lowering.runtime.solvers.stall_guard.StallGuard` takes over."""

    __slots__ = ("best_worst", "fruitful", "fruitless", "guard", "m", "period", "stale", "tol")

    def __init__(self, period: int, m: int, tol: float):
        self.period, self.m, self.tol = period, m, tol
        self.best_worst, self.stale = float("inf"), 0
        # restarts in a row that gained nothing, and the best worst residual since the last
        # that did
        self.fruitless, self.fruitful = 0, float("inf")
        self.guard: StallGuard | None = None  # made at a stall (ANDERSON_FRUITLESS)

    @property
    def guard_idle(self) -> bool:
        """No guard phase is running (the stall test applies; in a phase: the guard's own)."""
        return self.guard is None or self.guard.phase is None

    def stalled(self, worst: float, filled: int) -> bool:
        """Record this run's worst residual (a continued solve may have a better past)."""
        if worst < 0.999 * self.best_worst:
            self.best_worst, self.stale = worst, 0
        else:
            self.stale += 1
        return self.stale >= self.period and filled > 1

    def restart(self, worst: float, r2: torch.Tensor) -> None:
        """Count the restart (fruitless: its best worst residual is not below ``ANDERSON_GAIN``
        times the best since the last one that gained) and start a guard phase if due
        (``r2``: the latest ``||f(x) − x||²``)."""
        if self.best_worst < ANDERSON_GAIN * self.fruitful:
            self.fruitless, self.fruitful = 0, self.best_worst
        else:
            self.fruitless, self.fruitful = self.fruitless + 1, min(self.fruitful,
                                                                    self.best_worst)
        if self.guard is None and self.fruitless >= ANDERSON_FRUITLESS:
            self.guard = StallGuard(2 * self.m, self.tol)
        if self.guard is not None and not self.guard.dead:  # a plain phase from here
            self.guard.start(r2)
        self.stale, self.best_worst = 0, worst

    def resume(self, worst: float) -> None:
        """The guard's phases ended: the stall test afresh from ``worst``."""
        self.best_worst, self.stale = worst, 0
