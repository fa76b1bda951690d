"""``lower(objective)``: the first rule of the registry that matches the objective derives ``T``."""

from __future__ import annotations

from typing import Any

from .derived import EDITS, DerivedLayer
from .rules import RULES, RuleRegistry, register_rule, unregister_rule
from .rules.base import OPTIONS

__all__ = ["OPTIONS", "derive_again", "lower", "register_rule", "unregister_rule"]


def lower(objective: Any, *, rules: RuleRegistry | None = None, **options: Any) -> DerivedLayer:
    """Derive the fixed-point layer of ``objective`` with the first matching rule.

    Options: ``regularizer`` ("auto" | "prox" | "gradient": variant of φ + γR edits),
    ``deep_form`` ("composition": ``T`` returns ``z_0`` | "multiblock": ``T`` returns every
    block; a DeepComposition only), ``tau`` (forward–backward step, a number > 0; the
    forward–backward rule only).  Other values and options that do not apply raise
    ``OptionError`` (docs/guide.md §2).  ``rules`` defaults to the registry that
    :func:`register_rule` extends."""
    derived = (RULES if rules is None else rules).lower(objective, **options)
    if options and not derived.lower_options:
        derived.lower_options = dict(options)
    return derived


def derive_again(derived: DerivedLayer) -> DerivedLayer:
    """``derived`` derived afresh from its objective: ``lower`` with the options it was lowered
    with, then the edits it records, in order (e.g. after unpickling its objective)."""
    out = lower(derived.source, **(derived.lower_options or {}))
    for name, options in derived.edits:
        out = EDITS[name](out, **options)
    return out
