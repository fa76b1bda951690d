"""Fuzz: random well-formed objective trees.

For every drawn objective (``fuzz.strategies.well_formed``): ``lowering.lower`` derives a layer or
raises a documented error naming the term; ``T`` is finite on finite inputs; the contraction
estimate is a valid Lipschitz bound and, when < 1, plain iteration converges geometrically;
``latex()``/``str()``/``describe()`` print; the objective's value at ``T``'s outputs is never NaN;
the CVXPY export matches ``objective.value`` at feasible points or raises ``NotDCPError``;
``verify.check`` passes or reports a labelled reason.  Outcome counts:
``/tmp/convex_eq_fuzz_stats_<profile>.json`` (and ``--hypothesis-show-statistics``).
"""

from __future__ import annotations

import warnings

from hypothesis import given, note

from tests.fuzz import properties as P
from tests.fuzz.stats import fuzz_stats, record  # noqa: F401  (autouse: writes the outcome counts)
from tests.fuzz.strategies import Case, proxable_objectives, well_formed


@given(well_formed())
def test_lower_derives_or_documented_error(case: Case) -> None:
    note(repr(case))
    d, outcome = P.lower_case(case)
    record("lower", f"{case.family}/{outcome}")
    record("printing", P.check_printing(case, d))
    if d is None:
        return
    record("T-finite", P.check_T_finite(d, case))
    record("contraction", P.check_contraction(d, case))
    record("value", P.check_value(case, d))


@given(well_formed(families=("canonical", "theorem1", "moreau", "precompose", "deep", "fb",
                             "random")))
def test_cvxpy_export_matches_value_or_not_dcp(case: Case) -> None:
    note(repr(case))
    record("cvxpy", f"{case.family}/{P.check_cvxpy(case)}")


@given(proxable_objectives())
def test_objective_prox_is_a_minimizer(case: tuple) -> None:
    phi, t, v = case
    note(f"φ = {phi}, t = {t}, v = {v}")
    record("prox", P.check_prox(phi, t, v))


@given(well_formed())
def test_verify_check_passes_or_labels_the_reason(case: Case) -> None:
    note(repr(case))
    d, _outcome = P.lower_case(case)
    if d is None:
        record("verify", f"{case.family}/not-lowered")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record("verify", f"{case.family}/{P.check_verify(d, case)}")
