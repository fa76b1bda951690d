"""The conjugate-gradient adjoint (lowering/backward.py, ``_cg_adjoint``): used where the plan's
``Jᵀ`` is ``L(d ⊙ ·)`` with ``L`` self-adjoint (a Gram matrix or ``Aᵀ(A·)``), the adjoint
solver is ``auto`` and the method ``auto``; the same gradient as the iterative adjoint; a typed
fallback to the configured solver wherever it cannot vouch for its result."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering.runtime.backward import AdjointConfig, FixedPointProblem
from lowering.runtime.backward.adjoint import adjoint_from_map as _adjoint_from_map
from lowering.runtime.linear import solve_cg
from lowering.runtime.plan.transpose import DiagonalThenT, FunctionT, MatrixT
from lowering.runtime.solvers import SolverStats
from tests.lowering.runtime.helpers import relu_layer

T64 = torch.float64



def _cg_adjoint(d: torch.Tensor, inner: object, jt: object, v: torch.Tensor,
                cfg: AdjointConfig) -> object:
    """The CG linear solve as the adjoint calls it (:func:`lowering.runtime.linear.solve_cg`)."""
    return solve_cg(jt, v, tol=cfg.tol, max_iter=cfg.max_iter, split=(d, inner))

def _layer():
    return relu_layer(m=20, n=10, norm=0.9)


def _grad(mod: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    xx = x.detach().clone().requires_grad_()
    (mod(xx) * c).sum().backward()
    return xx.grad


@pytest.mark.parametrize("batch", [64, 200])
def test_default_adjoint_is_cg_with_the_iterative_gradient(batch: int) -> None:
    """The Gram matrix ``WᵀW`` is self-adjoint (B·N > 512 here: no direct solve).  Both
    adjoints stop at a relative residual of 1e-12 (float64) on a map that contracts with factor
    ≤ ‖W‖² = 0.81, so each gradient is within 1e-12/(1 − 0.81) ≈ 5e-12 of the exact one
    (relative): 1e-9 leaves a wide margin on any BLAS."""
    d = _layer()
    rng = np.random.default_rng(batch)
    x = torch.as_tensor(rng.standard_normal((batch, 10)), dtype=T64)
    c = torch.as_tensor(rng.standard_normal((batch, 10)), dtype=T64)
    kw = dict(weight_control=None, dtype=T64, tol=1e-12, max_iter=500)
    mod = d.torch_module(**kw)
    ref = d.torch_module(backward_adjoint="iterative", **kw)
    g, g_ref = _grad(mod, x, c), _grad(ref, x, c)
    st_ = mod.last_backward_stats
    assert st_.solver == "cg" and ref.last_backward_stats.solver != "cg"
    assert bool(st_.converged.all()) and float(st_.returned_residual.max()) <= 1e-12
    # fewer iterations than plain iteration needs on the same system
    assert int(st_.iterations.max()) < int(ref.last_backward_stats.iterations.max())
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)


def test_b1_plan_without_gram_uses_cg() -> None:
    """N ≥ 2m: no Gram matrix is formed (``Aᵀ(A·)`` per application, cheaper there), and a map
    has no blocks for a direct solve: CG takes the self-adjoint ``Aᵀ(A·)``.  Tolerances as in
    the test above (float64, 1e-12, factor ≤ 0.81)."""
    d = relu_layer(m=8, n=32, norm=0.9)
    mod = d.torch_module(weight_control=None, dtype=T64, tol=1e-12, max_iter=500,
                         backward_adjoint="iterative")
    x = torch.randn(1, 32, dtype=T64, generator=torch.Generator().manual_seed(0))
    c = torch.randn(1, 32, dtype=T64, generator=torch.Generator().manual_seed(1))
    g_ref = _grad(mod, x, c)
    mod.config.backward.adjoint = "auto"
    g = _grad(mod, x, c)
    assert mod.last_backward_stats.solver == "cg"
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("opts", [{"backward_solver": "plain"}, {"backward_solver": "anderson"},
                                  {"backward_adjoint": "iterative"}])
def test_an_explicit_adjoint_choice_is_kept(opts: dict) -> None:
    d = _layer()
    mod = d.torch_module(weight_control=None, dtype=T64, tol=1e-10, max_iter=500, **opts)
    _grad(mod, torch.randn(64, 10, dtype=T64), torch.randn(64, 10, dtype=T64))
    assert mod.last_backward_stats.solver != "cg"


def _spd_case(seed: int, n: int, b: int, rho: float, binary: bool):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=T64)
    m = (a + a.T) / 2
    m *= rho / torch.linalg.matrix_norm(m, 2)
    d = (torch.rand(b, n, generator=g, dtype=T64) > 0.4).to(T64) if binary \
        else torch.rand(b, n, generator=g, dtype=T64)
    v = torch.randn(b, n, generator=g, dtype=T64)
    return m, d, v


@settings(deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 24), b=st.integers(1, 9),
       rho=st.floats(0.05, 0.97), binary=st.booleans())
def test_cg_solves_the_adjoint_system(seed: int, n: int, b: int, rho: float,
                                      binary: bool) -> None:
    """For a symmetric ``M`` with ‖M‖ = ρ < 1 and ``d ∈ [0, 1]`` the system ``g = v + (d ⊙ g)M``
    is symmetric positive definite after the change of variables: CG returns ``g`` with the
    checked relative residual ≤ tol, and ``g`` matches a dense solve of each sample's system
    within tol/(1 − ρ) (relative; 1e-10 is tol here, float64)."""
    m, d, v = _spd_case(seed, n, b, rho, binary)
    jt = DiagonalThenT(d, MatrixT(m, symmetric=True))
    cfg = AdjointConfig("auto", 1e-10, 500, "raise", "auto", True)
    out = _cg_adjoint(d, jt.inner, jt, v, cfg)
    assert out is not None
    g, stats = out
    assert stats.solver == "cg" and bool(stats.converged.all())
    for i in range(b):  # row convention: g_i = v_i + (d_i ⊙ g_i) M  ⇔  (I − Mᵀ D_i) g_iᵀ = v_iᵀ
        a = torch.eye(n, dtype=T64) - m.T @ torch.diag(d[i])
        ref = torch.linalg.solve(a, v[i])
        err = float((g[i] - ref).norm() / ref.norm().clamp_min(1e-300))
        assert err <= 1e-10 / (1 - rho) * 10, (i, err)


def test_a_system_cg_cannot_take_goes_to_the_configured_solver() -> None:
    """A negative ``d`` (no square root: the symmetrisation does not exist) on a map that still
    contracts (‖M‖ = 0.5, |d| ≤ 1): CG gives no result and the adjoint is the configured
    solver's, with its statistics and a gradient that solves the system (relative residual
    checked by the solver at tol 1e-10, float64; the bound 1e-8 leaves a wide margin)."""
    m, _, v = _spd_case(5, 16, 40, 0.5, False)  # B·N = 640 > 512: no direct solve
    d = torch.rand(40, 16, dtype=T64, generator=torch.Generator().manual_seed(2)) * 1.5 - 0.5
    jt = DiagonalThenT(d, MatrixT(m, symmetric=True))
    seen: list = []
    cfg = AdjointConfig("auto", 1e-10, 500, "raise", "auto", True)
    problem = FixedPointProblem(lambda z, ts: z, [], cfg, seen.append)
    g = _adjoint_from_map(jt, torch.zeros(40, 16, dtype=T64), v, problem)
    assert seen and "cg" not in seen[-1].solver and bool(seen[-1].converged.all())
    res = g - v - (d * g) @ m
    assert float((res.norm(dim=1) / g.norm(dim=1)).max()) <= 1e-8


def test_nan_cotangent_gives_no_cg_result() -> None:
    m, d, v = _spd_case(4, 8, 3, 0.5, True)
    v[1, 2] = math.nan
    jt = DiagonalThenT(d, MatrixT(m, symmetric=True))
    assert _cg_adjoint(d, jt.inner, jt, v, AdjointConfig("auto", 1e-8, 100, "raise", "auto",
                                                         True)) is None


def test_symmetric_split_needs_a_self_adjoint_map() -> None:
    d = torch.ones(2, 3)
    assert DiagonalThenT(d, MatrixT(torch.eye(3), symmetric=False)).symmetric_split() is None
    assert DiagonalThenT(d, FunctionT(lambda v: v)).symmetric_split() is None
    assert DiagonalThenT(d, FunctionT(lambda v: v, self_adjoint=True)).symmetric_split() \
        is not None


def _exact_zero_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``M = 0.5 I + 0.1 S`` (symmetric, ``S`` zero diagonal, ‖M‖ < 1); sample 0 has one active
    unit (``d = e₀``, ``v = e₀``): its first CG step is exact in binary floating point
    (``pAp = 0.5``, ``α = 2``, ``r = 1 − 2·0.5 = 0``); samples 1–3 need several iterations."""
    n = 6
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=T64)
    s = (a + a.T) / 2
    s.fill_diagonal_(0.0)
    s /= torch.linalg.matrix_norm(s, 2)
    m = 0.5 * torch.eye(n, dtype=T64) + 0.1 * s
    d = torch.rand(4, n, generator=g, dtype=T64) * 0.5 + 0.5
    v = torch.randn(4, n, generator=g, dtype=T64)
    d[0] = 0.0
    d[0, 0] = 1.0
    v[0] = 0.0
    v[0, 0] = 1.0
    return m, d, v


def test_cg_sample_with_exact_zero_residual_does_not_abandon_the_batch() -> None:
    """The system is SPD (‖S M S‖ ≤ ‖M‖ ≤ 0.6, every d ∈ [0, 1]): CG must solve it, also when
    one sample's recurrence residual reaches exactly 0 (sample 0 after one step), and give each
    sample the dense solve's ``g`` (float64, 1e-8 relative against a CG tolerance of 1e-10).

    Pins: ``pAp`` and ``rᵀr`` were clamped only when some sample started with ``s ⊙ v = 0``;
    a sample that finished exactly later gave ``α = 0/0`` and CG was abandoned for the whole
    batch (the same batch with an extra all-zero cotangent row was solved)."""
    m, d, v = _exact_zero_case()
    jt = DiagonalThenT(d, MatrixT(m, symmetric=True))
    cfg = AdjointConfig("auto", 1e-10, 200, "raise", "auto", True)
    # the same batch plus a zero row: the clamps are on, and CG succeeds
    d2, v2 = torch.cat([d, d[:1]]), torch.cat([v, torch.zeros_like(v[:1])])
    assert _cg_adjoint(d2, MatrixT(m, symmetric=True),
                       DiagonalThenT(d2, MatrixT(m, symmetric=True)), v2, cfg) is not None
    out = _cg_adjoint(d, jt.inner, jt, v, cfg)
    assert out is not None, "CG gave up on an SPD batch: one sample finished exactly"
    g, _ = out
    for i in range(d.shape[0]):  # g_i = v_i + (d_i ⊙ g_i) M  ⇔  (I − Mᵀ D_i) g_iᵀ = v_iᵀ
        ref = torch.linalg.solve(torch.eye(6, dtype=T64) - m.T @ torch.diag(d[i]), v[i])
        torch.testing.assert_close(g[i], ref, rtol=1e-8, atol=1e-12)


def test_float32_relu_layer_takes_cg_by_default() -> None:
    """The canonical ReLU layer (float32, defaults, N = 10, B = 200): B·N > 512, so no direct
    solve; ``WᵀW`` is formed and self-adjoint: the default adjoint is documented to be CG
    (docs/theory.md §8).  CG finishes there in 8–10 iterations on every seed tried (10/10).

    Pins: the batch fell back to plain iteration after ~7 wasted CG iterations whenever a
    sample's residual reached exactly 0 (nearly every call at N = 10 or 16)."""
    d = _layer()
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.standard_normal((200, 10)), dtype=torch.float32).requires_grad_()
    c = torch.as_tensor(rng.standard_normal((200, 10)), dtype=torch.float32)
    mod = d.torch_module(weight_control=None, dtype=torch.float32)
    (mod(x) * c).sum().backward()
    st = mod.last_backward_stats
    assert bool(st.converged.all())
    assert st.solver == "cg", f"default adjoint fell back to {st.solver!r}"


def test_cg_iterations_follow_the_stats_contract() -> None:
    """``SolverStats.iterations``: "(B,) iterations until the sample first met tol (or K)", read
    from the sample's own ``residuals`` — what every other solver's statistics give (the
    property computes it when ``iterations_`` is None).  Sample 0 (``s ⊙ v = 0``: its residual
    history is 0 from the first iteration) meets tol at iteration 1.

    Pins: the CG statistics gave every sample the batch's iteration count K."""
    g = torch.Generator().manual_seed(1)
    n, b = 12, 5
    a = torch.randn(n, n, generator=g, dtype=T64)
    m = (a + a.T) / 2
    m *= 0.9 / torch.linalg.matrix_norm(m, 2)
    d = torch.rand(b, n, generator=g, dtype=T64)
    v = torch.randn(b, n, generator=g, dtype=T64)
    d[0] = 0.0  # sample 0: nothing active, g = v exactly
    jt = DiagonalThenT(d, MatrixT(m, symmetric=True))
    out = _cg_adjoint(d, jt.inner, jt, v, AdjointConfig("auto", 1e-10, 200, "raise", "auto",
                                                        True))
    assert out is not None
    st = out[1]
    assert st.solver == "cg" and st.residuals.shape[1] > 1
    by_contract = SolverStats(st.solver, st.residuals, None, st.converged, st.tol,
                              returned_residual=st.returned_residual).iterations
    assert int(by_contract[0]) == 1
    assert torch.equal(st.iterations, by_contract), (st.iterations, by_contract)
