"""Weight normalisation of the emitted module (``weight_normalization=(...)``,
:mod:`lowering.runtime.weight_control`): the layer uses ``W = g·V/||V||`` per output filter (numpy),
is unchanged at construction, its gradients reach ``g`` and ``V`` (central differences), and it
is never combined with spectral-norm control of the same weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import OptionError
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

T64 = torch.float64


def _geq():
    return lowering.lower(models.conv_geq((1, 16), 8, scales=(1, 2), channel_split=4, hidden=8,
                                          gamma="input", seed=1))


def _x(b: int = 3) -> torch.Tensor:
    return torch.randn(b, 1, 16, generator=torch.Generator().manual_seed(0), dtype=T64)


def test_the_layer_uses_g_times_the_direction_and_starts_unchanged() -> None:
    d = _geq()
    plain = d.torch_module(tol=1e-12, max_iter=500, dtype=T64)
    wn = d.torch_module(tol=1e-12, max_iter=500, dtype=T64, weight_normalization=("W1", "W2"))
    x = _x()
    with torch.no_grad():
        a, b = plain(x), wn(x)
    for za, zb in zip(a, b):  # g = ||V|| at construction: the same layer (rounding of g·V/||V||)
        torch.testing.assert_close(za, zb, atol=1e-12, rtol=1e-12)
    with torch.no_grad():
        wn.weights.parametrizations.W1.original0.mul_(1.5)  # g ← 1.5 g (a training step would)
    v = wn.weights.parametrizations.W1.original1.detach().numpy()
    g = wn.weights.parametrizations.W1.original0.detach().numpy()
    ref = g * v / np.sqrt((v ** 2).sum(axis=(1, 2), keepdims=True))  # one gain per filter
    np.testing.assert_allclose(wn.env()["W1"].detach().numpy(), ref, rtol=1e-14, atol=1e-14)
    with torch.no_grad():
        plain.weights["W1"].copy_(torch.as_tensor(ref))
        for za, zb in zip(plain(x), wn(x)):
            torch.testing.assert_close(za, zb, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("which", ["original0", "original1"])
def test_gradients_reach_the_gain_and_the_direction(which: str) -> None:
    mod = _geq().torch_module(tol=1e-12, max_iter=500, backward_tol=1e-12,
                              backward_max_iter=500, dtype=T64, weight_normalization=("W1",))
    p = getattr(mod.weights.parametrizations.W1, which)
    x = _x()

    def loss() -> torch.Tensor:
        z1, z2 = mod(x)
        return (z1 * torch.linspace(-1, 1, z1.shape[-1], dtype=T64)).sum() + z2.sum()

    mod.zero_grad()
    loss().backward()
    g = float(p.grad.reshape(-1)[0])
    h, vals = 1e-6, []
    for s in (h, -2 * h, h):
        with torch.no_grad():
            p.reshape(-1)[0] += s
            vals.append(float(loss()))
    fd = (vals[0] - vals[1]) / (2 * h)
    # solves to 1e-12 in float64, h = 1e-6: the central difference is ~1e-6 accurate
    assert abs(g - fd) <= 1e-5 * max(1.0, abs(fd)) and abs(fd) > 1e-4, (g, fd)


def test_two_controls_of_one_weight_are_refused() -> None:
    d = _geq()
    with pytest.raises(OptionError, match="two controls"):
        d.torch_module(weight_normalization=("W1",), weight_bounds={"W1": 1.0})
    with pytest.raises(OptionError, match="not a trained weight"):
        d.torch_module(weight_normalization=("W9",))
    opteq = lowering.lower(models.opteq(n=6, m=6, d=3))  # ||W||₂ ≤ 1: auto controls W
    with pytest.raises(OptionError, match="two controls") as err:
        opteq.torch_module(weight_normalization=("W",))
    assert "weight_control=None" in str(err.value)
    opteq.torch_module(weight_normalization=("W",), weight_control=None)  # explicit: allowed
    with pytest.raises(OptionError, match="conflicts with the spectral-norm control"):
        EquilibriumClassifier(opteq, TrainingSettings(weight_normalization=("W",)), pool="none")
    # another weight than the controlled one: both controls, on different weights
    mod = opteq.torch_module(weight_normalization=("U",))
    assert [n for _, n, _ in mod.weight_control.targets] == ["W"]
