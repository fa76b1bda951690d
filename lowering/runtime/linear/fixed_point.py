"""``y = L y + b`` by a registered fixed-point solver (iterating the affine map)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..grad_mode import set_grad_enabled
from ..solvers import SOLVERS, CompiledSteps, SolverStats, get_solver


def solve_fixed_point(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *,
                      tol: float, max_iter: int, solver: str = "anderson",
                      compiled: CompiledSteps | None = None
                      ) -> tuple[torch.Tensor, SolverStats]:
    """``y = L y + b`` iterated by ``solver`` from ``y = b``, gradients off; a map that can fuse
    the affine step (a plan's ``Jᵀ``: ``matvec.plus_fn``) iterates it fused, and only then in
    ``compiled`` chunks.  The statistics describe the returned ``y`` (converged or not)."""
    run = SOLVERS.get(solver) or get_solver(solver)  # (the latter: a typed error)
    plus_fn = getattr(matvec, "plus_fn", None)
    step = plus_fn(b) if plus_fn is not None else (lambda y: matvec(y) + b)
    steps = compiled if plus_fn is not None else None
    on = torch.is_grad_enabled()  # (grad_off's work inline: off already in a first-order
    if on:  # backward, where this runs once per call)
        set_grad_enabled(False)
    try:
        y, st = run(step, b, tol=tol, max_iter=max_iter, compiled=steps)
    finally:
        if on:
            set_grad_enabled(True)
    st.__dict__.pop("image", None)  # (not kept by the statistics)
    return y, st
