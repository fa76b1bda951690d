"""Lowering: derive the fixed-point layer ``z = T(z, x)`` of a hidden objective, and run it.

Two wings: the deriving side (``lower``, the rules, ``DerivedLayer``, the derivation trace, the
converter, the perturbation) and :mod:`lowering.runtime` (the emitted module and what runs it),
which imports the deriving side and registers the emitters ``DerivedLayer.torch_module`` uses.

Deriving and printing a layer load no torch: the runtime's names (and the converter, whose
network is a ``torch.nn.Module``) are imported on first use, and the runtime is imported by the
first ``torch_module()`` call (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import Any

from .derived import EMITTER_LOADERS, DerivedLayer, register_edit
from .lower import derive_again, lower, register_rule, unregister_rule
from .perturbation import Perturbation, perturbation, perturbation_enhanced
from .trace import Claim, Contraction, Derivation, Step

#: public names imported on first use → the module that defines them
_DEFERRED = {
    **dict.fromkeys(("ConvertedNetwork", "convert"), "lowering.converter"),
    **dict.fromkeys(("BACKWARD_STRATEGIES", "SOLVERS", "BackwardConfig", "EquilibriumModule",
                     "ModuleConfig", "SAMConfig", "SolveConfig", "SolverStats",
                     "WeightControlConfig", "register_backward", "register_solver", "solve"),
                    "lowering.runtime"),
}


def _load_runtime() -> None:
    importlib.import_module("lowering.runtime")


EMITTER_LOADERS.append(_load_runtime)


#: subpackages reachable as attributes before anything imported them (``lowering.runtime.X``)
_SUBMODULES = ("runtime", "converter")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"lowering.{name}")  # (the import sets the attribute)
    home = _DEFERRED.get(name)
    if home is None:
        raise AttributeError(f"module 'lowering' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later reads are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_DEFERRED))


__all__ = [
    "BACKWARD_STRATEGIES",
    "SOLVERS",
    "BackwardConfig",
    "Claim",
    "Contraction",
    "ConvertedNetwork",
    "Derivation",
    "DerivedLayer",
    "EquilibriumModule",
    "ModuleConfig",
    "Perturbation",
    "SAMConfig",
    "SolveConfig",
    "SolverStats",
    "Step",
    "WeightControlConfig",
    "convert",
    "derive_again",
    "lower",
    "perturbation",
    "perturbation_enhanced",
    "register_backward",
    "register_edit",
    "register_rule",
    "register_solver",
    "solve",
    "unregister_rule",
]
