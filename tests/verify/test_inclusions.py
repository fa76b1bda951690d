"""verify for inclusion layers (verify/inclusion.py): ``check_inclusion`` fails a layer of another
inclusion, ``verify.check`` routes inclusion layers to it, and the CVXPY reference's retry of an
inaccurate Clarabel stop loosens only the tight defaults, never a user's own tolerances."""

from __future__ import annotations

import dataclasses

import cvxpy as cp
import numpy as np
import pytest

from convex_eq import models
from lowering import lower
from verify.inclusion import check_inclusion
from verify.references import inclusion as vi
from verify.references import reference_solver_options


def test_check_inclusion_fails_on_a_layer_of_another_inclusion():
    # the same weights (the layer reads them by name) but margin 0.8: another inclusion
    inc = models.mon(n=8, d=4, weight_scale=3.0, seed=4)
    wrong = models.mon(n=8, d=4, weight_scale=3.0, seed=4, margin=0.8)
    d = dataclasses.replace(lower(wrong), source=inc)
    x = np.random.default_rng(2).standard_normal((2, 4))
    rep = check_inclusion(d, x, tol=1e-6)
    assert not rep.passed
    assert rep.worst("distance bound") > 1e-3 and rep.worst("lcp rel. error") > 1e-3


def test_verify_check_routes_inclusion_layers():
    import verify

    d = lower(models.mon(n=6, d=3, weight_scale=3.0))
    x = np.random.default_rng(0).standard_normal((2, 3))
    rep = verify.check(d, x)
    assert rep.passed and rep.label == "inclusion" and "lcp" in rep.reference.kind
    assert rep.max_rel_error is not None and rep.max_rel_error <= 1e-6
    wrong = dataclasses.replace(lower(models.mon(n=6, d=3, weight_scale=3.0, margin=0.9)),
                                source=d.source)
    bad = verify.check(wrong, x)
    assert not bad.passed and bad.status.startswith("FAILED")


def test_an_inaccurate_clarabel_stop_is_solved_again_ten_times_looser(monkeypatch):
    """verify.references.inclusion._solve: Clarabel's ``optimal_inaccurate`` at the tight
    default is solved once more with gap and feasibility tolerances ten times looser; other
    statuses and other solvers are returned as they are."""
    import cvxpy as cp

    from verify.references import inclusion as vi
    from verify.references import reference_solver_options

    calls: list[dict] = []
    answers: list[str] = []

    def fake(prob, opts):
        calls.append(dict(opts))
        return answers.pop(0)

    monkeypatch.setattr(vi, "_solve_once", fake)
    opts = reference_solver_options(None)
    answers[:] = [cp.OPTIMAL_INACCURATE, cp.OPTIMAL]
    notes: list[str] = []
    assert vi._solve(None, opts, notes) == cp.OPTIMAL
    assert len(calls) == 2 and calls[0] == opts
    assert all(calls[1][k] == min(10.0 * opts[k], 1e-10)
               for k in ("tol_gap_abs", "tol_gap_rel", "tol_feas"))
    assert len(notes) == 1 and "solved again at tolerance 1e-10" in notes[0]
    calls.clear()
    answers[:] = [cp.INFEASIBLE]
    assert vi._solve(None, opts) == cp.INFEASIBLE and len(calls) == 1
    calls.clear()
    scs = reference_solver_options({"solver": "SCS", "eps": 1e-10})
    answers[:] = [cp.OPTIMAL_INACCURATE]
    assert vi._solve(None, scs) == cp.OPTIMAL_INACCURATE and len(calls) == 1


@pytest.mark.parametrize("tol", [1e-7, 1e-8])
def test_the_inaccurate_retry_never_loosens_a_users_explicit_tolerances(
        monkeypatch: pytest.MonkeyPatch, tol: float) -> None:
    """``verify.references.inclusion._solve`` retries a Clarabel ``optimal_inaccurate`` stop at
    looser tolerances; ``reference_solver_options`` keeps a user's own Clarabel tolerances, and the
    retry must never be looser than what the user asked (at most ``max(tol, 1e-10)``).

    Pins: the retry multiplied a user's 1e-7 by ten, solving the reference at 1e-6 — the verify
    tolerance itself — silently (``optimal`` then read as if the requested accuracy had been
    met)."""
    calls: list[dict] = []
    answers = [cp.OPTIMAL_INACCURATE, cp.OPTIMAL]

    def fake(prob: object, opts: dict) -> str:
        calls.append(dict(opts))
        return answers.pop(0)

    monkeypatch.setattr(vi, "_solve_once", fake)
    opts = reference_solver_options({"solver": "CLARABEL", "tol_gap_abs": tol,
                                     "tol_gap_rel": tol, "tol_feas": tol})
    vi._solve(None, opts)  # type: ignore[arg-type]
    used = max(float(c[k]) for c in calls for k in ("tol_gap_abs", "tol_gap_rel", "tol_feas"))
    assert used <= max(tol, 1e-10) * (1 + 1e-12), (
        f"asked for {tol:g}, the reference was solved at {used:g}")
