"""Identity activation ``σ(t) = t``: ``f_σ = 0`` on ℝ, ``f_σ* = ι_{0}``."""

from __future__ import annotations

from .._lazy import cvxpy as cp
from .._lazy import torch
from . import _numeric as nm
from .base import INF, Activation, Scale, TensorLike, zeros_with_grad


class Identity(Activation):
    """``σ(t) = t``; ``σ̃(a) = a²/2``; ``σ̃*(u) = u²/2``; ``f_σ = 0``; ``prox_{t f_σ} = id``."""

    name = "identity"
    lipschitz = 1.0
    domain = (-INF, INF)
    conjugate_domain = (0.0, 0.0)
    smooth_potential = True
    latex_sigma = "t"
    text_sigma = "t"
    _split_coefficient = 0.0
    _conjugate_boundary = (0.0, 0.0)

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = t``."""
        return nm.as_tensor(t)

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = 1``."""
        return torch.ones_like(nm.as_tensor(t))

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u) = u``."""
        return nm.as_tensor(u)

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = a²/2``."""
        a = nm.as_tensor(a)
        return 0.5 * a * a

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = u²/2``."""
        u = nm.as_tensor(u)
        return 0.5 * u * u

    def potential(self, u: TensorLike) -> torch.Tensor:
        """``f_σ(u) = 0``."""
        u = nm.as_tensor(u)
        return torch.where(torch.isnan(u), u, zeros_with_grad(u))

    def potential_grad(self, u: TensorLike) -> torch.Tensor:
        """``∇f_σ(u) = 0``."""
        u = nm.as_tensor(u)
        return torch.where(torch.isnan(u), u, zeros_with_grad(u))

    def conjugate_potential(self, w: TensorLike) -> torch.Tensor:
        """``f_σ*(w) = ι_{0}(w)``."""
        w = nm.as_tensor(w)
        out = torch.where(w == 0, zeros_with_grad(w), torch.full_like(w, INF))
        return torch.where(torch.isnan(w), w, out)

    def prox(self, v: TensorLike, t: Scale = 1.0) -> torch.Tensor:
        """``prox_{t f_σ}(v) = v``."""
        v = nm.as_tensor(v)
        self._check_scale(t)
        return v

    def cvxpy_potential(self, u: cp.Expression) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(0, [])``."""
        return cp.Constant(0.0), []

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(½ ||u||², [])``."""
        return 0.5 * cp.sum_squares(u), []

    def latex_potential(self, arg: str = "u") -> str:
        """``0``."""
        return "0"

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``½ a²``."""
        return rf"\tfrac{{1}}{{2}} {arg}^{{2}}"
