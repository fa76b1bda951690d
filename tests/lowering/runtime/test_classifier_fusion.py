"""``EquilibriumClassifier(fusion="average")``: branches brought to a common size by average
pooling or nearest up-sampling and averaged before the readout (the GEQ / MDEQ fusion), against
numpy; refused with typed errors where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import OptionError
from lowering.runtime.classifier import EquilibriumClassifier


def _signal_layer():
    """Branches ``(8, 40)`` and ``(8, 20)`` (scales 1 and 2 of a length-40 signal)."""
    return lowering.lower(models.conv_geq((1, 40), 8, scales=(1, 2), channel_split=4, hidden=8,
                                          gamma=0.5))


def _blocks(*shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, *s, generator=g) for s in shapes)


def test_average_fusion_up_samples_the_smaller_branch() -> None:
    clf = EquilibriumClassifier(_signal_layer(), fusion="average", pool="max", pooled=4)
    z1, z2 = _blocks((8, 40), (8, 20))
    a, b = z1.double().numpy(), z2.double().numpy()
    fused = (a + np.repeat(b, 2, axis=-1)) / 2  # nearest up-sampling repeats each position
    ref = fused.reshape(2, 8, 4, 10).max(axis=-1).reshape(2, -1)  # 4 max-pooled windows
    got = clf.pooled_features((z1, z2)).double().numpy()
    # float32 means of two numbers and maxima: exact up to one rounding of the mean (~6e-8)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert clf.features_dim == 8 * 4 and clf.fc.in_features == 32


def test_average_fusion_pools_the_larger_branches_to_a_chosen_size() -> None:
    clf = EquilibriumClassifier(_signal_layer(), fusion="average", fused_size=(10,),
                                pool="none")
    z1, z2 = _blocks((8, 40), (8, 20))
    a, b = z1.double().numpy(), z2.double().numpy()
    ref = (a.reshape(2, 8, 10, 4).mean(-1) + b.reshape(2, 8, 10, 2).mean(-1)) / 2
    got = clf.pooled_features((z1, z2)).double().numpy()
    np.testing.assert_allclose(got, ref.reshape(2, -1), rtol=1e-6, atol=1e-6)


def test_average_fusion_on_images_mixes_pooling_and_up_sampling() -> None:
    d = lowering.lower(models.conv_geq((3, 8, 8), 8, scales=(1, 2, 4), gamma=0.5, hidden=16))
    clf = EquilibriumClassifier(d, fusion="average", fused_size=(4, 4), pool="none")
    z1, z2, z3 = _blocks((8, 8, 8), (8, 4, 4), (8, 2, 2))
    a, b, c = (t.double().numpy() for t in (z1, z2, z3))
    pooled = a.reshape(2, 8, 4, 2, 4, 2).mean(axis=(3, 5))  # 2×2 average pooling
    up = np.repeat(np.repeat(c, 2, axis=-2), 2, axis=-1)  # 2× nearest up-sampling
    ref = (pooled + b + up) / 3
    got = clf.pooled_features((z1, z2, z3)).double().numpy()
    np.testing.assert_allclose(got, ref.reshape(2, -1), rtol=1e-6, atol=1e-6)


def test_fusion_is_refused_where_it_does_not_apply() -> None:
    d = _signal_layer()
    with pytest.raises(OptionError, match="unknown fusion"):
        EquilibriumClassifier(d, fusion="sum")
    with pytest.raises(OptionError, match="fused_size applies to fusion='average' only"):
        EquilibriumClassifier(d, fused_size=(10,))
    with pytest.raises(OptionError, match="not an integer factor"):
        EquilibriumClassifier(d, fusion="average", fused_size=(15,))
    one = lowering.lower(models.conv_geq((1, 40), 8, scales=(1,), channel_split=4, hidden=8))
    with pytest.raises(OptionError, match="one state block"):
        EquilibriumClassifier(one, fusion="average")
    mixed = lowering.lower(models.mopteq(shapes=((2, 4, 4), (3, 2, 2)), fusion="none"))
    with pytest.raises(OptionError, match="equal channels"):
        EquilibriumClassifier(mixed, fusion="average")


def test_the_default_readout_still_concatenates() -> None:
    clf = EquilibriumClassifier(_signal_layer(), pool="max", pooled=4)
    z1, z2 = _blocks((8, 40), (8, 20))
    assert clf.fusion is None and clf.features_dim == 2 * 8 * 4
    assert clf.pooled_features((z1, z2)).shape == (2, 64)
