"""verify checks a layer's claim at the inputs the claim is about: MOptEq's perturbation-enhanced
layer (Algorithm 2) claims a stationary point of G at ``x_i − δ*_{i−1}`` with ``δ*`` frozen at
its fixed point, not at its own inputs."""

from __future__ import annotations

import torch

import lowering
import verify
from convex_eq import models
from verify.properties.common import stationarity_residual

T64 = torch.float64


def _pe_module():
    obj = models.conv_mopteq(image=(1, 8), channels=2, branch_inputs=True, lam=0.05)
    pe = lowering.perturbation_enhanced(lowering.lower(obj), 0.1)
    return obj, pe, pe.torch_module(dtype=T64, tol=1e-10, max_iter=300)


def test_pe_module_verifies_at_the_frozen_perturbed_inputs() -> None:
    obj, _, m = _pe_module()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), dtype=T64)
    rep = verify.check(m, {"x1": x, "x2": x})
    assert rep.passed, rep.failures
    assert any("at the inputs the layer states it for" in n for n in rep.notes)
    # independently (autograd of the declared terms): the module's output is a stationary point
    # of G at x_2 − δ*, δ* = 0.1·sign(U_1ᵀ y_1*), and not one at the unperturbed inputs
    with torch.no_grad():
        y1, y2 = m({"x1": x, "x2": x})
    states = {"y1": y1.reshape(4, -1), "y2": y2.reshape(4, -1)}
    u1 = obj.symbol("U1").value[:, 0, :]  # (2 channels, kernel 3) on a 1-channel signal
    conv_t = torch.nn.functional.conv_transpose1d(y1, u1[:, None, :], padding=1)[:, 0]
    delta = 0.1 * torch.sign(conv_t)
    frozen = {"x1": x, "x2": x - delta}
    # 1e-8: the module's tol 1e-10 times the layer's conditioning (verify reports κ ≈ 1.3)
    assert stationarity_residual(obj, states, frozen) <= 1e-8
    assert stationarity_residual(obj, states, {"x1": x, "x2": x}) > 1e-3
