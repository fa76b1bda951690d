"""``implicit``: exact implicit differentiation of the equilibrium (docs/theory.md §8).

``dL/dθ = (∂T/∂θ)ᵀ g`` with the adjoint fixed point ``g = Jᵀ g + ∂L/∂z*`` (``J = ∂T/∂z`` at
``z*``), as a ``torch.autograd.Function`` whose backward is itself differentiable: second-order
gradients (``create_graph=True``) differentiate the adjoint system implicitly
(:mod:`~lowering.runtime.backward.second_order`); a third derivative raises a typed error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from convex_eq.errors import OptionError
from lowering.nodes import partial_evaluation

from ..grad_mode import grad_off
from .adjoint import adjoint_from_graph, adjoint_from_map
from .problem import FixedPointProblem
from .second_order import differentiable_grads


def planned_backward(problem: FixedPointProblem, z: torch.Tensor, v: torch.Tensor,
                      needs: list[bool]) -> list[torch.Tensor | None]:
    """First-order implicit gradients from the forward's plan: ``Jᵀ`` at ``z*`` as a closure
    (no autograd per adjoint iteration), then ``(∂T/∂θ)ᵀ g`` (:func:`param_grads`)."""
    plan, leaves = problem.plan, problem.leaves
    assert leaves is not None
    # at an alias of the saved output without its grad_fn: the plan caches the point it was
    # linearised at, and the output object there would be a reference cycle (output → its
    # grad_fn → this problem → the plan → the output), freed only by the cyclic collector
    z = z.detach()
    _, jt = plan.linearize(z, value=False)  # a first-order backward runs without gradients
    g = v if jt is None else adjoint_from_map(jt, z, v, problem)
    return param_grads(plan, z, g, leaves, needs)


def param_grads(plan: Any, z: torch.Tensor, g: torch.Tensor, leaves: list[torch.Tensor],
                needs: list[bool]) -> list[torch.Tensor | None]:
    """``(∂T/∂θ)ᵀ g`` for each leaf the plan was built from (None where not needed or not
    reached): in closed form for the plan's state-free tensors (``param_vjp``), autograd only
    from those to the weights and inputs they were built from; one backward of ``T(z)`` when
    some part of the plan has no closed form."""
    with grad_off():
        pairs = plan.param_vjp(z, g)
    grads: list[torch.Tensor | None] = [None] * len(needs)
    if pairs is None:
        with torch.enable_grad():
            fz = plan(z)
        rest_t, rest_c = [fz], [g]
    else:
        index = {id(t): i for i, t in enumerate(leaves)}
        rest_t, rest_c = [], []
        for t, ct in pairs:
            if not t.requires_grad:
                continue
            i = index.get(id(t))
            if i is not None:  # the plan holds the leaf itself (an input injection q)
                grads[i] = ct if grads[i] is None else grads[i] + ct
            else:
                rest_t.append(t)
                rest_c.append(ct)
    want = [i for i, n in enumerate(needs) if n]
    if rest_t and want and any(t.requires_grad for t in rest_t):
        # retain_graph: the plan's state-free parts (Ux + b, AᵀA) keep their graph for a
        # second backward through the same output (retain_graph=True upstream)
        more = torch.autograd.grad(rest_t, [leaves[i] for i in want], rest_c, allow_unused=True,
                                   retain_graph=True)
        for i, gr in zip(want, more):
            if gr is not None:
                grads[i] = gr if grads[i] is None else grads[i] + gr
    return [gr if n else None for gr, n in zip(grads, needs)]


class _Solved:
    """The equilibrium handed to :class:`ImplicitFixedPoint` as a non-tensor argument."""

    __slots__ = ("z",)

    def __init__(self, z: torch.Tensor):
        self.z = z


def _refuse_batched_backward() -> None:
    """A typed error for a vectorised (vmapped) backward of the implicit gradient: its adjoint
    solve reads residuals on the host per iteration, which a batched ``v`` cannot give."""
    raise OptionError(
        "batched gradients through backward='implicit' are not supported "
        "(torch.autograd.grad(is_grads_batched=True), "
        "torch.autograd.functional.jacobian(vectorize=True), "
        "gradcheck(check_batched_grad=True), vmap over a vjp): the adjoint solve reads "
        "residuals on the host every iteration", term="backward",
        hint="compute the rows one at a time (jacobian(..., vectorize=False), a loop over "
        "grad_outputs), or use backward='phantom' or 'unroll'")


def _output(ctx: Any, z: torch.Tensor, problem: FixedPointProblem,
            tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The solver's iterate as an implicit function's output, saved with ``tensors`` for its
    backward (a view is copied: an output that is a view of another tensor would refuse later
    in-place operations)."""
    out = z if z._base is None else z.clone()
    ctx.problem = problem
    ctx.save_for_backward(out, *tensors)
    return out


def _refuse_batched(v: torch.Tensor) -> None:
    """:func:`_refuse_batched_backward` when the cotangent is batched or a functorch transform
    is active."""
    if _is_batched(v) or _transforms_active():
        _refuse_batched_backward()


_is_batched = torch._C._functorch.is_legacy_batchedtensor
_transforms_active = torch._C._are_functorch_transforms_active
_set_grad_enabled = torch._C._set_grad_enabled


class ImplicitFixedPoint(torch.autograd.Function):
    """Output ``z*``; backward ``(∂T/∂θ)ᵀ (I − Jᵀ)⁻¹ v``, differentiable (second order)."""

    @staticmethod
    def forward(ctx: Any, z_star: _Solved, problem: FixedPointProblem,
                *tensors: torch.Tensor) -> torch.Tensor:
        """The solver's equilibrium as the output, saved for the backward."""
        # the solver's iterate is not an input of this function (it comes boxed), so it can be
        # the output itself, without a copy; a view (a reshaped state) is copied, as an output
        # that is a view of another tensor would refuse later in-place operations
        # the output is saved (not z_star): in a second-order backward its dependence on θ is
        # again this implicit function
        return _output(ctx, z_star.z, problem, tensors)

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        """``(∂T/∂θ)ᵀ (I − Jᵀ)⁻¹ v`` for each tensor that needs a gradient."""
        z, *tensors = ctx.saved_tensors
        problem: FixedPointProblem = ctx.problem
        needs = list(ctx.needs_input_grad[2:])
        if not any(needs):
            return (None, None, *([None] * len(tensors)))
        _refuse_batched(v)
        if not torch.is_grad_enabled() and problem.plan is not None:
            return (None, None, *planned_backward(problem, z, v, needs))
        if not torch.is_grad_enabled():  # first order: leaf copies, one retained graph
            with torch.enable_grad():
                with partial_evaluation():  # one graph, differentiated many times
                    zz, ts, fz = problem.with_grad(z, tensors, needs)
                g = adjoint_from_graph(fz, zz, v, problem)
                want = [t for t, n in zip(ts, needs) if n]
                grads = iter(torch.autograd.grad(fz, want, g, allow_unused=True))
            return (None, None, *[next(grads) if n else None for n in needs])
        return (None, None, *differentiable_grads(problem, z, v, tensors, needs))


class _Express:
    """What :class:`PlannedFixedPoint` carries from the forward to the backward (not a tensor
    argument, so that the solver's iterate can be the output without a copy)."""

    __slots__ = ("problem", "z")

    def __init__(self, z: torch.Tensor, problem: FixedPointProblem):
        self.z, self.problem = z, problem


class PlannedFixedPoint(torch.autograd.Function):
    """``z*`` of a problem whose tensors are its plan's held tensors (``problem.held``): the
    same gradient as :class:`ImplicitFixedPoint`, with the plan's state-free tensors ``(c, M)``
    as the autograd inputs (built with autograd from the layer's inputs and weights, so autograd
    carries their cotangents on: no leaf copies, no second autograd pass) and ``f'`` at ``z*``
    read from the solver's last image where the activation allows (docs/theory.md §8).  Second
    order differentiates the plan's evaluation ``T(z, c, M)`` implicitly, as
    :class:`ImplicitFixedPoint` differentiates ``T``."""

    @staticmethod
    def forward(ctx: Any, box: _Express, *held: torch.Tensor) -> torch.Tensor:
        """The solver's equilibrium as the output, saved with the plan's held tensors."""
        z = box.z
        box.z = None  # (the output is saved; the box must not hold it: a cycle)
        return _output(ctx, z, box.problem, held)

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        """The implicit gradient with respect to the plan's held tensors, in closed form."""
        z, *held = ctx.saved_tensors
        problem: FixedPointProblem = ctx.problem
        needs = ctx.needs_input_grad[1:]
        if not any(needs):
            return (None, *([None] * len(held)))
        if _is_batched(v) or _transforms_active():  # (_refuse_batched's test, inline)
            _refuse_batched_backward()
        if torch.is_grad_enabled():  # create_graph=True: T as the plan's evaluation
            return (None, *differentiable_grads(problem, z, v, held, needs))
        z = z.detach()  # (an alias without the output's grad_fn: no cycle through the plan)
        plan = problem.plan
        image = problem.image
        jt, d = plan.linearize_at(z, image if image is not None and image.shape == z.shape
                                  else None)
        g = adjoint_from_map(jt, z, v, problem)
        return (None, *plan.held_vjp(z, g, d, needs))


class ImplicitBackward:
    """Exact implicit differentiation (first and second order)."""

    name = "implicit"
    #: the gradient comes from an adjoint linear solve (its solver, tol and cap apply)
    solves_adjoint = True

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor:
        """``z*`` with the exact implicit gradient attached (through the plan's held tensors
        when the problem is posed on them: ``problem.held``)."""
        z = z_star.detach() if z_star.requires_grad else z_star  # (the solvers' is not)
        if problem.held:
            return PlannedFixedPoint.apply(_Express(z, problem), *problem.tensors)
        return ImplicitFixedPoint.apply(_Solved(z), problem, *problem.tensors)
