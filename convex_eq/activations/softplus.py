"""Softplus ``σ(t) = log(1 + e^t)``: the built-in numeric (scipy ``quad``) fallback.

``σ̃`` has no elementary closed form (it is a dilogarithm), so it is computed as
``σ̃(a) = max(a, 0)²/2 + R(a)``, ``R(a) = ∫_0^a log(1 + e^{-|t|}) dt`` by ``scipy.integrate.quad``
(bounded, decaying integrand; ``R(±∞) = ±π²/12``).  With ``a = σ⁻¹(u) = u + L``,
``L = log(1 - e^{-u})``:  ``f_σ(u) = -L²/2 - R(a)`` if ``a > 0`` else ``u a - u²/2 - R(a)``.
Domain ``[0, ∞)`` with ``f_σ(0) = π²/12``; ``dom f_σ* = (-∞, 0]`` with ``f_σ*(0) = π²/12``.
"""

from __future__ import annotations

import math

import numpy as np

from .._lazy import torch
from . import _numeric as nm
from .base import INF, Activation, TensorLike

PI2_12 = math.pi**2 / 12


def _tail(t: float) -> float:
    return math.log1p(math.exp(-abs(t)))


def _tail_integral_np(a: np.ndarray) -> np.ndarray:
    return nm.quad_antiderivative(_tail, a)


def _tail_torch(a: torch.Tensor) -> torch.Tensor:
    return nm.softplus(-a.abs())


def tail_integral(a: torch.Tensor) -> torch.Tensor:
    """``R(a) = ∫_0^a log(1 + e^{-|t|}) dt`` (scipy quad; autograd ``R'(a) = log(1+e^{-|a|})``)."""
    return nm.numpy_antiderivative(a, _tail_integral_np, _tail_torch)


class Softplus(Activation):
    """``σ(t) = log(1 + e^t)``; ``σ⁻¹(u) = log(e^u - 1)``; ``σ̃``, ``f_σ`` by scipy quad."""

    name = "softplus"
    lipschitz = 1.0
    domain = (0.0, INF)
    conjugate_domain = (-INF, 0.0)
    smooth_potential = True
    latex_sigma = r"\log(1 + e^{t})"
    text_sigma = "log(1 + exp(t))"
    _split_coefficient = None
    _conjugate_boundary = (None, PI2_12)
    _antideriv_conj_boundary = (PI2_12, None)

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = log(1 + e^t)``."""
        return nm.softplus(nm.as_tensor(t))

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = 1/(1 + e^{-t})``."""
        return torch.sigmoid(nm.as_tensor(t))

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u) = u + log(1 - e^{-u})`` for ``u > 0`` (``-inf`` at 0, NaN for ``u < 0``)."""
        u = nm.as_tensor(u)
        pos = u > 0
        us = torch.where(pos, u, torch.ones_like(u))
        out = torch.where(pos, us + nm.log1mexp(us), torch.full_like(u, math.nan))
        return torch.where(u == 0, torch.full_like(u, -INF), out)

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = max(a, 0)²/2 + ∫_0^a log(1 + e^{-|t|}) dt`` (scipy quad)."""
        a = nm.as_tensor(a)
        r = torch.relu(a)
        return 0.5 * r * r + tail_integral(a)

    def _parts(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(interior mask, sanitized u, L = log(1 - e^{-u}))``."""
        inside = u > 0
        us = torch.where(inside, u, torch.ones_like(u))
        return inside, us, nm.log1mexp(us)

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = u a - σ̃(a)``, ``a = σ⁻¹(u)``; ``π²/12`` at 0, ``+inf`` for ``u < 0``."""
        u = nm.as_tensor(u)
        return self._assemble(u, self.potential_interior(u) + 0.5 * u * u, PI2_12)

    def potential(self, u: TensorLike) -> torch.Tensor:
        """``f_σ(u) = σ̃*(u) - u²/2`` (stable form, see module docstring); ``+inf`` for ``u < 0``."""
        u = nm.as_tensor(u)
        return self._assemble(u, self.potential_interior(u), PI2_12)

    def potential_interior(self, u: torch.Tensor) -> torch.Tensor:
        """``f_σ`` on ``u > 0`` (garbage elsewhere; use ``potential``)."""
        _, us, lg = self._parts(u)
        a = us + lg
        r = tail_integral(a)
        big = a > 0
        return torch.where(big, -0.5 * lg * lg, us * a - 0.5 * us * us) - r

    def _assemble(self, u: torch.Tensor, val: torch.Tensor, at_zero: float) -> torch.Tensor:
        inside = u > 0
        out = torch.where(inside, val, torch.full_like(u, INF))
        out = torch.where(u == 0, torch.full_like(u, at_zero), out)
        return torch.where(torch.isnan(u), u, out)

    # conjugate: s - σ(s) = -log(1 + e^{-s}) = w  ⇔  s = w - log(1 - e^{w})  (w < 0)
    def _g(self, s: torch.Tensor) -> torch.Tensor:
        return -nm.softplus(-s)

    def _g_prime(self, s: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(-s)

    def _conjugate_argmax(self, w64: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return w64 - nm.log1mexp(-w64)

    def _conjugate_value(self, s: torch.Tensor) -> torch.Tensor:
        # σ̃(s) - σ(s)²/2 = R(s) - softplus(-|s|)(softplus(s) + relu(s))/2  (no cancellation)
        return tail_integral(s) - 0.5 * nm.softplus(-s.abs()) * (nm.softplus(s) + torch.relu(s))

    def latex_potential(self, arg: str = "u") -> str:
        """``u σ⁻¹(u) - σ̃(σ⁻¹(u)) - u²/2`` with ``σ⁻¹(u) = log(e^u - 1)`` (numeric σ̃)."""
        u = arg
        return (
            rf"{u}\,\sigma^{{-1}}({u}) - \tilde\sigma(\sigma^{{-1}}({u})) - \tfrac12 {u}^2,"
            rf"\ \sigma^{{-1}}({u}) = \log(e^{{{u}}} - 1),"
            r"\ \tilde\sigma(a) = \int_0^a \log(1+e^{t})\,dt\ \text{(numeric)}"
        )

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``∫_0^a log(1 + e^t) dt`` (numeric)."""
        return rf"\int_0^{{{arg}}} \log(1 + e^{{t}})\,dt"
