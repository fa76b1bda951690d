"""Which reference verifies a claim (docs/theory.md §9), as code: one class per reference kind
behind one small protocol, found through ``REFERENCE_KINDS``, chosen by ``select_reference``::

    | situation                                            | reference                             |
    |------------------------------------------------------|---------------------------------------|
    | no equilibrium found                                 | none (nothing to compare)             |
    | deep composition                                     | deep (Corollary 1 / Theorem 2)        |
    | SAM module                                           | sam (Tikhonov path of argmin_Fix T R) |
    | convex claim, certified, ``auto``/``cvxpy``          | cvxpy (numeric if not DCP, ``auto``)  |
    | convex claim, certified, ``numeric``                 | numeric                               |
    | non-convex claim, certificate violated, or ``local`` | local (never "minimizer")             |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from convex_eq.composition import DeepComposition
from convex_eq.objective import Objective


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


class Reference(Protocol):
    """One reference kind: ``run`` fills the check's samples, rules and reference record."""

    kind: str

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Compute the reference for ``source``; record samples, rules and provenance in ``run``."""


class NoReference:
    """No equilibrium was found: nothing to compare, the check reports that."""
    kind = "none"

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Record that no equilibrium was found."""
        run.no_equilibrium()


class DeepReference:
    """Deep compositions: Corollary 1 (``L = 2``) or the Theorem 2 inclusion (docs/theory.md §5)."""
    kind = "deep"

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Check the deep claim; violated layer conditions are noted (they certify nothing)."""
        if not situation.certified:
            run.notes.append("deep model with violated layer conditions: Corollary 1 / "
                             "Theorem 2 residuals are reported but certify nothing")
        run.run_deep(source)


class SamReference:
    """SAM modules: ``argmin_{Fix T} R`` by the Tikhonov path (docs/theory.md §6)."""
    kind = "sam"

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Compare the SAM equilibrium with the selected fixed point."""
        run.run_sam(source)


class LocalReference:
    """Non-convex or uncertified claims: multi-start local minimization (docs/theory.md §9.3)."""
    kind = "local"

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Run the local reference (a refused ``numeric`` request is noted)."""
        if situation.requested == "numeric":
            run.notes.append("numeric (convex) reference refused: the objective is not "
                             "certified convex here; using the local reference")
        run.run_local(source)


class _Convex:
    """Shared by the convex references: the note of a modified-minimizer claim."""

    @staticmethod
    def note(run: Any, situation: Situation) -> None:
        if situation.claim_kind == "modified minimizer":
            run.notes.append("modified minimizer: the reference minimizes the objective the "
                             f"prox-variant edit really has, {run.derived.claim.objective_text}")


class CvxpyReference(_Convex):
    """Certified convex claims: CVXPY at tight tolerances (docs/theory.md §9.1)."""
    kind = "cvxpy"

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Solve with CVXPY, or the numeric reference when the objective is not DCP."""
        if not run.run_cvxpy(source, situation.claim_kind):  # not DCP, "auto": numeric
            NumericReference.solve(run, source, situation)
        self.note(run, situation)


class NumericReference(_Convex):
    """Convex by curvature, not DCP: an independent scipy minimization (docs/theory.md §9.2)."""
    kind = "numeric"

    @staticmethod
    def solve(run: Any, source: Any, situation: Situation) -> None:
        """Minimize the objective numerically and compare (label: convex, numeric reference)."""
        run.run_numeric(source, f"{situation.claim_kind} (convex, numeric reference)")

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Run the numeric reference and note a modified-minimizer claim."""
        self.solve(run, source, situation)
        self.note(run, situation)


class Unavailable:
    """A source no reference can verify: the check fails with that reason."""
    kind = "unavailable"

    def run(self, run: Any, source: Any, situation: Situation) -> None:
        """Record a failed ``reference`` rule naming the source's type."""
        run.rule("reference", False, f"reference unavailable: cannot verify a "
                 f"{type(source).__name__} source")


#: reference kind → implementation (the registry ``select_reference`` chooses from)
REFERENCE_KINDS: dict[str, Reference] = {r.kind: r for r in (
    NoReference(), DeepReference(), SamReference(), LocalReference(), CvxpyReference(),
    NumericReference(), Unavailable())}


def select_reference(s: Situation) -> str:
    """The reference kind for situation ``s`` (the table in the module docstring)."""
    if not s.equilibrium_found:
        return "none"
    if isinstance(s.source, DeepComposition):
        return "deep"
    if s.sam:
        return "sam"
    if not isinstance(s.source, Objective):
        return "unavailable"
    if s.requested == "local" or not s.convex_claim or not s.certified:
        return "local"
    return "numeric" if s.requested == "numeric" else "cvxpy"
