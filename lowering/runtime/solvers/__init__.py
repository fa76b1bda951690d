"""Fixed-point solvers: batched, per-sample statistics, one solver per file, found through a
registry (docs/theory.md §8, solvers).

Every solver finds ``z = f(z)`` for ``f: (B, N) → (B, N)`` and stops when every sample's
relative residual ``||f(z) − z|| / max(||f(z)||, 1e-30)`` is ≤ ``tol`` (or has become
non-finite); it returns, per sample, the iterate with the smallest residual measured (or the
latest within ``tol``) and the exact residual of that returned iterate, so a ``converged`` flag
always describes the returned point.
"""

from . import anderson, auto, broyden, plain
from .compiled import CompiledSteps
from .registry import SOLVERS, get_solver, register_solver, registered, solve
from .residuals import accumulation_dtype, exact_rel_residual, rel_residual
from .stats import SolverStats, empty_stats
from .tracker import Tracker

for _name, _iterate in (("plain", plain.plain), ("anderson", anderson.anderson),
                        ("auto", auto.auto), ("broyden", broyden.broyden)):
    register_solver(_name)(_iterate)

__all__ = [
    "SOLVERS",
    "CompiledSteps",
    "SolverStats",
    "Tracker",
    "accumulation_dtype",
    "empty_stats",
    "exact_rel_residual",
    "get_solver",
    "register_solver",
    "registered",
    "rel_residual",
    "solve",
]
