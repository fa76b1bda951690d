"""Deferred imports: heavy dependencies load on first use, not at ``import convex_eq``.

``cp = lazy_module("cvxpy")`` stands in for ``import cvxpy as cp``: the module is imported the
first time an attribute of ``cp`` is read (an export, a reference solve), so declaring an
objective, lowering it and running the emitted module never import cvxpy.  Likewise
``from convex_eq._lazy import torch`` in the symbolic layer: declaring and printing an objective
imports no torch; the first numeric evaluation (a value, a norm, a gradient) does.

An attribute read through the stand-in is kept on it, so after the first read ``torch.cat`` costs
one instance-dictionary lookup, as on the module itself (the hot path of an emitted module calls
operators and activations of this package).  Names are annotations only under
``from __future__ import annotations``, so ``torch.Tensor`` in a signature loads nothing.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


class LazyModule:
    """A module that is imported when one of its attributes is first read."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def load(self) -> ModuleType:
        """Import the module (once) and return it."""
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.load(), attr)
        self.__dict__[attr] = value  # later reads skip __getattr__
        return value

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded yet"
        return f"<lazy module {self._name!r} ({state})>"


def is_tensor(x: Any) -> bool:
    """``isinstance(x, torch.Tensor)``, without importing torch (no tensor exists before it)."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(x, torch_module.Tensor)


def lazy_module(name: str) -> Any:
    """``import name`` deferred to the first attribute access (typed ``Any`` for callers)."""
    return LazyModule(name)


#: ``from convex_eq._lazy import cvxpy as cp`` in place of ``import cvxpy as cp``
cvxpy: Any = lazy_module("cvxpy")
#: ``scipy.integrate`` (numeric antiderivatives of user activations)
scipy_integrate: Any = lazy_module("scipy.integrate")
#: ``scipy.linalg`` (dense matrices of block operators)
scipy_linalg: Any = lazy_module("scipy.linalg")
#: ``torch`` (tensors of values, evaluations, gradients): not needed to declare or print
torch: Any = lazy_module("torch")
#: ``torch.nn.functional`` (convolutions and pooling of operators)
torch_functional: Any = lazy_module("torch.nn.functional")
