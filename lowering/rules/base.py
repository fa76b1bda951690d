"""The rule protocol: ``match(objective) → Match | None`` reads the objective's structure,
``lower(match, ctx) → DerivedLayer`` derives ``T``; rules are tried in a registry's order."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from convex_eq.composition import DeepComposition
from convex_eq.errors import LoweringError, OptionError
from convex_eq.objective import Objective
from convex_eq.terms.base import Term

from .common import proxable

if TYPE_CHECKING:
    from ..derived import DerivedLayer


#: the options ``lower`` accepts (see :func:`lowering.lower`)
OPTIONS = frozenset({"regularizer", "deep_form", "tau"})


@dataclass(frozen=True)
class Match:
    """What a rule recognized in ``objective`` (rules subclass it with their pieces)."""

    objective: Any


@dataclass(frozen=True)
class Payload:
    """Typed per-rule facts about a derived layer (read by verify and weight control)."""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@runtime_checkable
class Rule(Protocol):
    """One calculus rule: a name, a structural ``match`` and a ``lower`` that derives ``T``."""

    name: str

    def match(self, objective: Any) -> Match | None: ...

    def lower(self, match: Any, ctx: LowerContext) -> DerivedLayer: ...


@dataclass(frozen=True)
class LowerContext:
    """Options of this ``lower`` call and the registry, to lower inner objectives recursively."""

    options: Mapping[str, Any]
    registry: RuleRegistry

    @property
    def regularizer(self) -> str:
        return str(self.options.get("regularizer", "auto"))

    @property
    def deep_form(self) -> str:
        return str(self.options.get("deep_form", "composition"))

    @property
    def tau(self) -> float | None:
        return self.options.get("tau")

    def lower(self, objective: Any) -> DerivedLayer:
        """Lower an inner objective with the same rules and options (``deep_form`` aside)."""
        opts = {k: v for k, v in self.options.items() if k != "deep_form"}
        return self.registry.lower(objective, **opts)


class RuleRegistry:
    """An ordered list of rules; the first whose ``match`` accepts the objective lowers it."""

    def __init__(self, rules: tuple[Rule, ...] = ()) -> None:
        self._rules: list[Rule] = []
        for r in rules:
            self.register(r)

    def register(self, rule: Rule, *, before: str | None = None, after: str | None = None
                 ) -> Rule:
        """Add ``rule`` (at the end, or just before/after the rule named ``before``/``after``)."""
        if not isinstance(rule, Rule):
            raise OptionError(f"{rule!r} is not a rule", term="register_rule",
                              hint="give it a name and match(objective)/lower(match, ctx) methods")
        if rule.name in self.names():
            raise OptionError(f"a rule named {rule.name!r} is already registered",
                              term="register_rule", hint="unregister it first or pick a new name")
        if before is not None and after is not None:
            raise OptionError("give before= or after=, not both", term="register_rule")
        pos = len(self._rules)
        if before is not None or after is not None:
            anchor = before if before is not None else after
            if anchor not in self.names():
                raise OptionError(f"no rule named {anchor!r}", term="register_rule",
                                  hint=f"registered: {self.names()}")
            pos = self.names().index(anchor) + (1 if after is not None else 0)
        self._rules.insert(pos, rule)
        return rule

    def unregister(self, name: str) -> Rule:
        for i, r in enumerate(self._rules):
            if r.name == name:
                return self._rules.pop(i)
        raise OptionError(f"no rule named {name!r}", term="unregister_rule",
                          hint=f"registered: {self.names()}")

    def names(self) -> list[str]:
        return [r.name for r in self._rules]

    def find(self, objective: Any) -> tuple[Rule, Any] | None:
        """The first rule that matches ``objective`` and its match."""
        for r in self._rules:
            m = r.match(objective)
            if m is not None:
                return r, m
        return None

    def lower(self, objective: Any, **options: Any) -> DerivedLayer:
        """Derive ``T`` of ``objective`` (a Term is one-term Objective) with the first rule
        that matches it; options as :func:`lowering.lower`."""
        unknown = set(options) - OPTIONS
        if unknown:
            raise OptionError(f"unknown option(s) {sorted(unknown)}", term="lower",
                              hint=f"valid options: {sorted(OPTIONS)}")
        if isinstance(objective, Term):
            objective = Objective([objective])
        found = self.find(objective)
        if found is None:
            if not isinstance(objective, (Objective, DeepComposition)):
                raise LoweringError(f"cannot lower a {type(objective).__name__}", term="lower",
                                    hint="pass an Objective, a Term or a DeepComposition")
            raise LoweringError(_why(objective), term=str(objective), hint=_hint(objective))
        rule, match = found
        return rule.lower(match, LowerContext(options, self))

    def __iter__(self) -> Iterator[Rule]:
        return iter(list(self._rules))

    def __repr__(self) -> str:
        return f"RuleRegistry({self.names()})"


def _nonsmooth(obj: Objective) -> list[Term]:
    return [t for t in obj.terms if not t.smooth]


def _why(obj: Any) -> str:
    if not isinstance(obj, Objective):
        return "no lowering rule applies to this objective"
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


def _hint(obj: Any) -> str:
    base = ("write the objective in canonical form Σf_σ(z) + ½||z||² − S(z), as ψ* − ½||·||² "
            "(Theorem 1), a Moreau envelope of a lowerable objective, or one prox-able term plus "
            "smooth terms; or register a rule of your own (lowering.register_rule)")
    nonsmooth = [t for t in _nonsmooth(obj) if proxable(t)] if isinstance(obj, Objective) else []
    if len(nonsmooth) > 1:
        extra = nonsmooth[-1]
        return (f"{base}; or smooth one of them: moreau({extra}, μ) (the layer's claim is then "
                f"about that Huber/envelope objective, not this one); an exact ℓ1 term joins a "
                "potential f_σ with σ(0) = 0 or an interval potential in the canonical form")
    return base
