"""Second-order implicit gradients: the adjoint solve as a differentiable function
(:class:`AdjointSolve`, ``h = (I − J)⁻¹ u`` for its own derivative), and a typed refusal of a
third order (docs/theory.md §8, implicit differentiation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from convex_eq.errors import OptionError

from .adjoint import linear_fixed_point
from .problem import FixedPointProblem


def differentiable_grads(problem: FixedPointProblem, z: torch.Tensor, v: torch.Tensor,
                          tensors: Sequence[torch.Tensor], needs: Sequence[bool]
                          ) -> list[torch.Tensor | None]:
    """``(∂T/∂θ)ᵀ (I − Jᵀ)⁻¹ v`` for each of ``tensors`` (θ) as a differentiable function of
    ``(v, z, θ)`` (a backward under ``create_graph=True``).  ``z`` is the saved *output*, so its
    dependence on θ is again the implicit function; the partial derivative at fixed ``z`` is a
    functorch vjp over θ alone: ``z`` enters as a captured tensor, differentiated only by the
    outer (higher-order) autograd."""
    g = AdjointSolve.apply(v, z, problem, *tensors)
    _, vjp_fn = torch.func.vjp(lambda *ts: problem.fn(z, list(ts)), *tensors)
    grads = vjp_fn(g)
    return [gr if n else None for gr, n in zip(grads, needs)]


class AdjointSolve(torch.autograd.Function):
    """``g = (I − J(z, θ)ᵀ)⁻¹ v`` with its implicit derivative: for an upstream ``u``,
    ``h = (I − J)⁻¹ u`` gives ``∂/∂v = h`` and ``∂/∂(z, θ) = ∇_{z,θ} ⟨J(z, θ) h, g⟩``."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, z: torch.Tensor, problem: FixedPointProblem,
                *tensors: torch.Tensor) -> torch.Tensor:
        """``g = (I − J(z, θ)ᵀ)⁻¹ v``."""
        with torch.enable_grad():
            zz, _, fz = problem.with_grad(z, tensors, [False] * len(tensors))

            def jt(y: torch.Tensor) -> torch.Tensor:
                return torch.autograd.grad(fz, zz, y, retain_graph=True)[0]

            g, kept = linear_fixed_point(jt, v.detach(), problem.adjoint,
                                         "adjoint fixed point", problem.sink)
        ctx.problem = problem
        # mask mode: rows zeroed for a failed adjoint are constant, so their derivative is 0
        ctx.kept = kept
        ctx.save_for_backward(z, g, *tensors)
        return g

    @staticmethod
    def backward(ctx: Any, u: torch.Tensor) -> Any:
        """``h = (I − J)⁻¹ u`` and the derivatives in ``(z, θ)`` of ``⟨J h, g⟩``."""
        z, g, *tensors = ctx.saved_tensors
        deps = [t for t in (u, z, g, *tensors) if t.requires_grad]
        if torch.is_grad_enabled() and deps:  # a third-order graph is being recorded
            with torch.no_grad():
                out = AdjointSolve._second_order(ctx, u, z, g, tensors)
            # once_differentiable would connect its outputs to ``u`` only: their dependence on
            # (z, g, θ) would be dropped, and a third derivative would come out silently wrong
            return tuple(o if o is None else ThirdOrderRefused.apply(o, *deps) for o in out)
        return AdjointSolve._second_order(ctx, u, z, g, tensors)

    @staticmethod
    def _second_order(ctx: Any, u: torch.Tensor, z: torch.Tensor, g: torch.Tensor,
                      tensors: list[torch.Tensor]) -> tuple:
        """``(h, ∂/∂z, None, ∂/∂θ…)`` of :meth:`backward`, without a graph."""
        problem: FixedPointProblem = ctx.problem
        needs = list(ctx.needs_input_grad[3:])
        u = u.detach()
        if ctx.kept is not None:  # g's zeroed rows do not depend on v (nor, below, on z, θ)
            u = torch.where(ctx.kept, u, torch.zeros((), dtype=u.dtype, device=u.device))
        with torch.enable_grad():
            zz, ts, fz = problem.with_grad(z, tensors, needs)
            y = torch.zeros_like(fz, requires_grad=True)
            jty = torch.autograd.grad(fz, zz, y, create_graph=True)[0]

            def jv(h: torch.Tensor) -> torch.Tensor:  # J h as the derivative of ⟨Jᵀy, h⟩ in y
                return torch.autograd.grad(jty, y, h, retain_graph=True)[0]

            h = linear_fixed_point(jv, u, problem.adjoint,
                                   "second-order (tangent) fixed point")[0]
            jtg = torch.autograd.grad(fz, zz, g, create_graph=True)[0]
            s = (jtg * h).sum()
            want = [zz] + [t for t, n in zip(ts, needs) if n]
            grads = torch.autograd.grad(s, want, allow_unused=True)
        gz, rest = grads[0], iter(grads[1:])
        return (h, gz, None, *[next(rest) if n else None for n in needs])


class ThirdOrderRefused(torch.autograd.Function):
    """Identity on ``out`` whose backward (a third derivative through the implicit backward)
    refuses with a typed error; ``deps`` connect it to what ``out`` depends on."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
        """``out`` itself (an identity connected to ``deps``)."""
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        """A typed refusal of the third derivative."""
        raise OptionError(
            "third- and higher-order gradients through backward='implicit' are not supported: "
            "its second-order (tangent) solve is differentiable once", term="backward",
            hint="use backward='unroll' for third-order gradients (autograd through its "
            "iterations, any order)")
