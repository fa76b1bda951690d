"""Generic fallback (docs/theory.md §3): ``G = g + h``, ``g`` prox-able, ``h`` smooth with
``L``-Lipschitz
gradient ⇒ ``z = prox_{τg}(z - τ∇h(z))``, ``τ ∈ (0, 2/L)`` (default ``1/L``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from convex_eq.errors import LoweringError
from convex_eq.objective import Objective
from convex_eq.terms.base import Term

from ..derived import DerivedLayer
from ..nodes import Combo, GradSum, Prox, Var
from ..trace import Contraction, Derivation, Step
from .base import LowerContext, Match, Payload
from .common import certificate, claim_from_certificate, proxable, sum_lip_text


@dataclass(frozen=True)
class FBMatch(Match):
    g: Term
    h: tuple[Term, ...]


@dataclass(frozen=True)
class FBPayload(Payload):
    tau: float


def match(obj: Any) -> FBMatch | None:
    if not isinstance(obj, Objective) or len(obj.states) != 1:
        return None
    nonsmooth = [t for t in obj.terms if not t.smooth]
    smooth = [t for t in obj.terms if t.smooth]
    if not nonsmooth and len(smooth) > 1:
        # all smooth (e.g. a Moreau envelope + ½||z − Ux||²): take one prox-able term as g,
        # preferring one that is not itself an envelope (its prox is the simpler closed form)
        cands = sorted((t for t in smooth if proxable(t)),
                       key=lambda t: type(t).__name__ == "MoreauEnvelope")
        if cands:
            return FBMatch(obj, cands[0], tuple(t for t in smooth if t is not cands[0]))
        return None
    if len(nonsmooth) != 1 or not proxable(nonsmooth[0]) or not smooth:
        return None
    return FBMatch(obj, nonsmooth[0], tuple(smooth))


def lower(m: FBMatch, tau: float | None = None) -> DerivedLayer:
    obj = m.objective
    z = obj.states[0]
    lip = sum(t.grad_lipschitz(None) for t in m.h)
    if not math.isfinite(lip):
        raise LoweringError("smooth part has no finite gradient-Lipschitz bound",
                            term=" + ".join(str(t) for t in m.h))
    if tau is None:
        tau = 1.0 / lip if lip > 0 else 1.0
    if lip > 0 and not 0 < tau < 2.0 / lip:
        raise LoweringError(f"step τ = {tau:g} outside (0, 2/L) with L = {lip:.4g}",
                            term="forward-backward", hint=f"use τ ≤ {1 / lip:.4g}")
    step = Combo([(1.0, Var(z)), (tau, GradSum(list(m.h), z, sign=-1.0))])
    node = Prox(m.g, step, tau)
    d = Derivation().then(Step(
        "forward–backward fallback",
        f"g = {m.g} prox-able; h smooth with L = {sum_lip_text(list(m.h))} = {lip:.4g}; "
        f"τ = {tau:.4g} ∈ (0, 2/L)",
        ("G = ", obj), (z, " ← ", node),
        note="fixed points are exactly the stationary points of G (minimizers if G is convex)",
    ))
    cert = certificate(obj)
    claim = claim_from_certificate(obj, cert, f"minimizer of G = {obj}")
    h_convex = all(t.curvature().kind in ("convex", "affine") and not t.curvature().conditions
                   for t in m.h)
    if h_convex:
        contraction = Contraction("1 (τ ≤ 2/L, h convex: averaged operator)", "1", lambda env: 1.0)
    else:
        contraction = Contraction(f"1 + τL = 1 + {tau:.3g}·({sum_lip_text(list(m.h))})",
                                  "1 + \\tau L",
                                  lambda env, h=m.h, t=tau: 1 + t * sum(x.grad_lipschitz(env)
                                                                        for x in h))
    return DerivedLayer(source=obj, blocks=[z], nodes={z.name: node}, derivation=d, claim=claim,
                        contraction=contraction, certificate=cert, payload=FBPayload(tau))


class ForwardBackward:
    """``g + h``, ``g`` prox-able, ``h`` smooth ⇒ ``z = prox_{τg}(z − τ∇h(z))``."""

    name = "forward-backward"

    def match(self, objective: Any) -> FBMatch | None:
        return match(objective)

    def lower(self, m: FBMatch, ctx: LowerContext) -> DerivedLayer:
        return lower(m, ctx.tau)


RULE = ForwardBackward()
