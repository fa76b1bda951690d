"""Review 10b: Anderson's fallback to plain iteration (6c80ac6, reverted) on maps where plain
iteration does not converge.  Both solves converge (A) / stay finite (B) without it; the remedy
for Anderson's stalls on slow contractions (the stall guard, lowering/solvers.py) keeps them so
(tests/test_anderson_stall.py has its own cases)."""

from __future__ import annotations

import torch

from lowering import solvers


def _lin(seed: int, rho: float, dt: torch.dtype, nonnormal: bool):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(24, 24, generator=g, dtype=torch.float64)
    W = (torch.triu(W, 1) * 0.5 + rho * torch.eye(24, dtype=torch.float64)) if nonnormal \
        else W / torch.linalg.matrix_norm(W, 2) * rho
    b = torch.randn(4, 24, generator=g, dtype=torch.float64)
    W, b = W.to(dt), b.to(dt)
    return lambda z: z @ W.T + b


def test_auto_does_not_fall_back_to_the_plain_iteration_it_left() -> None:
    f = _lin(1, 1.6, torch.float64, False)
    with torch.no_grad():
        _, st = solvers.solve(f, torch.zeros(4, 24, dtype=torch.float64), "auto", tol=1e-10,
                              max_iter=300, m=2, restart=1)
    assert bool(st.converged.all()), (st.solver, st.returned_residual)


def test_default_anderson_returns_finite_rows_where_plain_iteration_diverges() -> None:
    f = _lin(0, 1.6, torch.float32, True)
    with torch.no_grad():
        z, st = solvers.solve(f, torch.zeros(4, 24), "anderson", tol=1e-6, max_iter=300)
    assert bool(torch.isfinite(z).all()) and bool(torch.isfinite(st.returned_residual).all()), \
        (st.solver, st.returned_residual)


def test_the_stalled_anderson_solve_converges_and_a_failing_one_names_plain_iteration() -> None:
    """The stall found by the uniqueness property (tests/test_inclusions.py, seed 341): Anderson
    stayed at 3.7e-2 for 3000 iterations on a certified contraction (Lip(T) ≤ 0.993), where
    plain iteration converges (in about 2100).  Its stall guard (lowering/solvers.py,
    ``_StallGuard``) now converges there, to plain iteration's point; an Anderson solve that
    does fail on that contraction (too few iterations) still names solver='plain' in its hint."""
    import numpy as np
    import pytest

    import lowering
    from convex_eq.errors import ConvergenceError
    from tests.test_inclusions import T64, _decoupled_inclusion

    seed, scale = 341, 5.796875
    d = lowering.lower(_decoupled_inclusion(seed, scale, False))
    x = torch.as_tensor(np.random.default_rng(seed).standard_normal((2, 3)), dtype=T64)
    z0 = torch.as_tensor(np.random.default_rng(seed + 1).uniform(0.5, 5.0, (2, 6)), dtype=T64)
    mod = d.torch_module(dtype=T64, solver="anderson", tol=1e-13, max_iter=3000)
    with torch.no_grad():
        za, st = mod(x, z0=z0, return_stats=True)
    assert bool(st.converged.all()), (st.solver, st.returned_residual)
    mod.config.forward.solver = "plain"
    with torch.no_grad():
        zp, st = mod(x, z0=z0, return_stats=True)
    assert bool(st.converged.all())
    # both stop at relative residual 1e-13 of a contraction with factor ≤ 0.993, so each lies
    # within ~1e-13·||T(z)||/0.007 ≈ 1e-10 of the unique fixed point on any CPU/BLAS; distinct
    # equilibria would differ by O(1): 1e-8 separates the two with room on both sides
    assert torch.allclose(za, zp, atol=1e-8, rtol=0)
    # a genuinely failing Anderson solve on this contraction: its hint names plain iteration
    mod.config.forward.solver = "anderson"
    mod.config.forward.max_iter = 10
    with torch.no_grad(), pytest.raises(ConvergenceError, match="solver='plain'"):
        mod(x, z0=z0)
    # the hint never names what is set: a plain solve that fails does not suggest plain
    mod.config.forward.solver = "plain"
    with torch.no_grad(), pytest.raises(ConvergenceError) as err:
        mod(x, z0=z0)
    assert "solver='plain'" not in str(err.value)
