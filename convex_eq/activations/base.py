"""Scalar activations σ and their proximal potentials ``f_σ = σ̃* - u²/2`` (docs/theory.md §1).

Conventions used by every activation (all functions are elementwise on torch tensors):

* ``σ`` is nondecreasing and ``L_σ``-Lipschitz with ``L_σ ≤ 1``;
  ``σ̃(a) = ∫_0^a σ(t) dt`` (so ``σ̃(0) = 0``) and ``σ̃*(u) = sup_a u a - σ̃(a)``.
* ``f_σ(u) = σ̃*(u) - u²/2`` exactly (no dropped constants), convex, ``+inf`` outside
  ``domain`` (the closure of the range of ``σ``), and ``prox_{f_σ} = σ``.
* For ``u`` in the interior of ``domain`` and strictly increasing ``σ``:
  ``∇f_σ(u) = σ⁻¹(u) - u`` and ``σ̃*(u) = u σ⁻¹(u) - σ̃(σ⁻¹(u))``.
* The conjugate: ``f_σ*(w) = σ̃(s) - σ(s)²/2`` at any ``s`` with ``s - σ(s) = w`` (the sup over
  ``u`` is attained at ``u = σ(s)``); ``+inf`` outside ``conjugate_domain``, the closure of the
  range of ``s ↦ s - σ(s)``.
* ``prox_{t f_σ}(v) = σ(s)`` where ``t s + (1 - t) σ(s) = v``; the left side has slope in
  ``[min(t, 1), max(t, 1)]``, so the scalar solve is globally well posed for every ``t > 0``.
"""

from __future__ import annotations

import math
from typing import Any, Union

import numpy as np

from .._lazy import cvxpy as cp
from .._lazy import torch
from ..errors import NotDCPError, ScaleError
from . import _numeric as nm
from ._implicit import implicit_root, recording, value_with_gradient

INF = math.inf

TensorLike = Any
Scale = Union[float, "torch.Tensor"]

CERTIFIED_HINT = (
    "export σ̃* and collect the -u²/2 into the quadratic form, or use the certified-convex "
    "numeric reference (docs/theory.md §9.2)"
)


def fmt_number(x: float) -> str:
    """Short text for a float (``∞`` for infinities, integers without a trailing ``.0``)."""
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.6g}"


def fmt_interval(lo: float, hi: float) -> str:
    """Closed-interval text ``[lo, hi]`` with open ends at infinities."""
    left = "(" if math.isinf(lo) else "["
    right = ")" if math.isinf(hi) else "]"
    return f"{left}{fmt_number(lo)}, {fmt_number(hi)}{right}"


def zeros_with_grad(u: torch.Tensor) -> torch.Tensor:
    """Exact zeros shaped like ``u`` that stay connected to the autograd graph (zero gradient)."""
    finite = torch.isfinite(u)
    return 0.0 * torch.where(finite, u, torch.zeros_like(u))


class Activation:
    """A nondecreasing, 1-Lipschitz scalar ``σ`` with convex potential ``f_σ = σ̃* - u²/2``.

    :ivar name: registry name.
    :ivar lipschitz: ``L_σ = sup σ'`` (``≤ 1``).
    :ivar domain: closure of ``range(σ)`` = ``cl dom f_σ`` (``±inf`` allowed).
    :ivar conjugate_domain: closure of ``dom f_σ*`` = closure of the range of ``s - σ(s)``.
    :ivar smooth_potential: ``True`` iff ``σ`` is strictly increasing, i.e. ``f_σ`` has no indicator
        part: ``σ⁻¹`` is single-valued and ``f_σ`` is differentiable on the interior of
        ``domain`` with ``∇f_σ = σ⁻¹ - id``, and ``prox_{t f_σ}`` (``t ≠ 1``) needs a nonlinear
        scalar solve.  It does NOT mean ``f_σ`` is finite on ℝ (tanh, sigmoid, softplus are
        ``+inf`` outside ``domain``; check ``domain``).  ``False`` for ReLU and hard-tanh, whose
        potentials are (shifted) indicators and whose ``prox_{t f_σ}`` is a projection.
    :ivar latex_sigma: LaTeX of ``σ(t)``.
    :ivar text_sigma: plain-text formula of ``σ(t)`` (for ``str``).
    """

    name: str = "activation"
    lipschitz: float = 1.0
    domain: tuple[float, float] = (-INF, INF)
    conjugate_domain: tuple[float, float] = (-INF, INF)
    smooth_potential: bool = True
    latex_sigma: str = r"\sigma(t)"
    text_sigma: str = "σ(t)"
    #: coefficient ``c`` of the exporter's split ``f_σ = (DCP part) + c u²/2`` (None: no split)
    _split_coefficient: float | None = None
    #: ``f_σ*`` at the finite ends of ``conjugate_domain`` (None: computed by quad on demand)
    _conjugate_boundary: tuple[float | None, float | None] = (None, None)
    #: ``σ̃*`` at the finite ends of ``domain`` (None: computed by quad on demand)
    _antideriv_conj_boundary: tuple[float | None, float | None] = (None, None)

    # ------------------------------------------------------------------ the activation itself
    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t)``."""
        raise NotImplementedError

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t)`` (a fixed one-sided value at kinks, documented per activation)."""
        raise NotImplementedError

    @property
    def torch_sigma(self) -> Any:
        """``σ`` as a function of a tensor (the torch op itself where there is one: no input
        conversion on the solvers' hot path)."""
        return self.sigma

    def _keeps(self, owner: type, *names: str) -> bool:
        """True when this object's class uses ``owner``'s own definitions of ``names`` (a
        subclass that overrides ``sigma`` must not get ``owner``'s torch op for it)."""
        cls = type(self)
        return all(getattr(cls, n) is getattr(owner, n) for n in names)

    @property
    def torch_sigma_(self) -> Any:
        """``σ`` applied in place to a tensor (the torch op, e.g. ``torch.relu_``), or None:
        the solvers apply it to a pre-activation they have just formed, saving one allocation
        per iteration."""
        return None

    @property
    def sigma_prime_of_sigma(self) -> Any:
        """``u ↦ σ'(t)`` at ``u = σ(t)``, for activations whose value decides their derivative
        exactly (ReLU: ``1[u > 0]``), or None.  The emitted module's implicit backward then reads
        ``σ'`` at the equilibrium from the last image the solver computed instead of forming the
        pre-activation again (docs/theory.md §8, solver bookkeeping)."""
        return None

    @property
    def has_sigma_prime(self) -> bool:
        """True if this activation gives ``σ'`` in closed form (:meth:`sigma_prime`)."""
        return type(self).sigma_prime is not Activation.sigma_prime

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u)`` on ``domain`` (``±inf`` at unattained finite ends, NaN outside).

        Default: vectorized safeguarded Newton/bisection on ``σ(s) = u``.
        """
        return self._numeric_inverse(nm.as_tensor(u))

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a) = ∫_0^a σ(t) dt``."""
        raise NotImplementedError

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u) = sup_a u a - σ̃(a)`` (``+inf`` outside ``domain``).

        Default: ``u σ⁻¹(u) - σ̃(σ⁻¹(u))`` inside, limits by quad at finite ends.
        """
        return self._numeric_antiderivative_conjugate(nm.as_tensor(u))

    def latex_potential(self, arg: str = "u") -> str:
        """LaTeX of ``f_σ(arg)``."""
        return (
            rf"\tilde\sigma^*({arg}) - \tfrac12 {arg}^2,\quad "
            rf"\tilde\sigma^*({arg}) = \sup_a\,{arg} a - \tilde\sigma(a)"
        )

    def latex_antiderivative(self, arg: str = "a") -> str:
        """LaTeX of ``σ̃(arg) = ∫_0^arg σ``."""
        return rf"\int_0^{{{arg}}} \sigma(t)\,dt"

    # ----------------------------------------------------------------------- the potential
    def potential(self, u: TensorLike) -> torch.Tensor:
        """``f_σ(u) = σ̃*(u) - u²/2`` (``+inf`` outside ``domain``)."""
        u = nm.as_tensor(u)
        val = self.antiderivative_conjugate(u)
        finite = torch.isfinite(val)
        us = torch.where(finite, u, torch.zeros_like(u))
        return torch.where(torch.isinf(val), val, val - 0.5 * us * us)

    def potential_grad(self, u: TensorLike) -> torch.Tensor:
        """``∇f_σ(u) = σ⁻¹(u) - u`` on the interior of ``domain``.

        At a finite end of ``domain`` the one-sided limit from the interior is returned
        (``±inf`` for strictly increasing ``σ``; ``0`` for indicator potentials); NaN outside
        ``domain`` (the subdifferential is empty there).
        """
        u = nm.as_tensor(u)
        inside = self._in_domain(u)
        us = torch.where(inside, u, torch.full_like(u, self._domain_point()))
        val = self.inverse(us) - us
        return torch.where(inside, val, torch.full_like(u, math.nan))

    def conjugate_potential(self, w: TensorLike) -> torch.Tensor:
        """``f_σ*(w) = sup_u w u - f_σ(u) = σ̃(s) - σ(s)²/2`` with ``s - σ(s) = w``.

        ``+inf`` outside ``conjugate_domain``; the one-sided limit at its finite ends.  The
        scalar equation is solved by safeguarded Newton/bisection in float64;
        ``d f_σ*/dw = σ(s)`` is attached for autograd.
        """
        w = nm.as_tensor(w)
        lo, hi = self.conjugate_domain
        inside = (w > lo) & (w < hi)
        out = torch.full_like(w, INF)
        if lo < hi:
            ws = torch.where(inside, w, torch.full_like(w, self._conjugate_mid()))
            out = torch.where(inside, self._conjugate_interior(ws), out)
        for end, bval in ((lo, 0), (hi, 1)):
            if math.isfinite(end):
                value = self._conjugate_boundary_value(bval)
                out = torch.where(w == end, torch.full_like(w, value), out)
        return torch.where(torch.isnan(w), w, out)

    # ------------------------------------------------------------------------------ proxes
    def prox(self, v: TensorLike, t: Scale = 1.0) -> torch.Tensor:
        """``prox_{t f_σ}(v) = argmin_u t f_σ(u) + (u - v)²/2`` (``t = 1``: ``σ(v)``).

        General ``t > 0``: ``σ(s)`` with ``t s + (1 - t) σ(s) = v`` solved by safeguarded
        Newton/bisection in float64 (to ~1e-15 relative), with the exact implicit derivative
        attached for autograd.  ``t ≤ 0`` raises ``ScaleError``.
        """
        v = nm.as_tensor(v)
        t = self._check_scale(t)
        if not isinstance(t, torch.Tensor) and t == 1.0:
            return self.sigma(v)
        return self._prox_solve(v, t)

    def prox_conjugate(self, v: TensorLike, t: Scale = 1.0) -> torch.Tensor:
        """``prox_{t f_σ*}(v) = v - t prox_{f_σ/t}(v/t)`` (Moreau identity), kept in the closed
        ``conjugate_domain`` (the subtraction leaves e.g. ``5e-17`` where the exact prox of
        ``ι_{0}`` (identity) is ``0``, and ``f_σ*`` is ``+inf`` there)."""
        v = nm.as_tensor(v)
        t = self._check_scale(t)
        out = v - t * self.prox(v / t, 1.0 / t)
        lo, hi = self.conjugate_domain
        if math.isfinite(lo) or math.isfinite(hi):
            out = torch.clamp(out, min=lo if math.isfinite(lo) else None,
                              max=hi if math.isfinite(hi) else None)
        return out

    # ---------------------------------------------------------------------------- CVXPY forms
    def cvxpy_potential(self, u: cp.Expression) -> tuple[cp.Expression, list[cp.Constraint]]:
        """DCP form of ``Σ_i f_σ(u_i)`` as ``(expression, constraints)``."""
        raise NotDCPError(
            f"f_σ = σ̃* - u²/2 for activation '{self.name}' is convex but not DCP "
            "(a difference of convex terms)",
            term=self.name,
            hint=CERTIFIED_HINT,
        )

    def cvxpy_antiderivative_conjugate(
        self, u: cp.Expression
    ) -> tuple[cp.Expression, list[cp.Constraint]]:
        """DCP form of ``Σ_i σ̃*(u_i)`` as ``(expression, constraints)``."""
        raise NotDCPError(
            f"σ̃* for activation '{self.name}' has no closed DCP form (it is evaluated "
            "numerically), so f_σ = σ̃* - u²/2 cannot be exported to CVXPY either",
            term=self.name,
            hint="use the certified-convex numeric reference (docs/theory.md §9.2)",
        )

    @property
    def quadratic_coefficient_of_potential(self) -> float | None:
        """``c`` with ``f_σ = (DCP part) + c u²/2`` for the exporter (None: not exportable)."""
        return self._split_coefficient

    def cvxpy_split(self, u: cp.Expression) -> tuple[float, cp.Expression, list[cp.Constraint]]:
        """``(c, expr, constraints)`` with ``Σ f_σ(u_i) = expr + c ||u||²/2`` and ``expr`` DCP.

        ``c = 0`` (expr = ``cvxpy_potential``) for identity / ReLU / leaky ReLU / hard-tanh;
        ``c = -1`` (expr = ``cvxpy_antiderivative_conjugate``) for tanh / sigmoid; raises
        ``NotDCPError`` when neither exists (softplus, sympy activations).
        """
        c = self._split_coefficient
        if c == 0.0:
            expr, cons = self.cvxpy_potential(u)
            return 0.0, expr, cons
        if c == -1.0:
            expr, cons = self.cvxpy_antiderivative_conjugate(u)
            return -1.0, expr, cons
        raise NotDCPError(
            f"f_σ = σ̃* - u²/2 for activation '{self.name}' is convex but not DCP (a difference "
            "of convex terms), and σ̃* has no closed DCP form either",
            term=self.name,
            hint="use the certified-convex numeric reference (docs/theory.md §9.2)",
        )

    # ------------------------------------------------------------------------------ display
    def __str__(self) -> str:
        return (
            f"{self.name}: σ(t) = {self.text_sigma}, L_σ = {fmt_number(self.lipschitz)}, "
            f"dom f_σ = {fmt_interval(*self.domain)}"
        )

    def __repr__(self) -> str:
        return f"<Activation {self.name}: σ(t) = {self.text_sigma}>"

    # ---------------------------------------------------------------------------- internals
    def _in_domain(self, u: torch.Tensor) -> torch.Tensor:
        lo, hi = self.domain
        return (u >= lo) & (u <= hi)

    def _interior(self, u: torch.Tensor) -> torch.Tensor:
        lo, hi = self.domain
        return (u > lo) & (u < hi)

    def _domain_point(self) -> float:
        """A point of the interior of ``domain`` (``σ(0)`` when it is interior)."""
        lo, hi = self.domain
        c = float(self.sigma(torch.zeros((), dtype=torch.float64)))
        if lo < c < hi:
            return c
        if math.isfinite(lo) and math.isfinite(hi):
            return 0.5 * (lo + hi)
        return lo + 1.0 if math.isfinite(lo) else hi - 1.0

    def _check_scale(self, t: Scale) -> Scale:
        if isinstance(t, torch.Tensor):
            if not bool(((t > 0) & torch.isfinite(t)).all()):
                raise ScaleError(
                    "prox scale t must be finite and > 0 everywhere",
                    term=self.name,
                    hint="prox_{t f} is defined for t > 0 only",
                )
            return t
        tf = float(t)
        if not (tf > 0 and math.isfinite(tf)):
            raise ScaleError(
                f"prox scale t must be finite and > 0 (got {t})",
                term=self.name,
                hint="prox_{t f} is defined for t > 0 only",
            )
        return tf

    def _sigma_scalar(self, x: float) -> float:
        return float(self.sigma(torch.tensor(x, dtype=torch.float64)))

    def _sigma_prime_scalar(self, x: float) -> float:
        return float(self.sigma_prime(torch.tensor(x, dtype=torch.float64)))

    # --- prox solve ------------------------------------------------------------------------
    def _prox_solve(self, v: torch.Tensor, t: Scale) -> torch.Tensor:
        """``σ(s)``, ``t s + (1 − t) σ(s) = v``: ``s`` by safeguarded Newton/bisection in
        float64, attached by the implicit function ``ds/dv = 1/(t + (1 − t)σ'(s))``,
        ``ds/dt = −(s − σ(s))/(t + (1 − t)σ'(s))`` to every order (docs/theory.md §1)."""
        tt = t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=v.dtype,
                                                                  device=v.device)
        if not recording():
            return self.sigma(self._prox_root(v, tt))
        return self.sigma(implicit_root(self._prox_root, self._prox_partials, v, tt))

    def _prox_root(self, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The root ``s`` of ``t s + (1 − t) σ(s) = v`` (float64 solve, ``v``'s dtype; no
        autograd)."""
        v64 = v.detach().to(torch.float64)
        t64 = t.detach().to(device=v.device, dtype=torch.float64)
        v64, t64 = torch.broadcast_tensors(v64, t64)

        def h(s: torch.Tensor) -> torch.Tensor:
            return t64 * s + (1 - t64) * self.sigma(s)

        def dh(s: torch.Tensor) -> torch.Tensor:
            return t64 + (1 - t64) * self.sigma_prime(s)

        with torch.no_grad():
            m = torch.minimum(t64, torch.ones_like(t64))
            r0 = h(v64) - v64
            rad = r0.abs() / m * (1 + 1e-9) + 1e-300
            s = nm.solve_increasing(h, dh, v64, v64 - rad, v64 + rad, x0=v64)
            s = torch.where(torch.isfinite(v64), s, v64)
        return s.to(v.dtype)

    def _prox_partials(self, s: torch.Tensor, v: torch.Tensor, t: torch.Tensor
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(F_s, [F_v, F_t])`` of ``F = t s + (1 − t) σ(s) − v``."""
        return (t + (1 - t) * self.sigma_prime(s),
                [-torch.ones_like(s), s - self.sigma(s)])

    # --- conjugate solve -------------------------------------------------------------------
    def _g(self, s: torch.Tensor) -> torch.Tensor:
        """``g(s) = s - σ(s)`` (nondecreasing, slope ``1 - σ'(s) ∈ [0, 1]``)."""
        return s - self.sigma(s)

    def _g_prime(self, s: torch.Tensor) -> torch.Tensor:
        return 1 - self.sigma_prime(s)

    def _conjugate_mid(self) -> float:
        lo, hi = self.conjugate_domain
        c = -float(self.sigma(torch.zeros((), dtype=torch.float64)))
        if lo < c < hi:
            return c
        if math.isfinite(lo) and math.isfinite(hi):
            return 0.5 * (lo + hi)
        return lo + 1.0 if math.isfinite(lo) else hi - 1.0

    def _conjugate_argmax(self, w64: torch.Tensor) -> torch.Tensor:
        """Some ``s`` with ``s - σ(s) = w`` (float64, no autograd)."""
        with torch.no_grad():
            lo, hi = nm.bracket_increasing(self._g, w64, w64)
            return nm.solve_increasing(self._g, self._g_prime, w64, lo, hi, x0=w64)

    def _conjugate_root(self, w: torch.Tensor) -> torch.Tensor:
        """The root ``s`` of ``s − σ(s) = w`` in ``w``'s dtype (float64 solve, no autograd)."""
        return self._conjugate_argmax(w.detach().to(torch.float64)).to(w.dtype)

    def _conjugate_partials(self, s: torch.Tensor, w: torch.Tensor
                            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(F_s, [F_w])`` of ``F = s − σ(s) − w``."""
        return self._g_prime(s), [-torch.ones_like(s)]

    def _conjugate_interior(self, w: torch.Tensor) -> torch.Tensor:
        """``f_σ*(w)`` inside ``conjugate_domain``: the value at the root ``s`` of
        ``s − σ(s) = w``, with ``d f_σ*/dw = σ(s(w))`` and ``s(w)`` an implicit root, so every
        derivative order is exact (docs/theory.md §1)."""
        def value(x: torch.Tensor) -> torch.Tensor:
            s = self._conjugate_argmax(x.detach().to(torch.float64))
            return self._conjugate_value(s).to(x.dtype)

        if not recording():
            return value(w)

        def gradient(x: torch.Tensor) -> torch.Tensor:
            return self.sigma(implicit_root(self._conjugate_root, self._conjugate_partials, x))

        return value_with_gradient(value, gradient, w)

    def _conjugate_value(self, s: torch.Tensor) -> torch.Tensor:
        """``σ̃(s) - σ(s)²/2`` (= ``f_σ*(s - σ(s))``)."""
        return self.antiderivative(s) - 0.5 * self.sigma(s) ** 2

    def _conjugate_boundary_value(self, side: int) -> float:
        """``f_σ*`` at a finite end: ``-σ(0)²/2 + ∫_0^{±∞} σ(1 - σ')`` (``+inf`` if divergent)."""
        cached = self._conjugate_boundary[side]
        if cached is not None:
            return cached
        s0 = self._sigma_scalar(0.0)

        def integrand(x: float) -> float:
            return self._sigma_scalar(x) * (1.0 - self._sigma_prime_scalar(x))

        if side == 1:
            val = -0.5 * s0 * s0 + nm.quad_improper(integrand, 0.0, INF)
        else:
            # f_σ* is convex and lsc: its limit at an end is finite or +inf, never -inf
            val = -0.5 * s0 * s0 - nm.quad_improper(lambda x: integrand(-x), 0.0, INF)
            if val == -INF:
                val = INF
        bounds = list(self._conjugate_boundary)
        bounds[side] = val
        self._conjugate_boundary = (bounds[0], bounds[1])
        return val

    # --- numeric inverse / conjugate of the antiderivative ---------------------------------
    def _numeric_inverse(self, u: torch.Tensor) -> torch.Tensor:
        lo, hi = self.domain
        inside = self._interior(u)
        mid = self._domain_point()
        us = torch.where(inside, u, torch.full_like(u, mid))
        out = (implicit_root(self._inverse_root, self._inverse_partials, us) if recording()
               else self._inverse_root(us))
        out = torch.where(inside, out, torch.full_like(u, math.nan))
        out = torch.where(u == lo, torch.full_like(u, self._inverse_at_end(0)), out)
        return torch.where(u == hi, torch.full_like(u, self._inverse_at_end(1)), out)

    def _inverse_root(self, u: torch.Tensor) -> torch.Tensor:
        """The root ``s`` of ``σ(s) = u`` in ``u``'s dtype (float64 solve, no autograd)."""
        u64 = u.detach().to(torch.float64)
        with torch.no_grad():
            x0 = torch.zeros_like(u64)
            blo, bhi = nm.bracket_increasing(self.sigma, u64, x0)
            s = nm.solve_increasing(self.sigma, self.sigma_prime, u64, blo, bhi, x0=x0)
        return s.to(u.dtype)

    def _inverse_partials(self, s: torch.Tensor, u: torch.Tensor
                          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(F_s, [F_u])`` of ``F = σ(s) − u`` (``F_s = 0`` where ``σ`` is flat: derivative
        0 there, the one-sided convention at saturated ends)."""
        return self.sigma_prime(s), [-torch.ones_like(s)]

    def _inverse_at_end(self, side: int) -> float:
        """``σ⁻¹`` at a finite end of ``domain``: ``∓inf`` unless ``σ`` attains it."""
        end = self.domain[side]
        if not math.isfinite(end):
            return math.nan
        return -INF if side == 0 else INF

    def _numeric_antiderivative_conjugate(self, u: torch.Tensor) -> torch.Tensor:
        lo, hi = self.domain
        inside = self._interior(u)
        us = torch.where(inside, u, torch.full_like(u, self._domain_point()))
        a = self.inverse(us)
        val = us * a - self.antiderivative(a)
        out = torch.where(inside, val, torch.full_like(u, INF))
        for end, side in ((lo, 0), (hi, 1)):
            if math.isfinite(end):
                bval = self._antideriv_conj_boundary_value(side)
                out = torch.where(u == end, torch.full_like(u, bval), out)
        return torch.where(torch.isnan(u), u, out)

    def _antideriv_conj_boundary_value(self, side: int) -> float:
        """``σ̃*(c)`` at a finite end ``c``: ``∫_{-∞}^0 (σ - c)`` or ``∫_0^∞ (c - σ)``."""
        cached = self._antideriv_conj_boundary[side]
        if cached is not None:
            return cached
        c = self.domain[side]
        if side == 0:
            val = nm.quad_improper(lambda x: self._sigma_scalar(-x) - c, 0.0, INF)
        else:
            val = nm.quad_improper(lambda x: c - self._sigma_scalar(x), 0.0, INF)
        bounds = list(self._antideriv_conj_boundary)
        bounds[side] = val
        self._antideriv_conj_boundary = (bounds[0], bounds[1])
        return val


def cvxpy_size(u: cp.Expression) -> int:
    """Number of scalar entries of a CVXPY expression."""
    return int(np.prod(u.shape)) if u.shape else 1
