"""The adjoint linear fixed point ``g = Jᵀg + v`` of the implicit backward, composed from the
pure linear solves (:mod:`lowering.runtime.linear`): direct where small, conjugate gradients
where ``Jᵀ`` splits symmetrically, the configured fixed-point solver otherwise; one failure
policy (:func:`~lowering.runtime.backward.policy.judge`).  See docs/theory.md §8."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..linear import (
    blocks_by_autograd,
    blocks_by_vmap,
    solve_cg,
    solve_direct,
    solve_fixed_point,
)
from ..solvers import SolverStats
from .policy import judge
from .problem import (
    DIRECT_MAX_ROWS,
    DIRECT_MAX_ROWS_PLAN,
    DIRECT_MAX_STATE,
    DIRECT_MAX_STATE_PLAN,
    AdjointConfig,
    FixedPointProblem,
)

Map = Callable[[torch.Tensor], torch.Tensor]


def linear_fixed_point(apply: Map, rhs: torch.Tensor, cfg: AdjointConfig, what: str,
                       sink: Callable[[SolverStats], None] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = apply(y) + rhs`` (``apply`` linear) by the configured solver, judged by the
    failure policy: ``(y, kept)`` (``kept``: the rows kept where mask mode zeroed failed
    ones, else None)."""
    y, st = solve_fixed_point(apply, rhs, tol=cfg.tol, max_iter=cfg.max_iter,
                              solver=cfg.solver, compiled=cfg.compiled_steps)
    if sink is not None:
        sink(st)
    return judge(y, st, cfg, what)


def use_direct(cfg: AdjointConfig, z: torch.Tensor, max_state: int = DIRECT_MAX_STATE,
               max_rows: int = DIRECT_MAX_ROWS) -> bool:
    """Whether the adjoint is solved directly: ``method="direct"``, or ``"auto"`` on a small
    problem (``N ≤ max_state``, ``B·N ≤ max_rows``); never for samples that interact."""
    if cfg.method == "iterative" or not cfg.batch_independent or z.ndim != 2:
        return False
    if cfg.method == "direct":
        return True
    b, n = z.shape
    return n <= max_state and b * n <= max_rows


def adjoint_from_graph(fz: torch.Tensor, zz: torch.Tensor, v: torch.Tensor,
                       problem: FixedPointProblem) -> torch.Tensor:
    """``g = Jᵀg + v`` at the retained graph ``fz = T(zz)`` (``Jᵀ`` by autograd)."""
    cfg = problem.adjoint

    def jt(y: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(fz, zz, y, retain_graph=True)[0]

    if use_direct(cfg, zz):
        blocks = blocks_by_autograd(fz, zz)
        out = None if blocks is None else solve_direct(jt, v, tol=cfg.tol, blocks=blocks)
        if out is not None:
            problem.sink(out[1])
            return out[0]
    return linear_fixed_point(jt, v, cfg, "adjoint fixed point", problem.sink)[0]


def adjoint_from_map(jt: Map, z: torch.Tensor, v: torch.Tensor,
                     problem: FixedPointProblem) -> torch.Tensor:
    """``g = Jᵀg + v`` with ``Jᵀ`` a plan's transpose map: direct when :func:`use_direct` says
    so (the per-sample matrices from the map's ``blocks`` — one broadcast product for the
    canonical ``diag(σ') M`` — or, asked for explicitly, by ``vmap``), conjugate gradients
    when the map splits as ``M ∘ diag(d)`` with ``M`` self-adjoint (``auto`` adjoint and
    solver, independent samples), else the adjoint solver."""
    cfg = problem.adjoint
    if use_direct(cfg, z, DIRECT_MAX_STATE_PLAN, DIRECT_MAX_ROWS_PLAN):
        form = getattr(jt, "blocks", None)  # a plan's transpose types can form them
        blocks = form(v) if form is not None else None
        if blocks is None and cfg.method == "direct":
            blocks = blocks_by_vmap(jt, z)
        out = None if blocks is None else solve_direct(jt, v, tol=cfg.tol, blocks=blocks)
        if out is not None:
            problem.sink(out[1])
            return out[0]
    if cfg.method == "auto" and cfg.solver == "auto" and cfg.batch_independent and z.ndim == 2:
        # (inside torch.compile too: the recurrence runs eagerly, as the adjoint's stop tests)
        ask = getattr(jt, "symmetric_split", None)  # a plan's transpose types can tell
        split = ask() if ask is not None else None
        if split is not None:
            out = solve_cg(jt, v, tol=cfg.tol, max_iter=cfg.max_iter, split=split)
            if out is not None:
                problem.sink(out[1])
                return out[0]
    return linear_fixed_point(jt, v, cfg, "adjoint fixed point", problem.sink)[0]
