"""Moreau envelope → skip connection (docs/theory.md §4):
``prox_{λM_φ^μ}(x) = x + λ/(μ+λ)(prox_{(μ+λ)φ}(x) - x)``; with ``λ = α``, ``μ = 1-α``:
``α prox_φ(x) + (1-α) x``, same fixed points as ``prox_φ``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convex_eq.errors import LoweringError
from convex_eq.objective import Objective
from convex_eq.terms.moreau import MoreauEnvelope

from ..derived import DerivedLayer
from ..nodes import Combo, Prox, Var
from ..trace import Claim, Contraction, Derivation, Step
from .base import LowerContext, Match, Payload
from .common import certificate, claim_from_certificate, envelope_problem, no_prox


@dataclass(frozen=True)
class SkipMatch(Match):
    envelope: MoreauEnvelope


@dataclass(frozen=True)
class SkipPayload(Payload):
    inner: DerivedLayer | None
    alpha: float


def match(obj: Any) -> SkipMatch | None:
    """A single Moreau-envelope term ``λ·M_φ^μ``."""
    if isinstance(obj, Objective) and len(obj.terms) == 1 and isinstance(obj.terms[0],
                                                                         MoreauEnvelope):
        return SkipMatch(obj, obj.terms[0])
    return None


def lower(m: SkipMatch, ctx: LowerContext) -> DerivedLayer:
    env_term, obj = m.envelope, m.objective
    lam = env_term.coef(None)
    mu = env_term.mu_value(None)
    if lam <= 0:
        raise LoweringError("the envelope's coefficient must be positive", term=str(env_term))
    z = env_term.state
    t_sum = mu + lam
    if abs(t_sum - 1.0) <= 1e-12:
        inner = ctx.lower(env_term.inner)
        if len(inner.blocks) != 1:
            raise LoweringError("Moreau skip rule needs a single-block inner layer",
                                term=str(env_term))
        base = inner.nodes[z.name]
        exact = inner.is_prox
    else:
        inner = None
        why = no_prox(env_term.inner, t_sum)
        if why:
            raise LoweringError(f"no prox_{{(μ+λ)φ}} for this inner objective: {why}",
                                term=str(env_term),
                                hint="use μ + λ = 1 (skip rule on a lowerable φ), or φ = one "
                                "prox-able term plus squared-norm and linear terms")
        base = Prox(env_term.inner, Var(z), t_sum)
        exact = True
    a = lam / t_sum
    node = Combo([(a, base), (1.0 - a, Var(z))])
    d = inner.derivation if inner is not None else Derivation()
    d = d.then(Step(
        "Moreau envelope → skip connection",
        f"λ = {lam:g}, μ = {mu:g}: prox_{{λM_φ^μ}}(x) = x + λ/(μ+λ)(prox_{{(μ+λ)φ}}(x) − x)",
        env_term, (z, " ← ", node),
        note="same fixed points as prox_φ (minimizers of M_φ = minimizers of φ)"
        + ("" if exact else "; inner layer is not prox_φ, so the layer is an averaged "
           "version of it (fixed points preserved) but not prox_{λM_φ^μ}"),
    ))
    if inner is not None:
        claim = Claim(inner.claim.kind, f"{inner.claim.statement}; unchanged by the envelope edit "
                      f"(Fix(aT + (1-a)I) = Fix T)", inner.claim.latex,
                      inner.claim.objective_text, inner.claim.conditions)
        base_lip = inner.contraction
        contraction = Contraction(f"{a:g}·({base_lip.formula}) + {1 - a:g}",
                                  f"{a:g}\\,({base_lip.latex}) + {1 - a:g}",
                                  lambda env, b=base_lip, a=a: a * b.value(env) + (1 - a))
        cert = inner.certificate
    else:
        cert = certificate(env_term.inner)
        claim = claim_from_certificate(obj, cert, f"minimizer of {env_term.inner}")
        contraction = _general_contraction(env_term, a, t_sum)
    return DerivedLayer(source=obj, blocks=[z], nodes={z.name: node}, derivation=d, claim=claim,
                        contraction=contraction, is_prox=exact, certificate=cert,
                        payload=SkipPayload(inner, a))


class MoreauSkip:
    """``λM_φ^μ`` ⇒ ``z = λ/(μ+λ)·prox_{(μ+λ)φ}(z) + μ/(μ+λ)·z`` (a skip connection)."""

    name = "moreau-skip"

    def match(self, objective: Any) -> SkipMatch | None:
        return match(objective)

    def lower(self, m: SkipMatch, ctx: LowerContext) -> DerivedLayer:
        return lower(m, ctx)


@dataclass(frozen=True)
class EnvelopeMatch(Match):
    why: str
    term: Any


class EnvelopeGuard:
    """Refuses an objective with an envelope term whose gradient ``(v − prox_{μφ}(v))/μ`` has
    no closed form (other envelopes enter ``T`` through that gradient)."""

    name = "envelope-guard"

    def match(self, objective: Any) -> EnvelopeMatch | None:
        if not isinstance(objective, Objective):
            return None
        for t in objective.terms:
            why = envelope_problem(t)
            if why:
                return EnvelopeMatch(objective, why, t)
        return None

    def lower(self, m: EnvelopeMatch, ctx: LowerContext) -> DerivedLayer:
        raise LoweringError(m.why, term=str(m.term), hint="φ must be one prox-able term plus "
                            "squared-norm and linear terms (with 1 + μ·a > 0)")


RULE = MoreauSkip()
GUARD = EnvelopeGuard()


def _general_contraction(env_term: MoreauEnvelope, a: float, t: float) -> Contraction:
    """``Lip(a·prox_{tφ} + (1−a)I)`` for ``φ = g + (q/2)||·||² + linear`` (``g`` convex):
    ``prox_{tφ}(v) = prox_{t/(1+tq) g}((v − t·lin)/(1 + tq))`` is ``1/(1 + tq)``-Lipschitz, so
    the layer is nonexpansive for ``q ≥ 0`` and ``a/(1 + tq) + 1 − a``-Lipschitz for ``q < 0``
    (a weakly convex φ; ``1 + tq > 0`` is checked by ``no_prox``)."""
    from convex_eq.terms.quadratic import SqNorm

    q = sum(term.coef(None) for term in env_term.inner.terms
            if isinstance(term, SqNorm) and term.prox_state is env_term.state)
    if q >= 0:
        return Contraction("1 (prox of a convex function is nonexpansive)", "1", lambda env: 1.0)
    lip = a / (1.0 + t * q) + (1.0 - a)
    return Contraction(
        f"a/(1 + t·q) + 1 − a with a = {a:g}, t = μ+λ = {t:g}, q = {q:g} (prox of a weakly "
        f"convex φ is 1/(1 + t·q)-Lipschitz)",
        "\\frac{a}{1 + tq} + 1 - a", lambda env, v=lip: v)
