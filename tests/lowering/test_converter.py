"""The converter (lowering/converter.py ``lowering.convert``, Lemma 1-2 of docs/theory.md): an MLP
becomes an equilibrium network whose module reproduces it and whose hidden layers are scaled
proxes; weights outside float64's range are refused naming the layer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import convex_eq as ce
import lowering
from tests.lowering.helpers import close, randn

T64 = torch.float64


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
@pytest.mark.parametrize("widths", [(5, 7, 3), (4, 9, 9, 6, 2), (10, 3), (3, 16, 8, 8, 8, 1)])
def test_converter_reproduces_mlps(act: type, widths: tuple[int, ...]) -> None:
    """The module reproduces the MLP (within 1e-5) and each hidden layer is ``μ_k·prox_{φ_k}``
    of the previous one (within 1e-10)."""
    torch.manual_seed(sum(widths))
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(act())
    seq = nn.Sequential(*layers).double()
    net = lowering.convert(seq)
    x = randn(20, widths[0])
    with torch.no_grad():
        assert float((net.module()(x) - seq(x)).abs().max()) < 1e-5
    hidden = net.module().hidden(x)
    for k, obj in enumerate(net.objectives):  # each hidden layer is μ_k·prox_{φ_k}
        d = lowering.lower(obj)
        assert d.is_prox
        close(net.mus[k] * d.apply({f"u{k}": hidden[k]})[f"u{k}"], hidden[k + 1], 1e-10)


@pytest.mark.parametrize("scale, error", [(1e-274, ce.ScaleError), (1e160, ce.ScaleError),
                                          (math.nan, ce.NonFiniteError),
                                          (math.inf, ce.NonFiniteError)])
def test_converter_refuses_weights_outside_float64_range_naming_the_layer(
        scale: float, error: type) -> None:
    """Weights scaled to 1e-274 or 1e160, or NaN/Inf: a ScaleError / NonFiniteError naming
    ``convert: Linear 1``.

    Pins: a ZeroDivisionError (μ underflowed), an OverflowError and a LinAlgError escaped."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[0].weight.mul_(scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error) as err:
            lowering.convert(net)
    assert err.value.term == "convert: Linear 1"
