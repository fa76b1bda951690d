"""Lowering: derive the fixed-point layer ``z = T(z, x)`` of a hidden objective, and run it.

Two wings: the deriving side (``lower``, the rules, ``DerivedLayer``, the derivation trace, the
converter, the perturbation) and :mod:`lowering.runtime` (the emitted module and what runs it),
which imports the deriving side and registers the emitters ``DerivedLayer.torch_module`` uses.
"""

from .converter import ConvertedNetwork, convert
from .derived import DerivedLayer, register_edit
from .lower import derive_again, lower, register_rule, unregister_rule
from .perturbation import Perturbation, perturbation, perturbation_enhanced
from .runtime import (
    BACKWARD_STRATEGIES,
    SOLVERS,
    BackwardConfig,
    EquilibriumModule,
    ModuleConfig,
    SAMConfig,
    SolveConfig,
    SolverStats,
    WeightControlConfig,
    register_backward,
    register_solver,
    solve,
)
from .trace import Claim, Contraction, Derivation, Step

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
