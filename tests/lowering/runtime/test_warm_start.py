"""Warm starts from the per-sample cache of equilibria (``torch_module(warm_start=N)``,
``forward(x, sample_ids=ids)``): where the certificate makes the equilibrium unique, a solve
started from a sample's last equilibrium reaches the same point as a cold one; elsewhere the
cache is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import OptionError, ShapeError

F64 = torch.float64


def _numpy_equilibrium(env: dict[str, torch.Tensor], x: np.ndarray) -> tuple[np.ndarray, float]:
    """``z = relu(U x + b + Wᵀ W z)`` (the canonical ReLU OptEq layer) by plain iteration in
    float64 numpy to a residual of 1e-12, and its contraction rate ``||W||₂²`` (a dense SVD):
    weight control keeps ``||W||₂ ≤ 0.99``, so the iteration converges."""
    U, b, W = (env[k].detach().double().numpy() for k in ("U", "b", "W"))
    rate = float(np.linalg.norm(W, 2)) ** 2
    assert rate < 1.0
    q = x @ U.T + b
    M = W.T @ W
    z = np.zeros_like(q)
    for _ in range(20000):
        z, prev = np.maximum(q + z @ M, 0.0), z
        if np.abs(z - prev).max() < 1e-14:
            break
    assert np.abs(np.maximum(q + z @ M, 0.0) - z).max() < 1e-12
    return z, rate


def test_warm_started_solves_reach_the_cold_equilibrium_after_the_weights_move() -> None:
    d = lowering.lower(models.opteq(n=24, m=24, d=6, seed=3))
    m = d.torch_module(warm_start=40, dtype=F64, tol=1e-10)
    x = torch.randn(40, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(3):
        z, st = m(x[ids], sample_ids=ids, return_stats=True)
        ref, rate = _numpy_equilibrium(m.env(), x[ids].numpy())
        # a returned iterate with relative residual ≤ tol is within tol·||T(z)||/(1 − rate) of
        # the fixed point (a contraction); 2× that bound, plus 1e-12 for the reference's own
        # residual, holds on any BLAS
        zn = z.detach().numpy()
        err = np.linalg.norm(zn - ref, axis=1)
        bound = 2 * 1e-10 * np.linalg.norm(zn, axis=1) / (1 - rate) + 1e-12
        assert bool(st.converged.all()) and np.all(err <= bound)
        if step:  # started from the equilibria of the step before: fewer iterations
            assert m.warm_start_cache.hits >= 40 * step
        (z ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert m.warm_start_cache.nbytes == 40 * 24 * 8


def test_warm_starts_cost_fewer_iterations_at_unchanged_weights() -> None:
    d = lowering.lower(models.opteq(conv=(4, 3), image=(1, 16), seed=0))
    m = d.torch_module(warm_start=32, dtype=F64)
    x = torch.randn(32, 16, dtype=F64, generator=torch.Generator().manual_seed(2))
    ids = torch.arange(32)
    _, cold = m(x, sample_ids=ids, return_stats=True)
    _, warm = m(x, sample_ids=ids, return_stats=True)
    assert warm.mean_iterations < cold.mean_iterations and bool(warm.converged.all())


@pytest.mark.parametrize("case", ["nonconvex", "uncontrolled"])
def test_layers_without_a_uniqueness_certificate_refuse_the_cache(case: str) -> None:
    if case == "nonconvex":  # GEQ's claim is a stationary point of a nonconvex objective
        build = lambda: lowering.lower(models.geq()).torch_module(warm_start=8)  # noqa: E731
        match = "not certified convex"
    else:  # ||W||₂ ≤ 1 not kept during training: uniqueness can be lost
        build = lambda: lowering.lower(models.opteq()).torch_module(  # noqa: E731
            warm_start=8, weight_control=None)
        match = "not kept during training"
    with pytest.raises(OptionError, match=match):
        build()


def test_sample_ids_are_checked() -> None:
    m = lowering.lower(models.opteq()).torch_module(warm_start=4)
    x = torch.randn(2, 8)
    with pytest.raises(ShapeError, match=r"in \[0, 4\)"):
        m(x, sample_ids=torch.tensor([0, 4]))
    with pytest.raises(ShapeError, match="shape \\(2,\\)"):
        m(x, sample_ids=torch.tensor([0]))
    with pytest.raises(OptionError, match="not both"):
        m(x, z0=torch.zeros(2, 16), sample_ids=torch.tensor([0, 1]))
    with pytest.raises(OptionError, match="keeps no equilibria"):
        lowering.lower(models.opteq()).torch_module()(x, sample_ids=torch.tensor([0, 1]))
    with pytest.raises(OptionError, match="unroll"):
        lowering.lower(models.opteq()).torch_module(warm_start=4, backward="unroll")
