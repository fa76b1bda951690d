"""Elementwise roots ``s(θ)`` of ``F(s, θ) = 0`` with exact derivatives of every order.

The root is solved numerically (float64, no autograd) and attached to autograd as a function of
its parameters by the implicit function theorem (docs/theory.md §1, "Derivatives of numeric
proxes"): ``∂s/∂θ_i = −F_{θ_i}(s, θ) / F_s(s, θ)``.  The backward evaluates those partials at
the *output* ``s`` itself, which stays connected to the graph when autograd records the
backward (``create_graph=True``); differentiating the backward therefore differentiates
``s`` again through this same rule, so second, third, … derivatives are exactly those of the
implicit function (up to rounding), not those of a linearisation around the root.

The ``torch.autograd.Function`` is defined on first use (a subclass at import would import torch
with the symbolic layer) and uses ``setup_context``, so ``torch.func.vjp`` / ``grad`` can run it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from .._lazy import torch

#: ``partials(s, *params) -> (F_s, [F_θ1, F_θ2, …])``: torch expressions (differentiable)
Partials = Callable[..., "tuple[torch.Tensor, Sequence[torch.Tensor]]"]
#: ``solve(*params) -> s``: the root, computed without autograd
Solve = Callable[..., "torch.Tensor"]


def recording() -> bool:
    """Whether autograd may differentiate what is computed next: grad mode is on.

    Not ``requires_grad``: under a ``torch.func`` transform a tensor captured from an outer
    autograd graph (the saved equilibrium in an implicit second-order backward) reads
    ``requires_grad=False`` at the transform's level while the outer graph still differentiates
    through it; a shortcut on ``requires_grad`` would detach it there."""
    return torch.is_grad_enabled()


def implicit_root(solve: Solve, partials: Partials, *params: torch.Tensor) -> torch.Tensor:
    """``s`` with ``F(s, params) = 0`` elementwise: ``solve(*params)`` as the value, and
    ``ds/dθ_i = −F_{θ_i}/F_s`` (from ``partials``) to every order of autograd.

    ``params`` are tensors broadcastable to the root's shape; the root's dtype is the caller's
    (``solve`` may work in float64 and cast back).  Where ``F_s`` is zero or the root is not
    finite the derivative is 0 (the callers' convention at saturated ends)."""
    return _root_function().apply(solve, partials, *params)


def value_with_gradient(value: Solve, gradient: Callable[[torch.Tensor], torch.Tensor],
                        x: torch.Tensor) -> torch.Tensor:
    """``value(x)`` (computed without autograd) with the elementwise derivative ``gradient(x)``,
    itself differentiated by autograd: exact to every order when ``gradient`` is (e.g.
    ``f_σ*`` with ``d f_σ*/dw = σ(s(w))``, ``s`` an :func:`implicit_root`)."""
    return _value_function().apply(value, gradient, x)


def _reduce(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``g`` summed over the dimensions ``like`` was broadcast along, in ``like``'s dtype."""
    if g.shape != like.shape:
        g = g.sum_to_size(like.shape) if like.dim() else g.sum()
    return g.to(like.dtype)


@functools.cache
def _root_function() -> type:
    """The autograd Function of :func:`implicit_root` (defined on first use)."""

    class ImplicitRoot(torch.autograd.Function):
        """Value from ``solve``; backward ``−grad·F_θ/F_s`` at the (differentiable) output."""

        @staticmethod
        def forward(solve: Solve, partials: Partials, *params: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return solve(*params)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
            ctx.partials = inputs[1]
            ctx.save_for_backward(output, *inputs[2:])

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            s, *params = ctx.saved_tensors
            ok = torch.isfinite(s)
            # partials at a finite stand-in where the root is not finite: a NaN there would
            # reach the gradient of the masked branch in a recorded (double) backward
            s_safe = torch.where(ok, s, torch.zeros_like(s))
            f_s, f_params = ctx.partials(s_safe, *params)
            ok = ok & (f_s != 0)
            r = torch.where(ok, grad / torch.where(ok, f_s, torch.ones_like(f_s)),
                            torch.zeros_like(grad))
            out: list[torch.Tensor | None] = [None, None]
            for i, (p, f_p) in enumerate(zip(params, f_params)):
                if not ctx.needs_input_grad[2 + i]:
                    out.append(None)
                    continue
                out.append(_reduce(-r * torch.where(ok, f_p, torch.zeros_like(f_p)), p))
            return tuple(out)

    return ImplicitRoot


@functools.cache
def _value_function() -> type:
    """The autograd Function of :func:`value_with_gradient` (defined on first use)."""

    class ValueWithGradient(torch.autograd.Function):
        """Value from ``value``; backward ``grad · gradient(x)`` at the (differentiable) input."""

        @staticmethod
        def forward(value: Solve, gradient: Any, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return value(x)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
            ctx.gradient = inputs[1]
            ctx.save_for_backward(inputs[2])

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            (x,) = ctx.saved_tensors
            return None, None, grad * ctx.gradient(x)

    return ValueWithGradient
