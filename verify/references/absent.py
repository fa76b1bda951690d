"""The two outcomes with no reference to compute (docs/theory.md §9): no equilibrium was found
(nothing to compare), or the source is not a kind any reference verifies."""

from __future__ import annotations

from typing import Any

from ..context import CheckContext
from ..report import ReferenceInfo
from .base import Situation


class NoReference:
    """No equilibrium was found: nothing to compare, the check reports that."""

    kind = "none"

    def applies(self, s: Situation) -> bool:
        """The tight solve found no equilibrium."""
        return not s.equilibrium_found

    def answers(self, requested: str, s: Situation) -> bool:
        """Every request: without an equilibrium nothing is compared."""
        return True

    def scope(self, s: Situation) -> str:
        return "no equilibrium was found: nothing is compared"

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Record that no equilibrium was found and label the samples."""
        ctx.notes.append("no reference computed: without an equilibrium there is nothing to "
                         "compare (the layer may have no fixed point here)")
        ctx.ref = ReferenceInfo("none", "not computed (equilibrium not found)", ok=False)
        ctx.label = "equilibrium not found"
        tol = ctx.tols.sam if s.sam else ctx.tols.residual
        for sample in ctx.samples:
            sample.label = "equilibrium not found" if sample.residual > tol else "not compared"


class Unavailable:
    """A source no reference can verify: the check fails with that reason."""

    kind = "unavailable"

    def applies(self, s: Situation) -> bool:
        """Anything but an objective (deep compositions have their own reference)."""
        return s.family != "objective"

    def answers(self, requested: str, s: Situation) -> bool:
        """Every request: the check fails whatever was asked for."""
        return True

    def scope(self, s: Situation) -> str:
        return f"no reference verifies a {type(s.source).__name__} source"

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Record a failed ``reference`` rule naming the source's type."""
        ctx.rule("reference", False, f"reference unavailable: cannot verify a "
                 f"{type(source).__name__} source")
