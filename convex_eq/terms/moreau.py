"""Moreau envelope ``M_f^μ(v) = min_u f(u) + ||u - v||²/(2μ)`` of a term or an objective."""

from __future__ import annotations

import itertools
import math
from typing import Any

from .._lazy import torch
from ..errors import ScaleError, ShapeError
from ..export import ExportContext
from ..symbols import Env, Scalar, State, Symbol, scalar_coef, scalar_value
from .base import Curvature, Term

_ids = itertools.count()


class MoreauEnvelope(Term):
    """``M_f^μ``: smooth with ``∇ = (v - prox_{μf}(v))/μ`` (Lipschitz ``1/μ``), convex if ``f`` is;
    ``prox_{λM_f^μ}(x) = x + λ/(μ+λ)(prox_{(μ+λ)f}(x) - x)``."""

    label = "Moreau envelope"
    lift_role = "envelope"  # lifted with an auxiliary copy u of its state: f(u) + ||u − v||²/(2μ)
    smooth = True

    def __init__(self, inner: Any, mu: float | Scalar = 1.0):
        from ..objective import Objective

        self.inner = inner if isinstance(inner, Objective) else Objective([inner])
        self.mu = mu
        states = self.inner.states
        if len(states) != 1:
            raise ShapeError(
                f"Moreau envelope of a function of {len(states)} state blocks",
                term=f"M[{self.inner}]", hint="take the envelope of each block's function",
            )
        if not scalar_value(mu) > 0 or not math.isfinite(scalar_value(mu)):
            raise ScaleError(f"μ = {scalar_value(mu)} must be finite and > 0",
                             term=f"M[{self.inner}]")
        super().__init__(states[0])

    @property
    def state(self) -> Symbol:
        """The state the envelope smooths (the inner objective's state)."""
        return self.inner.states[0]

    def mu_value(self, env: Env | None = None) -> float:
        """The smoothing parameter ``μ > 0`` at the current values (a ``ScaleError`` otherwise)."""
        mu = scalar_value(self.mu, env)
        if not mu > 0 or not math.isfinite(mu):
            raise ScaleError(f"μ = {mu} must be finite and > 0", term=str(self))
        return mu

    def mu_t(self, env: Env | None = None) -> Any:
        """``μ`` for evaluation: checked like :meth:`mu_value`, a tensor carrying the gradient
        when ``μ`` is a learnable scalar (``Scalar.coef_value``)."""
        self.mu_value(env)
        return scalar_coef(self.mu, env)

    @property
    def batch_coupled(self) -> bool:  # type: ignore[override]
        """Coupled across the batch when a term of the inner objective is (e.g. a batch
        decorrelation inside the envelope)."""
        return any(getattr(t, "batch_coupled", False) for t in self.inner.terms)

    def symbols(self) -> list[Symbol]:
        """The inner objective's symbols and ``μ`` when it is a ``Scalar``."""
        out = list(self.inner.symbols)
        if isinstance(self.mu, Scalar) and all(self.mu is not s for s in out):
            out.append(self.mu)
        return out

    # ---------------------------------------------------------------- numerics
    def inner_prox(self, v: torch.Tensor, t: float, values: dict, env: Env | None
                   ) -> torch.Tensor:
        """``prox_{t f}(v)`` of the inner objective ``f`` (which may read the inputs ``values``)."""
        return self.inner.prox(v, t, values, env)

    def value(self, values: dict, env: Env | None = None) -> torch.Tensor:  # type: ignore[override]
        """``coef·M_f^μ(v) = coef·(f(p) + ||p − v||²/(2μ))`` with ``p = prox_{μf}(v)``."""
        mu = self.mu_t(env)
        v = values[self.state.name]
        p = self.inner_prox(v, mu, values, env)
        vals = {**values, self.state.name: p}
        fv = self.inner.value_tensor(vals, env)
        return self.coef_t(env) * (fv + ((p - v) ** 2).sum(-1) / (2 * mu))

    def grad(self, values: dict, env: Env | None = None) -> dict[str, torch.Tensor]:
        """``∇(coef·M_f^μ)(v) = coef·(v − prox_{μf}(v))/μ``."""
        mu = self.mu_t(env)
        v = values[self.state.name]
        p = self.inner_prox(v, mu, values, env)
        return {self.state.name: self.coef_t(env) * (v - p) / mu}

    def grad_lipschitz(self, env: Env | None = None) -> float:
        """``1/μ`` for a convex ``φ``; for ``φ = g + (a/2)||·||²`` with ``g`` convex and ``a < 0``
        (weakly convex, ``1 + μa > 0``) the Jacobian of ``prox_{μφ}`` has eigenvalues in
        ``[0, 1/(1 + μa)]``, so ``Lip(∇M) = max(1/μ, -a/(1 + μa))``."""
        from .quadratic import SqNorm

        mu = self.mu_value(env)
        a = sum(t.coef(env) for t in self.inner.terms
                if isinstance(t, SqNorm) and t.prox_state is self.state)
        lip = 1.0 / mu
        if a < 0:
            lip = max(lip, -a / (1.0 + mu * a)) if 1.0 + mu * a > 0 else math.inf
        return abs(self.coef(env)) * lip

    @property
    def has_prox(self) -> bool:
        """``True``: ``prox_{λM_f^μ}(x) = x + λ/(μ+λ)·(prox_{(μ+λ)f}(x) − x)`` (docs/theory.md §4
        row 1)."""
        return True

    def prox(self, v: torch.Tensor, t: float = 1.0, env: Env | None = None,
             values: dict | None = None) -> torch.Tensor:
        """``prox_{λ M_f^μ}(x) = x + λ/(μ+λ)(prox_{(μ+λ)f}(x) - x)``, ``λ = t·coef``."""
        if not t * self.coef(env) > 0:
            raise ScaleError("prox needs a positive coefficient", term=str(self))
        lam = t * self.coef_t(env)
        mu = self.mu_t(env)
        return v + lam / (mu + lam) * (self.inner_prox(v, mu + lam, values or {}, env) - v)

    # ---------------------------------------------------------------- structure
    def raw_curvature(self) -> Curvature:
        """Convex with the inner objective's conditions when ``f`` is convex, else unknown."""
        cert = self.inner.certificate_structure()
        if cert.kind == "convex":
            return Curvature("convex", list(cert.conditions),
                             "Moreau envelope of a convex function")
        return Curvature("unknown", [], f"envelope of a non-convex function ({cert.reason})")

    # ---------------------------------------------------------------- export
    def declare(self, ctx: ExportContext) -> None:
        """Auxiliary ``u`` (the inner minimizer); the inner terms are declared on ``u``."""
        self._aux = State(f"{self.state.name}_env{next(_ids)}", self.state.shape)
        ctx.add_state(self._aux)
        with ctx.aliased({self.state.name: self._aux.name}):
            for t in self.inner.terms:
                if hasattr(t, "declare"):
                    t.declare(ctx)

    def export(self, ctx: ExportContext) -> None:
        """``c·[f(u) + ||u - v||²/(2μ)]``, jointly convex in (u, v) when f is convex."""
        from .quadratic import SqNorm

        c = self.coef(ctx.env)
        mu = self.mu_value(ctx.env)
        with ctx.aliased({self.state.name: self._aux.name}):
            for t in self.inner.terms:
                scaled = t * c
                for qp in scaled.quad_parts(ctx.env):
                    ctx.add_quadratic(qp.coef, qp.u1, qp.u2, qp.source)
                scaled.export(ctx)
        diff = self._aux - self.state
        ctx.add_quadratic(c / mu, diff, None, source=f"{self} (coupling ||u - v||²/2μ)")
        _ = SqNorm  # the coupling is a squared norm collected into the PSD form

    # ---------------------------------------------------------------- printing
    def _mu_str(self) -> str:
        return self.mu.name if isinstance(self.mu, Scalar) else f"{self.mu:g}"

    def raw_latex(self) -> str:
        """LaTeX of ``M_f^μ`` (without the coefficient)."""
        mu = self.mu.latex() if isinstance(self.mu, Scalar) else f"{self.mu:g}"
        return f"M^{{{mu}}}_{{{self.inner.latex()}}}({self.state.latex()})"

    def raw_str(self) -> str:
        """Plain-text formula ``M_f^μ`` (without the coefficient)."""
        return f"M^{self._mu_str()}[{self.inner}]({self.state.name})"


def moreau(inner: Any, mu: float | Scalar = 1.0) -> MoreauEnvelope:
    """``M_f^μ`` of a term or objective."""
    return MoreauEnvelope(inner, mu)


_ = math
