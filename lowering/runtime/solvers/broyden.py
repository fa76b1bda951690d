"""Limited-memory ("good") Broyden on ``g(z) = f(z) − z`` (docs/theory.md §8, solvers)."""

from __future__ import annotations

import torch

from .tracker import F, Tracker


def _matvec(u: torch.Tensor, vt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``B v`` for ``B = −I + U Vᵀ`` (batched)."""
    if u.shape[-1] == 0:
        return -v
    return -v + (u @ (vt @ v[..., None]))[..., 0]


def _rmatvec(u: torch.Tensor, vt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``vᵀ B`` for ``B = −I + U Vᵀ`` (batched)."""
    if u.shape[-1] == 0:
        return -v
    return -v + ((v[:, None] @ u) @ vt)[:, 0]


def broyden(f: F, z0: torch.Tensor, tr: Tracker, *, max_iter: int = 100, m: int = 30
            ) -> None:
    """Broyden's method with inverse-Jacobian estimate ``B = −I + Σ u_i v_iᵀ`` (Sherman–Morrison
    updates of the last ``m`` steps), unit step ``z ← z − B g(z)``, recorded into ``tr``."""
    b, n = z0.shape
    dt, dev = z0.dtype, z0.device
    Us = torch.zeros(b, n, m, dtype=dt, device=dev)
    VTs = torch.zeros(b, m, n, dtype=dt, device=dev)
    x = z0
    fx = f(x)
    gx = fx - x
    if tr.record(x, fx, gx) or max_iter <= 1:
        return
    update = gx
    nstep = 0
    for _ in range(1, max_iter):
        x_new = x + update
        fx_new = f(x_new)
        gx_new = fx_new - x_new
        if tr.record(x_new, fx_new, gx_new):
            break
        dx, dg = x_new - x, gx_new - gx
        x, gx = x_new, gx_new
        k = min(nstep, m)
        pu, pvt = Us[:, :, :k], VTs[:, :k]
        vT = _rmatvec(pu, pvt, dx)
        denom = (vT * dg).sum(-1, keepdim=True)
        ok = denom.abs() > 1e-30
        u = (dx - _matvec(pu, pvt, dg)) / torch.where(ok, denom, torch.ones_like(denom))
        u = torch.where(ok, u, torch.zeros_like(u))
        vT = torch.where(ok, vT, torch.zeros_like(vT))
        slot = nstep % m
        Us[:, :, slot] = u
        VTs[:, slot] = vT
        nstep += 1
        k = min(nstep, m)
        update = -_matvec(Us[:, :, :k], VTs[:, :k], gx)
