"""Linear solves ``y = L y + b`` (``L`` a linear map given as ``matvec``), each a pure unit:
``solve(matvec, b, *, tol, max_iter, …) -> (y, stats)``, or None where a method gives up (the
caller then takes another).  No raising, warning or masking here: the backward strategies apply
one failure policy (:mod:`lowering.runtime.backward.policy`).  See docs/theory.md §8 (the
adjoint solve)."""

from .cg import CG_TARGET, solve_cg
from .direct import blocks_by_autograd, blocks_by_vmap, solve_direct
from .fixed_point import solve_fixed_point

__all__ = ["CG_TARGET", "blocks_by_autograd", "blocks_by_vmap", "solve_cg", "solve_direct",
           "solve_fixed_point"]
