"""Canonical stationarity form (docs/theory.md §3): ``G = Σ_b 1ᵀf_{σ_b}(z_b) + ½||z||² - S(z)``
⇒ ``0 ∈ ∂f_σ(z) + z - ∇S(z)`` ⇔ ``z_b = σ_b(∇_b S(z))`` (forward–backward with unit step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from convex_eq.objective import Objective
from convex_eq.terms.base import Term
from convex_eq.terms.potential import Potential
from convex_eq.terms.potential import act_latex as _sig
from convex_eq.terms.quadratic import SqNorm

from ..derived import DerivedLayer
from ..nodes import GradSum, Prox, Sigma, Var
from ..trace import Claim, Contraction, Derivation, Step
from .common import certificate, claim_from_certificate, proxable, sum_lip_text


@dataclass
class CanonicalMatch:
    potentials: dict[str, Potential]
    unit_sq: dict[str, SqNorm]
    rest: list[Term]
    extra_prox: dict[str, Term] = field(default_factory=dict)


def _interval_potential(p: Potential) -> bool:
    """f_σ is the indicator of an interval (or 0): σ is the projection onto it."""
    return p.act.name in ("relu", "hardtanh", "clamp", "identity")


def _separable_prox(t: Term) -> bool:
    return bool(getattr(t, "separable", False)) and proxable(t) and t.prox_state is not None


def _differentiable(t: Term) -> bool:
    return t.smooth or getattr(t, "almost_everywhere_grad", False)


def match(obj: Any) -> CanonicalMatch | None:
    """Every block has one potential ``Σf_σ(z_b)`` and one ``½||z_b||²``; the rest is -S."""
    if not isinstance(obj, Objective):
        return None
    pots: dict[str, Potential] = {}
    sqs: dict[str, SqNorm] = {}
    rest: list[Term] = []
    for t in obj.terms:
        s = t.prox_state
        if isinstance(t, Potential) and s is not None and t.scale == 1.0 and not t.scalars \
                and s.name not in pots:
            pots[s.name] = t
        elif isinstance(t, SqNorm) and s is not None and t.scale == 1.0 and not t.scalars \
                and s.name not in sqs:
            sqs[s.name] = t
        else:
            rest.append(t)
    names = [b.name for b in obj.states]
    if set(pots) != set(names) or set(sqs) != set(names):
        return None
    extra: dict[str, Term] = {}
    smooth_rest = []
    for t in rest:
        s = t.prox_state
        if not _differentiable(t) and s is not None and _separable_prox(t) \
                and _interval_potential(pots[s.name]) and s.name not in extra:
            extra[s.name] = t
        else:
            smooth_rest.append(t)
    if not all(_differentiable(t) for t in smooth_rest):
        return None
    return CanonicalMatch(pots, sqs, smooth_rest, extra)


def lower(m: CanonicalMatch, obj: Objective) -> DerivedLayer:
    blocks = obj.states
    nodes = {}
    d = Derivation()
    s_obj = Objective([-t for t in m.rest], name="S") if m.rest else None
    s_text = str(s_obj) if s_obj is not None else "0"
    acts = ", ".join(f"σ_{b.name} = {m.potentials[b.name].act.name}" for b in blocks)
    d.add(Step(
        "canonical form G = Σ f_σ(z) + ½||z||² − S(z)",
        f"{acts} nondecreasing and 1-Lipschitz (f_σ convex, prox_{{f_σ}} = σ); "
        "S differentiable (gradient rules of its terms)",
        f"G = {obj}", f"S(z) = {s_text}", obj.latex(),
        f"S(z) = {s_obj.latex() if s_obj is not None else '0'}",
    ))
    for b in blocks:
        grad = GradSum(m.rest, b, sign=-1.0)
        act = m.potentials[b.name].act
        g = m.extra_prox.get(b.name)
        nodes[b.name] = Sigma(act, grad if g is None else Prox(g, grad))
        if g is not None:
            d.add(Step(
                "separable prox with an interval potential",
                f"f_σ is the indicator of an interval ({act.name}) and {g} is separable with a "
                "closed-form prox: in 1-D, prox_{ι_I + g} = proj_I ∘ prox_g",
                f"prox_{{f_{act.name} + {g}}}(v)", f"{act.name}({Prox(g, Var(b)).text()})",
                f"\\mathrm{{prox}}_{{f + {g.latex()}}}(v)",
                f"{_sig(act)}\\big({Prox(g, Var(b)).latex()}\\big)",
                note=f"exact: fixed points are stationary points of G including {g} "
                     "(no envelope)",
            ))
        d.add(Step(
            "stationarity ⇔ fixed point (forward–backward, unit step)",
            "0 ∈ ∂f_σ(z) + z − ∇S(z) ⇔ z = prox_{f_σ}(∇S(z)) = σ(∇S(z))",
            f"0 ∈ ∂f_{act.name}({b.name}) + {b.name} − ∇_{b.name}S(z)",
            f"{b.name} = {nodes[b.name].text()}",
            f"0 \\in \\partial f_{{{_sig(act)}}}({b.latex()}) + {b.latex()} - "
            f"\\nabla_{{{b.latex()}}} S(z)",
            f"{b.latex()} = {nodes[b.name].latex()}",
            note="∇S assembled from the terms' own gradient rules",
        ))
    cert = certificate(obj)
    nonsmooth = [t for t in m.rest if not t.smooth]
    claim = claim_from_certificate(obj, cert, f"minimizer of G = {obj}")
    if nonsmooth and claim.kind != "minimizer":
        claim = Claim("stationary point",
                      f"stationary point of G = {obj} (a.e. gradient of "
                      f"{', '.join(t.label for t in nonsmooth)}; not convex: {cert.reason})",
                      objective_text=str(obj))
    claim.latex = f"\\text{{{claim.kind} of }} {obj.latex()}"
    l_sig = max(m.potentials[b.name].act.lipschitz for b in blocks)
    contraction = Contraction(
        f"L_σ·Lip(∇S) = {l_sig:g}·({sum_lip_text(m.rest)})",
        "L_\\sigma \\cdot \\mathrm{Lip}(\\nabla S)",
        lambda env, r=m.rest, ls=l_sig: ls * sum(t.grad_lipschitz(env) for t in r),
    )
    return DerivedLayer(source=obj, blocks=list(blocks), nodes=nodes, derivation=d, claim=claim,
                        contraction=contraction, is_prox=False, certificate=cert,
                        info={"S_terms": m.rest, "potentials": m.potentials})
