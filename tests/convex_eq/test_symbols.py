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


def test_scalar_reads_a_plain_number_and_a_one_element_tensor() -> None:
    lam = ce.Scalar("lam", 0.25, low=0.0)
    lam.value = 0.3  # bound as a plain number through the setter
    assert lam.float() == 0.3
    assert lam.float({"lam": torch.tensor([0.5])}) == 0.5  # one element, as float() reads it
    W = ce.Weight("W", (2,), [1.0, 2.0])
    with pytest.raises(ce.ShapeError, match="shape"):
        W.numpy({"W": np.ones((1, 2))})  # only scalars take a reshaped value


def test_a_symbol_unpickled_from_before_the_array_field_reads_its_value() -> None:
    W = ce.Weight("W", (2,), [1.0, 2.0])
    del W.__dict__["_array"]  # as a symbol pickled before the field existed
    np.testing.assert_array_equal(W.numpy(), [1.0, 2.0])


def test_threads_reading_a_lazily_made_value_at_once_all_get_it() -> None:
    """A declared value is made on first read; threads reading it at once get the one value
    (without the lock a reader could see the value neither pending nor made: None)."""
    import threading

    for _ in range(20):
        given = np.random.default_rng(0).standard_normal((64, 64))
        W = ce.Weight("W", (64, 64), given)
        S = ce.Weight("S", (8, 8), seed=3)  # the library's seeded draw, made on first read
        got: list = []
        start = threading.Barrier(6)

        def read(W: ce.Weight = W, S: ce.Weight = S, got: list = got,
                 start: threading.Barrier = start) -> None:
            start.wait()
            got.append((W.value, S.value))

        threads = [threading.Thread(target=read) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 6
        assert all(w is got[0][0] and s is got[0][1] for w, s in got)
        assert torch.equal(got[0][0], torch.as_tensor(given))
