"""Fixed-point solvers (batched, per-sample statistics) with a registry, torchdeq-style.

Every solver finds ``z = f(z)`` for ``f: (B, N) → (B, N)`` and stops when every sample's relative
residual ``||f(z) - z|| / max(||f(z)||, eps)`` is ≤ ``tol``; it returns the best iterate per
sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import NonFiniteError, OptionError

F = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SolverStats:
    """Per-sample solver statistics."""

    solver: str
    residuals: torch.Tensor  # (B, K) relative residual after each iteration
    iterations: torch.Tensor  # (B,) iterations until the sample first met tol (or K)
    converged: torch.Tensor  # (B,) bool
    tol: float

    @property
    def max_residual(self) -> float:
        return float(self.final_residual.max()) if self.final_residual.numel() else 0.0

    @property
    def final_residual(self) -> torch.Tensor:
        """Best relative residual reached by each sample."""
        if self.residuals.shape[1] == 0:
            return torch.zeros(self.residuals.shape[0])
        return self.residuals.min(dim=1).values

    @property
    def mean_iterations(self) -> float:
        return float(self.iterations.float().mean())

    def __str__(self) -> str:
        return (f"{self.solver}: {int(self.converged.sum())}/{self.converged.numel()} converged, "
                f"mean iterations {self.mean_iterations:.1f}, max relative residual "
                f"{self.max_residual:.3e} (tol {self.tol:g})")


def rel_residual(fz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``||f(z) - z|| / max(||f(z)||, 1e-30)`` per sample.  Norms of float32/16 states are
    accumulated in float64: ``Σv²`` overflows float32 once ``|v| ≳ 1e19`` and ``x/inf = 0``
    would report a wrong iterate as converged."""
    if fz.ndim != 2:
        fz, z = fz.flatten(1), z.flatten(1)
    acc = torch.float64 if fz.dtype in (torch.float32, torch.float16, torch.bfloat16) else None
    norm = torch.linalg.vector_norm
    r = norm(fz - z, dim=1, dtype=acc) / norm(fz, dim=1, dtype=acc).clamp_min(1e-30)
    return r if acc is None else r.to(fz.dtype)


class _Tracker:
    """Records residuals, keeps the best iterate per sample, detects NaN/Inf."""

    def __init__(self, name: str, z0: torch.Tensor, tol: float):
        self.name, self.tol = name, tol
        self.best = z0.detach().clone()
        self.best_res = torch.full((z0.shape[0],), float("inf"), dtype=z0.dtype,
                                   device=z0.device)
        self.hist: list[torch.Tensor] = []
        b = z0.shape[0]
        self.iters = torch.zeros(b, dtype=torch.long, device=z0.device)
        self.done = torch.zeros(b, dtype=torch.bool, device=z0.device)

    def record(self, z: torch.Tensor, fz: torch.Tensor) -> bool:
        if fz.requires_grad:  # solvers run under no_grad: detach only when needed
            fz, z = fz.detach(), z.detach()
        r = rel_residual(fz, z)
        self.hist.append(r)
        # store f(z) (one more application is never worse for a contraction) as the iterate
        self.best = torch.where((r < self.best_res)[:, None], fz, self.best)
        # torch.minimum propagates NaN: a NaN/Inf anywhere in fz (its norm is then non-finite)
        # makes best_res NaN for good, so one reduction answers "diverged?" and "all done?"
        self.best_res = torch.minimum(r, self.best_res)
        worst = float(self.best_res.max())
        if worst != worst:
            raise NonFiniteError(
                f"NaN/Inf in the fixed-point iterates after {len(self.hist)} iterations",
                term=f"solver {self.name}",
                hint="the iteration diverged: check the contraction estimate, scale the weights "
                "(weight_control='spectral_norm') or the inputs",
            )
        return worst <= self.tol

    def stats(self) -> SolverStats:
        k = len(self.hist)
        res = (torch.stack(self.hist, dim=1) if self.hist
               else torch.zeros(self.best.shape[0], 0, dtype=self.best.dtype))
        self.done = self.best_res <= self.tol
        if k:  # first iteration at which each sample met tol (computed once, not per iteration)
            met = res <= self.tol
            first = met.to(torch.int8).argmax(dim=1) + 1
            self.iters = torch.where(met.any(dim=1), first, torch.full_like(first, k))
        iters = torch.where(self.done, self.iters, torch.full_like(self.iters, k))
        return SolverStats(self.name, res, iters, self.done.clone(), self.tol)


SOLVERS: dict[str, Callable[..., tuple[torch.Tensor, SolverStats]]] = {}


def register_solver(name: str) -> Callable[[Callable], Callable]:
    """Decorator adding a solver ``fn(f, z0, tol, max_iter, **options)`` to the registry."""

    def deco(fn: Callable) -> Callable:
        SOLVERS[name] = fn
        return fn

    return deco


def get_solver(name: str) -> Callable[..., tuple[torch.Tensor, SolverStats]]:
    if name not in SOLVERS:
        raise OptionError(f"unknown solver {name!r}", term="solver",
                          hint=f"available: {', '.join(sorted(SOLVERS))}")
    return SOLVERS[name]


def solve(f: F, z0: torch.Tensor, solver: str = "anderson", tol: float = 1e-6,
          max_iter: int = 100, **options: Any) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``z = f(z)`` with a registered solver."""
    return get_solver(solver)(f, z0, tol=tol, max_iter=max_iter, **options)


@register_solver("plain")
def plain(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100,
          damping: float = 1.0) -> tuple[torch.Tensor, SolverStats]:
    """``z ← (1-λ) z + λ f(z)`` (λ = damping)."""
    if not 0 < damping <= 1:
        raise OptionError(f"damping {damping} must lie in (0, 1]", term="solver plain")
    tr = _Tracker("plain", z0, tol)
    z = z0
    for _ in range(max_iter):
        fz = f(z)
        if tr.record(z, fz):
            break
        z = fz if damping == 1.0 else (1 - damping) * z + damping * fz
    return tr.best, tr.stats()


@register_solver("anderson")
def anderson(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, m: int = 5,
             beta: float = 1.0, lam: float = 1e-8) -> tuple[torch.Tensor, SolverStats]:
    """Anderson acceleration (type II); ridge ``lam·tr(G)/n`` scaled to the residual Gram matrix
    so the regularization shrinks with the residuals and never stalls near tight tolerances."""
    if m < 1:
        raise OptionError("Anderson history m must be ≥ 1", term="solver anderson")
    b, n = z0.shape
    dt, dev = z0.dtype, z0.device
    X = torch.zeros(b, m, n, dtype=dt, device=dev)
    Fh = torch.zeros(b, m, n, dtype=dt, device=dev)
    tr = _Tracker("anderson", z0, tol)
    X[:, 0] = z0
    Fh[:, 0] = f(z0)
    if tr.record(X[:, 0], Fh[:, 0]) or max_iter <= 1:
        return tr.best, tr.stats()
    X[:, 1] = Fh[:, 0]
    Fh[:, 1] = f(Fh[:, 0])
    if tr.record(X[:, 1], Fh[:, 1]):
        return tr.best, tr.stats()
    H = torch.zeros(b, m + 1, m + 1, dtype=dt, device=dev)
    H[:, 0, 1:] = 1
    H[:, 1:, 0] = 1
    y = torch.zeros(b, m + 1, 1, dtype=dt, device=dev)
    y[:, 0] = 1
    eye = torch.eye(m, dtype=dt, device=dev)
    tiny = torch.finfo(dt).tiny ** 0.5
    for k in range(2, max_iter):
        nk = min(k, m)
        G = Fh[:, :nk] - X[:, :nk]
        GG = G @ G.transpose(1, 2)
        ridge = lam * GG.diagonal(dim1=1, dim2=2).mean(dim=1) + tiny
        H[:, 1:nk + 1, 1:nk + 1] = GG + ridge[:, None, None] * eye[:nk, :nk]
        sol, info = torch.linalg.solve_ex(H[:, :nk + 1, :nk + 1], y[:, :nk + 1])
        alpha = sol[:, 1:nk + 1, 0]
        if bool(info.any()):  # singular: fall back to the latest plain step for those samples
            plain_step = torch.zeros_like(alpha)
            plain_step[:, (k - 1) % m] = 1.0
            alpha = torch.where((info != 0)[:, None], plain_step, alpha)
        x_new = (alpha[:, None] @ Fh[:, :nk])[:, 0]
        if beta != 1.0:
            x_new = beta * x_new + (1 - beta) * (alpha[:, None] @ X[:, :nk])[:, 0]
        fx = f(x_new)
        X[:, k % m] = x_new
        Fh[:, k % m] = fx
        if tr.record(x_new, fx):
            break
    return tr.best, tr.stats()


@register_solver("broyden")
def broyden(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, m: int = 30
            ) -> tuple[torch.Tensor, SolverStats]:
    """Limited-memory ("good") Broyden on ``g(z) = f(z) - z`` with inverse-Jacobian estimate
    ``B = -I + Σ u_i v_iᵀ`` (Sherman–Morrison updates), unit step."""
    b, n = z0.shape
    dt, dev = z0.dtype, z0.device
    Us = torch.zeros(b, n, m, dtype=dt, device=dev)
    VTs = torch.zeros(b, m, n, dtype=dt, device=dev)
    tr = _Tracker("broyden", z0, tol)
    x = z0
    fx = f(x)
    gx = fx - x
    if tr.record(x, fx):
        return tr.best, tr.stats()

    def matvec(part_u: torch.Tensor, part_vt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if part_u.shape[-1] == 0:
            return -v
        return -v + (part_u @ (part_vt @ v[..., None]))[..., 0]

    def rmatvec(part_u: torch.Tensor, part_vt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if part_u.shape[-1] == 0:
            return -v
        return -v + ((v[:, None] @ part_u) @ part_vt)[:, 0]

    update = gx
    nstep = 0
    for _ in range(1, max_iter):
        x_new = x + update
        fx_new = f(x_new)
        gx_new = fx_new - x_new
        if tr.record(x_new, fx_new):
            break
        dx, dg = x_new - x, gx_new - gx
        x, gx = x_new, gx_new
        k = min(nstep, m)
        pu, pvt = Us[:, :, :k], VTs[:, :k]
        vT = rmatvec(pu, pvt, dx)
        denom = (vT * dg).sum(-1, keepdim=True)
        ok = denom.abs() > 1e-30
        u = (dx - matvec(pu, pvt, dg)) / torch.where(ok, denom, torch.ones_like(denom))
        u = torch.where(ok, u, torch.zeros_like(u))
        vT = torch.where(ok, vT, torch.zeros_like(vT))
        slot = nstep % m
        Us[:, :, slot] = u
        VTs[:, slot] = vT
        nstep += 1
        k = min(nstep, m)
        update = -matvec(Us[:, :, :k], VTs[:, :k], gx)
    return tr.best, tr.stats()
