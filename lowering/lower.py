"""``lower(objective)``: the first rule of the registry that matches the objective derives ``T``."""

from __future__ import annotations

from typing import Any

from convex_eq.composition import DeepComposition
from convex_eq.errors import LoweringError, OptionError
from convex_eq.objective import Objective
from convex_eq.terms.base import Term

from .derived import DerivedLayer
from .rules import RULES, LowerContext, RuleRegistry, register_rule, unregister_rule
from .rules.common import proxable

OPTIONS = {"regularizer", "deep_form", "tau"}

__all__ = ["OPTIONS", "lower", "register_rule", "unregister_rule"]


def lower(objective: Any, *, rules: RuleRegistry | None = None, **options: Any) -> DerivedLayer:
    """Derive the fixed-point layer of ``objective`` with the first matching rule.

    Options: ``regularizer`` ("auto" | "prox" | "gradient": variant of φ + γR edits),
    ``deep_form`` ("composition": ``T`` returns ``z_0`` | "multiblock": ``T`` returns every
    block), ``tau`` (forward–backward step).  ``rules`` defaults to the registry that
    :func:`register_rule` extends."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise OptionError(f"unknown option(s) {sorted(unknown)}", term="lower",
                          hint=f"valid options: {sorted(OPTIONS)}")
    registry = RULES if rules is None else rules
    if isinstance(objective, Term):
        objective = Objective([objective])
    if not isinstance(objective, (Objective, DeepComposition)):
        found = registry.find(objective)  # a user rule may lower other kinds of object
        if found is None:
            raise LoweringError(f"cannot lower a {type(objective).__name__}", term="lower",
                                hint="pass an Objective, a Term or a DeepComposition")
    else:
        found = registry.find(objective)
    if found is None:
        raise LoweringError(_why(objective), term=str(objective), hint=_hint(objective))
    rule, match = found
    return rule.lower(match, LowerContext(options, registry))


def _nonsmooth(obj: Objective) -> list[Term]:
    return [t for t in obj.terms if not t.smooth]


def _why(obj: Objective) -> str:
    nonsmooth = _nonsmooth(obj)
    blocking = [t for t in nonsmooth if not proxable(t)]
    if blocking:
        return ("no lowering rule applies: term(s) " + ", ".join(f"'{t}' ({t.label})"
                                                                 for t in blocking)
                + " are neither smooth nor prox-able here")
    if len(nonsmooth) > 1:
        return ("no lowering rule applies: several non-smooth terms (" +
                ", ".join(f"'{t}'" for t in nonsmooth) + ") and no rule combines their proxes")
    return "no lowering rule applies to this objective"


def _hint(obj: Objective) -> str:
    base = ("write the objective in canonical form Σf_σ(z) + ½||z||² − S(z), as ψ* − ½||·||² "
            "(Theorem 1), a Moreau envelope of a lowerable objective, or one prox-able term plus "
            "smooth terms")
    nonsmooth = [t for t in _nonsmooth(obj) if proxable(t)]
    if len(nonsmooth) > 1:
        extra = nonsmooth[-1]
        return (f"{base}; or smooth one of them: moreau({extra}, μ) (the layer's claim is then "
                f"about that Huber/envelope objective, not this one); an exact ℓ1 term joins a "
                "potential f_σ with σ(0) = 0 or an interval potential in the canonical form")
    return base
