"""The closed form of Theorem 1's objective for invertible ``W`` (TPAMI Eq. 4, Table 1 row 4):

``φ(z) = Σσ̃*(Mz) − <q, Mz> − ½||z||²`` with ``M`` square invertible is ``ψ* − ½||·||²`` for
``ψ(v) = Σσ̃(Wv + q)``, ``W = M⁻ᵀ``: substituting ``y = Wv + q`` in
``ψ*(z) = sup_v <z, v> − Σσ̃(Wv + q)`` gives ``<Mz, y − q>``, so ``ψ*(z) = Σσ̃*(Mz) − <q, Mz>``.
Hence (Theorem 1) ``prox_φ(z) = ∇ψ(z) = Wᵀσ(Wz + q) = M⁻¹σ(M⁻ᵀz + q)``; ``φ`` is convex iff
``M ᵀM/L_σ ⪰ I`` i.e. ``||W||₂² L_σ ≤ 1`` (the certificate's ``λ_min(Q) ≥ 0``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from convex_eq.certificate import certify
from convex_eq.objective import Objective
from convex_eq.operators import Adjoint, Inverse
from convex_eq.terms.base import Term
from convex_eq.terms.conjugate import SeparableAffineConjugate
from convex_eq.terms.potential import AntiderivativeConjugate
from convex_eq.terms.quadratic import Linear, SqNorm

from ..derived import DerivedLayer
from ..trace import Claim, ClaimKind, Derivation, Step
from .base import LowerContext, Match
from .regularizers import apply_edits
from .theorem1 import TheoremOneMatch, lower_base


@dataclass(frozen=True)
class ClosedFormMatch(Match):
    conj: AntiderivativeConjugate
    lin: Linear | None
    neg_sq: SqNorm
    op: Any
    rest: tuple[Term, ...]


def _op_on(u: Any, z: Any) -> Any:
    """``M`` if ``u = Mz`` exactly (one entry, coefficient 1, no offset), else None."""
    sp = u.state_part
    if u.offset_part is not None or sp is None or len(sp.entries) != 1:
        return None
    e = sp.entries[0]
    return e.op if e.symbol is z and e.coef == 1.0 and e.op is not None else None


def _same_op(a: Any, b: Any) -> bool:
    """The same linear map: one object, or the same kind on the very same weight symbols."""
    if a is None or b is None:
        return False
    return a is b or (type(a) is type(b) and str(a) == str(b) and len(a.symbols()) > 0
                      and all(x is y for x, y in zip(a.symbols(), b.symbols(), strict=True)))


def match(obj: Any) -> ClosedFormMatch | None:
    if not isinstance(obj, Objective) or len(obj.states) != 1:
        return None
    z = obj.states[0]
    conj = [t for t in obj.terms if isinstance(t, AntiderivativeConjugate) and t.scale == 1.0
            and not t.scalars and _op_on(t.args[0], z) is not None]
    negs = [t for t in obj.terms if isinstance(t, SqNorm) and t.prox_state is z
            and t.scale == -1.0 and not t.scalars]
    if len(conj) != 1 or not negs:
        return None
    op = _op_on(conj[0].args[0], z)
    if op.in_size != op.out_size:
        return None
    lins = [t for t in obj.terms if isinstance(t, Linear) and t.scale == -1.0 and not t.scalars
            and _same_op(_op_on(t.args[1], z), op)]
    lin = lins[0] if lins else None
    used = (conj[0], negs[0], *([lin] if lin is not None else []))
    rest = tuple(t for t in obj.terms if all(t is not u for u in used))
    return ClosedFormMatch(obj, conj[0], lin, negs[0], op, rest)


def lower(m: ClosedFormMatch) -> DerivedLayer:
    z = m.neg_sq.prox_state
    w_op = Adjoint(Inverse(m.op))  # W = M⁻ᵀ
    q = m.lin.args[0] if m.lin is not None else None
    conj = SeparableAffineConjugate(m.conj.act, w_op, q, 1.0, z)
    closed = Objective([t for t in (m.conj, m.lin, m.neg_sq) if t is not None], name="phi")
    base = lower_base(TheoremOneMatch(closed, conj, m.neg_sq, ()))
    step = Step(
        "closed form of ψ* for invertible W (TPAMI Eq. 4)",
        f"M = {m.op} square; ψ(v) = Σσ̃(Wv + q) with W = M⁻ᵀ has "
        "ψ*(z) = Σσ̃*(Mz) − <q, Mz> (substitute y = Wv + q)",
        ("φ(z) = ", closed), ("φ(z) = ψ*(z) − ½||z||², W = ", w_op),
        note="M must be invertible: the layer solves with M (a singular M makes T fail)")
    cert = certify(closed)
    claim = Claim(ClaimKind.MINIMIZER, f"z* ∈ argmin φ, φ = {closed}",
                  f"z^\\star \\in \\arg\\min {closed.latex()}", objective_text=str(closed),
                  conditions=tuple(c.text for c in cert.conditions))
    return dataclasses.replace(base, source=closed, certificate=cert, claim=claim,
                               derivation=Derivation((step, *base.derivation.steps)))


class ClosedFormConjugate:
    """``Σσ̃*(Mz) − <q, Mz> − ½||z||²`` (+ edits) ⇒ ``z = M⁻¹σ(M⁻ᵀz + q)``."""

    name = "closed-form-conjugate"

    def match(self, objective: Any) -> ClosedFormMatch | None:
        return match(objective)

    def lower(self, m: ClosedFormMatch, ctx: LowerContext) -> DerivedLayer:
        return apply_edits(lower(m), list(m.rest), ctx.regularizer)


RULE = ClosedFormConjugate()
