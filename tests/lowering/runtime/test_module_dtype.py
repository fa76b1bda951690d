"""The emitted module's dtype: half-precision modules solve in float32 and return their own
dtype, and ``.to()`` / ``.double()`` / ``.half()`` move a module, a weightless one included."""

from __future__ import annotations

import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import L1, Input, Linear, SqNorm, State, models

F64 = torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_modules_solve_in_float32(dtype):
    """A float16 / bfloat16 module returns its dtype, agrees with the float32 module to the
    rounding of its weights, and its weights' gradients have its dtype."""
    d = lowering.lower(models.opteq(n=6, m=6, d=3, seed=0))
    m32 = d.torch_module(dtype=torch.float32)
    mh = d.torch_module(dtype=dtype)
    x = torch.randn(4, 3)
    out = mh(x)
    assert out.dtype == dtype
    # the half module's weights are the float32 ones rounded to 8/11 mantissa bits
    assert torch.allclose(out.float(), m32(x), atol=5e-2)
    out.float().sum().backward()
    assert mh.weights["W"].grad.dtype == dtype


@pytest.mark.parametrize("move", ["double", "to", "half"])
def test_weightless_layer_follows_to(move: str) -> None:
    """A layer without tensor weights or constants (``½||z||² − <x, z> + 0.1||z||₁``) takes the
    dtype ``.double()`` / ``.to()`` / ``.half()`` give it, and its output has that dtype.

    Pins: ``module.dtype`` stayed the configured float32 (nothing to convert), so after
    ``.double()`` float64 inputs were cast down and float32 came out."""
    z, x = State("z", 4), Input("x", 4)
    m = lowering.lower(ce.Objective([SqNorm(z), -Linear(x, z), L1(z) * 0.1])).torch_module()
    assert not list(m.parameters())
    want = {"double": F64, "to": F64, "half": torch.float16}[move]
    m = m.double() if move == "double" else m.to(F64) if move == "to" else m.half()
    xs = 1.0 + 1e-9 * torch.arange(8, dtype=F64).reshape(2, 4)
    out = m(xs)
    assert m.dtype == want and out.dtype == want
    if want == F64:  # the prox of the L1 term: soft-threshold(x, 0.1), exact in float64
        # (the 1e-9 steps are below float32 resolution: a float32 solve would erase them)
        assert float((out - (xs - 0.1)).abs().max()) <= 1e-15
    assert "dtype_ref" not in m.state_dict()  # not persistent: state dicts are unchanged
