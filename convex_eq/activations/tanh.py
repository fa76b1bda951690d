"""tanh: ``f_σ(u) = ½[(1+u)log(1+u) + (1-u)log(1-u)] - u²/2`` on ``[-1, 1]``."""

from __future__ import annotations

import math
from typing import Any

from .._lazy import cvxpy as cp
from .._lazy import torch
from . import _numeric as nm
from .base import INF, Activation, TensorLike


class Tanh(Activation):
    """``σ = tanh``; ``σ̃(a) = log cosh a``; ``σ̃*(u) = ½[(1+u)log(1+u) + (1-u)log(1-u)]``."""

    name = "tanh"
    lipschitz = 1.0
    domain = (-1.0, 1.0)
    conjugate_domain = (-INF, INF)
    smooth_potential = True
    latex_sigma = r"\tanh(t)"
    text_sigma = "tanh(t)"
    _split_coefficient = -1.0
    _antideriv_conj_boundary = (math.log(2.0), math.log(2.0))

    @property
    def torch_sigma(self) -> Any:
        """``torch.tanh`` (a subclass's own ``sigma`` where it overrides it)."""
        return torch.tanh if self._keeps(Tanh, "sigma") else self.sigma

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = tanh t``."""
        return torch.tanh(nm.as_tensor(t))

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = sech² t = 4x/(1+x)²``, ``x = e^{-2|t|}`` (no overflow).  ``|t|`` is taken
        as ``t`` or ``−t`` by sign, not by ``abs``: both branches are analytic, so autograd's
        derivatives of ``σ'`` of every order are exact at ``t = 0`` too (``abs`` has derivative 0
        there, which would zero the odd derivatives of ``sech²`` and break the third
        derivative of ``prox_{t f_σ}``)."""
        t = nm.as_tensor(t)
        x = torch.exp(-2 * torch.where(t >= 0, t, -t))
        return 4 * x / (1 + x) ** 2

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u) = atanh u`` (``±inf`` at ``±1``, NaN outside)."""
        return torch.atanh(nm.as_tensor(u))

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = log cosh a = log(1 + e^{2a}) - a - log 2``."""
        a = nm.as_tensor(a)
        return nm.softplus(2 * a) - a - math.log(2.0)

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = ½[(1+u)log(1+u) + (1-u)log(1-u)]`` on ``[-1, 1]``, ``+inf`` outside."""
        u = nm.as_tensor(u)
        inside = self._in_domain(u)
        us = torch.where(inside, u, torch.zeros_like(u))
        val = 0.5 * (nm.xlog1p(1 + us, us) + nm.xlog1p(1 - us, -us))
        out = torch.where(inside, val, torch.full_like(u, INF))
        return torch.where(torch.isnan(u), u, out)

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(-½ Σ [entr(1+u) + entr(1-u)], [-1 ≤ u ≤ 1])`` (no additive constant)."""
        return -0.5 * cp.sum(cp.entr(1 + u) + cp.entr(1 - u)), [u >= -1, u <= 1]

    def latex_potential(self, arg: str = "u") -> str:
        """``½[(1+u)log(1+u) + (1-u)log(1-u)] - u²/2``."""
        u = arg
        return (
            rf"\tfrac{{1}}{{2}}\big[(1+{u})\log(1+{u}) + (1-{u})\log(1-{u})\big]"
            rf" - \tfrac{{1}}{{2}} {u}^{{2}}"
        )

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``log cosh a``."""
        return rf"\log\cosh {arg}"
