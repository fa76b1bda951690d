"""``unroll``: ordinary autograd through ``K`` plain iterations from ``z0`` (any order; the
forward is the unrolled loop, docs/theory.md §8)."""

from __future__ import annotations

from typing import Any

import torch

from .problem import FixedPointProblem


class UnrollBackward:
    """Autograd through ``K`` plain iterations from ``z0`` (the forward is the unrolled loop)."""

    name = "unroll"
    #: no adjoint solve: the backward_solver / tol / max_iter / adjoint options do not apply
    solves_adjoint = False

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor:
        """The unrolled iterate as is (the module runs the unrolled loop with autograd)."""
        return z_star
