"""The approximate backward strategies (lowering/backward.py): ``phantom`` (a few steps of the
iteration differentiated at the equilibrium) gives first-order gradients only and refuses second
order with a typed error; ``unroll`` (autograd through the iteration) handles a batch with no
sample left.  Their agreement with the implicit gradient is in test_implicit_backward.py, their
use under torch.func in test_torch_func.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from convex_eq import models
from convex_eq.errors import ConvergenceWarning, OptionError
from lowering import lower
from tests.lowering.runtime.helpers import gen, small_dense, uneven_inputs, uneven_relu_layer

T64 = F64 = torch.float64


def test_phantom_refuses_second_order_with_a_typed_error():
    """``create_graph=True`` through a phantom layer: an OptionError; first order still runs."""
    m = small_dense().torch_module(dtype=T64, backward="phantom", weight_control=None)
    x = torch.randn(2, 2, dtype=T64, requires_grad=True)
    z = m(x)
    with pytest.raises(OptionError, match="first-order gradients only"):
        torch.autograd.grad(z.sum(), x, create_graph=True)
    z = m(x)
    (g,) = torch.autograd.grad(z.sum(), x)  # first order still works
    assert torch.isfinite(g).all()


def test_mon_phantom_second_order_is_a_typed_refusal() -> None:
    """The same for a monotone-operator (splitting) layer; the hint does not suggest phantom."""
    m = lower(models.mon(n=4, d=2, seed=1)).torch_module(dtype=T64, backward="phantom")
    x = torch.randn(2, 2, dtype=T64, generator=gen(0), requires_grad=True)
    with pytest.raises(OptionError, match="first-order gradients only") as err:
        torch.autograd.grad(m(x).sum(), x, create_graph=True)
    assert "backward='phantom'" not in (err.value.hint or "")  # no hint to what is set


@pytest.mark.parametrize("case", ["empty", "all_nan_inputs", "all_diverge"])
def test_unroll_over_no_sample(case: str) -> None:
    """The outputs are NaN (empty for an empty batch), the statistics cover the batch with no
    sample converged, and the backward runs (zero input gradients: no sample reaches it):
    for an empty batch, every input NaN (masked) and every unrolled iterate non-finite.

    Pins: the unrolled backward crashed in the residual bookkeeping ("max(): Expected
    reduction dim …") where the other strategies return NaN outputs."""
    layer = uneven_relu_layer()
    x = uneven_inputs()[:3]
    opts = dict(dtype=F64, backward="unroll", on_nonconvergence="mask")
    if case == "empty":
        x = x[:0]
    elif case == "all_nan_inputs":
        x[:] = float("nan")
    else:  # ||W||₂ = 3 without control: the unrolled iterates overflow to inf / NaN
        opts.update(weight_control=None, unroll_steps=2000)
    m = layer.torch_module(**opts)
    if case == "all_diverge":
        with torch.no_grad():
            m.weights["W"].mul_(3.0 / 0.97)
    xs = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the masked samples, announced
        out, st = m(xs, return_stats=True)
    assert out.shape == (x.shape[0], 6) and bool(torch.isnan(out).all())
    assert st.converged.shape == (x.shape[0],) and not bool(st.converged.any())
    torch.nansum(out).backward()
    assert xs.grad is not None and float(xs.grad.abs().sum()) == 0.0
