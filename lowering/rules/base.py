"""The rule protocol: ``match(objective) → Match | None`` reads the objective's structure,
``lower(match, ctx) → DerivedLayer`` derives ``T``; rules are tried in a registry's order."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from convex_eq.composition import DeepComposition
from convex_eq.errors import LoweringError, OptionError
from convex_eq.objective import Objective
from convex_eq.terms.base import Term

from .common import proxable

if TYPE_CHECKING:
    from ..derived import DerivedLayer


#: ``deep_form`` of a DeepComposition: ``T`` returns ``z_0`` or every block
DEEP_FORMS = ("composition", "multiblock")
#: ``regularizer``: how ``φ + γR`` edits of a prox layer enter ``T``
REGULARIZER_VARIANTS = ("auto", "prox", "gradient")
#: the options ``lower`` accepts and their valid values (see :func:`lowering.lower`)
OPTION_VALUES: dict[str, tuple[str, ...] | str] = {
    "regularizer": REGULARIZER_VARIANTS,
    "deep_form": DEEP_FORMS,
    "tau": "a finite number > 0 (the forward–backward step; default 1/L)",
}
OPTIONS = frozenset(OPTION_VALUES)
#: the options read by the rules during the outermost ``lower`` call in progress
_READ: ContextVar[set[str] | None] = ContextVar("convex_eq_lower_options_read", default=None)


def check_options(objective: Any, options: Mapping[str, Any]) -> None:
    """Refuse unknown options, invalid values, and ``deep_form`` on anything but a
    ``DeepComposition`` (an option that does not apply is refused, not ignored)."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise OptionError(f"unknown option(s) {sorted(unknown)}", term="lower",
                          hint=f"valid options: {sorted(OPTIONS)}")
    for name, value in options.items():
        valid = OPTION_VALUES[name]
        if isinstance(valid, tuple):
            if not (isinstance(value, str) and value in valid):
                raise OptionError(f"{name}={value!r} is not a valid value", term="lower",
                                  hint=f"{name} is one of {', '.join(map(repr, valid))}")
        elif not (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value) and value > 0):
            raise OptionError(f"{name}={value!r} is not a valid value (the step τ)", term="lower",
                              hint=f"{name} is {valid}")
    if "deep_form" in options and not isinstance(objective, DeepComposition):
        raise OptionError(f"deep_form applies to a DeepComposition only (got a "
                          f"{type(objective).__name__})", term="lower", hint="drop deep_form")


def _check_no_state(objective: Any) -> None:
    if isinstance(objective, Objective) and not objective.states:
        raise LoweringError(
            "the objective has no state: every term is a function of inputs and weights only, "
            "so there is no equilibrium to solve for", term=str(objective),
            hint="declare the unknown with State('z', n) and use it in the terms, e.g. "
            "½||z||² − ⟨Ux, z⟩ + Σf_σ(z)")


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

    def _read(self, name: str, default: Any) -> Any:
        read = _READ.get()
        if read is not None:
            read.add(name)
        return self.options.get(name, default)

    @property
    def regularizer(self) -> str:
        return str(self._read("regularizer", "auto"))

    @property
    def deep_form(self) -> str:
        return str(self._read("deep_form", "composition"))

    @property
    def tau(self) -> float | None:
        return self._read("tau", None)

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
        if isinstance(objective, Term):
            objective = Objective([objective])
        check_options(objective, options)
        _check_no_state(objective)
        found = self.find(objective)
        if found is None:
            if not isinstance(objective, (Objective, DeepComposition)):
                raise LoweringError(f"cannot lower a {type(objective).__name__}", term="lower",
                                    hint="pass an Objective, a Term or a DeepComposition")
            raise LoweringError(_why(objective), term=str(objective), hint=_hint(objective))
        rule, match = found
        if _READ.get() is not None:  # an inner objective of a call in progress
            return rule.lower(match, LowerContext(options, self))
        token = _READ.set(set())
        try:
            derived = rule.lower(match, LowerContext(options, self))
            if "tau" in options and "tau" not in (_READ.get() or ()):
                raise OptionError(f"tau applies to the forward–backward rule only; "
                                  f"'{rule.name}' derived this layer without a step",
                                  term="lower", hint="drop tau")
        finally:
            _READ.reset(token)
        return derived

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
