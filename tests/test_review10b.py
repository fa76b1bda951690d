"""Review 10b: Anderson's fallback to plain iteration (6c80ac6, reverted) on maps where plain
iteration does not converge.  Both solves converge (A) / stay finite (B) without it; a future
remedy for Anderson's stalls on slow contractions must keep them so."""

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
