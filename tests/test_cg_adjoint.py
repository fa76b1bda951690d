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

from lowering.backward import AdjointConfig, FixedPointProblem, _adjoint_from_map, _cg_adjoint
from lowering.plan import DiagonalThenT, FunctionT, MatrixT
from tests.test_entry_path import _layer as _entry_layer

T64 = torch.float64


def _layer():
    return _entry_layer(m=20, n=10, norm=0.9)


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
    d = _entry_layer(m=8, n=32, norm=0.9)
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
