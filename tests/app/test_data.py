"""Data sets generated or shipped locally: shapes, standardisation from the training part only,
seeded corruptions and augmentation, no side effect on the global random generators."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from convex_eq.errors import OptionError
from convex_eq_app import data as D


@pytest.fixture(scope="module")
def m1d() -> D.Dataset:
    return D.mnist1d()


def test_mnist1d_shapes_and_standardisation(m1d: D.Dataset) -> None:
    assert m1d.shape == (1, 40)
    assert m1d.x_train.shape == (4000, 1, 40) and m1d.x_test.shape == (1000, 1, 40)
    assert m1d.x_train.dtype == torch.float32 and m1d.y_train.dtype == torch.long
    assert set(m1d.y_train.tolist()) == set(range(10))
    # 1e-4: float32 sums of 160 000 values of order 1 (round-off ~1e-6); the statistics are
    # those of the training part exactly, so only round-off remains
    assert abs(float(m1d.x_train.double().mean())) < 1e-4
    assert abs(float(m1d.x_train.double().std()) - 1.0) < 1e-4


def test_mnist1d_is_reproducible_and_leaves_global_rngs_alone(m1d: D.Dataset) -> None:
    np.random.seed(123)
    random.seed(123)
    before_np, before_py = np.random.get_state()[1].copy(), random.getstate()
    D._mnist1d_arrays.cache_clear()
    again = D.mnist1d()
    assert np.array_equal(np.random.get_state()[1], before_np)
    assert random.getstate() == before_py
    assert torch.equal(again.x_train, m1d.x_train) and torch.equal(again.y_test, m1d.y_test)
    other = D.mnist1d(data_seed=1)
    assert not torch.equal(other.x_train, m1d.x_train)


def test_shuffled_variant_permutes_positions_consistently(m1d: D.Dataset) -> None:
    s = D.mnist1d_shuffled(seed=3)
    assert s.name == "mnist1d-shuffled"
    assert not torch.equal(s.x_train, m1d.x_train)
    # the same permutation for every sample of train and test: find it on sample 0 of train
    # (its values are distinct) and check it maps every sample
    x0, s0 = m1d.x_train[0, 0], s.x_train[0, 0]
    perm = torch.tensor([int(torch.nonzero(x0 == v)[0]) for v in s0])
    assert torch.equal(m1d.x_train[..., perm], s.x_train)
    assert torch.equal(m1d.x_test[..., perm], s.x_test)


def test_digits_and_registry() -> None:
    d = D.load("digits")
    assert d.shape == (1, 8, 8) and len(d.y_train) + len(d.y_test) == 1797
    with pytest.raises(OptionError, match="unknown data set"):
        D.load("mnist")


def test_validation_split_holds_out_part_of_train(m1d: D.Dataset) -> None:
    v = m1d.validation_split(0.125, seed=0)
    assert len(v.y_train) == 3500 and len(v.y_test) == 500
    rows = {tuple(r.tolist()) for r in v.x_train.reshape(3500, -1)}
    assert not any(tuple(r.tolist()) in rows for r in v.x_test.reshape(500, -1))
    with pytest.raises(OptionError):
        m1d.validation_split(1.0)


def test_gaussian_noise_is_seeded_with_the_stated_level(m1d: D.Dataset) -> None:
    a = D.corrupted(m1d, "noise", 0.5, seed=1)
    b = D.corrupted(m1d, "noise", 0.5, seed=1)
    c = D.corrupted(m1d, "noise", 0.5, seed=2)
    assert torch.equal(a.x_test, b.x_test) and not torch.equal(a.x_test, c.x_test)
    assert torch.equal(a.x_train, m1d.x_train)
    # 0.02: the sample std of 40 000 N(0, 0.25) draws is 0.5 ± 0.002 (10 standard errors)
    assert abs(float((a.x_test - m1d.x_test).std()) - 0.5) < 0.02


def test_blur_smooths_and_keeps_constants() -> None:
    x = torch.randn(3, 1, 40, generator=torch.Generator().manual_seed(0))
    y = D.blur(x, 2.0)
    tv = lambda t: float((t[..., 1:] - t[..., :-1]).abs().sum())  # noqa: E731
    assert tv(y) < 0.5 * tv(x)
    const = torch.full((2, 1, 8, 8), 3.0)
    # 1e-12: a normalised Gaussian filter of a constant is that constant up to float64 round-off
    assert torch.allclose(D.blur(const, 1.5), const, atol=1e-12, rtol=0)
    assert torch.equal(D.blur(x, 0.0), x)
    with pytest.raises(OptionError, match="unknown corruption"):
        D.corrupted(D.load("digits"), "rotate", 1.0)


def test_random_shift_moves_samples_and_fills_zeros() -> None:
    x = torch.arange(1.0, 11.0).view(2, 1, 5)
    g = torch.Generator().manual_seed(0)
    y = D.random_shift(x, 2, g)
    for i in range(2):
        row, out = x[i, 0], y[i, 0]
        assert any(torch.equal(out, _shift(row, s)) for s in range(-2, 3))
    assert D.random_shift(x, 0) is x


def _shift(row: torch.Tensor, s: int) -> torch.Tensor:
    out = torch.zeros_like(row)
    n = len(row)
    for j in range(n):
        if 0 <= j - s < n:
            out[j] = row[j - s]
    return out
