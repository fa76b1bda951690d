"""Terms of hidden objectives (one small unit per term, CVXPY-atom style)."""

from .base import Condition, Curvature, QuadPart, StrongConvexity, Term
from .conjugate import SeparableAffineConjugate
from .coupling import ChannelDecorrelation, Coupling, SmoothChannelDecorrelation
from .decorrelation import BatchDecorrelation
from .gaussian_kernel import (
    GaussianKernel,
    InputBandwidth,
    PatchGaussianKernel,
    ResidualBandwidth,
)
from .hsic import HSIC
from .incay import FeatureIncay
from .l1 import L1, LinfBallIndicator
from .moreau import MoreauEnvelope, moreau
from .potential import Antiderivative, AntiderivativeConjugate, Potential, PotentialConjugate
from .quadratic import Linear, QuadraticForm, SqNorm, gram

__all__ = [
    "HSIC", "L1", "Antiderivative", "AntiderivativeConjugate", "BatchDecorrelation",
    "ChannelDecorrelation", "Condition", "Coupling", "Curvature", "FeatureIncay",
    "GaussianKernel", "InputBandwidth", "Linear", "LinfBallIndicator", "MoreauEnvelope",
    "PatchGaussianKernel", "Potential", "PotentialConjugate", "QuadPart", "QuadraticForm",
    "ResidualBandwidth", "SeparableAffineConjugate", "SmoothChannelDecorrelation", "SqNorm",
    "StrongConvexity", "Term", "gram", "moreau",
]
