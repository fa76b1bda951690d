"""The constructors of the expression algebra, registered by the modules that define them.

``z + x`` on symbols builds an :class:`~convex_eq.affine.Affine`, ``W @ z`` a ``Dense``
operator applied to ``z``, ``A @ B`` a ``Compose``, ``A.T`` an ``Adjoint`` and ``t1 + t2`` on
terms an :class:`~convex_eq.objective.Objective`.  Python looks these operators up on the left
operand's class, and that class lives in a module *below* the one defining the result
(``affine`` imports ``symbols``, ``operators.compose`` imports ``operators.base``, ``objective``
imports ``terms.base``).  So the lower module asks this registry for the constructor by name, and
the module defining the result registers it when it is imported -- the dependency points down in
the files, with no import running back up (``import convex_eq`` imports and registers them all).

This module imports nothing from the package but its errors: it is the floor of the algebra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ConvexEqError

#: operation → (the module that provides it, what it builds)
OPERATIONS: dict[str, tuple[str, str]] = {
    "affine": ("convex_eq.affine", "a symbol or affine expression as an Affine (z + x, c·z)"),
    "dense": ("convex_eq.operators.dense", "the operator v ↦ W v of a weight/constant (W @ z)"),
    "compose": ("convex_eq.operators.compose", "the composition A ∘ B of operators (A @ B)"),
    "transpose": ("convex_eq.operators.adjoint", "the adjoint operator Aᵀ (A.T)"),
    "sum": ("convex_eq.objective", "the objective Σ terms of a list of terms (t1 + t2)"),
}

_BUILDERS: dict[str, Callable[..., Any]] = {}


def register(operation: str, builder: Callable[..., Any]) -> None:
    """Record ``builder`` as the constructor of ``operation`` (once; by its defining module)."""
    if operation not in OPERATIONS:
        raise ConvexEqError(f"unknown algebra operation {operation!r}", term="algebra",
                            hint=f"one of {sorted(OPERATIONS)}")
    old = _BUILDERS.get(operation)
    if old is not None and old is not builder:
        raise ConvexEqError(f"algebra operation {operation!r} is already provided by {old!r}",
                            term="algebra")
    _BUILDERS[operation] = builder


def build(operation: str, *args: Any) -> Any:
    """Call the registered constructor of ``operation`` on ``args``."""
    builder = _BUILDERS.get(operation)
    if builder is None:
        module, what = OPERATIONS[operation]
        raise ConvexEqError(f"{what}: its module {module} has not been imported",
                            term="algebra", hint="import convex_eq (it imports every module)")
    return builder(*args)
