"""``y = L y + b`` per sample by an LU solve of ``(I − L_b) y_b = b_b`` from formed blocks."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ..solvers import SolverStats, accumulation_dtype, exact_rel_residual


def solve_direct(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *,
                 tol: float, blocks: torch.Tensor) -> tuple[torch.Tensor, SolverStats] | None:
    """``y_b = (I − L_b)⁻¹ b_b`` from the per-sample matrices ``blocks`` ``(B, N, N)`` (or
    ``(1, N, N)`` when shared; ``(L y)_b = L_b y_b``), solved in the accumulation dtype.  The
    residual ``||y − L y − b|| / ||y||`` is measured with the true map ``matvec`` (one
    application), so a coupling between samples that the blocks miss fails it: None then
    (and for a non-finite or singular system), and the caller iterates."""
    n = b.shape[1]
    eye = torch.eye(n, dtype=b.dtype, device=b.device)
    acc = accumulation_dtype(b.dtype)
    try:
        with torch.no_grad():
            y = torch.linalg.solve((eye - blocks).to(acc), b.detach().to(acc)[..., None])
    except RuntimeError:  # singular (torch.linalg.LinAlgError) or not finite
        return None
    y = y[..., 0].to(b.dtype)
    res = (y - matvec(y) - b).detach()
    # exact: float64 norms of a float32/16 state, the scaled form of a float64 one
    exact = exact_rel_residual(res, y)
    conv = exact <= tol  # False for a NaN residual: one test for non-finite and unconverged
    if not bool(conv.all()):
        return None
    r = exact.to(y.dtype)
    stats = SolverStats("direct", r[:, None],
                        torch.ones(b.shape[0], dtype=torch.long, device=b.device), conv, tol,
                        returned_residual=r, all_converged=True)
    return y, stats


def blocks_by_autograd(fz: torch.Tensor, zz: torch.Tensor) -> torch.Tensor | None:
    """The transposed per-sample Jacobians ``J_bᵀ`` ``(B, N, N)`` of the retained graph
    ``fz = T(zz)`` (one batched vector–Jacobian product of the identity rows); None where an
    operation has no batching rule."""
    b, n = zz.shape
    eye = torch.eye(n, dtype=zz.dtype, device=zz.device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "performance drop" of ops without batching rules
            rows = torch.autograd.grad(fz, zz, eye[:, None, :].expand(n, b, n),
                                       retain_graph=True, is_grads_batched=True)[0]
    except (RuntimeError, NotImplementedError):
        return None
    return rows.transpose(0, 1).transpose(1, 2)  # rows[i, b] = row i of J_b


def blocks_by_vmap(matvec: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor
                   ) -> torch.Tensor | None:
    """The per-sample matrices of a map ``v ↦ L v`` ``(B, N, N)`` by ``vmap`` over the identity
    rows; None where the map cannot be vmapped."""
    b, n = z.shape
    eye = torch.eye(n, dtype=z.dtype, device=z.device)
    try:  # rows[i, b] = L_b e_i
        rows = torch.func.vmap(matvec)(eye[:, None, :].expand(n, b, n))
    except (RuntimeError, NotImplementedError):
        return None
    return rows.transpose(0, 1).transpose(1, 2)
