"""Name → activation factory registry (``get_activation('leaky_relu', slope=0.1)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._lazy import torch
from ..errors import ActivationError, OptionError
from .base import Activation
from .checks import check_sigma
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


#: the factories of the built-in activations (not re-checked when built)
_BUILTIN = tuple(_REGISTRY.values())
#: (factory, parameters) of user activations already checked when built
_CHECKED: set[tuple[Any, tuple]] = set()


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def available_activations() -> list[str]:
    """Sorted registered activation names."""
    return sorted(_REGISTRY)


def register_activation(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register ``factory(**params) -> Activation`` under ``name``.

    The activation the factory builds without parameters is checked as ``from_sympy`` checks
    a ``σ`` (nondecreasing, 1-Lipschitz, and within its declared ``lipschitz``, on a grid:
    :func:`~convex_eq.activations.checks.check_sigma`); ``ActivationError`` names the broken
    condition.  A plain ``σ`` (e.g. ``torch.sin``) in place of a factory is checked the same
    way and then refused with the way to declare it (docs/theory.md §1)."""
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
    _check_factory(key, factory)
    _REGISTRY[key] = factory


def check_activation(act: Activation) -> None:
    """Refuse (``ActivationError``) an activation whose ``σ`` breaks the conditions on the
    grid of :mod:`~convex_eq.activations.checks`."""
    check_sigma(act.sigma, act.name, act.sigma_prime if act.has_sigma_prime else None,
                act.lipschitz)


def _check_factory(key: str, factory: Factory) -> None:
    """Check what ``factory()`` builds; a ``σ`` given as the factory is checked, then refused."""
    try:
        act = factory()
    except TypeError as exc:  # needs parameters, or is a σ (a function of a tensor)
        probe = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
        try:
            out = factory(probe)
        except Exception:
            return  # a factory with required parameters: checked when get_activation builds it
        if not (isinstance(out, torch.Tensor) and out.shape == probe.shape):
            return
        check_sigma(factory, key)
        raise ActivationError(
            f"register_activation({key!r}, …) takes a factory that returns an Activation; "
            f"{getattr(factory, '__name__', factory)!r} maps tensors to tensors (a σ)",
            term=key, hint="declare σ with convex_eq.activations.from_sympy(expr, t) (it derives "
            "f_σ, σ⁻¹ and σ̃) or subclass Activation, then register a factory returning it"
        ) from exc
    if not isinstance(act, Activation):
        raise ActivationError(f"factory for {key!r} returned a {type(act).__name__}, not an "
                              "Activation", term=key,
                              hint="return an Activation (e.g. from_sympy(expr, t))")
    check_activation(act)


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
    factory = _REGISTRY[key]
    if not any(factory is b for b in _BUILTIN):
        # a user factory that needs parameters could not be checked when it was registered
        try:
            seen = (factory, tuple(sorted(params.items())))
            hash(seen)
        except TypeError:
            seen = None
        if seen is None or seen not in _CHECKED:
            check_activation(act)
            if seen is not None:
                _CHECKED.add(seen)
    return act
