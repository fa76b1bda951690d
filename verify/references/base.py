"""What the choice of a reference depends on, and the protocol every reference unit follows
(docs/theory.md §9; the units are registered in :mod:`verify.selection`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from convex_eq.composition import DeepComposition
from convex_eq.objective import Objective

from ..context import CheckContext

#: source type → the family of claims it makes (its nearest registered base class decides)
SOURCE_FAMILIES: Mapping[type, str] = {DeepComposition: "deep", Objective: "objective"}


@dataclass(frozen=True)
class Situation:
    """What the choice depends on."""

    source: Any
    claim_kind: str
    certified: bool
    sam: bool
    equilibrium_found: bool
    requested: str  # "auto" | "cvxpy" | "numeric" | "local"

    @property
    def convex_claim(self) -> bool:
        """``True`` iff the claim is a minimizer (of the objective or of the edited one)."""
        return self.claim_kind in ("minimizer", "modified minimizer")

    @property
    def family(self) -> str:
        """``"deep"`` | ``"objective"`` | ``"other"`` (``source_family``)."""
        return source_family(self.source)


def source_family(source: Any) -> str:
    """The family of ``source`` in ``SOURCE_FAMILIES`` by its nearest registered base class
    (``"other"`` when none is registered)."""
    for cls in type(source).__mro__:
        if cls in SOURCE_FAMILIES:
            return SOURCE_FAMILIES[cls]
    return "other"


class Reference(Protocol):
    """One reference kind: ``applies`` says whether it is the one for a situation (the first
    registered that applies is chosen); ``run`` fills the check's samples, rules and record."""

    kind: str

    def applies(self, s: Situation) -> bool:
        """Whether this reference verifies the claim in situation ``s``."""

    def answers(self, requested: str, s: Situation) -> bool:
        """Whether ``reference=requested`` is a way to ask for this reference in ``s``."""

    def scope(self, s: Situation) -> str:
        """What this reference verifies: why a request it does not answer is refused."""

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Compute the reference for ``source``; record samples, rules and provenance in ``ctx``."""
