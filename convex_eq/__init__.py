"""convex-eq: declare the hidden objective of an equilibrium layer; derive, verify, train.

Quick tour::

    from convex_eq import models
    phi = models.opteq(n=8, m=8, d=4, activation="relu", form="conjugate")
    print(phi.latex()); print(phi.certificate())
    exported = phi.to_cvxpy(x=[0.1, 0.2, 0.3, 0.4])
"""

from typing import Any

from . import models
from .activations import available_activations, get_activation, register_activation
from .affine import Affine
from .certificate import Certificate
from .composition import DeepComposition
from .errors import (
    ActivationError,
    CertificateError,
    ConvergenceError,
    ConvergenceWarning,
    ConvexEqError,
    CurvatureError,
    ExportError,
    LoweringError,
    NonFiniteError,
    NotDCPError,
    OptionError,
    ScaleError,
    ShapeError,
    SolverError,
)
from .export import ExportedProblem
from .objective import Objective, objective
from .operators import (
    AvgDownsample,
    BlockDiag,
    Conv2d,
    CyclicPermutation,
    Dense,
    Identity,
    LinOp,
    downsample_or_identity,
)
from .precompose import precompose
from .symbols import Constant, Input, Scalar, State, Weight
from .terms import (
    HSIC,
    L1,
    Antiderivative,
    AntiderivativeConjugate,
    BatchDecorrelation,
    ChannelDecorrelation,
    Coupling,
    FeatureIncay,
    GaussianKernel,
    Linear,
    LinfBallIndicator,
    MoreauEnvelope,
    PatchGaussianKernel,
    Potential,
    PotentialConjugate,
    QuadraticForm,
    SeparableAffineConjugate,
    SmoothChannelDecorrelation,
    SqNorm,
    Term,
    moreau,
)


def __getattr__(name: str) -> Any:
    """``from_sympy`` (user activations from sympy expressions) imports sympy on first use."""
    if name == "from_sympy":
        from .activations import symbolic

        return symbolic.from_sympy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def conjugate(term: Term) -> Term:
    """Closed-form convex conjugate of a term (rule per term; separable∘affine included)."""
    return term.conjugate()


__version__ = "0.1.0"
__all__ = [
    "HSIC",
    "L1",
    "ActivationError",
    "Affine",
    "Antiderivative",
    "AntiderivativeConjugate",
    "AvgDownsample",
    "BatchDecorrelation",
    "BlockDiag",
    "Certificate",
    "CertificateError",
    "ChannelDecorrelation",
    "Constant",
    "Conv2d",
    "ConvergenceError",
    "ConvergenceWarning",
    "ConvexEqError",
    "Coupling",
    "CurvatureError",
    "CyclicPermutation",
    "DeepComposition",
    "Dense",
    "ExportError",
    "ExportedProblem",
    "FeatureIncay",
    "GaussianKernel",
    "Identity",
    "Input",
    "LinOp",
    "Linear",
    "LinfBallIndicator",
    "LoweringError",
    "MoreauEnvelope",
    "NonFiniteError",
    "NotDCPError",
    "Objective",
    "OptionError",
    "PatchGaussianKernel",
    "Potential",
    "PotentialConjugate",
    "QuadraticForm",
    "Scalar",
    "ScaleError",
    "SeparableAffineConjugate",
    "ShapeError",
    "SmoothChannelDecorrelation",
    "SolverError",
    "SqNorm",
    "State",
    "Term",
    "Weight",
    "__version__",
    "available_activations",
    "conjugate",
    "downsample_or_identity",
    "from_sympy",
    "get_activation",
    "models",
    "moreau",
    "objective",
    "precompose",
    "register_activation",
]
