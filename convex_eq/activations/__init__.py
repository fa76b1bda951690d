"""Scalar activations and their proximal potentials ``f_σ = σ̃* - u²/2`` (docs/theory.md §1)."""

from .base import Activation
from .hardtanh import HardTanh
from .identity import Identity
from .leaky_relu import LeakyReLU
from .registry import available_activations, get_activation, register_activation
from .relu import ReLU
from .sigmoid import Sigmoid
from .softplus import Softplus
from .symbolic import SympyActivation, from_sympy
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
