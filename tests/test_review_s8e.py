"""Review: the mask mode's failed adjoint rows in the second-order backward; a NaN weight
written through ``.data`` under the convolution norm bound."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowering
from convex_eq.errors import NonFiniteError
from convex_eq.models import conv_mopteq
from lowering.backward import AdjointConfig, FixedPointProblem, _AdjointSolve

F64 = torch.float64


def test_second_order_of_a_masked_adjoint_row_is_zero() -> None:
    """Under on_nonconvergence='mask' the adjoint solve ``g = Jᵀg + v`` returns zero rows for
    the samples whose solve failed: those rows are constants, so the second-order backward
    must give them a zero derivative.  It gave them the tangent solution ``(I − J)⁻¹u``
    instead (the tangent solve masked only its own failures), so a double backward (a
    gradient penalty) received a gradient through rows that had left the gradient.

    ``T(z) = Wz`` with ``W = [[0.1, 0], [1, 0.95]]``: sample 0's ``v`` is the eigenvector of
    ``Wᵀ`` for 0.95 (the 20 plain iterations leave a relative residual ~1e-2 ≫ 1e-10: it
    fails), sample 1's is that for 0.1 (converges); both tangents ``u`` are the eigenvector of
    ``W`` for 0.1 (converge)."""
    w = torch.tensor([[0.1, 0.0], [1.0, 0.95]], dtype=F64, requires_grad=True)
    cfg = AdjointConfig("plain", 1e-10, 20, "mask", "iterative", True)
    problem = FixedPointProblem(lambda z, ts: z @ ts[0].T, [w], cfg, lambda st: None)
    z = torch.zeros(2, 2, dtype=F64)
    v = torch.tensor([[1.0, 0.85], [1.0, 0.0]], dtype=F64, requires_grad=True)
    u = torch.tensor([[0.85, -1.0], [0.85, -1.0]], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the mask mode's warning naming sample 0)
        g = _AdjointSolve.apply(v, z, problem, w)
        gv, = torch.autograd.grad(g, v, u)
    assert float(g[0].abs().max()) == 0.0
    assert float(gv[0].abs().max()) == 0.0  # a constant row: exactly zero
    # the converged sample: h = (I − W)⁻¹u = u / 0.9; its plain tangent iteration contracts by
    # 0.1 per step to relative residual 1e-10, so h is within ~1e-11 relative of that on any
    # BLAS (2×2 products, float64); 1e-9 leaves a wide margin
    assert float((gv[1] - u[1] / 0.9).abs().max()) <= 1e-9


@pytest.mark.parametrize("mode", ["spectral_norm", "project"])
def test_a_nan_conv_kernel_written_through_data_is_named(mode: str) -> None:
    """A write through ``.data`` makes no version change, so the once-per-version finiteness
    check of a weight does not see it; the exact-norm bound now names such a weight before its
    SVD, but the convolution bound (per-frequency matrix norms) still failed with torch's
    untyped ``LinAlgError`` for a NaN kernel under weight control."""
    mod = lowering.lower(conv_mopteq(image=(1, 8), channels=2)).torch_module(
        dtype=F64, weight_control=mode, weight_bounds={"W1": 0.9, "W2": 0.9})
    mod.env()  # (the weights' versions are now marked as checked)
    mod.weights["W1"].data.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match="parameter 'W1' contains NaN or Inf"):
        mod.env()
