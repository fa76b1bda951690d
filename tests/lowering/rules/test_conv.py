"""Convolutional seeds: 1-D convolution, rectangular kernels, depthwise/grouped convolution, and
"same" padding that wastes no weights; T against hand-written torch convolutions, verify."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convex_eq as ce
import lowering
from convex_eq import models
from convex_eq.errors import ShapeError
from convex_eq.operators import Conv1d, Conv2d
from verify.check import check

T64 = torch.float64
GEN = torch.Generator().manual_seed(5)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=T64)


@pytest.mark.parametrize("cls,in_shape,kshape,groups", [
    (Conv1d, (4, 9), (6, 2, 3), 2), (Conv2d, (3, 4, 5), (3, 1, 3, 1), 3),
    (Conv2d, (2, 5, 6), (4, 2, 1, 5), 1)])
def test_conv_adjoint_and_torch_formula(cls, in_shape, kshape, groups) -> None:
    k = randn(*kshape)
    op = cls(ce.Weight("K", kshape, k.numpy()), in_shape,
             padding=tuple(s // 2 for s in kshape[2:]), groups=groups)
    v, w = randn(3, op.in_size), randn(3, op.out_size)
    conv = F.conv1d if cls is Conv1d else F.conv2d
    ref = conv(v.reshape(3, *in_shape), k, padding=op.padding, groups=groups).reshape(3, -1)
    # the same torch convolution on both sides in float64: rounding only
    torch.testing.assert_close(op.apply(v), ref, atol=1e-12, rtol=1e-12)
    # <Av, w> = <v, Aᵀw>: float64 sums of O(100) O(1) products, rounding ~1e-13
    torch.testing.assert_close((op.apply(v) * w).sum(), (v * op.adjoint(w)).sum(),
                               atol=1e-10, rtol=1e-10)


def test_conv1d_opteq_layer_matches_hand_formula_and_verifies() -> None:
    g = models.opteq(conv=(3, 5), image=(2, 12), seed=1)
    d = lowering.lower(g)
    u, w = (g.symbol(n).value.detach() for n in ("U", "W"))
    b = g.symbol("b").value.detach()
    assert u.shape == (3, 2, 5) and w.shape == (3, 3, 5)
    z, x = randn(2, 36), randn(2, 24)
    wz = F.conv1d(z.reshape(2, 3, 12), w, padding=2)
    ref = torch.relu(F.conv_transpose1d(wz, w, padding=2).reshape(2, -1)
                     + F.conv1d(x.reshape(2, 2, 12), u, padding=2).reshape(2, -1) + b)
    # σ(WᵀWz + Ux + b) with torch's own convolutions, float64: rounding only
    torch.testing.assert_close(d.apply({"z": z, "x": x})["z"], ref, atol=1e-12, rtol=1e-12)
    rep = check(d, x[:1].numpy())
    assert rep.passed, rep


def test_depthwise_rectangular_opteq_and_geq() -> None:
    g = models.opteq(conv=(4, (3, 5), 4), image=(2, 4, 6), seed=2)
    w = g.symbol("W").value.detach()
    assert w.shape == (4, 1, 3, 5)  # depthwise: one 3×5 filter per channel
    d = lowering.lower(g)
    u, b = g.symbol("U").value.detach(), g.symbol("b").value.detach()
    z, x = randn(2, 96), randn(2, 48)
    wz = F.conv2d(z.reshape(2, 4, 4, 6), w, padding=(1, 2), groups=4)
    ref = torch.relu(F.conv_transpose2d(wz, w, padding=(1, 2), groups=4).reshape(2, -1)
                     + F.conv2d(x.reshape(2, 2, 4, 6), u, padding=(1, 2)).reshape(2, -1) + b)
    # the same torch convolutions in float64: rounding only
    torch.testing.assert_close(d.apply({"z": z, "x": x})["z"], ref, atol=1e-12, rtol=1e-12)
    rep = check(d, x[:1].numpy())
    assert rep.passed, rep
    geq = models.geq(conv=(2, 3, 2), image=(1, 4, 4), patch=2, seed=0)
    assert geq.symbol("W").shape == (2, 1, 3, 3)
    assert lowering.lower(geq).claim.kind == "stationary point"


def test_same_padding_on_a_signal_wastes_no_weights() -> None:
    g = models.opteq(conv=(4, 3), image=(1, 1, 40), activation="tanh", seed=0)
    w = g.symbol("W")
    assert w.shape == (4, 4, 1, 3)  # a 3×3 kernel would have 2/3 of its taps on padding only
    mod = lowering.lower(g).torch_module(tol=1e-5, max_iter=300)  # float32 weights
    x = torch.randn(3, 40, generator=GEN, dtype=T64).float()
    mod(x).pow(2).sum().backward()
    grads = [p.grad for n, p in mod.named_parameters() if n.endswith("W")]
    assert grads and (grads[0] != 0).all()  # every tap of W trains
    with pytest.raises(ShapeError, match="even size"):
        models.opteq(conv=(2, 4), image=(1, 6, 6))
    with pytest.raises(ShapeError, match="groups"):
        models.opteq(conv=(4, 3, 3), image=(1, 6, 6))
    assert bool(mod.last_stats.converged.all())
