"""The derived layer's ``T`` (lowering/derived.py ``DerivedLayer.T`` / ``apply``): batch sizes
are checked and a batch-independent update is broadcast to the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import Linear, Objective, Potential, SqNorm, State, models

T64 = torch.float64


def test_T_with_different_batch_sizes_raises_a_shape_error() -> None:
    """Blocks and inputs of different batch sizes: a ShapeError; a single sample broadcasts.

    Pins: a torch broadcasting RuntimeError."""
    d = lowering.lower(models.opteq(n=3, m=3, d=2))
    with pytest.raises(ce.ShapeError, match="batch sizes differ"):
        d.T(z=np.zeros((3, 3)), x=np.zeros((2, 2)))
    out = d.T(z=np.zeros(3), x=np.zeros((2, 2)))  # one sample broadcasts (as Objective.value)
    assert out.shape == (2, 3)


def test_a_batch_independent_update_is_broadcast_to_the_batch() -> None:
    """``Σf_id(z) + ½||z||² + c<b, z>`` lowers to ``z ← −c·b``, returned for every sample of
    the batch.

    Pins: T returned shape (1, n) for a batch of 2."""
    z = State("z1", (1, 2, 2))
    b = ce.Constant("b2", np.arange(4.0))
    d = lowering.lower(Objective([Potential("identity", z), SqNorm(z), Linear(b, z) * 0.5]))
    out = d.apply({"z1": torch.zeros(2, 4, dtype=T64)})["z1"]
    assert out.shape == (2, 4)
    assert torch.equal(out[1], -0.5 * torch.arange(4.0, dtype=T64))
    m = d.torch_module(dtype=T64)
    assert m.T(torch.zeros(3, 4, dtype=T64), {}, m.env()).shape == (3, 4)
