"""The built-in lowering rules, in the order ``lower`` tries them (first match wins).

Add a rule of your own with :func:`register_rule` (see :class:`~lowering.rules.base.Rule`)."""

from __future__ import annotations

from .base import LowerContext, Match, Payload, Rule, RuleRegistry
from .canonical import RULE as CANONICAL
from .closed_form import RULE as CLOSED_FORM
from .deep import RULE as DEEP
from .forward_backward import RULE as FORWARD_BACKWARD
from .moreau_skip import GUARD as ENVELOPE_GUARD
from .moreau_skip import RULE as MOREAU_SKIP
from .multibranch import RULE as MULTIBRANCH
from .precompose import RULE as PRECOMPOSE
from .splitting import RULES as SPLITTING
from .theorem1 import RULE as THEOREM1

#: the registry ``lower`` uses: deep compositions, precompositions and single envelopes first
#: (they lower an inner objective), then the closed forms, then the generic fallback
RULES = RuleRegistry((DEEP, PRECOMPOSE, MOREAU_SKIP, ENVELOPE_GUARD, THEOREM1, CLOSED_FORM,
                      MULTIBRANCH, CANONICAL, FORWARD_BACKWARD, *SPLITTING))


def register_rule(rule: Rule, *, before: str | None = None, after: str | None = None) -> Rule:
    """Add ``rule`` to the default registry (last, or before/after the named rule)."""
    return RULES.register(rule, before=before, after=after)


def unregister_rule(name: str) -> Rule:
    """Remove the rule named ``name`` from the default registry (and return it)."""
    return RULES.unregister(name)


__all__ = ["RULES", "LowerContext", "Match", "Payload", "Rule", "RuleRegistry", "register_rule",
           "unregister_rule"]
