"""Name → activation factory registry (``get_activation('leaky_relu', slope=0.1)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ActivationError, OptionError
from .base import Activation
from .hardtanh import HardTanh
from .identity import Identity
from .leaky_relu import LeakyReLU
from .relu import ReLU
from .sigmoid import Sigmoid
from .softplus import Softplus
from .tanh import Tanh

Factory = Callable[..., Activation]


def _hardtanh(lo: float = -1.0, hi: float = 1.0) -> Activation:
    return HardTanh(lo, hi, name="hardtanh")


def _clamp(lo: float = -1.0, hi: float = 1.0) -> Activation:
    return HardTanh(lo, hi, name="clamp")


def _leaky(slope: float = 0.01) -> Activation:
    return LeakyReLU(slope)


_REGISTRY: dict[str, Factory] = {
    "identity": Identity,
    "relu": ReLU,
    "leaky_relu": _leaky,
    "hardtanh": _hardtanh,
    "clamp": _clamp,
    "tanh": Tanh,
    "sigmoid": Sigmoid,
    "softplus": Softplus,
}


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def available_activations() -> list[str]:
    """Sorted registered activation names."""
    return sorted(_REGISTRY)


def register_activation(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register ``factory(**params) -> Activation`` under ``name``."""
    if not isinstance(name, str) or not name.strip():
        raise ActivationError(f"activation name must be a non-empty string (got {name!r})")
    if not callable(factory):
        raise ActivationError(f"factory for {name!r} is not callable", term=name)
    key = _normalize(name)
    if key in _REGISTRY and not overwrite:
        raise ActivationError(
            f"activation {key!r} is already registered",
            term=key,
            hint="pass overwrite=True to replace it",
        )
    _REGISTRY[key] = factory


def get_activation(name: str | Activation, **params: Any) -> Activation:
    """Activation registered under ``name`` built with ``params`` (an Activation passes through)."""
    if isinstance(name, Activation):
        if params:
            raise OptionError(
                f"parameters {sorted(params)} given with an Activation instance", term=name.name
            )
        return name
    if not isinstance(name, str):
        raise ActivationError(f"activation name must be a string (got {name!r})")
    key = _normalize(name)
    if key not in _REGISTRY:
        raise ActivationError(
            f"unknown activation {name!r}; known activations: {', '.join(available_activations())}",
            term=name,
            hint="use one of the known names, register_activation(), or from_sympy()",
        )
    try:
        act = _REGISTRY[key](**params)
    except TypeError as exc:
        raise OptionError(
            f"invalid parameters {sorted(params)} for activation {key!r} ({exc})",
            term=key,
            hint="leaky_relu takes slope; hardtanh/clamp take lo, hi; the others take none",
        ) from exc
    if not isinstance(act, Activation):
        raise ActivationError(f"factory for {key!r} did not return an Activation", term=key)
    return act
