"""What a backward strategy receives: ``T`` as a function of the state and of the tensors it reads
(:class:`FixedPointProblem`), and how its adjoint linear fixed points are solved
(:class:`AdjointConfig`); docs/theory.md §8."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..solvers import CompiledSteps, SolverStats


@dataclass
class AdjointConfig:
    """How adjoint (and second-order) linear fixed points are solved.

    ``method``: ``"iterative"`` (the ``solver`` on ``g = Jᵀg + v``), ``"direct"`` (the
    per-sample Jacobian ``J`` formed once by one batched vector–Jacobian product, then an LU
    solve of ``(I − Jᵀ) g = v``; needs samples that do not interact), or ``"auto"``: direct when
    the samples are independent and the problem is small (``N ≤ DIRECT_MAX_STATE`` and
    ``B·N ≤ DIRECT_MAX_ROWS``: there the per-iteration overhead of an iterative adjoint
    dominates, while the N-row VJP of the Jacobian costs about one iteration), iterative
    otherwise (docs/theory.md §8)."""

    solver: str = "anderson"
    tol: float = 1e-6
    max_iter: int = 100
    on_fail: str = "raise"  # "raise" | "warn" | "mask"
    method: str = "auto"
    batch_independent: bool = False
    #: compiled chunks of plain adjoint iterations (a ``CompiledSteps``; None: eager), used
    #: when ``Jᵀ`` comes from a plan (the module sets them inside ``torch.compile``)
    compiled_steps: CompiledSteps | None = None
    #: the batch index of each row of the adjoint problem when it holds a subset of the batch
    #: (samples masked out of the backward), so that messages name batch samples; None: all
    rows: torch.Tensor | None = None


#: ``"auto"`` forms the Jacobian only when it is small: N batched VJP rows per sample
DIRECT_MAX_STATE = 256
DIRECT_MAX_ROWS = 2048
ADJOINT_METHODS = ("auto", "direct", "iterative")
#: with a plan an adjoint iteration is two tensor operations, so ``"auto"`` solves directly
#: only while one batched LU costs less than its ~20–30 iterations (the crossover measured by
#: ``python -m benchmarks.run --only limit``, docs/performance.md)
DIRECT_MAX_STATE_PLAN = 128
DIRECT_MAX_ROWS_PLAN = 512


@dataclass
class FixedPointProblem:
    """``T(z, tensors)`` with the tensors it depends on (inputs and weights, in order).

    ``sink`` receives the adjoint solver statistics (``sink(stats)``), so that the module can
    expose them as ``last_backward_stats``."""

    fn: Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
    tensors: list[torch.Tensor]
    adjoint: AdjointConfig
    sink: Callable[[SolverStats], None]
    #: ``T`` planned at these tensors (:mod:`lowering.runtime.plan`), built with autograd
    #: from ``leaves`` (detached copies of ``tensors``): the first-order implicit backward
    #: linearises it
    plan: Any = None
    leaves: list[torch.Tensor] | None = None
    #: True when ``tensors`` are the plan's own held tensors (``plan.held``, built with
    #: autograd from the inputs and weights) and ``fn`` is ``plan.eval_with``: the implicit
    #: backward then differentiates the plan in closed form (``implicit.PlannedFixedPoint``)
    held: bool = False
    #: ``T`` at the equilibrium as the forward solver computed it (or None): the planned
    #: backward reads ``f'`` there (``plan.linearize_at``)
    image: torch.Tensor | None = None

    def with_grad(self, z: torch.Tensor, tensors: Sequence[torch.Tensor],
                  needs: Sequence[bool]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Leaf copies of ``z`` and of the tensors that need gradients, and ``T`` at them."""
        zz = z.detach().requires_grad_()
        ts = [t.detach().requires_grad_() if n else t.detach() for t, n in zip(tensors, needs)]
        return zz, ts, self.fn(zz, ts)
