"""Compiled chunks of plain iterations (``lowering.runtime.solvers.CompiledSteps``), what an emitted
module runs inside ``torch.compile``: the same iterates and the same stop as the eager loop,
every claim of convergence confirmed exactly, and the module's compiled path equal to its
eager one.

Tiny states (each compiled chunk costs a few seconds of compiling once); the module under
``torch.compile`` is tested in tests/lowering/runtime/test_torch_compile.py."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from convex_eq.errors import OptionError
from lowering.runtime.solvers import CompiledSteps, exact_rel_residual, solve
from tests.lowering.runtime.helpers import (
    compiled_relu_module,
    false_passes,
    one_diverging,
    shrinking,
)

F64 = torch.float64


class _Counting(CompiledSteps):
    """Counts the iterations it ran as compiled chunks."""

    def __init__(self, chunk: int = 8):
        super().__init__(chunk)
        self.ran: list[int] = []

    def __call__(self, f, z, k):  # type: ignore[no-untyped-def]
        self.ran.append(k)
        return super().__call__(f, z, k)


def _affine(b: int = 3, n: int = 5, rate: float = 0.8, seed: int = 0):  # type: ignore[no-untyped-def]
    """``z ↦ zA + c`` with ``||A||₂ = rate``: plain iteration converges geometrically."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, dtype=F64, generator=g)
    a = rate * a / torch.linalg.matrix_norm(a, 2)
    c = torch.randn(b, n, dtype=F64, generator=g)
    return (lambda z: torch.addmm(c, z, a)), torch.zeros(b, n, dtype=F64)


@pytest.mark.parametrize("solver", ["plain", "auto"])
def test_chunks_stop_where_the_eager_loop_stops(solver: str) -> None:
    """The chunk schedule (predicted from the residual's rate, never cut short) runs the same
    plain iterates as the eager loop and stops at the same iteration, with the returned
    residual confirmed below ``tol``.

    Tolerance: the compiled and eager norms of the same float64 iterates can differ in the last
    bits only, which moves the stop by one iteration only for a residual within ~1e-15
    relative of ``tol``; the geometric rate 0.8 puts consecutive residuals 25 % apart, so the
    counts agree.  Iterates: the same float64 operations (addmm, one per iteration), compared
    to 1e-12 relative (a different GEMM blocking may round differently)."""
    f, z0 = _affine()
    ze, se = solve(f, z0, solver, tol=1e-10, max_iter=200)
    steps = _Counting(8)
    zc, sc = solve(f, z0, solver, tol=1e-10, max_iter=200, compiled=steps)
    assert sum(steps.ran) >= 8, "no compiled chunk ran"
    assert sc.solver.startswith("plain[compiled×8]")
    assert sc.residuals.shape[1] == se.residuals.shape[1]
    assert bool(sc.converged.all())
    fz = f(zc)
    assert float(exact_rel_residual(fz - zc, fz).max()) <= 1e-10
    torch.testing.assert_close(zc, ze, rtol=1e-12, atol=0)


def test_a_chunk_that_underreports_its_residuals_cannot_fake_convergence() -> None:
    """Meta-test of the design: a broken chunk reporting zero residuals would stop the solve
    at once; the tracker's exact confirmation of the returned iterate refuses the claim and
    the solve goes on until the true residual meets ``tol``.  (The bound is exact arithmetic:
    the returned iterate's residual is recomputed in float64 from the iterate itself.)"""

    class Lying(CompiledSteps):
        def __call__(self, f, z, k):  # type: ignore[no-untyped-def]
            zp, fz, r = super().__call__(f, z, k)
            return zp, fz, torch.zeros_like(r)

    f, z0 = _affine(rate=0.9)
    z, st = solve(f, z0, "plain", tol=1e-10, max_iter=300, compiled=Lying(8))
    fz = f(z)
    true = exact_rel_residual(fz - z, fz)
    assert bool(st.converged.all())
    assert float(true.max()) <= 1e-10, "a lying chunk made the solver stop early"


def test_a_sample_that_turns_nan_inside_a_chunk_is_not_converged() -> None:
    """Sample 1's map returns NaN once its iterate passes 1.5 (inside the first compiled
    chunks); the NaN reaches the chunk's last iterate, so the tracker marks the sample
    non-finite while sample 0 converges normally."""
    def f(z: torch.Tensor) -> torch.Tensor:
        out = 0.5 * z + 1.0
        bad = (torch.arange(z.shape[0]) == 1)[:, None] & (z > 1.5)
        return torch.where(bad, torch.full_like(out, math.nan), out)

    z, st = solve(f, torch.zeros(2, 3, dtype=F64), "plain", tol=1e-12, max_iter=100,
                  compiled=CompiledSteps(4))
    assert bool(st.converged[0]) and not bool(st.converged[1])
    assert bool(st.nonfinite[1])
    torch.testing.assert_close(z[0], torch.full((3,), 2.0, dtype=F64), rtol=1e-11, atol=0)


def test_an_unconverged_solve_returns_each_samples_recorded_minimum() -> None:
    """The replay of an unconverged solve (``replay.best_per_sample``) runs eagerly on the chunked
    first run's schedule: sample 1 (no fixed point: its residual falls, then rises) gets the
    iterate with the smallest recorded residual.  Tolerance: the same float64 iterate measured
    in the chunk and exactly, a few ulps apart; 1e-9 relative."""
    def f(z: torch.Tensor) -> torch.Tensor:
        out = 0.5 * z + 1.0
        drift = z + 0.01 * (1 + z ** 2)
        return torch.where((torch.arange(2) == 1)[:, None] & (torch.arange(2) == 1), drift, out)

    z, st = solve(f, torch.zeros(2, 2, dtype=F64), "plain", tol=1e-6, max_iter=100,
                  compiled=CompiledSteps(8))
    assert bool(st.converged[0]) and not bool(st.converged[1])
    fz = f(z)
    best = torch.nan_to_num(st.residuals, nan=math.inf).min(dim=1).values
    torch.testing.assert_close(exact_rel_residual(fz - z, fz)[1], best[1], rtol=1e-9, atol=0)


@pytest.mark.parametrize("bad", [-1, True, 2.5, "8"])
def test_compile_steps_is_validated(bad: object) -> None:
    with pytest.raises(OptionError, match="compile_steps"):
        compiled_relu_module(compile_steps=bad)


def test_a_zero_fixed_point_has_no_nan_residuals_in_compiled_chunks() -> None:
    """Sample 0's iterates are exactly 0 from the start (``relu(0.9·z − c)``, ``c > 0``): a
    finite fixed point.  ``SolverStats.residuals`` is documented NaN only where the iterate
    was not finite: the compiled chunks record 0 there, as the eager loop does (its 0/0 goes
    to the exact form).

    Pins: the chunks measured ``||0|| / ||0||`` = NaN for every iteration inside a chunk.

    No tolerance: the checks are NaN-ness and exact zeros (0 − 0 and ||0|| are exact in any
    arithmetic)."""
    c = torch.tensor([[-1.0, -2.0], [1.0, 2.0]], dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.relu(0.9 * z + c)

    z, st = solve(f, torch.zeros(2, 2, dtype=F64), "plain", tol=1e-10, max_iter=400,
                  compiled=CompiledSteps(4))
    assert st.solver == "plain[compiled×4]"
    assert bool(st.converged.all()) and not bool(st.nonfinite.any())
    assert bool((z[0] == 0).all())
    assert not bool(torch.isnan(st.residuals).any()), (
        f"{int(torch.isnan(st.residuals).sum())} NaN residuals for finite iterates")
    assert bool((st.residuals[0] == 0).all())


@pytest.mark.parametrize("scale", [1e20, 1e-19])
def test_an_overflowed_plain_norm_leaves_no_false_zero_in_the_history(scale: float) -> None:
    """Float32 states near 1e20: ``||f(z)||²`` overflows in float32 while ``||f(z) − z||``
    does not, so the plain residual reads 0; near 1e-19 the squares of a difference at
    relative size 1e-3 underflow, with the same result.  The stop is confirmed exactly (the
    solve goes on), and in the eager loop and the compiled chunks alike every recorded residual
    at or below ``tol`` belongs to an iterate whose exact residual meets it.  (Fails with the
    tracker's first-image scale check, ``_extreme_scale``, disabled: checked at both scales.)

    Pins: the false 0 stayed in ``SolverStats.residuals`` and ``iterations`` reported the
    sample as meeting ``tol`` there, long before any iterate did.

    Tolerance: the iterates are recomputed by the same float32 ``addmm`` in the same order
    (deterministic on one machine); a residual recorded with float32 plain norms and the
    exact float64 one of the same iterate differ by ~1e-6 relative when nothing overflows,
    so 1.001·tol separates a true claim from a false 0 (exact residual ≫ tol) on any BLAS."""
    g = torch.Generator().manual_seed(0)
    n, tol = 8, 1e-5
    a = torch.randn(n, n, generator=g)
    a = 0.8 * a / torch.linalg.matrix_norm(a, 2)
    c = torch.randn(3, n, generator=g) * scale
    c[0] /= scale  # sample 0 at ordinary scale

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, z, a)

    for ctx in (None, CompiledSteps(4)):
        _, st = solve(f, torch.zeros(3, n), "plain", tol=tol, max_iter=200, compiled=ctx)
        z, exact = torch.zeros(3, n), []
        for _ in range(st.residuals.shape[1]):
            fz = f(z)
            exact.append(exact_rel_residual(fz - z, fz))
            z = fz
        true = torch.stack(exact, 1)
        claimed = st.residuals <= tol
        assert bool(st.converged.all())
        assert bool((true[claimed] <= 1.001 * tol).all()), (
            st.solver, st.iterations.tolist(), (claimed & (true > 1.001 * tol)).nonzero()[:4])


@pytest.mark.parametrize("f, z0", [(shrinking, torch.ones(2, 8)),
                                   (one_diverging, torch.zeros(2, 8))],
                         ids=["warm-start-to-tiny-scale", "one-diverging-sample"])
def test_no_false_zero_in_the_history_of_compiled_chunks(
        f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor) -> None:
    """The two solves of the eager false-zero test in tests/lowering/runtime/test_residuals.py
    (``shrinking`` from ``z0 = 1``, ``one_diverging``) in compiled chunks of 4: a chunk's
    interior residuals (plain float32 norms, ``compiled.run_steps``) must not keep a false 0 either.
    (The chunk runs while the worst rate predicts many more iterations — here while a sample
    diverges or the residual has not started falling — exactly when these scales are reached.)
    Tolerances as there: elementwise float32 maps, float64 reference norms, false entries 0
    against ≥ 1e-4.

    Pins: a chunk's interior residuals were recorded without confirmation, so a false 0 read
    inside a chunk stayed in the history where the eager loop's was corrected."""
    tol = 1e-6
    _, st = solve(f, z0, "plain", tol=tol, max_iter=100, compiled=CompiledSteps(4))
    false_pass = false_passes(f, z0, st, tol)
    assert not bool(false_pass.any()), (st.solver, false_pass.nonzero()[:4])


def test_compiled_steps_apply_only_to_the_solve_they_are_passed_to() -> None:
    """Compiled chunks are an argument of the solve (no context a nested solve would see): a
    solve inside the map ``f`` of a compiled solve iterates eagerly."""
    inner_names: list[str] = []

    def f(z: torch.Tensor) -> torch.Tensor:
        _, st = solve(lambda y: 0.5 * y + 1.0, torch.zeros(1, 2, dtype=F64), "plain",
                      tol=1e-12, max_iter=100)
        inner_names.append(st.solver)
        return 0.5 * z + 1.0

    _, st = solve(f, torch.zeros(2, 2, dtype=F64), "plain", tol=1e-10, max_iter=200,
                  compiled=CompiledSteps(4))
    assert st.solver.startswith("plain[compiled×4]")
    assert inner_names and all(n == "plain" for n in inner_names)
