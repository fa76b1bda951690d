"""Convolutional seed models on signals: conv deep OptEq, multi-scale conv MOptEq / POptEq, the
resampling between branch scales and the perturbation-enhanced (PE) classifier."""

from __future__ import annotations

import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import ShapeError
from lowering.runtime.classifier import EquilibriumClassifier

T64 = torch.float64


def test_signal_resampling_has_an_exact_adjoint() -> None:
    down = models.resample((3, 8), (3, 4), "P")
    up = models.resample((3, 4), (3, 8), "Q")
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(2, 24, generator=g, dtype=T64), torch.randn(2, 12, generator=g, dtype=T64)
    # 1e-12: both sides are sums of 24 float64 products of order 1
    assert torch.allclose((down.apply(u) * v).sum(1), (u * down.adjoint(v)).sum(1), atol=1e-12)
    assert torch.allclose(up.apply(v), down.adjoint(v), atol=1e-12)
    # averaging pairs: a constant signal stays constant
    assert torch.allclose(down.apply(torch.ones(1, 24, dtype=T64)), torch.ones(1, 12, dtype=T64))
    with pytest.raises(ShapeError):
        models.resample((3, 8), (3, 3), "P")


def test_popteq_branches_are_independent_conv_opteqs() -> None:
    """POptEq (fusion 'none'): branch 1, ``y = σ(W Wᵀ y + q)``, is exactly a conv OptEq
    ``z = σ(VᵀV z + q)`` with ``V = W₁ᵀ``: as a convolution, the kernel flipped and its channel
    axes swapped."""
    pop = lowering.lower(models.conv_mopteq(image=(1, 12), channels=3, kernels=(3, 5),
                                            scales=(1, 2), fusion="none"))
    one = lowering.lower(models.opteq(conv=(3, 3), image=(1, 12)))
    mp = pop.torch_module(tol=1e-12, max_iter=200, dtype=T64)
    mo = one.torch_module(tol=1e-12, max_iter=200, dtype=T64)
    with torch.no_grad():
        mo.weights["W"].copy_(mp.weights["W1"].flip(-1).transpose(0, 1))
        for k in ("U", "b"):
            mo.weights[k].copy_(mp.weights[f"{k}1"])
    x = torch.randn(4, 1, 12, generator=torch.Generator().manual_seed(1), dtype=T64)
    y1, y2 = mp(x)
    assert y2.shape == (4, 3, 6)
    # 1e-9: both solves stop at relative residual 1e-12 on a contraction of rate ≤ 0.81
    assert torch.allclose(y1, mo(x), atol=1e-9)


def test_fusion_couples_the_branches_and_the_layer_verifies() -> None:
    from verify.check import check

    x = torch.randn(2, 1, 12, generator=torch.Generator().manual_seed(2), dtype=T64)
    outs = {}
    for fusion in ("none", "H", "HD"):
        d = lowering.lower(models.conv_mopteq(image=(1, 12), channels=2, fusion=fusion))
        m = d.torch_module(tol=1e-10, max_iter=300, dtype=T64)
        outs[fusion] = m(x)[0]
        assert check(m, x[:1]).passed, fusion
    assert not torch.allclose(outs["none"], outs["H"], atol=1e-6)
    assert not torch.allclose(outs["H"], outs["HD"], atol=1e-6)


def test_conv_deep_opteq_on_signals_verifies() -> None:
    from verify.check import check

    d = lowering.lower(models.deep_opteq(L=2, conv=(3, 5), image=(1, 12), alpha=0.5))
    m = d.torch_module(tol=1e-10, max_iter=300, dtype=T64)
    x = torch.randn(1, 1, 12, generator=torch.Generator().manual_seed(3), dtype=T64)
    assert m(x).shape == (1, 3, 12)
    assert check(m, x).passed
    with pytest.raises(ShapeError, match="image"):
        models.deep_opteq(conv=(3, 5))


def test_pe_classifier_trains_and_differs_from_the_clean_layer() -> None:
    """A PE classifier (MOptEq Algorithm 2 in every evaluation) trains, and with the same
    weights it differs from the classifier of the clean layer (branch 2 reads x − δ_1)."""
    obj = models.conv_mopteq(image=(1, 12), channels=2, branch_inputs=True, fusion="H")
    d = lowering.lower(obj)
    torch.manual_seed(0)
    clf = EquilibriumClassifier(lowering.perturbation_enhanced(d, 0.5))
    torch.manual_seed(0)
    plain = EquilibriumClassifier(d)
    x = torch.randn(5, 1, 12, generator=torch.Generator().manual_seed(5))
    assert torch.equal(clf.fc.weight, plain.fc.weight)
    assert not torch.allclose(clf(x), plain(x), atol=1e-4)
    clf(x).logsumexp(1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in clf.parameters() if p.requires_grad)
