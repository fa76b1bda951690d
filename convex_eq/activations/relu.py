"""ReLU ``σ(t) = max(t, 0)``: ``f_σ = ι_{[0, ∞)}``, ``f_σ* = ι_{(-∞, 0]}``."""

from __future__ import annotations

import math
from typing import Any

from .._lazy import cvxpy as cp
from .._lazy import torch
from . import _numeric as nm
from .base import INF, Activation, Scale, TensorLike, zeros_with_grad


class ReLU(Activation):
    """``σ(t) = max(t, 0)``; ``σ̃(a) = max(a, 0)²/2``; ``f_σ = ι_{u ≥ 0}``; prox = projection."""

    name = "relu"
    lipschitz = 1.0
    domain = (0.0, INF)
    conjugate_domain = (-INF, 0.0)
    smooth_potential = False
    latex_sigma = r"\max(t, 0)"
    text_sigma = "max(t, 0)"
    _split_coefficient = 0.0
    _conjugate_boundary = (None, 0.0)

    @property
    def torch_sigma(self) -> Any:
        """``torch.relu`` (a subclass's own ``sigma`` where it overrides it)."""
        return torch.relu if self._keeps(ReLU, "sigma") else self.sigma

    @property
    def torch_sigma_(self) -> Any:
        """``torch.relu_`` (None for a subclass with its own ``sigma`` or ``torch_sigma``)."""
        return torch.relu_ if self._keeps(ReLU, "sigma", "torch_sigma") else None

    @property
    def sigma_prime_of_sigma(self) -> Any:
        """``u ↦ 1[u > 0]``: ``max(t, 0) > 0`` exactly when ``t > 0`` (None for a subclass with
        its own ``sigma`` or ``sigma_prime``)."""
        return _positive if self._keeps(ReLU, "sigma", "sigma_prime") else None

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = max(t, 0)``."""
        return torch.relu(nm.as_tensor(t))

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = 1[t > 0]`` (``σ'(0) = 0``, as torch's autograd)."""
        t = nm.as_tensor(t)
        return (t > 0).to(t.dtype)

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``u`` for ``u ≥ 0`` (at 0: the largest preimage, of ``(-∞, 0]``), NaN for ``u < 0``."""
        u = nm.as_tensor(u)
        return torch.where(u >= 0, u, torch.full_like(u, math.nan))

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = max(a, 0)²/2``."""
        r = torch.relu(nm.as_tensor(a))
        return 0.5 * r * r

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = u²/2`` for ``u ≥ 0``, ``+inf`` otherwise."""
        u = nm.as_tensor(u)
        out = torch.where(u >= 0, 0.5 * u * u, torch.full_like(u, INF))
        return torch.where(torch.isnan(u), u, out)

    def potential(self, u: TensorLike) -> torch.Tensor:
        """``f_σ(u) = ι_{[0, ∞)}(u)``."""
        u = nm.as_tensor(u)
        out = torch.where(u >= 0, zeros_with_grad(u), torch.full_like(u, INF))
        return torch.where(torch.isnan(u), u, out)

    def potential_grad(self, u: TensorLike) -> torch.Tensor:
        """``0`` on ``[0, ∞)`` (interior gradient; its limit at 0), NaN for ``u < 0``."""
        u = nm.as_tensor(u)
        return torch.where(u >= 0, zeros_with_grad(u), torch.full_like(u, math.nan))

    def conjugate_potential(self, w: TensorLike) -> torch.Tensor:
        """``f_σ*(w) = ι_{(-∞, 0]}(w)``."""
        w = nm.as_tensor(w)
        out = torch.where(w <= 0, zeros_with_grad(w), torch.full_like(w, INF))
        return torch.where(torch.isnan(w), w, out)

    def prox(self, v: TensorLike, t: Scale = 1.0) -> torch.Tensor:
        """``prox_{t f_σ}(v) = max(v, 0)`` for every ``t > 0`` (projection)."""
        v = nm.as_tensor(v)
        self._check_scale(t)
        return torch.relu(v)

    def cvxpy_potential(self, u: cp.Expression) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(0, [u ≥ 0])``."""
        return cp.Constant(0.0), [u >= 0]

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(½ ||u||², [u ≥ 0])``."""
        return 0.5 * cp.sum_squares(u), [u >= 0]

    def latex_potential(self, arg: str = "u") -> str:
        """``ι_{[0,∞)}(u)``."""
        return rf"\iota_{{[0,\infty)}}({arg})"

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``½ max(a, 0)²``."""
        return rf"\tfrac{{1}}{{2}} \max({arg}, 0)^{{2}}"


def _positive(u: torch.Tensor) -> torch.Tensor:
    """``1[u > 0]`` in ``u``'s dtype: ReLU's ``σ'(t)`` read from ``u = max(t, 0)`` (0 at ``t = 0``,
    as :meth:`ReLU.sigma_prime`; NaN gives 0 there too)."""
    return (u > 0).to(u.dtype)
