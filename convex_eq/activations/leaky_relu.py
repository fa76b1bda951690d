"""Leaky ReLU ``σ(t) = max(t, a t)``, slope ``a ∈ (0, 1]``: ``f_σ = (1/a - 1) min(u, 0)²/2``."""

from __future__ import annotations

import math

from .._lazy import cvxpy as cp
from .._lazy import torch
from ..errors import ScaleError
from . import _numeric as nm
from .base import INF, Activation, Scale, TensorLike, fmt_number, zeros_with_grad


class LeakyReLU(Activation):
    """``σ(t) = t (t ≥ 0), a t (t < 0)``; ``f_σ(u) = c min(u, 0)²/2`` with ``c = 1/a - 1``."""

    name = "leaky_relu"
    lipschitz = 1.0
    domain = (-INF, INF)
    smooth_potential = True
    _split_coefficient = 0.0

    def __init__(self, slope: float = 0.01):
        try:
            a = float(slope)
        except (TypeError, ValueError):
            a = math.nan
        if not (0.0 < a <= 1.0):
            raise ScaleError(
                f"slope must lie in (0, 1] (got {slope!r}): slope 0 is ReLU (use 'relu'), "
                "slope > 1 makes σ not 1-Lipschitz, slope < 0 makes σ not nondecreasing",
                term="leaky_relu",
                hint="pass 0 < slope <= 1",
            )
        self.slope = a
        self.curvature = 1.0 / a - 1.0
        self.conjugate_domain = (0.0, 0.0) if self.curvature == 0 else (-INF, 0.0)
        self._conjugate_boundary = (0.0, 0.0)
        self.latex_sigma = rf"\max(t, {fmt_number(a)}\,t)"
        self.text_sigma = f"max(t, {fmt_number(a)}·t)"

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = t`` if ``t > 0`` else ``a t``."""
        t = nm.as_tensor(t)
        return torch.where(t > 0, t, self.slope * t)

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = 1`` if ``t > 0`` else ``a`` (``σ'(0) = a``, as torch's autograd)."""
        t = nm.as_tensor(t)
        return torch.where(t > 0, torch.ones_like(t), torch.full_like(t, self.slope))

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u) = u`` if ``u > 0`` else ``u / a``."""
        u = nm.as_tensor(u)
        return torch.where(u > 0, u, u / self.slope)

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = (max(a, 0)² + slope · min(a, 0)²)/2``."""
        a = nm.as_tensor(a)
        p, n = torch.clamp(a, min=0), torch.clamp(a, max=0)
        return 0.5 * (p * p + self.slope * n * n)

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = (max(u, 0)² + min(u, 0)²/slope)/2``."""
        u = nm.as_tensor(u)
        p, n = torch.clamp(u, min=0), torch.clamp(u, max=0)
        return 0.5 * (p * p + n * n / self.slope)

    def potential(self, u: TensorLike) -> torch.Tensor:
        """``f_σ(u) = (1/a - 1) min(u, 0)²/2``."""
        n = torch.clamp(nm.as_tensor(u), max=0)
        return 0.5 * self.curvature * n * n

    def potential_grad(self, u: TensorLike) -> torch.Tensor:
        """``∇f_σ(u) = (1/a - 1) min(u, 0)``."""
        return self.curvature * torch.clamp(nm.as_tensor(u), max=0)

    def conjugate_potential(self, w: TensorLike) -> torch.Tensor:
        """``f_σ*(w) = w²/(2(1/a - 1))`` for ``w ≤ 0``, else ``+inf`` (``ι_{0}`` if ``a = 1``)."""
        w = nm.as_tensor(w)
        if self.curvature == 0:
            out = torch.where(w == 0, zeros_with_grad(w), torch.full_like(w, INF))
        else:
            n = torch.clamp(w, max=0)
            out = torch.where(w <= 0, 0.5 * n * n / self.curvature, torch.full_like(w, INF))
        return torch.where(torch.isnan(w), w, out)

    def prox(self, v: TensorLike, t: Scale = 1.0) -> torch.Tensor:
        """``prox_{t f_σ}(v) = v`` if ``v ≥ 0`` else ``v / (1 + t (1/a - 1))``."""
        v = nm.as_tensor(v)
        t = self._check_scale(t)
        if not isinstance(t, torch.Tensor) and t == 1.0:
            return self.sigma(v)
        return torch.where(v >= 0, v, v / (1 + t * self.curvature))

    def cvxpy_potential(self, u: cp.Expression) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``((1/a - 1)/2 · ||neg(u)||², [])``."""
        return (self.curvature / 2) * cp.sum_squares(cp.neg(u)), []

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(½ ||pos(u)||² + 1/(2a) ||neg(u)||², [])``."""
        return 0.5 * cp.sum_squares(cp.pos(u)) + cp.sum_squares(cp.neg(u)) / (2 * self.slope), []

    def latex_potential(self, arg: str = "u") -> str:
        """``(1/a - 1) min(u, 0)²/2``."""
        return rf"\tfrac{{{fmt_number(self.curvature)}}}{{2}} \min({arg}, 0)^{{2}}"

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``½ max(a,0)² + (slope/2) min(a,0)²``."""
        a = fmt_number(self.slope)
        return rf"\tfrac{{1}}{{2}} \max({arg}, 0)^{{2}} + \tfrac{{{a}}}{{2}} \min({arg}, 0)^{{2}}"

    def __repr__(self) -> str:
        return f"<Activation leaky_relu(slope={fmt_number(self.slope)})>"
