"""Deferred imports: heavy dependencies load on first use, not at ``import convex_eq``.

``cp = lazy_module("cvxpy")`` stands in for ``import cvxpy as cp``: the module is imported the
first time an attribute of ``cp`` is read (an export, a reference solve), so declaring an
objective, lowering it and running the emitted module never import cvxpy.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """A module that is imported when one of its attributes is first read."""

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def load(self) -> ModuleType:
        """Import the module (once) and return it."""
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded yet"
        return f"<lazy module {self._name!r} ({state})>"


def lazy_module(name: str) -> Any:
    """``import name`` deferred to the first attribute access (typed ``Any`` for callers)."""
    return LazyModule(name)


#: ``from convex_eq._lazy import cvxpy as cp`` in place of ``import cvxpy as cp``
cvxpy: Any = lazy_module("cvxpy")
#: ``scipy.integrate`` (numeric antiderivatives of user activations)
scipy_integrate: Any = lazy_module("scipy.integrate")
#: ``scipy.linalg`` (dense matrices of block operators)
scipy_linalg: Any = lazy_module("scipy.linalg")
