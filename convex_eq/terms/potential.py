"""Activation terms: the potential ``Σ f_σ(u)`` (prox = σ), the antiderivative ``Σ σ̃(u)`` and
its conjugate ``Σ σ̃*(u) = Σ f_σ(u) + ½||u||²`` (docs/theory.md §1)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lazy import torch
from ..activations import Activation, get_activation
from ..errors import NotDCPError
from ..export import ExportContext
from ..symbols import Env
from .base import StrongConvexity, Term, single_arg


def act_latex(act: Activation) -> str:
    """LaTeX name of an activation, e.g. ``\\operatorname{relu}``."""
    name = act.name.replace("_", "\\_")
    return f"\\operatorname{{{name}}}"


_sig = act_latex


def _activation(act: Any) -> Activation:
    return get_activation(act) if isinstance(act, str) else act


_SMOOTH_POTENTIAL_LIP = {"identity": lambda a: 0.0, "leaky_relu": lambda a: 1.0 / a.slope - 1.0}


def activation_box(lo: float, hi: float, size: int, open_ends: bool) -> tuple[Any, Any]:
    """``[lo, hi]^size`` as float64 arrays; with ``open_ends`` (a strictly increasing σ: the
    domain is open) finite ends move inside by 1e-12 (a point on the boundary is outside)."""
    if open_ends and lo < hi:
        lo = lo + 1e-12 * max(1.0, abs(lo)) if math.isfinite(lo) else lo
        hi = hi - 1e-12 * max(1.0, abs(hi)) if math.isfinite(hi) else hi
    return np.full(size, lo, dtype=np.float64), np.full(size, hi, dtype=np.float64)


class _ActivationTerm(Term):
    def __init__(self, act: Any, u: Any):
        self.act = _activation(act)
        super().__init__(u)

    def _arg_str(self) -> str:
        return str(single_arg(self))

    def _arg_latex(self) -> str:
        return single_arg(self).latex()


class Potential(_ActivationTerm):
    """``Σ_j f_σ(u_j)``, ``f_σ = σ̃* - ½(·)²``: convex, ``prox_{f_σ} = σ`` (docs/theory.md §1)."""

    label = "activation potential"
    grad_structure = "elementwise"
    prox_elementwise = True
    lift_prox = False  # its domain enters the lifted problem as a box, not as a prox term

    def domain_box(self, size: int, env: Env | None = None) -> tuple[Any, Any] | None:
        """``dom f_σ`` (``σ̃* = f_σ + ½u²`` has the same domain) when the coefficient is > 0."""
        if not self.coef(env) > 0:
            return None
        return activation_box(*self.act.domain, size, self.act.smooth_potential)
    base_curvature = "convex"

    @property
    def smooth(self) -> bool:  # type: ignore[override]
        """``True`` iff ``f_σ`` is finite with a Lipschitz gradient on ℝ (identity, leaky ReLU)."""
        return self.act.name in _SMOOTH_POTENTIAL_LIP

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_j f_σ(u_j)`` per sample (``+inf`` outside the closed range of ``σ``)."""
        return self.act.potential(us[0]).sum(dim=-1)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇f_σ(u) = σ⁻¹(u) − u`` on the interior of the domain (smooth potentials)."""
        return [self.act.potential_grad(us[0])]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """A bound on ``Lip(σ⁻¹ − id)`` where the activation has one, else ``inf``."""
        f = _SMOOTH_POTENTIAL_LIP.get(self.act.name)
        return [math.inf if f is None else f(self.act)]

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        """``prox_{t f_σ}(v)``; for ``t = 1`` it is ``σ(v)`` (docs/theory.md §1)."""
        return self.act.prox(v, t)

    def strong_convexity(self) -> StrongConvexity | None:
        """``c·f_σ`` is ``c(1/L_σ − 1)``-strongly convex (``f_σ + ½u²`` is ``1/L_σ``-strongly
        convex)."""
        s = self.prox_state
        if s is None or self.coef_sign() < 0 or self.scalars:
            return None
        m = self.scale * (1.0 / self.act.lipschitz - 1.0)
        return StrongConvexity(s, m) if m > 0 else None

    def conjugate(self) -> Term:
        """``(c·Σf_σ)*(y) = c·Σf_σ*(y/c)`` (a ``PotentialConjugate``)."""
        if self.prox_state is None or self.scalars:
            return super().conjugate()
        return self.scale * PotentialConjugate(self.act, single_arg(self), self.scale)

    def export(self, ctx: ExportContext) -> None:
        """``c·f_σ`` for ``c ≥ 0``: its ``−½u²`` part as a quadratic (cancels exactly), the rest
        DCP."""
        c = self.coef(ctx.env)
        if c < 0:
            raise NotDCPError("negative multiple of a convex potential", term=str(self))
        u = single_arg(self)
        quad, expr, cons = _cvxpy_split(self, ctx.expr(u))
        if quad != 0:
            ctx.add_quadratic(c * quad, u, None, source=f"{self} (-½u² part of f_σ)")
        ctx.add(c * expr if not _is_zero(expr) else None, cons, source=str(self))

    def raw_latex(self) -> str:
        """LaTeX of ``Σ f_σ(u)`` (without the coefficient)."""
        return f"\\sum_j f_{{{_sig(self.act)}}}\\big({self._arg_latex()}\\big)"

    def raw_str(self) -> str:
        """Plain-text formula ``Σ f_σ(u)`` (without the coefficient)."""
        return f"Σ f_{self.act.name}({self._arg_str()})"


class PotentialConjugate(_ActivationTerm):
    """``(c·Σ f_σ)*(y) = c Σ f_σ*(y/c)``: closed-form conjugate of a potential."""

    label = "conjugate potential"
    prox_elementwise = True
    lift_prox = True  # Σ_j g(u_j): 1-D proxes

    def domain_box(self, size: int, env: Env | None = None) -> tuple[Any, Any] | None:
        """``dom (c·Σf_σ)* = c·dom f_σ*`` when the coefficient is > 0 (a point domain, e.g.
        ``f_id* = ι{0}``, stays closed)."""
        if not self.coef(env) > 0:
            return None
        lo, hi = (self.c * v for v in self.act.conjugate_domain)
        return activation_box(lo, hi, size, self.act.smooth_potential)
    base_curvature = "convex"
    smooth = False

    def __init__(self, act: Any, u: Any, c: float = 1.0):
        self.c = float(c)
        super().__init__(act, u)

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_j f_σ*(y_j/c)`` per sample."""
        return self.act.conjugate_potential(us[0] / self.c).sum(dim=-1)

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        # prox_{t·f*(·/c)}(v) = c·prox_{(t/c²) f*}(v/c)
        """``prox_{t f*(·/c)}(v) = c·prox_{(t/c²) f*}(v/c)``."""
        return self.c * self.act.prox_conjugate(v / self.c, t / self.c**2)

    def conjugate(self) -> Term:
        """``(c·Σf_σ*(·/c))* = c·Σf_σ`` (closed convex ``f_σ``)."""
        return Potential(self.act, single_arg(self)) * self.c

    def raw_latex(self) -> str:
        """LaTeX of ``c·Σ f_σ*(y/c)`` (without the coefficient)."""
        return f"\\sum_j f_{{{_sig(self.act)}}}^*\\big({self._arg_latex()}\\big)"

    def raw_str(self) -> str:
        """Plain-text formula ``c·Σ f_σ*(y/c)`` (without the coefficient)."""
        return f"Σ f*_{self.act.name}({self._arg_str()})"


class Antiderivative(_ActivationTerm):
    """``Σ_j σ̃(u_j)``, ``σ̃(a) = ∫_0^a σ``: convex, smooth, ``∇ = Aᵀσ(u)``, Lip ``L_σ||A||²``."""

    label = "activation antiderivative"
    grad_structure = "elementwise"
    base_curvature = "convex"
    smooth = True

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_j σ̃(u_j)``, ``σ̃(a) = ∫_0^a σ`` per sample."""
        return self.act.antiderivative(us[0]).sum(dim=-1)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇σ̃(u) = σ(u)`` elementwise."""
        return [self.act.sigma(us[0])]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``L_σ``: ``σ`` is ``L_σ``-Lipschitz."""
        return [self.act.lipschitz]

    def grad_text(self, latex: bool = False) -> list[str | None]:
        """Printable gradient ``σ(u)`` (for derivations)."""
        u = single_arg(self)
        if latex:
            return [f"{_sig(self.act)}({u.latex()})"]
        return [f"{self.act.name}({u})"]

    def conjugate(self) -> Term:
        """``(c·Σσ̃(u))* = c·Σσ̃*(·/c)`` on a state, or ``ψ*`` of ``s·Σσ̃(Mz + q)``
        (docs/theory.md §2)."""
        if self.scalars or self.scale <= 0 or self.prox_state is None:
            return super().conjugate()  # σ̃∘affine: the rule of terms.conjugate (registered)
        u = single_arg(self) * (1 / self.scale)
        return self.scale * AntiderivativeConjugate(self.act, u)

    def raw_latex(self) -> str:
        """LaTeX of ``Σ σ̃(u)`` (without the coefficient)."""
        return f"\\sum_j \\widetilde{{{_sig(self.act)}}}\\big({self._arg_latex()}\\big)"

    def raw_str(self) -> str:
        """Plain-text formula ``Σ σ̃(u)`` (without the coefficient)."""
        return f"Σ ∫{self.act.name}({self._arg_str()})"


class AntiderivativeConjugate(_ActivationTerm):
    """``Σ_j σ̃*(u_j) = Σ f_σ(u_j) + ½||u||²``: (1/L_σ)-strongly convex, DCP for registry σ."""

    label = "conjugate antiderivative"
    lift_prox = True  # Σ_j σ̃*(u_j): 1-D proxes

    def domain_box(self, size: int, env: Env | None = None) -> tuple[Any, Any] | None:
        """``dom σ̃* = dom f_σ`` when the coefficient is > 0."""
        if not self.coef(env) > 0:
            return None
        return activation_box(*self.act.domain, size, self.act.smooth_potential)
    base_curvature = "convex"
    smooth = False

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_j σ̃*(u_j) = Σ_j f_σ(u_j) + ½||u||²`` per sample (docs/theory.md §1)."""
        return self.act.antiderivative_conjugate(us[0]).sum(dim=-1)

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        # prox_{t(f + ½u²)}(v) = prox_{t/(1+t) f}(v/(1+t))
        """``prox_{t(f_σ + ½u²)}(v) = prox_{(t/(1+t)) f_σ}(v/(1+t))``."""
        return self.act.prox(v / (1.0 + t), t / (1.0 + t))

    def strong_convexity(self) -> StrongConvexity | None:
        """``c·Σσ̃*`` is ``c/L_σ``-strongly convex (``σ̃`` has ``L_σ``-Lipschitz gradient); on
        an argument ``u = Mz + q`` of one state that is ``(c/L_σ)·MᵀM`` in ``z``."""
        if self.coef_sign() < 0 or self.scalars:
            return None
        s = self.prox_state
        if s is not None:
            return StrongConvexity(s, self.scale / self.act.lipschitz)
        states = single_arg(self).states()
        if len(states) != 1:
            return None
        return StrongConvexity(states[0], self.scale / self.act.lipschitz, arg=single_arg(self))

    def conjugate(self) -> Term:
        """``(c·Σσ̃*(u))* = c·Σσ̃(·/c)`` (closed convex ``σ̃``)."""
        if self.prox_state is None or self.scalars:
            return super().conjugate()
        return self.scale * Antiderivative(self.act, single_arg(self) * (1 / self.scale))

    def export(self, ctx: ExportContext) -> None:
        """``c·σ̃* = c·(f_σ + ½u²)``, ``c ≥ 0``: the DCP part of ``f_σ`` plus one quadratic."""
        c = self.coef(ctx.env)
        if c < 0:
            raise NotDCPError("negative multiple of a convex term", term=str(self))
        u = single_arg(self)
        quad, expr, cons = _cvxpy_split(self, ctx.expr(u))
        ctx.add_quadratic(c * (quad + 1.0), u, None, source=f"{self} (quadratic part)")
        ctx.add(c * expr if not _is_zero(expr) else None, cons, source=str(self))

    def raw_latex(self) -> str:
        """LaTeX of ``Σ σ̃*(u)`` (without the coefficient)."""
        return f"\\sum_j \\tilde{{{_sig(self.act)}}}^*\\big({self._arg_latex()}\\big)"

    def raw_str(self) -> str:
        """Plain-text formula ``Σ σ̃*(u)`` (without the coefficient)."""
        return f"Σ (∫{self.act.name})*({self._arg_str()})"


def _cvxpy_split(term: _ActivationTerm, u: Any) -> Any:
    """``term.act.cvxpy_split(u)``; a refusal names the term (not only the activation)."""
    try:
        return term.act.cvxpy_split(u)
    except NotDCPError as err:
        raise NotDCPError(err.reason, term=str(term), hint=err.hint) from err


def _is_zero(e: Any) -> bool:
    return isinstance(e, (int, float)) and e == 0
