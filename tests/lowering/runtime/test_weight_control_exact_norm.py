"""Weight control decides with the exact norm of the operator ``T`` applies (a dense SVD of the
operator as the reference here), measured once per content version of the weight: certified
weights are never touched, and a write through ``.data`` is seen."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from lowering.runtime.weight_control import WeightControlWarning

F64 = torch.float64


def _dense_norm(op: object, w: torch.Tensor) -> float:
    """``||A||₂`` of the (zero-padded) operator from its dense matrix: numpy's SVD."""
    name = op.symbols()[0].name  # type: ignore[attr-defined]
    eye = torch.eye(op.in_size, dtype=F64)  # type: ignore[attr-defined]
    dense = op.apply(eye, {name: w.detach().double()}).T.numpy()  # type: ignore[attr-defined]
    return float(np.linalg.norm(dense, 2))


def test_a_certified_conv_layer_is_used_as_declared() -> None:
    """``opteq(conv=(2, 3), image=(1, 4, 4))``: the exact ``||W||₂`` is 0.900 (its Fourier bound
    reads about 1.1): ``weight_control="auto"`` keeps the declared weights, so the output equals
    the uncontrolled module's exactly and no warning is given.

    Pins: the Fourier bound decided, W was rescaled by 0.904 and the output moved by 0.106."""
    d = lowering.lower(models.opteq(conv=(2, 3), image=(1, 4, 4), seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightControlWarning)
        m = d.torch_module(dtype=F64, tol=1e-12, max_iter=500)
    free = d.torch_module(dtype=F64, tol=1e-12, max_iter=500, weight_control=None)
    op = m.weight_control.targets[0][0]
    assert abs(_dense_norm(op, m.weights["W"]) - 0.9) < 1e-6
    # the measured norm is the exact one (power iteration to 1e-7 relative, far inside margin)
    sigma, _ = m.weight_norms()["W"]
    assert abs(sigma - _dense_norm(op, m.weights["W"])) <= 1e-6
    x = torch.randn(5, 1, 4, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m(x), free(x))


def test_a_violated_condition_is_named_with_its_exact_value() -> None:
    """Declared at ``||W||₂ = 1.5`` (dense SVD) against ``||W||₂ ≤ 1``: the warning names the
    condition and the measured norm, and the controlled operator's norm is ``1 − margin``."""
    obj = models.opteq(n=8, m=8, d=3, form="conjugate", weight_norm=1.5, seed=1)
    d = lowering.lower(obj)
    named = r"\|\|W\|\|₂ ≤ 1 does not hold \(\|\|W\|\|₂ = 1\.5"
    with pytest.warns(WeightControlWarning, match=named):
        m = d.torch_module(dtype=F64)
    op = m.weight_control.targets[0][0]
    assert abs(_dense_norm(op, m.env()["W"]) - 0.99) <= 1e-9


def test_a_write_through_data_is_seen_by_the_next_call() -> None:
    """After ``W.data.mul_(3)`` (no version change) the next call measures the new norm and
    rescales: the operator's norm (dense SVD) is back at ``1 − margin``, and the output equals a
    fresh module's built on the written weights.

    Pins: weight control's and the finiteness check's caches were keyed on ``_version`` and
    ``data_ptr``, which a write through ``.data`` keeps."""
    d = lowering.lower(models.opteq(conv=(2, 3), image=(1, 6), seed=0))
    m = d.torch_module(dtype=F64, tol=1e-12, max_iter=1000)
    x = torch.randn(4, 1, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    m(x)
    with torch.no_grad():
        m.weights["W"].data.mul_(3.0)
    out = m(x)
    op = m.weight_control.targets[0][0]
    assert abs(_dense_norm(op, m.env()["W"]) - 0.99) <= 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WeightControlWarning)
        fresh = d.torch_module(dtype=F64, tol=1e-12, max_iter=1000, weight_control="spectral_norm")
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(out, fresh(x), rtol=1e-9, atol=1e-11)
    with torch.no_grad():
        m.weights["W"].data[0, 0, 0] = float("nan")
    with pytest.raises(Exception, match="NaN or Inf"):
        m(x)
