"""Compiled chunks of plain iterations (``lowering.solvers.CompiledSteps``), what an emitted
module runs inside ``torch.compile``: the same iterates and the same stop as the eager loop,
every claim of convergence confirmed exactly, and the module's compiled path equal to its
eager one.

All in float64 on tiny states (each compiled chunk costs a few seconds of compiling once)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import lowering
from convex_eq.errors import OptionError
from convex_eq.models import opteq
from lowering.solvers import CompiledSteps, compiled_steps, exact_rel_residual, solve

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
    with compiled_steps(steps):
        zc, sc = solve(f, z0, solver, tol=1e-10, max_iter=200)
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
    with compiled_steps(Lying(8)):
        z, st = solve(f, z0, "plain", tol=1e-10, max_iter=300)
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

    with compiled_steps(CompiledSteps(4)):
        z, st = solve(f, torch.zeros(2, 3, dtype=F64), "plain", tol=1e-12, max_iter=100)
    assert bool(st.converged[0]) and not bool(st.converged[1])
    assert bool(st.nonfinite[1])
    torch.testing.assert_close(z[0], torch.full((3,), 2.0, dtype=F64), rtol=1e-11, atol=0)


def test_an_unconverged_solve_returns_each_samples_recorded_minimum() -> None:
    """The replay of an unconverged solve (``_per_sample_best``) runs eagerly on the chunked
    first run's schedule: sample 1 (no fixed point: its residual falls, then rises) gets the
    iterate with the smallest recorded residual.  Tolerance: the same float64 iterate measured
    in the chunk and exactly, a few ulps apart; 1e-9 relative."""
    def f(z: torch.Tensor) -> torch.Tensor:
        out = 0.5 * z + 1.0
        drift = z + 0.01 * (1 + z ** 2)
        return torch.where((torch.arange(2) == 1)[:, None] & (torch.arange(2) == 1), drift, out)

    with compiled_steps(CompiledSteps(8)):
        z, st = solve(f, torch.zeros(2, 2, dtype=F64), "plain", tol=1e-6, max_iter=100)
    assert bool(st.converged[0]) and not bool(st.converged[1])
    fz = f(z)
    best = torch.nan_to_num(st.residuals, nan=math.inf).min(dim=1).values
    torch.testing.assert_close(exact_rel_residual(fz - z, fz)[1], best[1], rtol=1e-9, atol=0)


def _close_fixed_points(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-11,
                        rate: float = 0.9) -> None:
    """Two points each with relative residual ≤ ``tol`` of the same ``rate``-contraction lie
    within ``2·tol·||z||/(1 − rate)`` of the fixed point per sample; 1.5× that for rounding."""
    diff = torch.linalg.vector_norm(a - b, dim=1)
    bound = 3 * tol / (1 - rate) * torch.linalg.vector_norm(b, dim=1) + 1e-300
    assert bool((diff <= bound).all()), (diff, bound)


def _layer(**kw):  # type: ignore[no-untyped-def]
    d = lowering.lower(opteq(n=6, m=6, d=3, activation="relu", weight_norm=0.9, seed=2))
    return d.torch_module(dtype=F64, tol=1e-11, max_iter=300, backward_tol=1e-11,
                          backward_adjoint="iterative", **kw)


def test_torch_compile_runs_the_solves_in_compiled_chunks() -> None:
    """``torch.compile(module)``: the forward and the adjoint solve run in compiled chunks
    (their statistics say so), the outputs and every gradient equal the eager module's, and
    ``compile_steps=0`` keeps the eager loop.

    Tolerance: both solves stop at relative residual 1e-11 of a 0.9-contraction (the chunk
    schedule may run a few iterations past the eager stop), so the outputs agree within the
    per-sample bound of ``_close_fixed_points``; the gradients (adjoint solves with the same
    tolerance, and ``z*`` entering them) to 1e-8 relative, with 1e-10 absolute for entries
    near zero, on any BLAS."""
    eager = _layer()
    comp_mod = _layer()
    comp_mod.load_state_dict(eager.state_dict())
    x = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, mod, call in (("eager", eager, eager), ("compiled", comp_mod,
                                                       torch.compile(comp_mod))):
        xx = x.clone().requires_grad_()
        z = call(xx)
        grads = torch.autograd.grad((z ** 2).sum(), [xx, *mod.parameters()])
        out[name] = (z.detach(), grads, mod.last_stats.solver, mod.last_backward_stats.solver)
    assert "compiled" not in out["eager"][2]
    assert out["compiled"][2].startswith("plain[compiled×16]"), out["compiled"][2]
    assert out["compiled"][3].startswith("plain[compiled×16]"), out["compiled"][3]
    _close_fixed_points(out["compiled"][0], out["eager"][0])
    for a, b in zip(out["compiled"][1], out["eager"][1]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)

    off = _layer(compile_steps=0)
    torch.compile(off)(x)
    assert "compiled" not in off.last_stats.solver


def test_a_module_used_under_torch_compile_still_pickles() -> None:
    """The compiled chunks a module made are dropped from its pickle (made again on use); the
    unpickled module (eager) computes the same equilibrium (bound: ``_close_fixed_points``)."""
    m = _layer(compile_steps=4)
    x = torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.compile(m)(x)
    assert "_compiled" in m.__dict__
    back = pickle.loads(pickle.dumps(m))
    assert "_compiled" not in back.__dict__
    with torch.no_grad():
        _close_fixed_points(back(x), ref)


@pytest.mark.parametrize("bad", [-1, True, 2.5, "8"])
def test_compile_steps_is_validated(bad: object) -> None:
    with pytest.raises(OptionError, match="compile_steps"):
        _layer(compile_steps=bad)

