"""Backward strategies of the emitted module, one unit each, found through a registry.

A strategy turns the equilibrium ``z*`` found without autograd into a tensor whose gradient is
the strategy's gradient (docs/theory.md §8): ``implicit`` (exact implicit differentiation,
first and second order), ``phantom`` (the last ``k`` damped applications of ``T``, first order)
and ``unroll`` (autograd through ``K`` iterations, any order).  Every strategy receives a
:class:`~lowering.runtime.backward.problem.FixedPointProblem`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from convex_eq.errors import OptionError

from .implicit import ImplicitBackward
from .phantom import PhantomBackward
from .problem import ADJOINT_METHODS, AdjointConfig, FixedPointProblem
from .unroll import UnrollBackward


class BackwardStrategy(Protocol):
    """Turns the detached equilibrium into the differentiable output of the layer."""

    name: str
    #: whether the gradient comes from an adjoint linear solve (the ``backward_solver``,
    #: ``backward_tol``, ``backward_max_iter`` and ``backward_adjoint`` options apply only then)
    solves_adjoint: bool

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor: ...


BACKWARD_STRATEGIES: dict[str, BackwardStrategy] = {}


def register_backward(strategy: BackwardStrategy) -> BackwardStrategy:
    """Add a backward strategy to the registry (by its ``name``)."""
    BACKWARD_STRATEGIES[strategy.name] = strategy
    return strategy


def get_backward(name: str) -> BackwardStrategy:
    """The registered strategy ``name`` (OptionError listing the available ones otherwise)."""
    if name not in BACKWARD_STRATEGIES:
        raise OptionError(f"unknown backward mode {name!r}", term="torch_module",
                          hint=f"use one of {tuple(BACKWARD_STRATEGIES)}")
    return BACKWARD_STRATEGIES[name]


for _strategy in (ImplicitBackward(), PhantomBackward(), UnrollBackward()):
    register_backward(_strategy)

__all__ = ["ADJOINT_METHODS", "BACKWARD_STRATEGIES", "AdjointConfig", "BackwardStrategy",
           "FixedPointProblem", "get_backward", "register_backward"]
