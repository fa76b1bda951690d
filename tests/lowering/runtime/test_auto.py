"""The solver ``auto`` (lowering/solvers.py ``_AutoWatch``, docs/theory.md §8): plain iteration
while the observed rate predicts a short solve, Anderson from the iteration where it predicts
more than the plain budget, Anderson from the start on large states; it never falls back."""

from __future__ import annotations

import math

import pytest
import torch

import lowering
from benchmarks.common import qp_weight
from convex_eq.models import opteq
from lowering.runtime import solvers
from lowering.runtime.solvers import auto as auto_mod
from lowering.runtime.solvers import get_solver, solve
from tests.lowering.runtime.helpers import linear_map

F64 = T64 = torch.float64


def test_auto_does_not_fall_back_to_the_plain_iteration_it_left() -> None:
    """A map with spectral norm 1.6 (plain iteration diverges): once ``auto`` has switched to
    Anderson (here with history 2, restarting every iteration) it converges there.

    Pins: a fallback from Anderson to plain iteration sent such solves back to diverge."""
    f = linear_map(1, 1.6, torch.float64, False)
    with torch.no_grad():
        _, st = solvers.solve(f, torch.zeros(4, 24, dtype=torch.float64), "auto", tol=1e-10,
                              max_iter=300, m=2, restart=1)
    assert bool(st.converged.all()), (st.solver, st.returned_residual)


def test_auto_measures_the_rate_again_when_a_short_tail_fails() -> None:
    """A fast transient then a slow mode: ``z ↦ zA + c`` with ``A = diag(0.5, 0.92)``, the slow
    component 0.03 of the fast one.  The first test sees the transient's rate and predicts a
    short tail (≤ AUTO_TAIL); past its end the rate is measured again over AUTO_WINDOW, which
    predicts 66 > 60 (the budget) and switches (25 iterations in all).

    Pins: the test past the short tail measured the rate over the whole span, the fast start
    included, and predicted 34, then fewer and fewer: 89 plain iterations, never switching.

    Tolerance: the decisions are float64 arithmetic on a 2-D diagonal map (rounding ~1e-15
    relative); the switching test is 10 % above the budget and the rule without the re-measure
    stays ≥ 7 % below it at every test, so no BLAS or CPU can move either side; ``≤ 40``
    separates 25 from 89."""
    a = torch.diag(torch.tensor([0.5, 0.92], dtype=F64))
    c = torch.tensor([[1.0, 0.03]], dtype=F64)
    _, st = solve(lambda z: torch.addmm(c, z, a), torch.zeros(1, 2, dtype=F64), "auto",
                  tol=1e-5, max_iter=150)
    assert st.solver == "plain→anderson", (st.solver, int(st.iterations.max()))
    assert bool(st.converged.all())
    assert int(st.iterations.max()) <= 40


def test_auto_switches_a_tanh_layers_slowing_adjoint_solve() -> None:
    """The same on an emitted layer: a canonical tanh OptEq at ‖W‖₂ = 0.99 (tol 1e-4,
    max_iter 100, B = 32): the adjoint solve's short-tail test comes 19 iterations after the
    previous one; with the rate measured again over AUTO_WINDOW it predicts 38 > 36 and
    switches (31 iterations in all).

    Pins: the averaged rate predicted 34 against a budget of 38 and the solve ran 67 plain
    iterations.

    Tolerance: float64 solves of a 32-wide state; rounding moves the residuals by ~1e-14
    relative, against a 5 % margin of the switching test and ≥ 10 % below the budget for the
    rule without the re-measure; ``< 50`` separates 31 from 67."""
    # (backward_adjoint="iterative": the adjoint by the solver ``auto`` whose rule this tests;
    # the default method takes conjugate gradients on this symmetric system, 13 iterations)
    mod = lowering.lower(opteq(n=32, m=32, d=32, activation="tanh", weight_norm=0.99, seed=3)
                         ).torch_module(dtype=F64, tol=1e-4, max_iter=100, weight_control=None,
                                        backward_adjoint="iterative")
    x = (0.2 * torch.randn(32, 32, generator=torch.Generator().manual_seed(0))).to(F64)
    z = mod(x.requires_grad_())
    (z * torch.linspace(-1, 1, 32, dtype=F64)).sum().backward()
    st = mod.last_backward_stats
    assert st.solver == "plain→anderson", (st.solver, int(st.iterations.max()))
    assert bool(st.converged.all())
    assert int(st.iterations.max()) < 50


def _reference_need(now: float, then: float, tol: float, window: int) -> float:
    """The prediction written out on its own: iterations to reach ``tol`` at the geometric
    rate observed over ``window`` iterations (the reference the inlined watch must match)."""
    if not (math.isfinite(now) and math.isfinite(then)) or now <= 0:
        return 0.0
    if now >= then:
        return math.inf
    if now <= tol:
        return 0.0
    rate = (now / then) ** (1.0 / window)
    return math.log(tol / now) / math.log(rate)


@pytest.mark.parametrize("now,then,window", [
    (1e-3, 1e-2, 4), (1e-3, 1e-3, 4), (2e-3, 1e-3, 4), (1e-7, 1e-6, 4), (1e-7, 2e-8, 4),
    (math.nan, 1e-2, 4), (1e-3, math.inf, 4), (0.0, 1e-2, 4), (5e-4, 9e-4, 13),
    (1e-4, 1e-3, 4), (1e-3, 2.5e-3, 4)])
def test_auto_watch_decides_as_the_reference_prediction(now: float, then: float,
                                                        window: int) -> None:
    """The watch switches to Anderson exactly when the reference prediction exceeds the budget
    and schedules the next test from it (the order of its cases matters: a residual below tol
    that grew since the last test predicts no end)."""
    tol, max_iter = 1e-6, 200
    for k_then in (1, 30, 150):
        tr = solvers.Tracker("plain", torch.zeros(1, 1), tol)
        w = auto_mod.AutoWatch(tr, tol, max_iter)
        w.next, w.then, w.k = k_then + window, then, k_then
        tr.top = now
        k = k_then + window
        need = _reference_need(now, then, tol, window)
        switch = need > min(auto_mod.AUTO_PLAIN_BUDGET, (max_iter - k) / 2)
        assert w(k) is switch
        if not switch:  # half the prediction, or (a short one) AUTO_WINDOW past its end
            assert w.next == k + (int(need) + auto_mod.AUTO_WINDOW
                                  if need <= auto_mod.AUTO_TAIL
                                  else max(auto_mod.AUTO_WINDOW, int(need) // 2))


def _tanh_layer(norm: float):
    from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight

    z, q = State("z", 64), Input("q", 64)
    w = Weight("W", (64, 64), qp_weight(64, norm=norm, seed=0))
    return lowering.lower(Objective([Potential("tanh", z), SqNorm(z), -Linear(q, z),
                                     -SqNorm(w @ z)]))


def test_auto_switches_a_slowing_solve_to_anderson() -> None:
    """A tanh layer at ‖W‖₂ = 0.99 converges fast at first and then slowly: the watch must see
    the slowdown and switch to Anderson.  A watch that re-tests only past each predicted end
    (never halving) lets it run 116 plain iterations instead of switching after 49."""
    mod = _tanh_layer(0.99).torch_module(weight_control=None, tol=1e-6, max_iter=400,
                                         backward_tol=1e-6, backward_max_iter=400)
    x = 0.2 * torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    # the switch comes where the rate since the last test predicts 68 further iterations
    # against the budget of 60: a margin of 13 %, far beyond rounding
    mod(x.double())
    assert mod.last_stats.solver == "plain→anderson", mod.last_stats.solver
    assert int(mod.last_stats.iterations.max()) < 80


@pytest.mark.parametrize("norm,expect", [(0.5, "plain"), (0.97, "plain→anderson")])
def test_auto_solver_keeps_plain_when_fast_and_switches_when_slow(norm: float,
                                                                  expect: str) -> None:
    """``solver="auto"`` on a linear map ``z ↦ Mz + q``, ``M`` symmetric with eigenvalues in
    ``[0, norm]``: plain iteration when it contracts fast (0.5: ~30 iterations to 1e-9); plain
    continued by Anderson when the observed rate predicts too many (0.97: ~680); either way the
    result meets the tolerance."""
    g = torch.Generator().manual_seed(0)
    a = torch.linalg.qr(torch.randn(16, 16, dtype=T64, generator=g))[0]
    m = a @ torch.diag(torch.linspace(0, norm, 16, dtype=T64)) @ a.T
    q = torch.randn(4, 16, dtype=T64, generator=g)

    def f(z: torch.Tensor) -> torch.Tensor:
        return z @ m.T + q

    z, st = get_solver("auto")(f, torch.zeros(4, 16, dtype=T64), tol=1e-9, max_iter=500)
    assert st.solver == expect and bool(st.converged.all())
    exact = torch.linalg.solve(torch.eye(16, dtype=T64) - m, q.T).T
    # relative residual 1e-9 with ||(I − M)⁻¹|| ≤ 1/(1 − norm) ≤ 34: error ≤ 4e-8 relative
    assert torch.allclose(z, exact, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("batch, expect", [(32, "anderson"), (2, "plain")])
def test_auto_uses_anderson_on_large_states_in_large_batches(batch: int, expect: str) -> None:
    """States of ``AUTO_ANDERSON_STATE`` entries or more run Anderson from the start in batches
    of ``AUTO_ANDERSON_WORK`` entries or more; a small batch starts plainly (this contraction,
    rate 0.5, then needs no switch).  Both reach the fixed point ``2q`` (relative 1e-9 at rate
    0.5: within 2e-9 relative)."""
    from lowering.runtime.solvers.auto import AUTO_ANDERSON_STATE, AUTO_ANDERSON_WORK

    n = AUTO_ANDERSON_STATE
    assert (batch * n >= AUTO_ANDERSON_WORK) == (expect == "anderson")
    q = torch.randn(batch, n, dtype=T64, generator=torch.Generator().manual_seed(1))
    z, st = get_solver("auto")(lambda z: 0.5 * z + q, torch.zeros(batch, n, dtype=T64),
                               tol=1e-9)
    assert st.solver == expect and bool(st.converged.all())
    torch.testing.assert_close(z, 2 * q, rtol=4e-9, atol=0)
