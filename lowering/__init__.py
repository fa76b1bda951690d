"""Lowering: derive the fixed-point layer ``z = T(z, x)`` of a hidden objective."""

from .converter import ConvertedNetwork, convert
from .derived import DerivedLayer
from .lower import lower, register_rule, unregister_rule
from .perturbation import Perturbation, perturbation
from .sam import SAMConfig
from .solvers import SOLVERS, SolverStats, register_solver, solve
from .trace import Claim, Contraction, Derivation, Step

__all__ = [
    "SOLVERS", "Claim", "Contraction", "ConvertedNetwork", "Derivation", "DerivedLayer",
    "Perturbation", "SAMConfig", "SolverStats", "Step", "convert", "lower", "perturbation",
    "register_rule", "register_solver", "solve", "unregister_rule",
]
