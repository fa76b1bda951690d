"""Regularizer edits of a prox layer (docs/theory.md §4, Theorem 4 of the TPAMI paper).

* gradient variant, ``R`` smooth: ``T(z) = prox_φ(z - γ∇R(z))``; fixed points = stationary points
  of ``φ + γR`` (minimizers when it is convex) — exact.
* prox variant, ``R`` with a prox: ``T(z) = prox_φ(prox_{γR}(z))``; fixed points = minimizers of
  ``φ + M^1_{γR}`` — NOT of ``φ + γR``.
* both: ``T(z) = prox_φ(prox_{γR}(z) − γ'∇R'(z))`` (not nested): stationary points of
  ``φ + γ'R' + M^1_{γR}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convex_eq.errors import LoweringError, OptionError
from convex_eq.objective import Objective
from convex_eq.terms.base import Term
from convex_eq.terms.moreau import MoreauEnvelope

from ..derived import DerivedLayer
from ..nodes import Combo, GradSum, Prox, Substitute, Var
from ..trace import Claim, ClaimKind, Contraction, Step
from .base import REGULARIZER_VARIANTS, Payload
from .common import certificate, envelope_problem, proxable

VARIANTS = REGULARIZER_VARIANTS


@dataclass(frozen=True)
class EditPayload(Payload):
    """A regularizer-edited prox layer: the unedited ``base`` and the variant used."""

    base: DerivedLayer
    variant: str

    def as_dict(self) -> dict[str, Any]:
        return {**self.base.info, "base": self.base, "variant": self.variant}


def _is_regularizer_on(t: Term, z: object) -> bool:
    return [s.name for s in t.states()] == [z.name]  # type: ignore[attr-defined]


def apply_edits(base: DerivedLayer, regs: list[Term], variant: str) -> DerivedLayer:
    """Apply ``φ → φ + γR`` edits to a prox layer ``base`` (``T_φ = prox_φ``); ``base`` is
    left unchanged (the edited layer gets a new derivation)."""
    if variant not in VARIANTS:
        raise OptionError(f"unknown regularizer variant {variant!r}", term="lower",
                          hint=f"use one of {VARIANTS}")
    if not regs:
        return base
    z = base.blocks[0]
    for r in regs:
        if not _is_regularizer_on(r, z):
            raise LoweringError("regularizer must act on the layer state only", term=str(r))
    prox_regs, grad_regs = _split_edits(regs, variant)
    phi = base.source
    d = base.derivation
    inner: Any = Var(z)
    modified_text, modified_latex = str(phi), phi.latex()
    new_obj = phi
    if grad_regs:
        inner = Combo([(1.0, Var(z)), (1.0, GradSum(grad_regs, z, sign=-1.0))])
        new_obj = Objective([*phi.terms, *grad_regs], name="phi+R")
        d = d.then(Step(
            "regularizer edit, gradient variant (Theorem 4)",
            f"{' + '.join(str(r) for r in grad_regs)} differentiable (gradient rule of the term)",
            ("φ → φ + ", *_joined(grad_regs)), ("z ← prox_φ(", inner, ")"),
            note="fixed points are exactly the stationary points of φ + γR",
        ))
        modified_text, modified_latex = str(new_obj), new_obj.latex()
    if prox_regs:
        inner, step = _prox_edit(prox_regs[0], grad_regs, inner, z)
        d = d.then(step)
        new_obj = Objective([*new_obj.terms, MoreauEnvelope(prox_regs[0], 1.0)], name="phi+M[R]")
        modified_text, modified_latex = str(new_obj), new_obj.latex()
    cert = certificate(new_obj)
    lip_base = base.contraction
    contraction = Contraction(
        f"({lip_base.formula})·(1 + Lip∇γR)" if grad_regs else lip_base.formula,
        lip_base.latex,
        (lambda env, b=lip_base, g=grad_regs: b.value(env) *
         (1.0 + sum(r.grad_lipschitz(env) for r in g))),
    )
    return DerivedLayer(source=new_obj, blocks=[z],
                        nodes={z.name: Substitute(base.nodes[z.name], z, inner)}, derivation=d,
                        claim=_edited_claim(cert, bool(prox_regs), modified_text,
                                            modified_latex),
                        contraction=contraction, is_prox=False, certificate=cert,
                        regularizers=regs,
                        payload=EditPayload(base, "prox" if prox_regs else "gradient"))


def _split_edits(regs: list[Term], variant: str) -> tuple[list[Term], list[Term]]:
    """``(prox edits, gradient edits)`` by the variant asked for and what each term allows."""
    prox_regs, grad_regs = [], []
    for r in regs:
        env_why = envelope_problem(r, r.coef(None)) if proxable(r) else ""
        use_prox = proxable(r) and not env_why and variant in ("auto", "prox")
        if variant == "prox" and not use_prox:
            raise LoweringError(
                "prox variant requested but the term has no closed-form prox (or a non-positive "
                f"coefficient){': ' + env_why if env_why else ''}", term=str(r),
                hint="use regularizer='gradient' (needs a smooth term) or a term with a prox",
            )
        if use_prox:
            prox_regs.append(r)
        elif r.smooth or getattr(r, "almost_everywhere_grad", False):
            grad_regs.append(r)
        else:
            raise LoweringError(
                f"{r.label} term is neither smooth nor prox-able on the state", term=str(r),
                hint="use a term with a closed-form prox or a smooth surrogate (Moreau envelope)",
            )
    if len(prox_regs) > 1:
        raise LoweringError(
            "at most one prox-variant regularizer edit can keep an exact claim",
            term=", ".join(str(r) for r in prox_regs),
            hint="pass regularizer='gradient' to lower() (the smooth ones then enter as "
                 "gradient steps), or keep one prox-able regularizer",
        )
    return prox_regs, grad_regs


def _prox_edit(r: Term, grad_regs: list[Term], inner: Any, z: Any) -> tuple[Any, Step]:
    """The prox-variant edit ``z ← prox_φ(prox_R(·))`` (with the gradient edits beside it) and
    its derivation step."""
    if grad_regs:
        # not prox_R(z − ∇R_g(z)): that has fixed points 0 ∈ ∂φ(z) + ∇R_g(z) +
        # ∇M¹_R(z − ∇R_g(z)), the envelope's gradient at the wrong point.  With
        # prox_R(z) − ∇R_g(z) = z − ∇M¹_R(z) − ∇R_g(z) both are evaluated at z.
        inner = Combo([(1.0, Prox(r, Var(z))), (1.0, GradSum(grad_regs, z, sign=-1.0))])
        note = (f"with the gradient edits: prox and gradients both at z, so fixed points "
                f"are stationary points of φ + {' + '.join(str(g) for g in grad_regs)} + "
                f"M^1[{r}] (its Moreau envelope), NOT of φ + … + {r}")
    else:
        inner = Prox(r, inner)
        note = (f"fixed points are minimizers of φ + M^1[{r}] (its Moreau envelope), "
                f"NOT of φ + {r}")
    return inner, Step("regularizer edit, prox variant (Theorem 4)", f"{r} has a closed-form prox",
                       ("φ → φ + ", r), ("z ← prox_φ(", inner, ")"), note=note)


def _edited_claim(cert: Any, prox: bool, text: str, latex: str) -> Claim:
    """What an equilibrium of the edited layer is: a (modified) minimizer when the edited
    objective is certified convex, a stationary point otherwise."""
    convex = cert.kind != "nonconvex"
    if not convex:
        kind = ClaimKind.STATIONARY
    else:
        kind = ClaimKind.MODIFIED_MINIMIZER if prox else ClaimKind.MINIMIZER
    what = f"{'minimizer' if convex else 'stationary point'} of {text}"
    if not convex:
        what += f" (not convex: {cert.reason})"
    return Claim(kind, what, f"\\text{{{kind} of }} {latex}", objective_text=text,
                 conditions=tuple(c.text for c in cert.conditions))


def _joined(terms: list[Term]) -> tuple[Any, ...]:
    """``t1 + t2 + …`` as formula parts."""
    out: list[Any] = []
    for i, t in enumerate(terms):
        out += [" + ", t] if i else [t]
    return tuple(out)
