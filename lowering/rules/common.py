"""Helpers shared by the lowering rules: claims from certificates, Lipschitz formulas."""

from __future__ import annotations

from typing import Any

from convex_eq.certificate import Certificate, certify
from convex_eq.symbols import Env
from convex_eq.terms.base import Term
from convex_eq.terms.quadratic import SqNorm

from ..trace import Claim, ClaimKind


def claim_from_certificate(obj: Any, cert: Certificate, what: str,
                           kind_if_convex: ClaimKind = ClaimKind.MINIMIZER, latex: str = ""
                           ) -> Claim:
    """"minimizer of G" when certified convex (with its condition), else "stationary point";
    ``latex`` may hold one ``%s`` for the claim kind."""
    if cert.kind == "nonconvex":
        kind = ClaimKind.STATIONARY
        what = (f"{what.replace('minimizer', 'stationary point')} (not convex: {cert.reason})")
    else:
        kind = kind_if_convex
    conds = tuple(c.text for c in cert.conditions) if cert.kind == "conditional" else ()
    return Claim(kind, what, latex.replace("%s", str(kind)), objective_text=str(obj),
                 conditions=conds)


def proxable(t: Term) -> bool:
    """``t`` has a closed-form prox that ``prox_{τ·t}`` can evaluate: ``Term.prox`` needs a
    positive coefficient, so ``-||z||₁`` or ``-½||z||²`` are not prox-able (lowering them as a
    prox step would derive a layer whose ``T`` always raises)."""
    return t.has_prox and t.coef(None) > 0


def no_prox(phi: Any, t: float) -> str:
    """Why ``Objective.prox`` cannot evaluate ``prox_{t·φ}`` ("" if it can): it handles one
    prox-able term (positive coefficient) plus ``a/2||z||²`` with ``1 + t·a > 0`` and linear
    terms.  Checked here so that ``lower`` refuses instead of deriving a ``T`` that raises."""
    from convex_eq.terms.quadratic import Linear

    s = phi.states[0]
    a, g = 0.0, []
    for term in phi.terms:
        if isinstance(term, SqNorm) and term.prox_state is s:
            a += term.coef(None)
        elif not (isinstance(term, Linear) and term.args[1].is_state(s)):
            g.append(term)
    if 1 + t * a <= 0:
        return f"quadratic coefficient {a:g} ≤ -1/t = {-1 / t:g} (t = {t:g})"
    if len(g) > 1 or (g and not proxable(g[0])):
        return ", ".join(f"'{x}'" for x in g) + " is not a single prox-able term"
    return ""


def envelope_problem(t: Term, extra: float = 0.0) -> str:
    """Why the gradient (``extra = 0``: needs ``prox_{μφ}``) or the prox (``extra = λ``: needs
    ``prox_{(μ+λ)φ}``) of a Moreau-envelope term cannot be evaluated ("" if it can, or if ``t``
    is not an envelope)."""
    from convex_eq.terms.moreau import MoreauEnvelope

    if not isinstance(t, MoreauEnvelope):
        return ""
    why = no_prox(t.inner, t.mu_value(None) + extra)
    return f"the Moreau envelope needs prox_{{μφ}} in closed form: {why}" if why else ""


def certificate(obj: Any, env: Env | None = None) -> Certificate:
    return certify(obj, env)


def lip_text(term: Term) -> str:
    """Short formula for ``Lip(∇term)`` (``||W||₂²`` for ``½||Wz||²``)."""
    if isinstance(term, SqNorm):
        a = term.args[0]
        sp = a.state_part
        if sp is not None and len(sp.entries) == 1:
            e = sp.entries[0]
            c = abs(term.scale * e.coef * e.coef)
            pre = "" if c == 1.0 else f"{c:g}·"
            return f"{pre}||{e.op}||₂²" if e.op is not None else (f"{c:g}" if c != 1 else "1")
    if term.smooth and term.grad_lipschitz(None) == 0.0:
        return ""
    return f"Lip∇[{term}]"


def sum_lip_text(terms: list[Term]) -> str:
    parts = [p for p in (lip_text(t) for t in terms) if p]
    return " + ".join(parts) if parts else "0"
