"""``Symbol.numpy``: a symbol's value as a float64 numpy array, the declared array itself before
any tensor is made, the bound tensor after, an ``env`` value over either."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convex_eq as ce


def test_numpy_of_a_declared_array_is_that_array_and_a_copy() -> None:
    given = np.arange(6.0).reshape(2, 3) / 7.0
    W = ce.Weight("W", (2, 3), given)
    got = W.numpy()
    np.testing.assert_array_equal(got, given)  # exact: no float32 round trip
    got[0, 0] = 99.0
    np.testing.assert_array_equal(W.numpy(), given)
    assert torch.equal(W.value, torch.as_tensor(given, dtype=torch.float64))


def test_numpy_follows_a_value_bound_later_and_in_place_edits_of_the_tensor() -> None:
    W = ce.Weight("W", (2, 2), np.eye(2))
    W.value = torch.full((2, 2), 0.5, dtype=torch.float32, requires_grad=True)
    np.testing.assert_array_equal(W.numpy(), np.full((2, 2), 0.5))
    V = ce.Weight("V", (2,), [1.0, 2.0])
    with torch.no_grad():
        V.value.mul_(3.0)  # the made tensor is the value from now on
    np.testing.assert_array_equal(V.numpy(), [3.0, 6.0])


def test_numpy_reads_env_over_the_stored_value_and_checks_its_shape() -> None:
    W = ce.Weight("W", (2, 2), np.eye(2))
    np.testing.assert_array_equal(W.numpy({"W": [[1.0, 2.0], [3.0, 4.0]]}),
                                  [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(W.numpy({"W": torch.ones(2, 2, requires_grad=True)}),
                                  np.ones((2, 2)))
    with pytest.raises(ce.ShapeError, match="shape"):
        W.numpy({"W": np.ones(3)})


def test_scalar_float_and_dense_norm_read_the_declared_values() -> None:
    lam = ce.Scalar("lam", 0.25, low=0.0)
    assert lam.float() == 0.25
    assert lam.float({"lam": torch.tensor(0.5, requires_grad=True)}) == 0.5
    with pytest.raises(ce.ScaleError):
        lam.float({"lam": -1.0})
    w = np.random.default_rng(0).standard_normal((5, 4))
    op = ce.Dense(ce.Weight("W", (5, 4), w))
    # rel 1e-12: both sides are one LAPACK SVD of the same float64 matrix
    assert op.norm() == pytest.approx(np.linalg.svd(w, compute_uv=False)[0], rel=1e-12)
    assert op.norm({"W": 2 * w}) == pytest.approx(2 * np.linalg.svd(w, compute_uv=False)[0],
                                                  rel=1e-12)
