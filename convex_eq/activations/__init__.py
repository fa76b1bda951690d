"""Scalar activations and their proximal potentials ``f_σ = σ̃* - u²/2`` (docs/theory.md §1)."""

from typing import Any

from .base import Activation
from .hardtanh import HardTanh
from .identity import Identity
from .leaky_relu import LeakyReLU
from .registry import available_activations, get_activation, register_activation
from .relu import ReLU
from .sigmoid import Sigmoid
from .softplus import Softplus
from .tanh import Tanh

__all__ = [
    "Activation",
    "HardTanh",
    "Identity",
    "LeakyReLU",
    "ReLU",
    "Sigmoid",
    "Softplus",
    "SympyActivation",
    "Tanh",
    "available_activations",
    "from_sympy",
    "get_activation",
    "register_activation",
]


def __getattr__(name: str) -> Any:
    """``SympyActivation`` and ``from_sympy`` import sympy on first use, not with the package."""
    if name in ("SympyActivation", "from_sympy"):
        from . import symbolic

        return getattr(symbolic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
