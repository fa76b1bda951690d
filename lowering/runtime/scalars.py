"""Learnable scalar hyper-parameters of an emitted module (``Scalar(..., learnable=True)``).

A learnable scalar is trained through an unconstrained parameter ``θ`` and a map onto its
declared range, chosen by which bounds the range has (one small unit each, in a registry):

* both bounds: ``v = low + (high − low)·sigmoid(θ)``;
* a lower bound: ``v = low + softplus(θ)``; an upper bound: ``v = high − softplus(θ)``;
* none: ``v = θ``.

``v`` is strictly inside the range at every step, so the conditions the derivation states on the
scalar's range (e.g. ``α ∈ (0, 1]`` of a skip connection, ``λ ≥ 0`` on a convex term) hold by
construction.  Two checks run when a module is built (:func:`check_learnable`): the lowered ``T``
must read the scalar differentiably (a rule that baked its value into a number is refused), and
the layer's certificate must not depend on it (a condition computed from the declared value would
be false after training).  See ``docs/guide.md`` ("Learnable hyper-parameters").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from convex_eq.errors import OptionError
from convex_eq.symbols import Scalar, as_tensor
from lowering.derived import DerivedLayer
from lowering.lower import lower


@dataclass(frozen=True)
class Parametrization:
    """``v = value(θ, low, high)`` and its inverse ``θ = raw(v, low, high)``."""

    name: str
    formula: str
    value: Callable[[torch.Tensor, float, float], torch.Tensor]
    raw: Callable[[float, float, float], float]


def _softplus_inv(y: float) -> float:
    """``θ`` with ``softplus(θ) = y > 0`` (stable for large and tiny ``y``)."""
    return y + math.log(-math.expm1(-y))


def _sigmoid(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.sigmoid(t)


def _sigmoid_raw(v: float, lo: float, hi: float) -> float:
    return math.log((v - lo) / (hi - v))


def _softplus_low(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return lo + F.softplus(t)


def _softplus_low_raw(v: float, lo: float, hi: float) -> float:
    return _softplus_inv(v - lo)


def _softplus_high(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return hi - F.softplus(t)


def _softplus_high_raw(v: float, lo: float, hi: float) -> float:
    return _softplus_inv(hi - v)


def _identity(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return t


def _identity_raw(v: float, lo: float, hi: float) -> float:
    return v


#: the map of a learnable scalar, by (has a lower bound, has an upper bound)
PARAMETRIZATIONS: dict[tuple[bool, bool], Parametrization] = {
    (True, True): Parametrization("sigmoid", "low + (high − low)·sigmoid(θ)", _sigmoid,
                                  _sigmoid_raw),
    (True, False): Parametrization("softplus", "low + softplus(θ)", _softplus_low,
                                   _softplus_low_raw),
    (False, True): Parametrization("softplus (upper)", "high − softplus(θ)", _softplus_high,
                                   _softplus_high_raw),
    (False, False): Parametrization("identity", "θ", _identity, _identity_raw),
}


class LearnableScalar:
    """The map of one learnable scalar: ``value(θ)`` onto the declared range."""

    def __init__(self, scalar: Scalar):
        self.name = scalar.name
        self.low = scalar.low if scalar.low is not None else -math.inf
        self.high = scalar.high if scalar.high is not None else math.inf
        self.param = PARAMETRIZATIONS[(scalar.low is not None, scalar.high is not None)]

    def initial_raw(self, v: float) -> float:
        return self.param.raw(v, self.low, self.high)

    def value(self, theta: torch.Tensor) -> torch.Tensor:
        return self.param.value(theta, self.low, self.high)

    def __repr__(self) -> str:
        return f"{self.name} = {self.param.formula} on [{self.low}, {self.high}]"


def check_learnable(derived: DerivedLayer, names: list[str], T: Callable[..., torch.Tensor],
                    env: dict[str, torch.Tensor], thetas: dict[str, torch.Tensor]) -> None:
    """Refuse learnable scalars that would train silently wrong (module construction).

    * reach: ``∂T/∂θ`` at a random point must exist (``T`` reads the scalar from ``env``
      through autograd, not as a number baked in by the rule or a term);
    * certificate: re-deriving the layer with the scalar at another value of its range must give
      the same certificate conditions (the certificate is computed from declared values)."""
    if not names:
        return
    g = torch.Generator().manual_seed(0)
    ref = next((v for v in env.values() if v.is_floating_point() and v.ndim), None)
    dt = ref.dtype if ref is not None else torch.float64
    dt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
    z = torch.randn(2, derived.state_size, generator=g, dtype=torch.float64).to(dt)
    inputs = {s.name: torch.randn(2, s.size, generator=g, dtype=torch.float64).to(dt)
              for s in derived.inputs}
    with torch.enable_grad(), warnings.catch_warnings():
        # a term that turns the value into a float warns here; the refusal below says it better
        warnings.simplefilter("ignore", UserWarning)
        out = T(z, inputs, env)
        grads = torch.autograd.grad(out.sum(), [thetas[n] for n in names], allow_unused=True)
    rule = _rules(derived)
    for n, gr in zip(names, grads):
        if gr is None:
            raise OptionError(f"scalar '{n}' is declared learnable, but the lowered T ({rule}) "
                              "does not read it differentiably: its value is baked into the "
                              "layer as a number, so it would never train", term=n,
                              hint=f"declare '{n}' fixed (learnable=False); see docs/guide.md, "
                              "'Learnable hyper-parameters', for the scalars that train")
    source = derived.source
    options = dict(derived.lower_options or {})
    for s in derived.parameters:
        if s.name not in names:
            continue
        old = float(s.value)
        sigs = {}
        for v in (old, _other_value(s)):
            prev = s.value
            try:
                s.value = as_tensor(v)
                sigs[v] = _signature(lower(source, **options))
            finally:
                s.value = prev
        (v0, base), (v1, moved) = sigs.items()
        diff = _first_difference(base, moved)
        if diff is not None:
            raise OptionError(f"scalar '{s.name}' is declared learnable, but the layer's "
                              f"derivation depends on its value ({diff[0]}: {diff[1]!r} at "
                              f"{s.name} = {v0:g}, {diff[2]!r} at {s.name} = {v1:g}): "
                              "trained, its certificate or step sizes would be those of the "
                              "declared value", term=s.name,
                              hint=f"declare '{s.name}' fixed (learnable=False)")


def _rules(derived: DerivedLayer) -> str:
    steps = getattr(derived.derivation, "steps", ())
    names = [str(getattr(st, "rule", "")) for st in steps]
    return "rules: " + ", ".join(n for n in names if n) if names else "its rule"


def _signature(derived: DerivedLayer) -> list[tuple[str, Any]]:
    """What must not move with a learnable scalar: the certificate (kind, each condition's
    text, bound and measured value at the declared values) and every derivation step's text
    (step sizes and constants a rule computed from the value print there)."""
    cert = derived.certificate
    out: list[tuple[str, Any]] = [("certificate", None if cert is None else cert.kind)]
    for c in [] if cert is None else cert.conditions:
        out.append(("condition", c.text))
        out.append((f"bound of {c.text}", float(c.bound)))
        out.append((f"value of {c.text}", round(float(c.value(None)), 12)))
    for i, st in enumerate(getattr(derived.derivation, "steps", ())):
        out.append((f"derivation step {i + 1}", st.text(i + 1)))
    return out


def _first_difference(a: list[tuple[str, Any]], b: list[tuple[str, Any]]
                      ) -> tuple[str, Any, Any] | None:
    if len(a) != len(b):
        return ("derivation", len(a), len(b))
    for (ka, va), (_, vb) in zip(a, b):
        if va != vb:
            return (ka, va, vb)
    return None


def _other_value(s: Scalar) -> float:
    """A second admissible value of ``s`` (halfway to a bound, or twice/half the value)."""
    v = float(s.value)
    lo = s.low if s.low is not None else -math.inf
    hi = s.high if s.high is not None else math.inf
    cand = [0.5 * (v + lo) if math.isfinite(lo) else v - max(1.0, abs(v)),
            0.5 * (v + hi) if math.isfinite(hi) else v + max(1.0, abs(v))]
    return next(c for c in cand if lo < c < hi and c != v)


__all__ = ["PARAMETRIZATIONS", "LearnableScalar", "Parametrization", "check_learnable"]
