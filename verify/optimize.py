"""Bound-constrained minimization of a lifted objective, its polishing and its Hessians
(docs/theory.md §9.2 and §9.3).

``minimize`` runs L-BFGS-B with exact autograd gradients, then (for ``|·|``-type prox terms)
accelerated proximal gradient, then projected Newton polishing; ``second_order`` classifies a
stationary point by the reduced Hessian and strict complementarity; ``partial_value`` is
``G(z) = min_aux F`` with the top-level states fixed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.optimize as so
import torch

from .lifting import LiftedProblem

T64 = torch.float64


@dataclass
class MinResult:
    """Outcome of a bound-constrained local minimization of ``F``."""

    v: np.ndarray
    f: float
    pg: float
    nit: int
    message: str
    success: bool
    method: str


def minimize(p: LiftedProblem, v0: np.ndarray, *, gtol: float = 1e-12, maxiter: int = 20000,
             polish: bool = True) -> MinResult:
    """L-BFGS-B (exact gradients, box bounds) from ``v0``, then optional projected Newton
    polishing (Hessian by central differences of the exact gradient) to ~1e-13."""
    v0 = p.clip(np.asarray(v0, dtype=np.float64))
    method = "scipy L-BFGS-B (exact autograd gradients)"
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = so.minimize(p.fun_grad, v0, jac=True, method="L-BFGS-B", bounds=p.bounds(),
                          options={"maxiter": maxiter, "maxfun": 4 * maxiter, "ftol": 1e-16,
                                   "gtol": gtol, "maxcor": 30})
        v = p.clip(res.x)
        nit = int(res.get("nit", 0))  # absent when every variable is fixed (lo == hi)
        if p.prox_terms and np.all(np.isfinite(v)):
            # |·|-type terms: L-BFGS-B only gets close; FISTA identifies the support
            v, k = prox_gradient_polish(p, v, iters=300 if polish else 100)
            nit += k
            method += " + accelerated proximal-gradient"
        if polish and np.all(np.isfinite(v)):
            v, k = newton_polish(p, v)
            nit += k
            method += " + projected Newton polish"
        f = p.value(v) if np.all(np.isfinite(v)) else math.nan
        pg = p.projected_gradient(v) if np.all(np.isfinite(v)) else math.inf
    msg = res.message if isinstance(res.message, str) else str(res.message)
    if not np.isfinite(f) or f < -1e100:
        msg += " (objective unbounded below along this run)"
    return MinResult(v, f, pg, nit, msg, bool(np.isfinite(f)), method)


def prox_gradient_polish(p: LiftedProblem, v: np.ndarray, iters: int = 3000,
                         tol: float = 1e-14) -> tuple[np.ndarray, int]:
    """FISTA with backtracking and adaptive restart on ``h + g`` (``g``: prox terms + box)."""

    def h(u: np.ndarray) -> float:
        vt = torch.as_tensor(u, dtype=T64)
        with torch.no_grad():
            parts = p.split(vt)
            return float(sum(c(parts).sum() for i, c in enumerate(p.contributions)
                             if i not in p.nonsmooth))

    x, y, tk, lip = v.copy(), v.copy(), 1.0, 1.0
    k = 0
    if not math.isfinite(p.value(v)):
        return v, 0
    for k in range(1, iters + 1):
        gy, hy = p.smooth_grad(y), h(y)
        while True:
            xn = p.prox_step(y - gy / lip, 1.0 / lip)
            d = xn - y
            if h(xn) <= hy + float(gy @ d) + 0.5 * lip * float(d @ d) + 1e-15 * max(1.0, abs(hy)):
                break
            lip *= 2.0
        tn = 0.5 * (1 + math.sqrt(1 + 4 * tk * tk))
        restart = float((xn - x) @ (y - xn)) > 0
        y = xn if restart else xn + (tk - 1) / tn * (xn - x)
        tk = 1.0 if restart else tn
        x = xn
        lip = max(lip / 1.5, 1e-12)
        if k % 10 == 0 and p.projected_gradient(x) <= tol * max(1.0, float(np.linalg.norm(x))):
            break
    return x, k


def active_set(p: LiftedProblem, v: np.ndarray, g: np.ndarray, tol: float = 1e-10
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(at_lower, at_upper)`` masks of coordinates on their bound with the gradient pushing
    outwards (``g ≥ 0`` at a lower bound)."""
    lo, hi = p.lower, p.upper
    with np.errstate(invalid="ignore"):
        at_lo = np.isfinite(lo) & (v <= lo + tol * np.maximum(1.0, np.abs(lo))) & (g >= 0)
        at_hi = np.isfinite(hi) & (v >= hi - tol * np.maximum(1.0, np.abs(hi))) & (g <= 0)
    return at_lo, at_hi


def fd_hessian(p: LiftedProblem, v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Symmetrized Hessian of ``F`` on coordinates ``idx`` by central differences of ``∇F``
    (one-sided where a bound is closer than the step)."""
    k = len(idx)
    h = np.zeros((k, k))
    if k == 0:
        return h
    lo, hi = p.lower, p.upper
    pts = np.repeat(v[None, :], 2 * k, axis=0)
    widths = np.zeros(k)
    for a, j in enumerate(idx):
        step = 1e-6 * max(1.0, abs(v[j]))
        up = min(step, (hi[j] - v[j]) if np.isfinite(hi[j]) else step)
        dn = min(step, (v[j] - lo[j]) if np.isfinite(lo[j]) else step)
        pts[2 * a, j] += up
        pts[2 * a + 1, j] -= dn
        widths[a] = up + dn
    gs = p.grads(pts)
    for a in range(k):
        if widths[a] > 0:
            h[:, a] = (gs[2 * a, idx] - gs[2 * a + 1, idx]) / widths[a]
    return 0.5 * (h + h.T)


def exact_hessian(p: LiftedProblem, v: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    """Hessian of ``F`` on coordinates ``idx`` by autograd (the one-sided second derivative of
    a piecewise-quadratic term at ``v`` itself: central differences straddle a kink closer than
    their step, e.g. ``σ̃*`` of leaky ReLU at ``y ≈ 0``, and Newton then stalls); None where
    it is not finite."""
    vt = torch.as_tensor(np.asarray(v, dtype=np.float64))
    it = torch.as_tensor(np.asarray(idx, dtype=np.int64))

    def f(u: torch.Tensor) -> torch.Tensor:
        return p.value_t(vt.index_put((it,), u))

    try:
        h = torch.autograd.functional.hessian(f, vt[it]).detach().numpy()
    except RuntimeError:
        return None
    return 0.5 * (h + h.T) if np.all(np.isfinite(h)) else None


def newton_polish(p: LiftedProblem, v: np.ndarray, iters: int = 25) -> tuple[np.ndarray, int]:
    """Projected Newton steps on the free coordinates while the projected gradient decreases."""
    f, g = p.fun_grad(v)
    if not math.isfinite(f):
        return v, 0
    pg = p.projected_gradient(v)
    k = 0
    for _ in range(iters):
        k += 1
        if pg <= 1e-14 * max(1.0, float(np.linalg.norm(v))) or not math.isfinite(f):
            break
        at_lo, at_hi = active_set(p, v, g)
        fixed = at_lo | at_hi
        for b in p.blocks:  # on the support |·| is smooth; coordinates at a kink stay fixed
            if b.name in p.prox_terms:
                fixed[b.sl] |= np.abs(v[b.sl]) <= 1e-12
        free = np.where(~fixed)[0]
        if free.size == 0:
            break
        hess = exact_hessian(p, v, free) if free.size <= 64 else None
        hess = fd_hessian(p, v, free) if hess is None else hess
        w, q = np.linalg.eigh(hess)
        w = np.maximum(np.abs(w), 1e-10 * max(1.0, float(np.abs(w).max())))
        d = np.zeros_like(v)
        d[free] = -(q @ ((q.T @ g[free]) / w))
        improved = False
        t = 1.0
        for _ in range(30):
            vn = p.clip(v + t * d)
            fn, gn = p.fun_grad(vn)
            pgn = p.projected_gradient(vn)
            if math.isfinite(fn) and (fn < f - 1e-4 * t * abs(float(g @ d)) or
                                      (pgn < pg and fn <= f + 1e-13 * max(1.0, abs(f)))):
                v, f, g, pg = vn, fn, gn, pgn
                improved = True
                break
            t *= 0.5
        if not improved:
            break
    return v, k


def second_order(p: LiftedProblem, v: np.ndarray, tol: float = 1e-8) -> dict[str, Any]:
    """Second-order check at a stationary ``v``: smallest eigenvalue of the Hessian reduced to
    the free coordinates, and strict complementarity on the active bounds."""
    _, g = p.fun_grad(v)
    at_lo, at_hi = active_set(p, v, g, tol=1e-9)
    mult = np.concatenate([g[at_lo], -g[at_hi]])
    kink = np.zeros(p.n, dtype=bool)
    for b in p.blocks:  # a coordinate held at a kink of a prox term (|·| at 0) is fixed too
        if b.name in p.prox_terms:
            kink[b.sl] = np.abs(v[b.sl]) <= 1e-12
    free = np.where(~(at_lo | at_hi | kink))[0]
    lam = float(np.linalg.eigvalsh(fd_hessian(p, v, free)).min()) if free.size else math.inf
    strict = bool(mult.size == 0 or mult.min() > tol)
    if lam > tol and strict:
        verdict = "local minimizer"
    elif lam < -tol:
        verdict = "saddle"
    else:
        verdict = "inconclusive"
    return {"lambda_min": lam, "active": int(at_lo.sum() + at_hi.sum()),
            "min_multiplier": float(mult.min()) if mult.size else math.inf,
            "strict_complementarity": strict, "verdict": verdict}


def partial_value(p: LiftedProblem, z: Mapping[str, np.ndarray]) -> float | None:
    """``G(z) = min_{aux} F`` with the top-level states fixed (inner envelopes by inner
    minimization); None if a top-level state is not a plain block."""
    fixed = np.zeros(p.n, dtype=bool)
    v0 = p.start_point()
    for b in p.blocks:
        if b.of in z and b.origin == "state":
            fixed[b.sl] = True
            v0[b.sl] = np.asarray(z[b.of], dtype=np.float64).reshape(-1)
    if any(s not in [b.of for b in p.blocks if b.origin == "state"] for s in p.top_states):
        return None
    if fixed.all():
        return p.value(v0)
    lo, hi = p.lower.copy(), p.upper.copy()
    lo[fixed] = hi[fixed] = v0[fixed]
    free = ~fixed

    def fg(u: np.ndarray) -> tuple[float, np.ndarray]:
        w = v0.copy()
        w[free] = u
        f, g = p.fun_grad(w)
        return f, g[free]

    bnds = [(None if not np.isfinite(a) else float(a), None if not np.isfinite(b) else float(b))
            for a, b in zip(lo[free], hi[free])]
    u0 = np.clip(v0[free], lo[free], hi[free])
    res = so.minimize(fg, u0, jac=True, method="L-BFGS-B", bounds=bnds,
                      options={"maxiter": 20000, "ftol": 1e-16, "gtol": 1e-12, "maxcor": 30})
    return float(res.fun)
