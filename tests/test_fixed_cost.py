"""The per-call fixed cost after this round of cuts (lowering/solvers.py, plan.py, nodes.py,
module.py): the stop confirmed by the plain norms themselves where they are provably exact
enough, the first record on the lean path, the transpose Jacobian without the unused value,
and per-node caches of what does not change between calls.  Each shortcut must decide what
the slower form decided, and each test that guards one is shown to fail on a broken rule."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import lowering
from benchmarks.common import qp_objective, qp_weight
from lowering import solvers
from lowering.solvers import Tracker, exact_rel_residual


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
    monkeypatch.setattr(solvers, "_EXACT_PLAIN", {torch.float32: 0.0, torch.float64: 0.0})
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
    monkeypatch.setattr(solvers, "_norms_in_range", lambda den, n, dtype, tol, least=0.0: True)
    assert tr.record(z, fz)


# ------------------------------------------------------------------ the module's fixed path
def _module(**kw: object) -> lowering.EquilibriumModule:
    layer = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-6, max_iter=200, backward_tol=1e-6,
                backward_max_iter=200, dtype=torch.float64)
    opts.update(kw)
    return layer.torch_module(**opts)


def test_first_order_backward_needs_no_value_from_the_linearisation() -> None:
    """``linearize(z, value=False)`` gives the same ``Jᵀ`` as with the value (which it may
    skip computing), on the canonical plan."""
    mod = _module()
    q = torch.randn(4, 64, dtype=torch.float64)
    z = torch.relu(torch.randn(4, 64, dtype=torch.float64))
    inputs, env = mod._inputs(q), mod.env()
    keys_in, keys_env = list(inputs), list(env)
    tensors = [inputs[k] for k in keys_in] + [env[k] for k in keys_env]
    root, _ = mod._plan(keys_in, keys_env, tensors, z)
    out, jt = root.linearize(z)
    none, jt2 = root.linearize(z, value=False)
    assert out is not None and none is None
    v = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(jt2(v), jt(v), rtol=0, atol=0)


def test_module_caches_survive_pickle_deepcopy_and_moves() -> None:
    """The per-node caches (activation ops, the bilinear placeholder zero) are not pickled and
    are made again for another dtype; outputs and gradients agree bit for bit."""
    mod = _module()
    q = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    z1 = mod(q)
    (g1,) = torch.autograd.grad(z1.sum(), q)
    for other in (pickle.loads(pickle.dumps(mod)), copy.deepcopy(mod)):
        z2 = other(q)
        (g2,) = torch.autograd.grad(z2.sum(), q)
        torch.testing.assert_close(z2, z1, rtol=0, atol=0)
        torch.testing.assert_close(g2, g1, rtol=0, atol=0)
    f32 = copy.deepcopy(mod).to(torch.float32)
    torch.testing.assert_close(f32(q.float()).double(), z1, rtol=1e-4, atol=1e-5)
    sig = mod.derived.nodes["z"]
    assert "_ops" not in pickle.loads(pickle.dumps(sig)).__dict__


def test_a_term_that_writes_into_the_placeholder_does_not_poison_the_next_call() -> None:
    """The cached zero passed for a bilinear term's state argument is replaced once anything
    wrote into it (its version counter moved)."""
    mod = _module()
    node = mod.derived.nodes["z"].inner
    like = torch.zeros(1, dtype=torch.float64)
    zero = node._zeros(64, like)
    assert node._zeros(64, like) is zero
    zero.add_(1.0)
    fresh = node._zeros(64, like)
    assert fresh is not zero and not bool(fresh.any())


def test_flat_and_shaped_inputs_take_the_same_route() -> None:
    """The fast path for one flat ``(B, size)`` input returns what the general one does (the
    dtype cast included)."""
    mod = _module()
    q = torch.randn(5, 64, dtype=torch.float32)
    fast = mod._inputs(q)
    assert fast["q"].dtype == torch.float64 and torch.equal(fast["q"], q.double())
    general = mod._inputs({"q": q})
    assert torch.equal(general["q"], fast["q"])


@pytest.mark.parametrize("tol", [0.3, 1e-3, 0.1, 1e-6 * (1 + 2**-30)])
def test_flags_compare_with_the_unrounded_tolerance(tol: float) -> None:
    """A float32 residual equal to ``tol`` rounded *up* to float32 lies above ``tol``: it is not
    converged, and ``iterations`` does not count it as a pass (torch would round the Python
    scalar to float32 in ``r <= tol`` and admit it).  The flags decide as the stop test does,
    on exact values."""
    t32 = float(torch.tensor(tol, dtype=torch.float32))
    if not t32 > tol:  # rounds down: step up to the next float32
        t32 = float(torch.nextafter(torch.tensor(tol, dtype=torch.float32),
                                    torch.tensor(1.0)))
    assert t32 > tol
    r = torch.tensor([t32, 0.5 * tol], dtype=torch.float32)
    st = solvers.SolverStats("t", r[:, None], None, None, tol, None, r)
    assert st.converged.tolist() == [False, True]
    assert st.iterations.tolist() == [1, 1]  # K = 1 for the sample that never met tol
    assert not bool(solvers._meets(r[:1], tol)[0])


def test_a_solve_one_float32_step_above_tol_is_not_converged() -> None:
    """End to end: ``f(z) = 1`` from ``z = 0.7`` leaves a float32 residual of 0.3000000119,
    above ``tol = 0.3`` (which float32 rounds to that very value)."""
    _, st = solvers.solve(lambda x: torch.ones_like(x), torch.tensor([[0.7]]), "plain", tol=0.3,
                          max_iter=1)
    assert float(st.final_residual[0]) > 0.3
    assert not bool(st.converged[0])
