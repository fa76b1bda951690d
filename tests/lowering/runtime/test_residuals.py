"""The solvers' residual and convergence flags (lowering/solvers.py ``Tracker``;
docs/theory.md §8): the relative residual ``||f(z) − z|| / max(||f(z)||, 1e-30)``, a stop
accepted on cheap plain norms only where they are provably exact enough (else recomputed
exactly), the first record's scale check, the lean record of later iterations, and flags that
never call a point converged whose exact residual misses ``tol`` — at float32 and float64
extremes, under flush-to-zero, with overflowing norms, and wherever the solve ends.  Each
shortcut decides what the exact form decides, and each test that guards one is shown to fail on
a broken rule."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import convex_eq as ce
import lowering
from convex_eq import models
from lowering.runtime import solvers
from lowering.runtime.solvers import Tracker, exact_rel_residual, get_solver, rel_residual, solve
from lowering.runtime.solvers.residuals import extreme_scale as _extreme_scale
from lowering.runtime.solvers.residuals import scale_ok as _scale_ok
from tests.lowering.runtime.helpers import false_passes, one_diverging, shrinking

T64 = torch.float64
TOL = 1e-5


# ------------------------------------------------------ a stop confirmed by the plain norms
def _pair(n: int, scale: float, rho: float, dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, fz)`` of one sample with ``||fz − z|| / ||fz|| ≈ rho`` and ``|fz| ~ scale``."""
    g = torch.Generator().manual_seed(seed)
    fz = torch.randn(1, n, generator=g, dtype=torch.float64)
    d = torch.randn(1, n, generator=g, dtype=torch.float64)
    d = d / d.norm() * fz.norm() * rho
    return (fz - d).mul(scale).to(dtype), fz.mul(scale).to(dtype)


def _exact(z: torch.Tensor, fz: torch.Tensor) -> float:
    """The residual as the solvers define it, ``||fz − z|| / max(||fz||, 1e-30)``, in float64
    for the very float32 vectors the tracker saw (their squares cannot over- or underflow
    there; the floor makes states below 1e-30 read an absolute residual, by definition)."""
    d = fz.double() - z.double()
    return float(d.norm() / fz.double().norm().clamp_min(1e-30))


@given(n=st.sampled_from([1, 7, 64, 1000]),
       log_scale=st.floats(-40.0, 38.0),
       rho_over_tol=st.floats(0.3, 1.5),
       tol=st.sampled_from([1e-2, 1e-6]),
       seed=st.integers(0, 2**16))
# the edges, always run: squares that overflow (1e20) or underflow (1e-25) in float32, a
# flat-ish long state near the lower end of the safe range, stops just around tol
@example(n=64, log_scale=20.0, rho_over_tol=1.5, tol=1e-6, seed=0)
@example(n=64, log_scale=-25.0, rho_over_tol=0.5, tol=1e-6, seed=0)
@example(n=1000, log_scale=-16.5, rho_over_tol=0.9, tol=1e-2, seed=1)
@example(n=64, log_scale=0.0, rho_over_tol=1.0, tol=1e-6, seed=2)
@example(n=7, log_scale=18.5, rho_over_tol=0.99, tol=1e-6, seed=3)
def test_plain_confirmation_never_passes_what_the_exact_residual_fails(
        n: int, log_scale: float, rho_over_tol: float, tol: float, seed: int) -> None:
    """A float32 stop is accepted only where the float64 residual of the same vectors meets
    ``tol``: at every scale float32 can hold (where the plain norms over- or underflow, the
    range check sends the stop to the exact recomputation) and at residuals just around
    ``tol`` (where the rounding margin decides).  The reported residual of an accepted stop is
    the float64 one up to float32 rounding: 1e-5 relative is >10× the ratio's worst rounding
    for n ≤ 1000 (``(n + 3)·2⁻²⁴`` ≈ 6e-5 bounds any summation order; torch's blocked sums sit
    far below it), so it holds on any CPU and BLAS."""
    z, fz = _pair(n, 10.0 ** log_scale, rho_over_tol * tol, torch.float32, seed)
    if not (torch.isfinite(z).all() and torch.isfinite(fz).all()) or not fz.abs().max() > 0:
        return  # not a float32 state (overflowed or all zero in the cast)
    tr = Tracker("t", torch.zeros_like(z), tol)
    done = tr.record(z, fz)
    exact = _exact(z, fz)
    assert done == (exact <= tol)
    if done:
        reported = float(tr.stats().final_residual[0])
        assert math.isclose(reported, exact, rel_tol=1e-5, abs_tol=0.0)


def _recomputations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the float64 recomputations of the returned residual (``_returned_residual``)."""
    calls = [0]
    orig = Tracker._returned_residual

    def counted(self: Tracker) -> torch.Tensor:
        calls[0] += 1
        return orig(self)

    monkeypatch.setattr(Tracker, "_returned_residual", counted)
    return calls


def test_the_plain_confirmation_is_what_a_common_stop_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcut is live: a stop at half the tolerance, at an ordinary scale, is confirmed
    by the plain norms (no float64 recomputation), in float32 and float64."""
    calls = _recomputations(monkeypatch)
    for dtype in (torch.float32, torch.float64):
        z, fz = _pair(64, 1.0, 0.5e-6, dtype, 0)
        tr = Tracker("t", torch.zeros_like(z), 1e-6)
        assert tr._lean
        assert tr.record(z, fz)
    assert calls[0] == 0


def test_half_precision_and_stops_at_the_margin_take_the_exact_recomputation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 (norms in float32 of float16 vectors) and a plain residual inside the rounding
    margin below ``tol`` are recomputed in float64."""
    calls = _recomputations(monkeypatch)
    z, fz = _pair(64, 1.0, 0.5e-3, torch.float16, 1)
    tr = Tracker("t", torch.zeros_like(z), 1e-2)
    assert tr.record(z, fz)
    assert calls[0] == 1
    z, fz = _pair(64, 1.0, 1e-6, torch.float32, 2)
    plain = float(torch.linalg.vector_norm(fz - z) / torch.linalg.vector_norm(fz))
    tr = Tracker("t", torch.zeros_like(z), plain)  # the stop sits exactly at tol
    tr.record(z, fz)
    assert calls[0] == 2


def _rounded_down_stop(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(z, fz, tol)`` where the plain residual equals ``tol`` while the float64 residual of
    the same vectors exceeds it (plain norms rounded down): a stop only the rounding margin
    refuses.  About half of all draws are such; the first of 200 is taken (which one depends
    on the CPU's summation order, that one exists does not)."""
    for seed in range(200):
        z, fz = _pair(64, 1.0, 1e-6, dtype, seed)
        plain = float(torch.linalg.vector_norm(fz - z, dim=1, keepdim=True)
                      / torch.linalg.vector_norm(fz, dim=1, keepdim=True))
        if float(exact_rel_residual(fz - z, fz)) > plain:
            return z, fz, plain
    raise AssertionError("no plain residual rounded below the exact one in 200 draws")


def test_the_rounding_margin_refuses_a_rounded_down_stop() -> None:
    z, fz, tol = _rounded_down_stop(torch.float32)
    tr = Tracker("t", torch.zeros_like(z), tol)
    assert not tr.record(z, fz)  # the exact residual says no, and it is what decides


def test_without_the_rounding_margin_the_property_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The margin is what keeps the property above true: with a zero unit round-off the plain
    norms accept a stop whose exact residual exceeds ``tol``."""
    z, fz, tol = _rounded_down_stop(torch.float32)
    monkeypatch.setattr(solvers.tracker, "EXACT_PLAIN", {torch.float32: 0.0, torch.float64: 0.0})
    tr = Tracker("t", torch.zeros_like(z), tol)
    assert tr.record(z, fz)  # the false pass the margin prevents
    assert float(exact_rel_residual(fz - z, fz)) > tol


def _later_overflow() -> tuple[Tracker, torch.Tensor, torch.Tensor]:
    """A tracker whose first iterate was ordinary and whose second sits at 1e20 in float32,
    where the plain norm of ``f(z)`` overflows and the plain residual reads 0."""
    z0, f0 = _pair(8, 1.0, 1e-1, torch.float32, 3)
    tr = Tracker("t", torch.zeros_like(z0), 1e-6)
    assert not tr.record(z0, f0)
    fz = torch.full((1, 8), 1e20)
    z = fz.clone()
    z[0, 0] -= 1e17  # true relative residual 1e17 / (1e20·√8) ≈ 3.5e-4
    return tr, z, fz


def test_a_later_extreme_iterate_is_not_confirmed_by_its_plain_norms() -> None:
    tr, z, fz = _later_overflow()
    assert not tr.record(z, fz)
    assert not bool(tr.stats().converged.any())


def test_without_the_range_check_the_later_overflow_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The range check is what refuses it: a check that accepts every scale lets the overflowed
    plain residual (0) stand as the exact one."""
    tr, z, fz = _later_overflow()
    monkeypatch.setattr(solvers.tracker, "norms_in_range",
                        lambda den, n, dtype, tol, least=0.0: True)
    assert tr.record(z, fz)


def test_a_solve_one_float32_step_above_tol_is_not_converged() -> None:
    """End to end: ``f(z) = 1`` from ``z = 0.7`` leaves a float32 residual of 0.3000000119,
    above ``tol = 0.3`` (which float32 rounds to that very value)."""
    _, st = solvers.solve(lambda x: torch.ones_like(x), torch.tensor([[0.7]]), "plain", tol=0.3,
                          max_iter=1)
    assert float(st.final_residual[0]) > 0.3
    assert not bool(st.converged[0])


# ------------------------------------------------------------------ the first record's scale check
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _edges(dtype: torch.dtype, tol: float) -> tuple[float, float]:
    """The safe range of a sample's largest entry (``_scale_ok``'s bounds)."""
    fi = torch.finfo(torch.float32 if dtype == torch.float16 else dtype)
    return 10 * fi.tiny ** 0.5 / max(tol, fi.eps), fi.max ** 0.5 / 1e3


def _state(scales: list[float | None], n: int, shape: str, dtype: torch.dtype,
           seed: int) -> torch.Tensor:
    """One sample per scale: ``scale`` times a pattern whose largest entry is either the whole
    norm (one nonzero entry) or ``norm/√n`` (all entries equal) — the two ends of the bound
    ``den/√n ≤ max|x| ≤ den`` the check relies on — or random; ``None``: a zero sample."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for sc in scales:
        if shape == "one":
            row = torch.zeros(n, dtype=torch.float64)
            row[0] = 1.0
        elif shape == "flat":
            row = torch.ones(n, dtype=torch.float64)
        else:
            row = torch.randn(n, generator=g, dtype=torch.float64)
        rows.append(row * sc if sc is not None else torch.zeros(n, dtype=torch.float64))
    return torch.stack(rows).to(dtype)


def _first_record_exact(fz: torch.Tensor, tol: float) -> bool:
    """Whether the tracker's first record switches to exact residuals (``_exact``)."""
    tr = Tracker("plain", torch.zeros_like(fz), tol)
    tr.record(torch.zeros_like(fz), fz)
    return tr.exact


@given(where=st.lists(st.one_of(st.none(), st.tuples(st.sampled_from(["lo", "hi", "any"]),
                                                       st.floats(-3.0, 3.0))),
                      min_size=1, max_size=4),
       n=st.sampled_from([1, 2, 7, 64, 1000]),
       shape=st.sampled_from(["one", "flat", "random"]),
       dtype=st.sampled_from(DTYPES),
       tol=st.sampled_from([1e-2, 1e-6, 1e-9]),
       seed=st.integers(0, 3))
# the ends of the bound, always run: a flat state just below the lower edge (its norm is √n
# above it) and one just above the upper edge with its norm √n above that
@example(where=[("lo", -0.3)], n=1000, shape="flat", dtype=torch.float32, tol=1e-6, seed=0)
@example(where=[("hi", 0.1), None], n=64, shape="flat", dtype=torch.float64, tol=1e-9, seed=0)
@example(where=[("hi", -1.0)], n=1000, shape="flat", dtype=torch.float32, tol=1e-6, seed=0)
def test_first_record_scale_check_decides_as_the_exact_check(where, n, shape, dtype, tol, seed):
    """The norm-based sufficient test only ever skips the exact check where that check says
    "safe": the decision equals ``_extreme_scale`` on every state (both are exact predicates
    on the same floats, no tolerance involved).  Sample scales are drawn within three decades
    of either edge of the safe range (where a wrong bound would show), or anywhere."""
    lo, hi = _edges(dtype, tol)
    scales = [None if w is None else
              (lo if w[0] == "lo" else hi if w[0] == "hi" else 1.0) * 10.0 ** (
                  w[1] * (1 if w[0] != "any" else 12)) for w in where]
    fz = _state(scales, n, shape, dtype, seed)
    if not bool(torch.isfinite(fz).all()):  # overflowed in this dtype: a non-finite iterate
        return
    assert _first_record_exact(fz, tol) == _extreme_scale(fz, tol)


@pytest.mark.parametrize("dtype, e", [(torch.float32, -13), (torch.float32, 17),
                                      (torch.bfloat16, -17), (torch.float64, -150)])
def test_first_record_scale_check_catches_the_edges(dtype: torch.dtype, e: int) -> None:
    """States just past the safe range, flat (largest entry = norm/√n: the end of the bound the
    check divides by) — exact mode is switched on.  (float16 never needs it: its norms run in
    float32, whose range holds every float16 square.)"""
    fz = _state([1.0, 10.0 ** e], 64, "flat", dtype, 0)
    assert _extreme_scale(fz, 1e-6)
    assert _first_record_exact(fz, 1e-6)


def test_a_broken_scale_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property above can fail: a check that forgets the ``√n`` of the lower bound (reads
    ``min den`` as the smallest largest entry) skips exact mode on a flat state whose entries
    sit below the safe range while its norm, √n times larger, does not."""
    def broken(den: torch.Tensor, n: int, dtype: torch.dtype, tol: float,
               least: float = 0.0) -> bool:
        return float(den.min()) >= least and _scale_ok(float(den.min()), float(den.max()),
                                                        dtype, tol)

    fi = torch.finfo(torch.float32)
    edge = 10 * fi.tiny ** 0.5 / 1e-6  # the smallest safe largest entry at tol 1e-6
    fz = torch.full((1, 1000), 0.5 * edge)  # below it; its norm is √1000/2 ≈ 16× above
    assert _extreme_scale(fz, 1e-6) and _first_record_exact(fz, 1e-6)
    monkeypatch.setattr(solvers.tracker, "norms_in_range", broken)
    assert not _first_record_exact(fz, 1e-6)


def test_non_finite_first_image_goes_exact() -> None:
    """A NaN in the first image makes the norms NaN: the check falls back to the exact one."""
    fz = torch.ones(3, 5)
    fz[1, 2] = math.nan
    assert _first_record_exact(fz, 1e-6) == _extreme_scale(fz, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_scale_check_on_shapes_the_property_test_does_not_draw(dtype: torch.dtype) -> None:
    """``_first_scale`` decides as ``_extreme_scale`` on states the property test above does not
    draw: (B, C, H, W) and (B, 1) states (torch's
    norm of a single entry is ``|x|`` itself, not a square root of a square), and samples whose
    entries spread over many decades (the norm is the largest entry's, so the ``den/√N`` lower
    bound is far from tight), scaled within two decades of either edge of the safe range.
    Both are exact predicates on the same floats: no tolerance."""
    g = torch.Generator().manual_seed(7)
    checked = 0
    for i in range(240):
        tol = (1e-2, 1e-6, 1e-9)[i % 3]
        lo, hi = _edges(dtype, tol)
        shape = ((2, 1), (3, 2, 2, 2), (1, 3, 5), (2, 300))[i % 4]
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        spread = (0.0, 1.0, 4.0, 10.0)[(i // 4) % 4]
        x = x * 10.0 ** (spread * torch.randn(shape, generator=g, dtype=torch.float64))
        for b in range(shape[0]):
            edge = (lo, hi, 1.0)[(i + b) % 3]
            u = float(torch.rand((), generator=g, dtype=torch.float64)) * 4 - 2
            x[b] = x[b] / x[b].abs().max() * edge * 10.0 ** u
        fz = x.to(dtype)
        if not bool(torch.isfinite(fz).all()):
            continue
        checked += 1
        assert _first_record_exact(fz, tol) == _extreme_scale(fz, tol), (shape, tol)
    # float16 cannot hold the upper edge (1.8e16 > 65504): a third of its draws overflow
    assert checked >= 60


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_ordinary_half_precision_state_is_not_measured_exactly(dtype: torch.dtype) -> None:
    """Half-precision norms accumulate in float32 (squares of entries ≤ 65504 cannot overflow
    there), but the scale check judges a float16 state by float16's own range: its window
    ``[10·sqrt(tiny)/tol, sqrt(max)/1e3] = [7.8e4, 0.26]`` would be empty, and every float16
    solve — entries of order 1 included — would measure every residual exactly: an ordinary
    float16 state is judged by float32's range.  bfloat16 (float32's range) is the control.
    No tolerance: the mode is a flag.

    Pins: float16 states were judged by float16's range (every residual measured exactly, a
    solve several times slower)."""
    z0 = torch.zeros(4, 8, dtype=dtype)
    fz = (torch.linspace(-2.0, 2.0, 32).reshape(4, 8) + 0.5).to(dtype)
    tr = Tracker("plain", z0, 1e-3)
    tr.record(z0, fz)
    assert not tr.exact


# ------------------------------------------------------------------ the lean record
@pytest.mark.parametrize("solver", ["plain", "auto", "anderson"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_lean_record_keeps_the_general_records_history(
        monkeypatch: pytest.MonkeyPatch, solver: str, dtype: torch.dtype) -> None:
    """The lean path of :meth:`Tracker.record` (later iterations of a finite (B, N) solve)
    records bit for bit what the general path records: same residual history, same returned
    iterate, same statistics — it is the same arithmetic, fewer Python steps."""
    from lowering.runtime.solvers import solve

    g = torch.Generator().manual_seed(5)
    a = 0.9 * torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))[0]
    a, b = a.to(dtype), torch.randn(6, 12, generator=g).to(dtype)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(z @ a + b)

    general = Tracker.record

    def no_lean(self, *args, **kw):  # type: ignore[no-untyped-def]
        self._lean = False
        return general(self, *args, **kw)

    runs = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(Tracker, "record", no_lean)
        z, st = solve(f, torch.zeros_like(b), solver=solver, tol=1e-5, max_iter=300)
        runs.append((z, st))
    (z1, s1), (z2, s2) = runs
    assert torch.equal(z1, z2)
    assert torch.equal(s1.residuals, s2.residuals)
    assert torch.equal(s1.converged, s2.converged) and s1.solver == s2.solver


def test_lean_record_hands_a_non_finite_iterate_to_the_general_path() -> None:
    """A sample that turns NaN after the lean path has taken over is still marked non-finite
    (its residual reads inf, never a pass), the others converge."""
    from lowering.runtime.solvers import solve

    def f(z: torch.Tensor) -> torch.Tensor:
        out = 0.5 * z + 1.0
        if bool((z[1] > 1.5).any()):  # sample 1 blows up after a few iterations
            out = out.clone()
            out[1] = math.nan
        return out

    _, st = solve(f, torch.zeros(3, 4), solver="plain", tol=1e-6, max_iter=100)
    assert st.nonfinite.tolist() == [False, True, False]
    assert st.converged.tolist() == [True, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", ["plain", "auto", "anderson"])
@pytest.mark.parametrize("shape", [(1, 6), (4, 6), (3, 2, 2, 2)])
def test_lean_record_flags_rest_on_exact_residuals_when_scales_change_mid_solve(
        dtype: torch.dtype, solver: str, shape: tuple[int, ...]) -> None:
    """Iterates start at 1 and shrink towards a fixed
    point of size 1e-18 in sample 0 (its difference's squares underflow in float32 late in the
    solve, when the lean path measures it) while the others stay O(1): every sample flagged
    converged meets tol by an exact residual of the returned point, the warm start is left
    unchanged and not returned.  (Tolerance: the exact residual is recomputed in float64 from
    the returned tensors; 1.01 absorbs the float32 rounding of the stored residual.)"""
    g = torch.Generator().manual_seed(1)
    b = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    scale = torch.ones((shape[0],) + (1,) * (len(shape) - 1), dtype=dtype)
    scale[0] = 1e-18

    def f(z: torch.Tensor) -> torch.Tensor:
        return 0.5 * z + scale * b

    z0 = torch.ones(shape, dtype=dtype)
    z0c = z0.clone()
    z, st = solve(f, z0, solver=solver, tol=TOL, max_iter=80)
    fz = f(z)
    exact = exact_rel_residual((fz - z).double(), fz.double())
    assert bool(st.converged.all())
    assert bool((exact <= TOL * 1.01).all()), exact
    assert torch.equal(z0, z0c) and z.data_ptr() != z0.data_ptr()


# ------------------------------------------------------------------ no false convergence
@pytest.mark.parametrize("f, z0", [(shrinking, torch.ones(2, 8)),
                                   (one_diverging, torch.zeros(2, 8))],
                         ids=["warm-start-to-tiny-scale", "one-diverging-sample"])
def test_a_false_zero_reached_after_the_first_image_leaves_no_trace_in_the_history(
        f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor) -> None:
    """The first-image scale check only sees the first iterate; later iterates can still reach
    scales where float32 plain norms read 0.  (a) A warm start at ordinary scale (``z0 = 1``)
    shrinking towards the fixed point ``2e-19`` of ``z/2 + 1e-19``: ~75 iterations in, the
    differences' squares underflow and the plain residual reads 0 where the exact one is
    ~1.3e-4.  (b) A batch in which one sample diverges (``2z + 1``, the other converges): near
    ``|f(z)| ≈ 7e18`` ``||f(z)||²`` overflows while ``||f(z) − z||²`` does not, and that sample
    reads 0 where its residual is 0.5.  The stop is confirmed exactly (the solve goes on), no
    recorded residual at or below ``tol`` belongs to an iterate that misses it, and in (a)
    ``iterations`` counts to the iterate that meets ``tol`` (83).

    Tolerances: every operation is an elementwise float32 ``a·z + c`` (no reduction, no BLAS:
    the same bits on every CPU); the recomputed exact residuals are float64 norms of float32
    vectors (exact to ~1e-16 relative); the false entries are 0 against a true ≥ 1e-4, the
    ``1.001·tol`` margin only absorbs float64 rounding.

    Pins: the false 0 stayed in ``SolverStats.residuals``: in (a) ``iterations`` said 75, and
    in (b) a best-iterate replay of the whole solve aimed at the false 0."""
    tol = 1e-6
    _, st = solve(f, z0, "plain", tol=tol, max_iter=100)
    false_pass = false_passes(f, z0, st, tol)
    assert not bool(false_pass.any()), (false_pass.nonzero()[:4], st.residuals[:, -10:])
    if f is shrinking:  # plain from z0: the first iterate meeting tol is the last recorded
        assert bool(st.converged.all())
        assert st.iterations.tolist() == [st.residuals.shape[1]] * 2


def _ftz_case() -> tuple[torch.Tensor, torch.Tensor, float]:
    """One float32 sample near the low end of the plain-norm range whose difference has eight
    entries just below ``√tiny`` (their squares are subnormal, flushed to 0 in FTZ mode: the
    first product of each SIMD lane has no accumulator to land in) and the rest of its norm on
    entries where ``T(z)`` is small (fine-grained differences).  ``tol·k`` is the target."""
    tiny = torch.finfo(torch.float32).tiny
    tol, n, k = 1e-6, 32, 1.0
    s = 2 * math.sqrt(n) * 10 * math.sqrt(tiny) / tol * 1.05  # just inside the range check
    fz = torch.zeros(1, n, dtype=torch.float32)
    fz[0, 8] = s
    fz[0, 9:] = s * 1e-3
    den = float(fz.double().norm())
    small = 0.99 * math.sqrt(tiny)
    z = fz.clone()
    z[0, :8] = -small
    dd = math.sqrt((tol * k * den) ** 2 - 8 * small ** 2) / math.sqrt(n - 9)
    z[0, 9:] = fz[0, 9:] - dd
    return z, fz, tol


def test_flush_denormal_does_not_let_a_plain_stop_pass_above_tol() -> None:
    """With ``torch.set_flush_denormal(True)`` the stop is accepted only if the float64
    residual of the very float32 vectors meets ``tol`` (float64 squares of these entries are far
    from under- or overflow; no tolerance is involved: the flag must agree with the exact
    residual's side of ``tol``).

    Pins: flushed squares below ``tiny`` let a stop pass on its plain residual above ``tol``."""
    z, fz, tol = _ftz_case()
    d = (fz - z).double()
    exact = float(d.norm() / fz.double().norm())
    assert exact > tol  # the case is what it claims: above tol by ~1e-4 relative
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        tr = Tracker("t", z, tol)
        done = tr.record(z, fz)
        st = tr.stats()
    finally:
        torch.set_flush_denormal(False)
    assert not done
    assert not bool(st.converged.any())
    assert float(st.final_residual[0]) > tol


def test_a_plain_stop_reports_the_floored_residual() -> None:
    """float64 state at ~1e-40: ``||d|| / max(||fz||, 1e-30)`` is the documented residual;
    the reported one must be it (float64 rounding: 1e-12 relative is ~10⁴ ulps).

    Pins: a stop accepted on its plain residual reported ``||d|| / ||fz||``."""
    fz = torch.full((1, 4), 1e-40, dtype=torch.float64)
    z = fz * (1 - 1e-8)
    tr = Tracker("t", z, 1e-6)
    assert tr.record(z, fz)
    d = fz - z
    want = float(d.norm() / max(float(fz.norm()), 1e-30))
    got = float(tr.stats().final_residual[0])
    assert math.isclose(got, want, rel_tol=1e-12), (got, want)


@pytest.mark.parametrize("solver", ["plain", "auto"])
@pytest.mark.parametrize("max_iter", list(range(14, 24)))
def test_refused_stop_leaves_a_consistent_tracker(solver: str, max_iter: int) -> None:
    """A float32 state whose scale falls to ~1e-19 (``||fz − z||`` squares underflow, the
    plain residual reads 0 while the exact one is ~1e-5): the plain stop is refused and the
    solve goes on exactly.  Wherever it ends (``max_iter`` around the refusal, ``auto``'s
    switch), ``converged``/``final_residual`` describe the returned point: recomputed in
    float64 from it (1e-3 relative: float32 iterates, float64 norms on both sides; the
    residual is 1e-8..1, the flags are booleans at tol 1e-6, far from 1e-3 of tol)."""
    a = 0.1
    g = torch.Generator().manual_seed(0)
    c = (1 - a) * 1e-19 * (1 + torch.rand(3, 8, generator=g))

    def f(z: torch.Tensor) -> torch.Tensor:
        return a * z + c

    z, st = get_solver(solver)(f, torch.ones(3, 8), tol=1e-6, max_iter=max_iter)
    fz = f(z).double()
    r = (fz - z.double()).norm(dim=1) / fz.norm(dim=1).clamp_min(1e-30)
    torch.testing.assert_close(st.final_residual.double(), r, rtol=1e-3, atol=0)
    assert torch.equal(st.converged, r <= 1e-6)
    assert st.residuals.shape[1] <= max_iter


@pytest.mark.parametrize("scale", [1e20, 1e30, 1e-22, 1e-25])
def test_float32_extreme_scales_never_converge_falsely(scale: float) -> None:
    """float32 iterates with entries ~``scale`` and a true relative residual of 1e-3: plain
    float32 norms overflow (1e20²) or underflow (1e-22²) there, yet the returned flag must say
    "not converged" and the reported residual must be the exact 1e-3 (float64 norms)."""
    n = 50
    fz = torch.full((2, n), scale, dtype=torch.float32)
    z = fz.clone()
    z[:, 0] -= 1e-3 * scale * n ** 0.5  # ||fz − z|| / ||fz|| = 1e-3 (up to float32 rounding)
    tr = Tracker("t", z, 1e-6)
    assert not tr.record(z, fz)
    st = tr.stats()
    assert not bool(st.converged.any())
    exact = (fz.double() - z.double()).norm(dim=1) / fz.double().norm(dim=1)
    # the reported residual is the float64 one of the same float32 vectors: equal to 1e-6
    assert torch.allclose(st.final_residual.double(), exact, rtol=1e-6)


def test_a_false_plain_convergence_is_confirmed_away() -> None:
    """A fixed-point map whose iterates sit at 1e20 in float32: the plain norm of f(z)
    overflows to inf, so the plain residual reads 0 ("converged") at the first step; the exact
    confirmation disagrees and the solve goes on, measuring exactly, to the true fixed point."""
    target = torch.full((1, 8), 1e20, dtype=torch.float32)

    def f(z: torch.Tensor) -> torch.Tensor:
        return 0.5 * z + 0.5 * target  # contraction 0.5 towards target

    z0 = torch.full((1, 8), 3e20, dtype=torch.float32)
    z, st = get_solver("plain")(f, z0, tol=1e-6, max_iter=100)
    assert bool(st.converged.all()) and st.residuals.shape[1] > 5
    assert float((z - target).abs().max() / 1e20) < 1e-5


def test_overflowing_iterate_norm_is_not_zero():
    """Components of 1e200 (float64): the unscaled ||·||² overflows to inf; the residual is
    still 0.5, not ``x/inf = 0`` (which would read as converged)."""
    fz = torch.full((1, 10), 1e200, dtype=T64)
    z = fz * 0.5
    r = rel_residual(fz, z)
    assert abs(float(r) - 0.5) < 1e-12


@pytest.mark.parametrize("scale", [2e153, 1e160, 1e300])  # 2e153: only ||f(z)|| overflows
def test_tracker_never_converges_on_an_overflowing_norm(scale):
    """The solvers' fast residual (plain float64 norms) must hand an overflowing ||f(z)|| to the
    scaled form: f(z) with entries ~scale and ||f(z) − z|| / ||f(z)|| = 1e-3 is not converged at
    tol 1e-6, whichever of the two norms overflows."""
    fz = torch.full((2, 50), scale, dtype=T64)
    z = fz.clone()
    z[:, 0] -= 1e-3 * scale * np.sqrt(50)  # relative residual 1e-3
    tr = Tracker("t", z, 1e-6)
    assert not tr.record(z, fz)
    st = tr.stats()
    assert not bool(st.converged.any())
    assert torch.allclose(st.final_residual, torch.full((2,), 1e-3, dtype=T64), rtol=1e-9)

def test_float32_residual_norm_does_not_overflow_into_false_convergence() -> None:
    """At |x| ~ 1e20 the float32 residual is still 1e-3 (float32 ``||·||`` would overflow),
    and a module whose iterates sit there raises rather than reporting convergence.

    Pins: ``r/inf = 0`` reported a wrong iterate (67 % off) as converged."""
    fz = torch.tensor([[3e19, -4e19, 2e20]])
    r = rel_residual(fz, fz * (1 + 1e-3))
    assert r.dtype == torch.float32 and abs(float(r) - 1e-3) < 1e-6  # float32 rounding of 1e-3
    d = lowering.lower(models.opteq(n=5, m=4, d=3, form="conjugate", weight_norm=0.999, seed=3))
    m = d.torch_module(dtype=torch.float32, tol=1e-7, max_iter=3, on_nonconvergence="raise")
    with pytest.raises(ce.ConvergenceError):
        m(torch.tensor([[8.0328e19, 1.7483e19, 8.8978e18]]))
