"""Logistic sigmoid: ``f_σ(u) = u log u + (1-u) log(1-u) + log 2 - u²/2`` on ``[0, 1]``.

The ``+ log 2`` comes from ``σ̃(0) = 0``: ``σ̃(a) = log(1 + e^a) - log 2`` (the source papers' table
drops this constant; it does not change the prox or any minimizer).
"""

from __future__ import annotations

import math
from typing import Any

from .._lazy import cvxpy as cp
from .._lazy import torch
from . import _numeric as nm
from .base import INF, Activation, TensorLike, cvxpy_size

LOG2 = math.log(2.0)


class Sigmoid(Activation):
    """``σ(t) = 1/(1+e^{-t})``; ``σ̃(a) = log(1+e^a) - log 2``; ``L_σ = 1/4``."""

    name = "sigmoid"
    lipschitz = 0.25
    domain = (0.0, 1.0)
    conjugate_domain = (-INF, INF)
    smooth_potential = True
    latex_sigma = r"\frac{1}{1 + e^{-t}}"
    text_sigma = "1/(1 + exp(-t))"
    _split_coefficient = -1.0
    _antideriv_conj_boundary = (LOG2, LOG2)

    @property
    def torch_sigma(self) -> Any:
        """``torch.sigmoid`` (a subclass's own ``sigma`` where it overrides it)."""
        return torch.sigmoid if self._keeps(Sigmoid, "sigma") else self.sigma

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = 1/(1 + e^{-t})``."""
        return torch.sigmoid(nm.as_tensor(t))

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = σ(t) σ(-t)``."""
        t = nm.as_tensor(t)
        return torch.sigmoid(t) * torch.sigmoid(-t)

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u) = log u - log(1 - u)`` (``∓inf`` at 0 and 1, NaN outside ``[0, 1]``)."""
        u = nm.as_tensor(u)
        return torch.log(u) - torch.log1p(-u)

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = log(1 + e^a) - log 2``."""
        return nm.softplus(nm.as_tensor(a)) - LOG2

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = u log u + (1-u) log(1-u) + log 2`` on ``[0, 1]``, ``+inf`` outside."""
        u = nm.as_tensor(u)
        inside = self._in_domain(u)
        us = torch.where(inside, u, torch.full_like(u, 0.5))
        val = nm.xlogx(us) + nm.xlog1p(1 - us, -us) + LOG2
        out = torch.where(inside, val, torch.full_like(u, INF))
        return torch.where(torch.isnan(u), u, out)

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(-Σ [entr(u) + entr(1-u)] + n log 2, [0 ≤ u ≤ 1])``."""
        expr = -cp.sum(cp.entr(u) + cp.entr(1 - u)) + LOG2 * cvxpy_size(u)
        return expr, [u >= 0, u <= 1]

    def latex_potential(self, arg: str = "u") -> str:
        """``u log u + (1-u) log(1-u) + log 2 - u²/2``."""
        u = arg
        return rf"{u}\log {u} + (1-{u})\log(1-{u}) + \log 2 - \tfrac{{1}}{{2}} {u}^{{2}}"

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``log(1 + e^a) - log 2``."""
        return rf"\log(1 + e^{{{arg}}}) - \log 2"
