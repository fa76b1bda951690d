"""The emitted module's guards of its inputs and weights: NaN/Inf inputs, warm starts and
weights (also written through ``.data``) are named, sparse and nested tensors and wrong shapes
are typed errors naming the input, sample or parameter and what to pass instead; large finite
inputs pass."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import convex_eq as ce
import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight, models
from convex_eq.errors import ConvergenceWarning, NonFiniteError, ShapeError
from convex_eq.models import conv_mopteq, opteq
from convex_eq.operators import Dense
from lowering.runtime.guards import nonfinite_inputs
from tests.lowering.runtime.helpers import nan_batch, qp_module, uneven_inputs, uneven_relu_layer

T64 = F64 = torch.float64


# ------------------------------------------------------------------ inputs
def _qp_module() -> torch.nn.Module:
    layer = lowering.lower(qp_objective(qp_weight(16, d=8)))
    return layer.torch_module(weight_control=None, dtype=torch.float32)


def test_large_finite_inputs_pass_the_finiteness_check() -> None:
    """An input whose norm overflows float32 (entries 1e30) is finite: the norm test falls back
    to the entrywise one instead of refusing it."""
    mod = _qp_module()
    x = torch.full((2, 8), 1e30)
    assert nonfinite_inputs(mod, {"q": x}) is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_are_named(bad: float) -> None:
    """NaN / ±Inf inputs are refused with the offending sample named."""
    mod = _qp_module()
    x = torch.randn(4, 8)
    x[2, 5] = bad
    with pytest.raises(NonFiniteError, match=r"samples 2\b"):
        mod(x)


def test_nan_sample_is_named():
    """A NaN in sample 3 of a default (raise) module: a ``NonFiniteError`` naming sample 3."""
    d, _, bad = nan_batch()
    m = d.torch_module()
    with pytest.raises(NonFiniteError, match="samples 3"):
        m(bad)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_is_a_typed_error(layout: str) -> None:
    """A sparse input (COO or CSR, bare or in a dict) is a ShapeError naming the input and
    what to pass (``q.to_dense()``).

    Pins: it failed inside the input check with torch's untyped NotImplementedError."""
    mod = qp_module()
    x = torch.randn(3, 64, dtype=torch.float64)
    x = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    for given in (x, {"q": x}):
        with pytest.raises(ShapeError, match=r"input 'q' is a torch\.sparse_.* q\.to_dense"):
            mod(given)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_input_is_a_typed_error_with_a_working_hint(layout) -> None:  # type: ignore[no-untyped-def]
    """A nested tensor is a ShapeError naming the input; the hint (stack the samples) gives
    the dense call's result.  (Exact equality: the same dense tensor, the same solve.)

    Pins: strided: ``.shape`` raised torch's untyped "NestedTensorImpl doesn't support sizes";
    jagged: a ShapeError whose hint, ``.to_dense()``, fails on it."""
    mod = lowering.lower(opteq(n=6, m=6, d=4, activation="relu", seed=2)).torch_module(dtype=F64)
    x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    nested = torch.nested.nested_tensor(list(x.unbind()), layout=layout)
    for given in (nested, {"x": nested}):
        with pytest.raises(ShapeError, match="'x' is a nested tensor") as info:
            mod(given)
        assert "torch.stack(x.unbind())" in str(info.value)
    with torch.no_grad():
        assert torch.equal(mod(torch.stack(nested.unbind())), mod(x))


@pytest.mark.parametrize("mode", ["raise", "warn", "mask"])
@pytest.mark.parametrize("solver", ["plain", "anderson"])
def test_nonfinite_warm_start_is_named(mode: str, solver: str) -> None:
    """A NaN row of ``z0`` raises a ``NonFiniteError`` naming ``z0`` and that sample (in every
    mode); a NaN row of a sample whose input is NaN too (dropped under ``mask``) is accepted,
    and the other samples match a cold-started Anderson reference at 1e-12 (1e-7: a relative
    residual of 1e-10 on a contraction of factor Lip(T) ≤ 0.941 puts the iterate within
    1e-10/(1 − 0.941)·||z|| ≈ 2e-9·||z|| of the fixed point, ||z|| < 10 here).

    Pins: NaN rows of ``z0`` were reported as diverged samples (hint: raise max_iter), and
    under mask a warm start taken from masked outputs kept those samples NaN call after call."""
    layer = uneven_relu_layer()
    x = uneven_inputs()[:4]
    m = layer.torch_module(dtype=F64, solver=solver, on_nonconvergence=mode, tol=1e-10,
                           max_iter=2000)
    z0 = torch.zeros(4, 6, dtype=F64)
    z0[2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"z0 contains NaN or Inf in samples 2\b"):
        m(x, z0=z0)
    if mode != "mask":
        return
    x[2] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the NaN input, announced
        out = m(x, z0=z0)
    with torch.no_grad():
        ref = layer.torch_module(dtype=F64, solver="anderson", tol=1e-12,
                                 max_iter=2000)(x[[0, 1, 3]])
    assert torch.isnan(out[2]).all()
    assert float(ref.abs().max()) < 10
    assert float((out[[0, 1, 3]] - ref).abs().max()) < 1e-7


# ------------------------------------------------------------------ shapes
def _module_two_inputs() -> nn.Module:
    z, x, y = State("z", 3), Input("x", 2), Input("y", 2)
    obj = Objective([Potential("relu", z), SqNorm(z),
                     Linear(Dense(Weight("U", (3, 2))) @ x + Dense(Weight("V", (3, 2))) @ y, z)
                     * -1.0, SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z) * -1.0])
    return lowering.lower(obj).torch_module(dtype=T64)


def test_module_inputs_with_different_batch_sizes_raise_a_shape_error() -> None:
    """Two inputs with batch sizes 3 and 2: a ShapeError saying so."""
    m = _module_two_inputs()
    with pytest.raises(ce.ShapeError, match="batch sizes"):
        m({"x": torch.zeros(3, 2, dtype=T64), "y": torch.zeros(2, 2, dtype=T64)})


@pytest.mark.parametrize("bad", ["numel", "batch", "numpy"])
def test_module_z0_of_the_wrong_shape_raises_a_shape_error(bad: str) -> None:
    """A ``z0`` with the wrong number of entries, the wrong batch or of numpy type: a
    ShapeError naming ``z0``; the right shape runs.

    Pins: ``z0.reshape(B, N)`` raised a torch RuntimeError (or AttributeError for numpy)."""
    m = lowering.lower(models.opteq(n=3, m=3, d=2)).torch_module()
    z0 = {"numel": torch.zeros(2, 4), "batch": torch.zeros(3, 2), "numpy": np.zeros((2, 3))}[bad]
    with pytest.raises(ce.ShapeError, match="z0"):
        m(torch.zeros(2, 2), z0=z0)
    assert m(torch.zeros(2, 2), z0=torch.zeros(2, 3)).shape == (2, 3)


@pytest.mark.parametrize("name", ["b", "W_h", "gamma"])
def test_module_parameter_of_the_wrong_shape_raises_naming_it(name: str) -> None:
    """A wrongly shaped bias / patch weight / scalar put into the module: a ShapeError whose
    ``term`` is the parameter.

    Pins: these surfaced as torch broadcasting or matmul RuntimeErrors inside T."""
    m = lowering.lower(models.geq(n=4, p=4, d=3, patch=2, image=(1, 2, 2))).torch_module()
    if name == "gamma":
        m.scalar_gamma = torch.ones(2, dtype=T64)
    else:
        m.weights[name] = nn.Parameter(torch.zeros(*[s + 1 for s in m.weights[name].shape]))
    with pytest.raises(ce.ShapeError) as err:
        m(torch.randn(2, 3))
    assert err.value.term == name


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_module_with_a_non_finite_weight_raises(value: float) -> None:
    """An Inf or NaN weight: a NonFiniteError whose ``term`` is the weight, also where the
    output would be finite (``relu(−inf) = 0``): a broken model never answers."""
    m = lowering.lower(models.opteq(n=3, m=3, d=2)).torch_module(dtype=T64)
    with torch.no_grad():
        m.weights["U"][0, 0] = value
    x = torch.tensor([[-1.0, 0.0]], dtype=T64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ce.NonFiniteError) as err:
            m(x)
    assert err.value.term == "U"


# ------------------------------------------------------------------ weights
@pytest.mark.parametrize("weight_control", ["auto", None])
@pytest.mark.parametrize("mode", ["raise", "mask"])
def test_a_nan_weight_written_through_data_is_named(weight_control: str | None,
                                                    mode: str) -> None:
    """A write through ``.data`` makes no version change, which a finiteness check run once per
    version would miss: every mode names the parameter, with and without weight control.

    Pins: with weight control the SVD of the NaN weight failed with torch's untyped
    LinAlgError; without, the solve reported diverged samples (raise) or NaN outputs (mask)."""
    mod = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0))).torch_module(
        dtype=torch.float64, on_nonconvergence=mode, weight_control=weight_control)
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mod(x)  # the weight's version is marked as checked
    mod.weights["W"].data[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the mask mode's own warning, if any, comes first)
        with pytest.raises(NonFiniteError, match="parameter 'W' contains NaN or Inf"):
            mod(x)


@pytest.mark.parametrize("mode", ["spectral_norm", "project"])
def test_a_nan_conv_kernel_written_through_data_is_named(mode: str) -> None:
    """The same for a convolution kernel under weight control: the convolution bound
    (per-frequency matrix norms) names the NaN kernel before its SVDs.

    Pins: the convolution bound failed with torch's untyped ``LinAlgError``."""
    mod = lowering.lower(conv_mopteq(image=(1, 8), channels=2)).torch_module(
        dtype=F64, weight_control=mode, weight_bounds={"W1": 0.9, "W2": 0.9})
    mod.env()  # the weights' versions are marked as checked
    mod.weights["W1"].data.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match="parameter 'W1' contains NaN or Inf"):
        mod.env()
