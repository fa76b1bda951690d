"""The runtime wing: what runs a derived layer — the emitted ``nn.Module``, its solvers, linear
solves, backward strategies, evaluation plans, weight control, learnable scalars, SAM, the
classifier and the cvxpylayers backend (docs/guide.md).

It imports the deriving side (:mod:`lowering`'s ``lower``, rules, nodes, ``DerivedLayer``),
never the reverse: importing it registers its emitters in
:data:`lowering.derived.EMITTERS`, which ``DerivedLayer.torch_module`` reads.
"""

from lowering.derived import register_emitter

from . import cvxpylayer
from .backward import BACKWARD_STRATEGIES, register_backward
from .classifier import EquilibriumClassifier, TrainingSettings
from .config import BackwardConfig, ModuleConfig, SolveConfig, WeightControlConfig
from .module import EquilibriumModule, emit
from .sam import SAMConfig
from .solvers import SOLVERS, SolverStats, register_solver, solve

register_emitter("fixed_point")(emit)
register_emitter("cvxpylayers")(cvxpylayer.emit)

__all__ = [
    "BACKWARD_STRATEGIES",
    "SOLVERS",
    "BackwardConfig",
    "EquilibriumClassifier",
    "EquilibriumModule",
    "ModuleConfig",
    "SAMConfig",
    "SolveConfig",
    "SolverStats",
    "TrainingSettings",
    "WeightControlConfig",
    "register_backward",
    "register_solver",
    "solve",
]
