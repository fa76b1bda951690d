"""Deep compositions (lowering/rules/deep.py, Lemma 3 and Theorem 3 of docs/theory.md): the
composition and multi-block forms of deep OptEq against the formula written out here, and the
contraction each form claims."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import (
    Antiderivative,
    DeepComposition,
    Input,
    Objective,
    SqNorm,
    State,
    Weight,
    models,
)
from convex_eq.operators import Dense
from tests.lowering.helpers import close, randn

T64 = torch.float64


def _deep_ref(comp, z0: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    z = z0
    for i in range(1, comp.L + 1):
        w, u, b = (comp.layers[i - 1].symbol(f"{k}{i}").value for k in "WUb")
        z = alpha * torch.relu(z @ w.T + x @ u.T + b) @ w + (1 - alpha) * z
    return z


@pytest.mark.parametrize("L", [2, 3])
def test_deep_opteq_composition_and_multiblock(L: int) -> None:
    comp = models.deep_opteq(L=L, n=6, m=8, d=3, alpha=0.6, seed=L)
    z0, x = randn(3, 6), randn(3, 3)
    d = lowering.lower(comp)
    close(d.apply({"z0": z0, "x": x})["z0"], _deep_ref(comp, z0, x, 0.6))
    mb = lowering.lower(comp, deep_form="multiblock")
    blocks = {b.name: randn(3, 6) for b in mb.blocks}
    out = mb.apply({**blocks, "x": x})
    # Lemma 3: block l is f_l applied to block l-1 (cyclically, z_0 before z_1)
    names = [b.name for b in mb.blocks]
    for i, n in enumerate(names):
        prev = blocks[names[i - 1]]
        one = models.deep_opteq(L=1, n=6, m=8, d=3, alpha=0.6)  # structure only
        _ = one
        w, u, b = (comp.layers[i].symbol(f"{k}{i + 1}").value for k in "WUb")
        close(out[n], 0.6 * torch.relu(prev @ w.T + x @ u.T + b) @ w + 0.4 * prev)
    assert d.claim.kind == ("minimizer" if L == 2 else "inclusion")


def test_multiblock_contraction_is_the_largest_layer_constant_not_the_product() -> None:
    """One application of the multi-block T moves each block through one layer, so its
    Lipschitz constant is max_l Lip(f_l) (checked on a pair of points); the composition form's
    is the product.

    Pins: the multi-block form reported the product, which a pair of points violates."""
    x = Input("x", 2)
    layers = []
    for i, s in enumerate((0.9, 0.3)):
        z = State(f"z{i}", 2)
        psi = Antiderivative("identity", Dense(Weight(f"W{i}", (2, 2), s * np.eye(2))) @ z
                             + Dense(Weight(f"U{i}", (2, 2), np.eye(2))) @ x)
        layers.append(Objective([psi.conjugate(), -SqNorm(z)]))
    d = lowering.lower(DeepComposition(layers, 1.0), deep_form="multiblock")
    c = d.contraction.value()
    assert c == pytest.approx(0.81)  # max(0.9², 0.3²), not 0.9²·0.3² = 0.0729
    xv = torch.zeros(1, 2, dtype=T64)
    z = {"z0": torch.zeros(1, 2, dtype=T64), "z1": torch.zeros(1, 2, dtype=T64), "x": xv}
    z2 = {**z, "z1": torch.ones(1, 2, dtype=T64)}  # z1 is the input block of f_1
    t1, t2 = d.apply(z), d.apply(z2)
    num = torch.cat([t1[k] - t2[k] for k in ("z0", "z1")], 1).norm()
    den = torch.cat([z[k] - z2[k] for k in ("z0", "z1")], 1).norm()
    assert float(num / den) <= c + 1e-12
    assert float(num / den) > 0.0729  # the product is not a Lipschitz bound of this T
    comp = lowering.lower(DeepComposition(layers, 1.0), deep_form="composition")
    assert comp.contraction.value() == pytest.approx(0.81 * 0.09)  # composition: product
