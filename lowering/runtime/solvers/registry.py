"""The solver registry: a solver is ``iterate(f, z0, tracker, *, max_iter, **options)`` that
records its iterates into a :class:`~lowering.runtime.solvers.tracker.Tracker`; registered, it
is called as ``solve(f, z0, tol=…, max_iter=…, compiled=None, **options) -> (z, stats)``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from convex_eq.errors import OptionError

from .compiled import CompiledSteps
from .replay import Iteration, best_per_sample
from .stats import SolverStats, empty_stats
from .tracker import F, Tracker

Solve = Callable[..., tuple[torch.Tensor, SolverStats]]
SOLVERS: dict[str, Solve] = {}


def registered(name: str, iterate: Iteration) -> Solve:
    """``iterate`` as a registered solver ``name``: flat ``(B, N)`` states (other shapes are
    flattened per sample), an empty batch answered without iterating, and each unconverged
    sample's best iterate returned (:func:`~lowering.runtime.solvers.replay.best_per_sample`)."""

    @functools.wraps(iterate)
    def run(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, *,
            compiled: CompiledSteps | None = None, **options: Any
            ) -> tuple[torch.Tensor, SolverStats]:
        if z0.ndim > 2:  # (B, C, H, W, …): every solver iterates on flat (B, N) states
            shape = z0.shape

            def flat(x: torch.Tensor) -> torch.Tensor:
                return f(x.reshape(shape)).flatten(1)

            z, st = run(flat, z0.flatten(1), tol, max_iter, compiled=compiled, **options)
            return z.reshape(shape), st
        if z0.ndim and z0.shape[0] == 0:  # an empty batch (e.g. every sample masked out)
            return z0.clone(), empty_stats(name, z0, tol)
        tr = Tracker(name, z0, tol, compiled=compiled)
        iterate(f, z0, tr, max_iter=max_iter, **options)
        return best_per_sample(iterate, tr, f, z0, max_iter, options)

    run.iterate = iterate  # type: ignore[attr-defined]
    run.option_names = _keyword_options(iterate)  # type: ignore[attr-defined]
    return run


def _keyword_options(iterate: Iteration) -> frozenset[str] | None:
    """The options ``iterate`` takes beyond ``(f, z0, tracker, max_iter)`` (None: any, where it
    takes ``**options``)."""
    params = list(inspect.signature(iterate).parameters.values())[3:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.name != "max_iter"
                     and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_options(name: str, options: dict[str, Any]) -> None:
    """A typed error naming the options solver ``name`` does not take (they would fail, or be
    ignored, at its first call)."""
    known = getattr(get_solver(name), "option_names", None)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise OptionError(f"solver {name!r} takes no option(s) {unknown}", term="solver_options",
                          hint=f"its options: {sorted(known) or 'none'}" if known is not None
                          else None)


def register_solver(name: str) -> Callable[[Iteration], Solve]:
    """Register a forward solver under ``name`` (a decorator).

    The decorated function ``iterate(f, z0, tracker, *, max_iter, **options)`` runs the
    iterations; :func:`registered` adds the shared bookkeeping."""

    def deco(iterate: Iteration) -> Solve:
        run = registered(name, iterate)
        SOLVERS[name] = run
        return run

    return deco


def get_solver(name: str) -> Solve:
    """The registered solver ``name`` (OptionError listing the available ones otherwise)."""
    if name not in SOLVERS:
        raise OptionError(f"unknown solver {name!r}", term="solver",
                          hint=f"available: {', '.join(sorted(SOLVERS))}")
    return SOLVERS[name]


def solve(f: F, z0: torch.Tensor, solver: str = "anderson", tol: float = 1e-6,
          max_iter: int = 100, **options: Any) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``z = f(z)`` with the registered solver ``solver`` (docs/guide.md, solvers)."""
    return get_solver(solver)(f, z0, tol=tol, max_iter=max_iter, **options)
