"""The registered Fourier upper bound of a convolution's spectral norm
(:func:`lowering.runtime.norms.conv_fourier_bound`) against a numpy transcription over the full
DFT grid, the exact norm of the dense operator, and central differences of the transcription."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from lowering.runtime.norms import conv_fourier_bound

CASES = {
    "1-D": dict(conv=(6, 5), image=(1, 20)),
    "2-D": dict(conv=(4, 3), image=(1, 7, 6)),
    "grouped 1-D": dict(conv=(4, 3, 2), image=(1, 9)),
}


def _operator(case: dict) -> tuple:
    m = lowering.lower(models.opteq(seed=3, **case)).torch_module(dtype=torch.float64)
    op, name, _ = m.weight_control.targets[0]
    return op, name, m.weights[name].detach().clone()


def _numpy_bound(op, K: np.ndarray) -> float:
    """max over the full DFT grid (size n + k + p per axis) and the groups of the largest
    singular value of the per-frequency matrix — the bound's definition, written apart."""
    nd = K.ndim - 2
    pads = op.padding if isinstance(op.padding, (tuple, list)) else (op.padding,) * nd
    sizes = [n + k + p for n, k, p in zip(op.in_shape[1:], K.shape[2:], pads)]
    Kh = np.fft.fftn(K, s=sizes, axes=tuple(range(2, 2 + nd)))
    g = int(getattr(op, "groups", 1))
    per = K.shape[0] // g
    best = 0.0
    for j in range(g):
        blk = Kh[j * per:(j + 1) * per]
        for idx in np.ndindex(*sizes):
            best = max(best, np.linalg.norm(blk[(slice(None), slice(None), *idx)], 2))
    return best


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_fourier_bound_is_the_full_grid_maximum_and_bounds_the_exact_norm(case: dict) -> None:
    """Equal to the full-grid transcription (float64 SVDs of the same small matrices: 1e-12
    relative is far above their round-off, ~1e-15, on any BLAS), and at least the exact norm of
    the dense operator from numpy's SVD (an upper bound; equal up to round-off allowed)."""
    op, name, K = _operator(case)
    got = float(conv_fourier_bound(op, name, {name: K}))
    ref = _numpy_bound(op, K.numpy())
    assert got == pytest.approx(ref, rel=1e-12)
    eye = torch.eye(op.in_size, dtype=torch.float64)
    exact = float(np.linalg.norm(op.apply(eye, {name: K}).T.numpy(), 2))
    assert exact <= got * (1 + 1e-12)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_fourier_bound_gradient_matches_central_differences(case: dict) -> None:
    """The bound's gradient in the kernel against central differences of the transcription
    (step 1e-6 in float64: truncation ~1e-12 and round-off ~1e-10 relative to entries of order
    0.1–1, so 1e-6 relative plus 1e-8 absolute holds on any CPU; the top singular value is
    simple at these random kernels, so the maximum is differentiable there)."""
    op, name, K = _operator(case)
    k = K.clone().requires_grad_(True)
    conv_fourier_bound(op, name, {name: k}).backward()
    Kn = K.numpy()
    fd = np.zeros_like(Kn)
    h = 1e-6
    for idx in np.ndindex(*Kn.shape):
        up, dn = Kn.copy(), Kn.copy()
        up[idx] += h
        dn[idx] -= h
        fd[idx] = (_numpy_bound(op, up) - _numpy_bound(op, dn)) / (2 * h)
    np.testing.assert_allclose(k.grad.numpy(), fd, rtol=1e-6, atol=1e-8)


def test_fourier_bound_of_a_non_finite_kernel_is_a_typed_error() -> None:
    """A NaN in the kernel is named, not returned as a bound."""
    from convex_eq.errors import NonFiniteError

    op, name, K = _operator(CASES["1-D"])
    K[0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=name):
        conv_fourier_bound(op, name, {name: K})
