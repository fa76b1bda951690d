"""``verify.selection``: the reference table of docs/theory.md §9 as code (pure logic, no solve)."""

from __future__ import annotations

import pytest

import convex_eq as ce
from convex_eq import models
from verify.selection import REFERENCE_KINDS, Situation, select_reference

PHI = models.opteq(n=3, m=3, d=2, seed=0)
DEEP = models.deep_opteq(L=2, n=3, m=4, d=2, alpha=0.5, seed=0)


@pytest.mark.parametrize(("source", "claim", "certified", "sam", "found", "requested", "kind"), [
    (PHI, "minimizer", True, False, False, "auto", "none"),
    (DEEP, "minimizer", True, False, True, "auto", "deep"),
    (DEEP, "minimizer", False, False, True, "cvxpy", "deep"),
    (PHI, "minimizer", True, True, True, "auto", "sam"),
    (PHI, "minimizer", True, False, True, "auto", "cvxpy"),
    (PHI, "modified minimizer", True, False, True, "cvxpy", "cvxpy"),
    (PHI, "minimizer", True, False, True, "numeric", "numeric"),
    (PHI, "minimizer", False, False, True, "numeric", "local"),
    (PHI, "minimizer", False, False, True, "auto", "local"),
    (PHI, "stationary point", True, False, True, "cvxpy", "local"),
    (PHI, "minimizer", True, False, True, "local", "local"),
    (ce.State("z", 2), "minimizer", True, False, True, "auto", "unavailable"),
    (PHI, "fixed point of the iteration", False, False, True, "auto", "iteration"),
    (PHI, "fixed point of the iteration", False, False, False, "auto", "none"),
])
def test_select_reference_is_the_table(source, claim, certified, sam, found, requested,
                                       kind) -> None:
    s = Situation(source, claim, certified, sam, found, requested)
    assert select_reference(s) == kind
    assert REFERENCE_KINDS[kind].kind == kind


def test_every_registered_reference_has_the_protocol() -> None:
    assert set(REFERENCE_KINDS) == {"none", "deep", "sam", "local", "cvxpy", "numeric",
                                    "unavailable", "iteration"}
    for ref in REFERENCE_KINDS.values():
        assert callable(ref.run) and isinstance(ref.kind, str)
