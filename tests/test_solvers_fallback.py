"""Anderson's fallback to plain iteration (lowering/solvers.py ``ANDERSON_FRUITLESS``): restarts
that gain nothing hand the solve to plain iteration.  Found by the uniqueness property of
tests/test_inclusions.py under its thorough profile: a warm-started inclusion layer whose
contraction factor is 0.993 stalled Anderson at a relative residual of 3.7e-2 for 3000
iterations, restarting every 11, while plain iteration reaches 1e-13 in about 2100."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.errors import ConvergenceError
from lowering import solvers
from tests.test_inclusions import T64, _decoupled_inclusion


def _stalling_case():
    seed, scale = 341, 5.796875  # the property's counterexample
    d = lowering.lower(_decoupled_inclusion(seed, scale, False))
    x = torch.as_tensor(np.random.default_rng(seed).standard_normal((2, 3)), dtype=T64)
    z0 = torch.as_tensor(np.random.default_rng(seed + 1).uniform(0.5, 5.0, (2, 6)), dtype=T64)
    return d, x, z0


def _solve(d, x, z0, solver: str, max_iter: int = 3000):
    mod = d.torch_module(dtype=T64, solver=solver, tol=1e-13, max_iter=max_iter)
    with torch.no_grad():
        return mod(x, z0=z0, return_stats=True)


def test_a_stalled_anderson_finishes_by_plain_iteration() -> None:
    """The stalled sample now meets 1e-13, at the point plain iteration finds (the layer is a
    contraction: one fixed point; 1e-9 is far above the round-off of two solves stopped at a
    relative residual of 1e-13 with factor 0.993, ~1e-11, and far below the O(1) distance the
    stall left)."""
    d, x, z0 = _stalling_case()
    z, st = _solve(d, x, z0, "anderson")
    assert st.solver == "anderson→plain"
    assert bool(st.converged.all()) and st.max_residual <= 1e-13
    zp, _ = _solve(d, x, z0, "plain", max_iter=5000)
    assert torch.allclose(z, zp, atol=1e-9, rtol=0)


def test_without_the_fallback_it_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same solve with the fallback switched off does not converge (the test above can
    fail)."""
    monkeypatch.setattr(solvers, "ANDERSON_FRUITLESS", 10**9)
    d, x, z0 = _stalling_case()
    with pytest.raises(ConvergenceError, match="did not reach"):
        _solve(d, x, z0, "anderson")


@pytest.mark.parametrize("solver", ["anderson", "auto"])
def test_a_solve_that_does_not_stall_is_unchanged(solver: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Anderson that converges (the benchmark's QP, ‖W‖₂ = 0.99, float32) never reaches the
    fallback: the same iterates and history bit for bit with it switched off."""
    layer = lowering.lower(qp_objective(qp_weight(128, norm=0.99, seed=0)))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    out = []
    for fruitless in (solvers.ANDERSON_FRUITLESS, 10**9):
        monkeypatch.setattr(solvers, "ANDERSON_FRUITLESS", fruitless)
        mod = layer.torch_module(weight_control=None, solver=solver, tol=1e-6, max_iter=500)
        with torch.no_grad():
            z, st = mod(x, return_stats=True)
        out.append((z, st.residuals, st.solver))
    assert "plain" not in out[0][2].split("→")[1:]
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
