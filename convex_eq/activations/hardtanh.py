"""Hard-tanh / clamp ``σ(t) = min(max(t, lo), hi)``: ``f_σ = ι_{[lo, hi]} - c₀²/2``.

``c₀ = clamp(0, lo, hi)`` is the projection of 0 on the box; it is 0 for the usual ``lo ≤ 0 ≤ hi``
and keeps ``f_σ = σ̃* - u²/2`` exact (``σ̃(0) = 0``) when the box does not contain 0.
"""

from __future__ import annotations

import math

from .._lazy import cvxpy as cp
from .._lazy import torch
from ..errors import ScaleError
from . import _numeric as nm
from .base import INF, Activation, Scale, TensorLike, cvxpy_size, fmt_number, zeros_with_grad


class HardTanh(Activation):
    """``σ(t) = clamp(t, lo, hi)``; ``f_σ = ι_{[lo,hi]} - c₀²/2``; prox = projection on the box."""

    lipschitz = 1.0
    conjugate_domain = (-INF, INF)
    smooth_potential = False
    _split_coefficient = 0.0

    def __init__(self, lo: float = -1.0, hi: float = 1.0, name: str = "hardtanh"):
        try:
            lo_f, hi_f = float(lo), float(hi)
        except (TypeError, ValueError):
            lo_f = hi_f = math.nan
        if not (math.isfinite(lo_f) and math.isfinite(hi_f)) or not lo_f < hi_f:
            raise ScaleError(
                f"the clamp bounds must be finite with lo < hi (got lo={lo!r}, hi={hi!r})",
                term=name,
                hint="pass finite lo < hi, e.g. lo=-1, hi=1",
            )
        self.name = name
        self.lo, self.hi = lo_f, hi_f
        self.c0 = min(max(0.0, lo_f), hi_f)
        self.domain = (lo_f, hi_f)
        lo_s, hi_s = fmt_number(lo_f), fmt_number(hi_f)
        self.latex_sigma = rf"\min(\max(t, {lo_s}), {hi_s})"
        self.text_sigma = f"min(max(t, {lo_s}), {hi_s})"

    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t) = min(max(t, lo), hi)``."""
        # F.hardtanh, not torch.clamp: its autograd derivative is 0 at the kinks, as
        # sigma_prime (clamp's is 1 there), so every path differentiates σ the same way
        return torch.nn.functional.hardtanh(nm.as_tensor(t), self.lo, self.hi)

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t) = 1[lo < t < hi]`` (0 at the kinks)."""
        t = nm.as_tensor(t)
        return ((t > self.lo) & (t < self.hi)).to(t.dtype)

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``u`` on ``[lo, hi]`` (at an end: the preimage nearest the interior), NaN outside."""
        u = nm.as_tensor(u)
        return torch.where(self._in_domain(u), u, torch.full_like(u, math.nan))

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = σ(a) a - σ(a)²/2 + c₀²/2``."""
        a = nm.as_tensor(a)
        c = torch.clamp(a, self.lo, self.hi)
        return c * a - 0.5 * c * c + 0.5 * self.c0**2

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = u²/2 - c₀²/2`` on ``[lo, hi]``, ``+inf`` outside."""
        u = nm.as_tensor(u)
        inside = self._in_domain(u)
        us = torch.where(inside, u, torch.zeros_like(u))
        out = torch.where(inside, 0.5 * us * us - 0.5 * self.c0**2, torch.full_like(u, INF))
        return torch.where(torch.isnan(u), u, out)

    def potential(self, u: TensorLike) -> torch.Tensor:
        """``f_σ(u) = -c₀²/2`` on ``[lo, hi]``, ``+inf`` outside."""
        u = nm.as_tensor(u)
        val = zeros_with_grad(u) - 0.5 * self.c0**2
        out = torch.where(self._in_domain(u), val, torch.full_like(u, INF))
        return torch.where(torch.isnan(u), u, out)

    def potential_grad(self, u: TensorLike) -> torch.Tensor:
        """``0`` on ``[lo, hi]`` (interior gradient and its limits), NaN outside."""
        u = nm.as_tensor(u)
        return torch.where(self._in_domain(u), zeros_with_grad(u), torch.full_like(u, math.nan))

    def conjugate_potential(self, w: TensorLike) -> torch.Tensor:
        """``f_σ*(w) = max(lo w, hi w) + c₀²/2``."""
        w = nm.as_tensor(w)
        return torch.maximum(self.lo * w, self.hi * w) + 0.5 * self.c0**2

    def prox(self, v: TensorLike, t: Scale = 1.0) -> torch.Tensor:
        """``prox_{t f_σ}(v) = clamp(v, lo, hi)`` for every ``t > 0`` (projection)."""
        v = nm.as_tensor(v)
        self._check_scale(t)
        return torch.clamp(v, self.lo, self.hi)

    def cvxpy_potential(self, u: cp.Expression) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(-n c₀²/2, [lo ≤ u, u ≤ hi])`` (the constant is 0 when ``lo ≤ 0 ≤ hi``)."""
        const = cp.Constant(-0.5 * self.c0**2 * cvxpy_size(u))
        return const, [self.lo <= u, u <= self.hi]

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """``(½ ||u||² - n c₀²/2, [lo ≤ u, u ≤ hi])``."""
        expr = 0.5 * cp.sum_squares(u) - 0.5 * self.c0**2 * cvxpy_size(u)
        return expr, [self.lo <= u, u <= self.hi]

    def latex_potential(self, arg: str = "u") -> str:
        """``ι_{[lo,hi]}(u) - c₀²/2``."""
        box = rf"\iota_{{[{fmt_number(self.lo)}, {fmt_number(self.hi)}]}}({arg})"
        return box if self.c0 == 0 else rf"{box} - \tfrac{{{fmt_number(self.c0**2)}}}{{2}}"

    def latex_antiderivative(self, arg: str = "a") -> str:
        """``σ(a) a - σ(a)²/2 + c₀²/2``."""
        s = rf"\sigma({arg})"
        tail = "" if self.c0 == 0 else rf" + \tfrac{{{fmt_number(self.c0**2)}}}{{2}}"
        return rf"{s}\,{arg} - \tfrac{{1}}{{2}} {s}^{{2}}{tail}"

    def __repr__(self) -> str:
        return f"<Activation {self.name}(lo={fmt_number(self.lo)}, hi={fmt_number(self.hi)})>"
