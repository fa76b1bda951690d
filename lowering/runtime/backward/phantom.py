"""``phantom``: the gradient of the last ``k`` (damped) applications of ``T`` from ``z*``, first
order only (docs/theory.md §8, phantom gradients)."""

from __future__ import annotations

from typing import Any

import torch

from convex_eq.errors import OptionError

from .problem import FixedPointProblem


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses ``create_graph=True`` with a typed error."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, mode: str) -> torch.Tensor:
        ctx.mode = mode
        return z.view_as(z)

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise OptionError(
                f"backward='{ctx.mode}' gives first-order gradients only; "
                "create_graph=True (second-order autograd) is not supported by it",
                term="backward", hint="use backward='implicit' (exact, any first/second order) "
                "or backward='unroll' for higher-order gradients")
        return v, None


class PhantomBackward:
    """Phantom gradient: autograd through ``k`` damped applications of ``T`` from ``z*``."""

    name = "phantom"
    #: no adjoint solve: the backward_solver / tol / max_iter / adjoint options do not apply
    solves_adjoint = False

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor:
        """``k`` damped applications of ``T`` from the detached ``z*``, first order only."""
        z = z_star.detach()
        lam = options.phantom_damping
        for _ in range(options.phantom_steps):
            fz = problem.fn(z, problem.tensors)
            z = fz if lam == 1.0 else lam * fz + (1 - lam) * z
        return _FirstOrderOnly.apply(z, self.name) if z.requires_grad else z
