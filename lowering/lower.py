"""``lower(objective)``: find the rule the objective's structure admits and derive ``T``."""

from __future__ import annotations

from typing import Any

from convex_eq.composition import DeepComposition
from convex_eq.errors import LoweringError, OptionError
from convex_eq.objective import Objective
from convex_eq.terms.base import Term

from .derived import DerivedLayer
from .rules import canonical, deep, forward_backward, moreau_skip, precompose, theorem1
from .rules.common import envelope_problem, proxable
from .rules.regularizers import apply_edits

OPTIONS = {"regularizer", "deep_form", "tau"}


def lower(objective: Any, **options: Any) -> DerivedLayer:
    """Derive the fixed-point layer of ``objective``.

    Options: ``regularizer`` ("auto" | "prox" | "gradient": variant of φ + γR edits),
    ``deep_form`` ("composition" | "multiblock"), ``tau`` (forward–backward step)."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise OptionError(f"unknown option(s) {sorted(unknown)}", term="lower",
                          hint=f"valid options: {sorted(OPTIONS)}")
    variant = options.get("regularizer", "auto")

    def inner(obj: Any) -> DerivedLayer:
        return lower(obj, **{k: v for k, v in options.items() if k != "deep_form"})

    if isinstance(objective, Term):
        objective = Objective([objective])
    if isinstance(objective, DeepComposition):
        return deep.lower(objective, inner, options.get("deep_form", "composition"))
    if not isinstance(objective, Objective):
        raise LoweringError(f"cannot lower a {type(objective).__name__}", term="lower",
                            hint="pass an Objective, a Term or a DeepComposition")
    pc = precompose.match(objective)
    if pc is not None:
        return precompose.lower(pc, objective, inner)
    env_term = moreau_skip.match(objective)
    if env_term is not None:
        return moreau_skip.lower(env_term, objective, inner)
    for t in objective.terms:  # other envelopes enter T through ∇M = (v - prox_{μφ}(v))/μ
        why = envelope_problem(t)
        if why:
            raise LoweringError(why, term=str(t), hint="φ must be one prox-able term plus "
                                "squared-norm and linear terms (with 1 + μ·a > 0)")
    m1 = theorem1.match(objective)
    if m1 is not None:
        base = theorem1.lower_base(m1, objective)
        return apply_edits(base, m1.rest, variant)
    mc = canonical.match(objective)
    if mc is not None:
        return canonical.lower(mc, objective)
    mfb = forward_backward.match(objective)
    if mfb is not None:
        return forward_backward.lower(mfb, objective, options.get("tau"))
    raise LoweringError(_why(objective), term=str(objective),
                        hint="write the objective in canonical form Σf_σ(z) + ½||z||² − S(z), as "
                        "ψ* − ½||·||² (Theorem 1), a Moreau envelope of a lowerable objective, or "
                        "one prox-able term plus smooth terms")


def _why(obj: Objective) -> str:
    nonsmooth = [t for t in obj.terms if not t.smooth]
    blocking = [t for t in nonsmooth if not proxable(t)]
    if blocking:
        return ("no lowering rule applies: term(s) " + ", ".join(f"'{t}' ({t.label})"
                                                                 for t in blocking)
                + " are neither smooth nor prox-able here")
    if len(nonsmooth) > 1:
        return ("no lowering rule applies: several non-smooth terms (" +
                ", ".join(f"'{t}'" for t in nonsmooth) + ") and no rule combines their proxes")
    return "no lowering rule applies to this objective"
