"""Theorem 1 (OptEq): ``φ = ψ* - ½||·||²`` with ``ψ = s Σσ̃(Mz + q)`` ⇒ ``prox_φ = ∇ψ``
(docs/theory.md §2); regularizers on ``z`` are then Theorem-4 edits of that prox layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convex_eq.objective import Objective
from convex_eq.terms.base import Term
from convex_eq.terms.conjugate import SeparableAffineConjugate
from convex_eq.terms.quadratic import SqNorm

from ..derived import DerivedLayer
from ..nodes import GradSum
from ..trace import Claim, ClaimKind, Contraction, Derivation, Step
from .base import LowerContext, Match, Payload
from .common import certificate
from .regularizers import apply_edits


@dataclass(frozen=True)
class TheoremOneMatch(Match):
    conj: SeparableAffineConjugate
    neg_sq: SqNorm
    rest: tuple[Term, ...]


@dataclass(frozen=True)
class TheoremOnePayload(Payload):
    phi: Objective
    psi: Any


def match(obj: Any) -> TheoremOneMatch | None:
    """``ψ*(z) - ½||z||² [+ regularizers on z]`` with ψ* a separable∘affine conjugate."""
    if not isinstance(obj, Objective) or len(obj.states) != 1:
        return None
    z = obj.states[0]
    conj = [t for t in obj.terms if isinstance(t, SeparableAffineConjugate)
            and t.scale == 1.0 and not t.scalars and t.state is z]
    negs = [t for t in obj.terms if isinstance(t, SqNorm) and t.prox_state is z
            and t.scale == -1.0 and not t.scalars]
    if len(conj) != 1 or not negs:
        return None
    rest = tuple(t for t in obj.terms if t is not conj[0] and t is not negs[0])
    return TheoremOneMatch(obj, conj[0], negs[0], rest)


def lower_base(m: TheoremOneMatch) -> DerivedLayer:
    """The OptEq layer ``z = ∇ψ(z) = s Mᵀσ(Mz + q)`` for ``φ = ψ* - ½||·||²``."""
    z = m.conj.state
    psi = m.conj.primal()
    phi = Objective([m.conj, m.neg_sq], name="phi")
    grad = GradSum([psi], z, sign=+1.0)
    act = m.conj.act
    s = m.conj.s
    cert = certificate(phi)
    cond = "; ".join(c.text for c in cert.conditions) or "none"
    d = Derivation().then(Step(
        "Theorem 1 (OptEq): prox of ψ* − ½||·||² is ∇ψ",
        f"ψ = {s:g}·Σσ̃(Mz+q) with σ = {act.name} nondecreasing, {act.lipschitz:g}-Lipschitz; "
        f"φ convex iff μ ≥ L_σ||M||₂² ({cond})",
        ("φ(z) = ", phi), ("prox_φ(z) = ∇ψ(z) = ", grad),
        note="fixed points of z = ∇ψ(z) are exactly the minimizers of φ",
    ))
    claim = Claim(ClaimKind.MINIMIZER, f"z* ∈ argmin φ, φ = {phi}",
                  f"z^\\star \\in \\arg\\min {phi.latex()}",
                  objective_text=str(phi), conditions=tuple(c.text for c in cert.conditions))
    op = m.conj.op
    contraction = Contraction(
        f"s·L_σ·||{op}||₂² (s = 1/μ = {s:g}, L_σ = {act.lipschitz:g})",
        f"\\tfrac1\\mu L_\\sigma \\|{op.latex()}\\|_2^2",
        lambda env, c=m.conj: c.grad_lipschitz_of_primal(env),
    )
    return DerivedLayer(source=phi, blocks=[z], nodes={z.name: grad}, derivation=d, claim=claim,
                        contraction=contraction, is_prox=True, certificate=cert,
                        payload=TheoremOnePayload(phi, psi))


class TheoremOne:
    """``ψ* − ½||·||²`` (+ regularizer edits) ⇒ ``z = ∇ψ(z)`` (edited by Theorem 4)."""

    name = "theorem1"

    def match(self, objective: Any) -> TheoremOneMatch | None:
        return match(objective)

    def lower(self, m: TheoremOneMatch, ctx: LowerContext) -> DerivedLayer:
        return apply_edits(lower_base(m), list(m.rest), ctx.regularizer)


RULE = TheoremOne()
