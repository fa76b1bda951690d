"""CVXPY export of objectives (convex_eq/export.py ``Objective.to_cvxpy``): refusals name the term
that is not DCP, a non-DCP conjugate's value is computed without CVXPY, a constant objective has
a solution, and a solver failure is a project error."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest
import torch

import convex_eq as ce
from convex_eq import L1, AntiderivativeConjugate, Objective, Potential, SqNorm, State, models


def test_not_dcp_potential_export_names_the_term() -> None:
    """A potential that is not DCP (softplus's antiderivative conjugate) is refused naming the
    term (``Σ f_softplus(z)``), not only the activation.

    Pins: the refusal named only the activation ('softplus')."""
    z, z2 = State("z", 2), State("y", 2)
    obj = Objective([Potential("relu", z2), SqNorm(z2), Potential("softplus", z), SqNorm(z)])
    with pytest.raises(ce.NotDCPError) as err:
        obj.to_cvxpy()
    assert err.value.term == "Σ f_softplus(z)"
    obj2 = Objective([AntiderivativeConjugate("softplus", z)])
    with pytest.raises(ce.NotDCPError) as err2:
        obj2.to_cvxpy()
    assert "(∫softplus)*(z)" in err2.value.term


def test_not_dcp_conjugate_export_and_value_name_the_term() -> None:
    """The export of a non-DCP conjugate names the term; its value (the inner problem over a
    non-injective ``Mᵀ``) is computed through its Fenchel dual and matches an independent
    SLSQP solve of the inner problem."""
    phi = models.opteq(n=2, m=4, d=2, activation="softplus", form="conjugate")
    conj = str(phi.terms[0])
    with pytest.raises(ce.NotDCPError) as err:
        phi.to_cvxpy(x=np.zeros(2))
    assert conj in str(err.value)
    # Mᵀ (2×4) is not injective: the value is the inner problem min{Σσ̃*(y) − <q,y> : Mᵀy = z},
    # solved through its Fenchel dual (no CVXPY: softplus is not DCP); checked against an
    # independent SLSQP solve of the inner problem itself
    import scipy.optimize as so

    t = phi.terms[0]
    m = t.op.matrix(None)
    q = t.q.evaluate({"x": torch.zeros(1, 2, dtype=torch.float64)}, None)[0].numpy()
    zv = t.s * m.T @ np.array([0.5, 0.2, 0.9, 0.4])  # in dom ψ* = s·Mᵀ(0, ∞)⁴
    act = t.act

    def inner(y: np.ndarray) -> float:
        return float(act.antiderivative_conjugate(torch.as_tensor(y)).sum()) - float(q @ y)

    res = so.minimize(inner, np.full(4, 0.5), method="SLSQP", bounds=[(1e-9, None)] * 4,
                      constraints=[{"type": "eq", "fun": lambda y: m.T @ y - zv / t.s}],
                      options={"ftol": 1e-14, "maxiter": 500})
    val = float(phi.terms[0].value({"z": torch.as_tensor(zv[None]),
                                    "x": torch.zeros(1, 2, dtype=torch.float64)}))
    # SLSQP at ftol 1e-14 on a smooth 4-variable problem: ~1e-8 in value; margin 100×
    assert res.success and abs(val - t.coef(None) * t.s * res.fun) <= 1e-6, (val, res)


def test_export_of_a_constant_objective_has_a_solution() -> None:
    """Σ f_identity(z) = 0: the export solves to 0 and ``state_values`` returns the state (CVXPY
    leaves an unused variable unset although the status is 'optimal').

    Pins: ``state_values`` raised "problem has no solution (status optimal)"."""
    z = State("z", (1, 2, 2))
    exp = Objective([Potential("identity", z)]).to_cvxpy()
    assert exp.solve() == 0.0
    assert exp.state_values()["z"].shape == (1, 2, 2)


def test_export_solver_failure_is_a_project_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CVXPY solver failure in ``ExportedProblem.solve`` is a project ``SolverError`` naming
    the solver.

    Pins: ``cvxpy.error.SolverError`` escaped (Clarabel failing on random objectives)."""
    z = State("z", 2)
    exp = Objective([L1(z), SqNorm(z)]).to_cvxpy()

    def fail(*args: object, **kwargs: object) -> None:
        raise cp.error.SolverError("Solver 'CLARABEL' failed.")

    monkeypatch.setattr(exp.problem, "solve", fail)
    with pytest.raises(ce.SolverError, match="CLARABEL"):
        exp.solve()
