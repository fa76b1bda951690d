"""Review of the solver changes since 38cf7a1 (lowering/solvers.py): the tracker's first-image
scale check (``_extreme_scale``), the lazily concatenated residual history
(``SolverStats.residuals_``) and what they promise — no residual in the history at or below
``tol`` for an iterate that does not meet it, statistics readable from earlier pickles, the
solvers' accepted inputs unchanged, and no exact-mode slowdown for ordinary states."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch

from lowering.solvers import SolverStats, Tracker, exact_rel_residual, solve


def _shrinking(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z + 1e-19


def _one_diverging(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([0.5 * z[:1] + 1.0, 2.0 * z[1:] + 1.0])


def _false_passes(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, st: SolverStats,
                  tol: float) -> torch.Tensor:
    """``(B, K)``: recorded residuals at or below ``tol`` whose iterate's exact residual is not
    (the plain iterates recomputed from ``z0``; ``1.001·tol`` absorbs float64 rounding)."""
    z, exact = z0, []
    for _ in range(st.residuals.shape[1]):
        fz = f(z)
        exact.append(exact_rel_residual(fz - z, fz))
        z = fz
    true = torch.stack(exact, 1)
    return (st.residuals <= tol) & (true > 1.001 * tol)


@pytest.mark.parametrize("f, z0", [(_shrinking, torch.ones(2, 8)),
                                   (_one_diverging, torch.zeros(2, 8))],
                         ids=["warm-start-to-tiny-scale", "one-diverging-sample"])
def test_a_false_zero_reached_after_the_first_image_leaves_no_trace_in_the_history(
        f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor) -> None:
    """The first-image scale check only sees the first iterate; later iterates can still reach
    scales where float32 plain norms read 0.  (a) A warm start at ordinary scale (``z0 = 1``)
    shrinking towards the fixed point ``2e-19`` of ``z/2 + 1e-19``: ~75 iterations in, the
    differences' squares underflow and the plain residual reads 0 where the exact one is
    ~1.3e-4.  (b) A batch in which one sample diverges (``2z + 1``, the other converges): near
    ``|f(z)| ≈ 7e18`` ``||f(z)||²`` overflows while ``||f(z) − z||²`` does not, and that sample
    reads 0 where its residual is 0.5.  The stop is confirmed exactly (the solve goes on), but
    the 0 stays in ``SolverStats.residuals``, and in (a) ``iterations`` reports the samples as
    meeting ``tol`` there (75) instead of at the iterate that does (83): statistics of another
    point (and in (b) a best-iterate replay of the whole solve aimed at the false 0).

    Tolerances: every operation is an elementwise float32 ``a·z + c`` (no reduction, no BLAS:
    the same bits on every CPU); the recomputed exact residuals are float64 norms of float32
    vectors (exact to ~1e-16 relative); the false entries are 0 against a true ≥ 1e-4, the
    ``1.001·tol`` margin only absorbs float64 rounding."""
    tol = 1e-6
    _, st = solve(f, z0, "plain", tol=tol, max_iter=100)
    false_pass = _false_passes(f, z0, st, tol)
    assert not bool(false_pass.any()), (false_pass.nonzero()[:4], st.residuals[:, -10:])
    if f is _shrinking:  # plain from z0: the first iterate meeting tol is the last recorded
        assert bool(st.converged.all())
        assert st.iterations.tolist() == [st.residuals.shape[1]] * 2


@pytest.mark.parametrize("f, z0", [(_shrinking, torch.ones(2, 8)),
                                   (_one_diverging, torch.zeros(2, 8))],
                         ids=["warm-start-to-tiny-scale", "one-diverging-sample"])
def test_no_false_zero_inside_compiled_chunks_either(
        f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor) -> None:
    """The same two solves in compiled chunks of 4 (``compiled_steps``): a chunk's interior
    residuals (plain float32 norms, ``_run_steps``) are recorded without any confirmation, so
    a false 0 read inside a chunk stays in the history even where the eager loop's is
    corrected.  (The chunk runs while the worst rate predicts many more iterations — here
    while a sample diverges or the residual has not started falling — exactly when these
    scales are reached.)  Tolerances as in the eager test above: elementwise float32 maps,
    float64 reference norms, false entries 0 against ≥ 1e-4."""
    from lowering.solvers import CompiledSteps, compiled_steps

    tol = 1e-6
    with compiled_steps(CompiledSteps(4)):
        _, st = solve(f, z0, "plain", tol=tol, max_iter=100)
    false_pass = _false_passes(f, z0, st, tol)
    assert not bool(false_pass.any()), (st.solver, false_pass.nonzero()[:4])


def test_stats_pickled_before_the_lazy_history_still_read() -> None:
    """``SolverStats`` held its history in the field ``residuals``; it is now ``residuals_``
    behind a property.  A module pickled by the previous version carries ``last_stats`` with
    the old field: reading ``last_stats.residuals`` (or ``str``, ``iterations``) after loading
    raised AttributeError.  The old pickle is reproduced exactly: the same class with the old
    instance dictionary (pickle stores the class name and ``__dict__``).  Exact comparisons:
    the tensors are pickled bit for bit."""
    _, st = solve(lambda z: 0.5 * z + 1.0, torch.zeros(2, 3, dtype=torch.float64), "plain",
                  tol=1e-6, max_iter=100)
    old = SolverStats.__new__(SolverStats)
    state = dict(st.__dict__)
    state["residuals"] = state.pop("residuals_") if isinstance(state["residuals_"], torch.Tensor) \
        else torch.cat(state.pop("residuals_"), dim=1)
    old.__dict__.update(state)
    loaded = pickle.loads(pickle.dumps(old))
    assert torch.equal(loaded.residuals, st.residuals)
    assert torch.equal(loaded.iterations, st.iterations)
    assert "converged" in str(loaded)


@pytest.mark.parametrize("solver", ["plain", "anderson", "broyden"])
def test_tol_zero_runs_max_iter_as_before(solver: str) -> None:
    """``solve(..., tol=0)`` (no stop on the residual: ``max_iter`` iterations, or an exact
    fixed point) ran before 38cf7a1; the first-image scale check divides by ``tol`` and raises
    a bare ZeroDivisionError.  Exact comparisons: iteration counts."""
    z, st = solve(lambda z: 0.5 * torch.tanh(z) + 1.0, torch.zeros(2, 3), solver, tol=0.0,
                  max_iter=5)
    assert z.shape == (2, 3) and 1 <= st.residuals.shape[1] <= 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_ordinary_half_precision_state_is_not_measured_exactly(dtype: torch.dtype) -> None:
    """Half-precision norms accumulate in float32 (squares of entries ≤ 65504 cannot overflow
    there), but the scale check judges a float16 state by float16's own range: its window
    ``[10·sqrt(tiny)/tol, sqrt(max)/1e3] = [7.8e4, 0.26]`` is empty, so every float16 solve —
    entries of order 1 included — measures every residual exactly (measured 2.9× slower per
    solve at B = 8, N = 4: 0.46 → 1.31 ms).  bfloat16 (float32's range) is the control.
    No tolerance: the mode is a flag."""
    z0 = torch.zeros(4, 8, dtype=dtype)
    fz = (torch.linspace(-2.0, 2.0, 32).reshape(4, 8) + 0.5).to(dtype)
    tr = Tracker("plain", z0, 1e-3)
    tr.record(z0, fz)
    assert not tr._exact
