"""Lowering: derive the fixed-point layer ``z = T(z, x)`` of a hidden objective."""

from . import module as _module
from .backward import BACKWARD_STRATEGIES, register_backward
from .config import BackwardConfig, ModuleConfig, SolveConfig, WeightControlConfig
from .converter import ConvertedNetwork, convert
from .derived import DerivedLayer
from .lower import lower, register_rule, unregister_rule
from .module import EquilibriumModule
from .perturbation import Perturbation, perturbation
from .sam import SAMConfig
from .solvers import SOLVERS, SolverStats, register_solver, solve
from .trace import Claim, Contraction, Derivation, Step

_module.RELOWER = lower  # unpickling an emitted module re-derives its layer

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
    "lower",
    "perturbation",
    "register_backward",
    "register_rule",
    "register_solver",
    "solve",
    "unregister_rule",
]
