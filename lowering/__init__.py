"""Lowering: derive the fixed-point layer ``z = T(z, x)`` of a hidden objective."""

from .derived import DerivedLayer
from .lower import lower
from .trace import Claim, Contraction, Derivation, Step

__all__ = ["Claim", "Contraction", "Derivation", "DerivedLayer", "Step", "lower"]
