"""Theorem 1 (OptEq): ``φ = ψ* - ½||·||²`` with ``ψ = s Σσ̃(Mz + q)`` ⇒ ``prox_φ = ∇ψ``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convex_eq.objective import Objective
from convex_eq.terms.base import Term
from convex_eq.terms.conjugate import SeparableAffineConjugate
from convex_eq.terms.quadratic import SqNorm

from ..derived import DerivedLayer
from ..nodes import GradSum, Var
from ..trace import Claim, Contraction, Derivation, Step
from .common import certificate


@dataclass
class TheoremOneMatch:
    conj: SeparableAffineConjugate
    neg_sq: SqNorm
    rest: list[Term]


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
    rest = [t for t in obj.terms if t is not conj[0] and t is not negs[0]]
    return TheoremOneMatch(conj[0], negs[0], rest)


def lower_base(m: TheoremOneMatch, obj: Objective) -> DerivedLayer:
    """The OptEq layer ``z = ∇ψ(z) = s Mᵀσ(Mz + q)`` for ``φ = ψ* - ½||·||²``."""
    z = m.conj.state
    psi = m.conj.primal()
    phi = Objective([m.conj, m.neg_sq], name="phi")
    grad = GradSum([psi], z, sign=+1.0)
    node = grad
    act = m.conj.act
    s = m.conj.s
    cert = certificate(phi)
    cond = "; ".join(c.text for c in cert.conditions) or "none"
    d = Derivation()
    d.add(Step(
        "Theorem 1 (OptEq): prox of ψ* − ½||·||² is ∇ψ",
        f"ψ = {s:g}·Σσ̃(Mz+q) with σ = {act.name} nondecreasing, {act.lipschitz:g}-Lipschitz; "
        f"φ convex iff μ ≥ L_σ||M||₂² ({cond})",
        f"φ(z) = {phi}", f"prox_φ(z) = ∇ψ(z) = {grad.text()}",
        phi.latex(), f"\\mathrm{{prox}}_\\varphi(z) = \\nabla\\psi(z) = {grad.latex()}",
        note="fixed points of z = ∇ψ(z) are exactly the minimizers of φ",
    ))
    claim = Claim("minimizer", f"z* ∈ argmin φ, φ = {phi}",
                  f"z^\\star \\in \\arg\\min {phi.latex()}",
                  objective_text=str(phi), conditions=[c.text for c in cert.conditions])
    op = m.conj.op
    contraction = Contraction(
        f"s·L_σ·||{op}||₂² (s = 1/μ = {s:g}, L_σ = {act.lipschitz:g})",
        f"\\tfrac1\\mu L_\\sigma \\|{op.latex()}\\|_2^2",
        lambda env, c=m.conj: c.grad_lipschitz_of_primal(env),
    )
    return DerivedLayer(source=phi, blocks=[z], nodes={z.name: node}, derivation=d, claim=claim,
                        contraction=contraction, is_prox=True, certificate=cert,
                        info={"phi": phi, "psi": psi, "Var": Var(z)})
