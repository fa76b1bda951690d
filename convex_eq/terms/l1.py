"""The ℓ1 norm ``||u||₁`` and its conjugate, the indicator of an ℓ∞ ball (docs/theory.md §4).

Conjugate pair (for ``c > 0``): ``(c·||·||₁)*(y) = c·ι_{||·||∞≤1}(y/c) = ι_{||·||∞≤c}(y)``, so
``L1(u) * c`` conjugates to ``LinfBallIndicator(u, radius=c)`` and back.  Moreau's identity
``prox_{c||·||₁}(v) + prox_{ι_{||·||∞≤c}}(v) = v`` reads ``soft(v, c) + clip(v, -c, c) = v``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lazy import cvxpy as cp
from .._lazy import torch
from ..errors import NotDCPError, ScaleError
from ..export import ExportContext
from ..symbols import Env, Scalar, Symbol
from .base import Curvature, Term, require_states, single_arg


class L1(Term):
    """``||u||₁ = Σ_j |u_j|``: convex, nonsmooth, ``prox_{t||·||₁}(v) = sign(v)·max(|v| - t, 0)``
    (soft-thresholding), conjugate ``ι_{||·||∞ ≤ c}`` (see :class:`LinfBallIndicator`),
    exported as ``c·norm1(u)``."""

    label = "ℓ1 norm"
    prox_elementwise = True
    base_curvature = "convex"
    smooth = False
    #: the prox acts coordinate-wise (used by rules that compose 1-D proxes)
    separable = True
    #: ``∂(c|·|)(v)`` depends on ``sign(v)`` only: ``prox_{f + c|·|} = prox_f ∘ soft_c`` for
    #: every 1-D convex ``f`` with ``prox_f`` sign-preserving (``prox_f(0) = 0``)
    sign_subdifferential = True

    def __init__(self, u: Any):
        super().__init__(u)

    def check_shapes(self) -> None:
        """The argument must involve a state."""
        require_states(self.args, str(self))

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``||u||₁ = Σ_j |u_j|`` per sample."""
        return us[0].abs().sum(dim=-1)

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        """Soft-thresholding ``prox_{t||·||₁}(v) = sign(v)·max(|v| − t, 0)``."""
        return torch.sign(v) * torch.clamp(v.abs() - t, min=0.0)

    def raw_curvature(self) -> Curvature:
        """Convex: a norm."""
        return Curvature("convex", reason="a norm")

    def prox_text(self, arg: str, t: float, latex: bool = False) -> str:
        """Display of ``prox_{t·c||·||₁}(arg)``: the soft-threshold at level ``t·c``."""
        level = f"{t * self.scale:g}" + "".join(
            ("·" if not latex else " ") + (s.latex() if latex else s.name) for s in self.scalars)
        if latex:
            return f"\\mathrm{{soft}}_{{{level}}}\\big({arg}\\big)"
        return f"soft-threshold_{level}({arg})"

    def conjugate(self) -> Term:
        """``(scale·Π scalars·||u||₁)* = ι_{||u||∞ ≤ scale·Π scalars}`` (same argument ``u``)."""
        if self.scale <= 0:
            raise NotDCPError(
                f"conjugate of a non-positive multiple ({self.scale:g}) of the ℓ1 norm is not a "
                "proper convex function", term=str(self),
                hint="only c·||u||₁ with c > 0 has the ℓ∞-ball indicator as conjugate",
            )
        return LinfBallIndicator(single_arg(self), self.scale, scalars=self.scalars)

    def export(self, ctx: ExportContext) -> None:
        """``c·norm1(u)`` for ``c ≥ 0`` (a negative multiple is concave: ``NotDCPError``)."""
        c = self.coef(ctx.env)
        if c < 0:
            raise NotDCPError("a negative multiple of the ℓ1 norm is concave", term=str(self),
                              hint="verify with the local reference instead of CVXPY")
        ctx.add(c * cp.norm1(ctx.expr(single_arg(self))), source=str(self))

    def raw_latex(self) -> str:
        """LaTeX of ``||u||₁`` (without the coefficient)."""
        return f"\\big\\|{single_arg(self).latex()}\\big\\|_1"

    def raw_str(self) -> str:
        """Plain-text formula ``||u||₁`` (without the coefficient)."""
        return f"||{single_arg(self)}||₁"


class LinfBallIndicator(Term):
    """``ι_{||u||∞ ≤ r}(u)`` = 0 if every ``|u_j| ≤ r`` else ``+∞`` (per sample).

    ``radius`` is a positive float or :class:`Scalar` (``scalars`` multiplies further positive
    scalar symbols into it, used by :meth:`L1.conjugate` for ``λ·||u||₁``).  Convex, nonsmooth,
    ``prox = clip(v, -r, r)`` for any step (a positive multiple of an indicator is the same
    indicator), conjugate ``r·||·||₁``, exported as the constraint ``||u||∞ ≤ r``.

    Membership is tested with a relative slack of ``8·eps(dtype)`` so that points produced by
    ``clip`` or by ``r·sign(x)`` count as inside in float32 as well as float64."""

    def domain_box(self, size: int, env: Env | None = None) -> tuple[Any, Any] | None:
        """``ι(||u||∞ ≤ r)`` is the box ``[-r, r]^size`` (when the coefficient is > 0)."""
        if not self.coef(env) > 0:
            return None
        r = self.radius_value(env)
        return np.full(size, -r, dtype=np.float64), np.full(size, r, dtype=np.float64)

    label = "ℓ∞-ball indicator"
    base_curvature = "convex"
    smooth = False

    def __init__(self, u: Any, radius: float | Scalar = 1.0, *,
                 scalars: tuple[Scalar, ...] = ()):
        self.radius = radius
        self.radius_scalars = tuple(scalars)
        if not isinstance(radius, Scalar):
            r = float(radius)
            if not (math.isfinite(r) and r > 0):
                raise ScaleError(f"radius {r:g} must be a positive finite number",
                                 term=f"ι(||{u}||∞ ≤ {r:g})")
        super().__init__(u)
        self.radius_value(None)

    def check_shapes(self) -> None:
        """The argument must involve a state."""
        require_states(self.args, str(self))

    def symbols(self) -> list[Symbol]:
        """The argument's symbols and the radius' ``Scalar`` symbols."""
        out = super().symbols()
        for s in (self.radius, *self.radius_scalars):
            if isinstance(s, Scalar) and all(s is not o for o in out):
                out.append(s)
        return out

    def radius_value(self, env: Env | None = None) -> float:
        """Current radius ``r > 0`` (raises ScaleError naming the term otherwise)."""
        rad = self.radius
        if isinstance(rad, Scalar):
            r = rad.check(float(rad.numpy(env)), term=str(self))
        else:
            r = float(rad)
        for s in self.radius_scalars:
            r *= s.check(float(s.numpy(env)), term=str(self))
        if not (math.isfinite(r) and r > 0):
            raise ScaleError(f"ball radius = {r:g} must be positive and finite", term=str(self))
        return r

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``ι_{||u||∞ ≤ r}(u)``: ``0`` inside the ball (up to rounding), ``+inf`` outside."""
        u = us[0]
        r = self.radius_value(env)
        slack = 8.0 * torch.finfo(u.dtype).eps * max(r, 1.0) if u.is_floating_point() else 0.0
        inside = (u.abs() <= r + slack).all(dim=-1)
        zero = torch.zeros(u.shape[0], dtype=u.dtype, device=u.device)
        return torch.where(inside, zero, torch.full_like(zero, math.inf))

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        """Projection onto the ball: ``clamp(v, −r, r)`` for every step ``t``."""
        r = self.radius_value(env)
        return torch.clamp(v, -r, r)

    def raw_curvature(self) -> Curvature:
        """Convex: the indicator of a convex set."""
        return Curvature("convex", reason="indicator of a convex set")

    def conjugate(self) -> Term:
        """``ι_{||·||∞ ≤ r}* = r·||·||₁`` (requires ``scale > 0``; the scale of an indicator is
        immaterial, scalar multipliers of the indicator are ignored for the same reason)."""
        if self.scale <= 0:
            raise NotDCPError("conjugate of a non-positive multiple of an indicator",
                              term=str(self))
        t = L1(single_arg(self))
        if isinstance(self.radius, Scalar):
            t.scalars = (self.radius, *self.radius_scalars)
        else:
            t.scale = float(self.radius)
            t.scalars = self.radius_scalars
        return t

    def export(self, ctx: ExportContext) -> None:
        """Constraint ``|u_j| ≤ r`` (``c·ι = ι`` for ``c > 0``; negative ``c`` is refused)."""
        if self.coef(ctx.env) <= 0:
            raise NotDCPError("a non-positive multiple of an indicator is not convex",
                              term=str(self))
        r = self.radius_value(ctx.env)
        ctx.add(None, [cp.abs(ctx.expr(single_arg(self))) <= r], source=str(self))

    def _radius_str(self, latex: bool) -> str:
        parts = []
        if isinstance(self.radius, Scalar):
            parts.append(self.radius.latex() if latex else self.radius.name)
        elif float(self.radius) != 1.0 or not self.radius_scalars:
            parts.append(f"{float(self.radius):g}")
        parts += [s.latex() if latex else s.name for s in self.radius_scalars]
        return (" " if latex else "·").join(parts)

    def raw_latex(self) -> str:
        """LaTeX of ``ι_{||u||∞ ≤ r}(u)`` (without the coefficient)."""
        return (f"\\iota\\big(\\|{single_arg(self).latex()}\\|_\\infty \\le "
                f"{self._radius_str(True)}\\big)")

    def raw_str(self) -> str:
        """Plain-text formula ``ι_{||u||∞ ≤ r}(u)`` (without the coefficient)."""
        return f"ι(||{single_arg(self)}||∞ ≤ {self._radius_str(False)})"
