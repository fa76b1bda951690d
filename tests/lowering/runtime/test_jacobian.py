"""Jacobian regularisation (``EquilibriumModule.jacobian_penalty``): the Hutchinson estimate
against the dense Jacobian of the layer's equation written in numpy, its gradient against
finite differences, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import OptionError, ShapeError

F64 = torch.float64


def _module() -> lowering.EquilibriumModule:
    phi = models.opteq(n=6, m=5, d=3, activation="relu", form="canonical", seed=3)
    return lowering.lower(phi).torch_module(dtype=F64, tol=1e-12, max_iter=500,
                                            weight_control=None)


def _numpy_jacobian(env: dict[str, torch.Tensor], x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``∂T/∂z`` of ``T(z) = relu(Wᵀ W z + U x + b)`` (the canonical ReLU OptEq layer, Theorem 1
    of the OptEq paper) per sample: ``diag(1[p > 0]) WᵀW``, ``p = WᵀW z + U x + b``."""
    U, b, W = (env[k].detach().numpy() for k in ("U", "b", "W"))
    M = W.T @ W
    p = z @ M + x @ U.T + b
    return (p > 0)[:, :, None] * M[None, :, :]


def test_penalty_is_the_hutchinson_sum_of_the_dense_jacobian() -> None:
    mod = _module()
    x = torch.as_tensor(np.random.default_rng(0).standard_normal((4, 3)), dtype=F64)
    z = mod(x)
    J = _numpy_jacobian(mod.env(), x.numpy(), z.detach().numpy())  # (B, N, N)
    pen = mod.jacobian_penalty(x, z, samples=3, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    eps = [torch.randn(z.shape, generator=g, dtype=F64).numpy() for _ in range(3)]
    hand = sum(float((np.einsum("bi,bij->bj", e, J) ** 2).sum()) for e in eps) / (3 * z.numel())
    # the same ε, one vector-Jacobian product each: equal up to float64 rounding of 6-term sums
    assert float(pen.detach()) == pytest.approx(hand, rel=1e-12)
    # and it estimates ||J||_F² / (B·N): the mean over many vectors is close to the exact value
    exact = float((J ** 2).sum()) / z.numel()
    many = mod.jacobian_penalty(x, z, samples=4000, generator=torch.Generator().manual_seed(1))
    # one vector's εᵀ(JJᵀ)ε has variance 2||JJᵀ||_F² ≤ 2||J||_F⁴: a relative standard deviation
    # of at most √2/√4000 ≈ 2.3 % at 4000 vectors; 10 % is over four of them
    assert float(many.detach()) == pytest.approx(exact, rel=0.1)


def test_penalty_gradient_matches_finite_differences() -> None:
    """The penalty is a function of the weights at the given state z (detached, as Bai et al.:
    it shapes T, not the solve): its gradient against central differences in W at that z, on a
    tanh layer, whose Jacobian depends on z and W both."""
    phi = models.opteq(n=6, m=5, d=3, activation="tanh", form="canonical", seed=3)
    mod = lowering.lower(phi).torch_module(dtype=F64, tol=1e-12, max_iter=500,
                                           weight_control=None)
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((3, 3)), dtype=F64)
    z = mod(x).detach()

    def penalty() -> torch.Tensor:
        return mod.jacobian_penalty(x, z, generator=torch.Generator().manual_seed(2))

    mod.zero_grad()
    penalty().backward()
    W = mod.weights["W"]
    for idx in [(0, 1), (2, 4), (4, 0)]:
        with torch.no_grad():
            w0 = W[idx].item()
            W[idx] = w0 + 1e-6
            fp = float(penalty())
            W[idx] = w0 - 1e-6
            fm = float(penalty())
            W[idx] = w0
        fd = (fp - fm) / 2e-6
        # central differences, h = 1e-6, of a smooth function of W in float64: truncation
        # ~h² and rounding ~1e-16/h, about 1e-10 together; 1e-7 leaves a wide margin
        assert abs(fd - float(W.grad[idx])) <= 1e-7 * max(1.0, abs(fd))
    assert float(W.grad.abs().max()) > 0


def test_penalty_refusals() -> None:
    mod = _module()
    x = torch.zeros(2, 3, dtype=F64)
    z = mod(x)
    with pytest.raises(OptionError, match="samples"):
        mod.jacobian_penalty(x, z, samples=0)
    with pytest.raises(ShapeError, match="entries per sample"):
        mod.jacobian_penalty(x, z[:, :4])
    pr = lowering.lower(models.mon(n=6, d=3, seed=0, splitting="peaceman-rachford"))
    m2 = pr.torch_module(dtype=F64)
    x2 = torch.zeros(2, 3, dtype=F64)
    assert pr.outputs is not None  # (Peaceman–Rachford iterates u and returns z = prox(u))
    with pytest.raises(OptionError, match="map of its state"):
        m2.jacobian_penalty(x2, m2(x2))
