"""The cvxpylayers backend (lowering/cvxpylayer.py, ``backend="cvxpylayers"``): the same
equilibrium and input gradient as the fixed-point module, from a conic solve; options that do
not apply are refused."""

from __future__ import annotations

import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import models
from tests.lowering.helpers import randn

T64 = torch.float64


def test_cvxpylayers_backend_matches_fixed_point_module() -> None:
    """The output (within 1e-6) and the input gradient (within 1e-4 relative) of the conic solve
    equal the fixed-point module's."""
    d = lowering.lower(models.opteq(n=6, m=8, d=3, form="conjugate", seed=3))
    fp = d.torch_module(tol=1e-12, max_iter=500, dtype=T64)
    cl = d.torch_module(backend="cvxpylayers")
    x = randn(3, 3).requires_grad_()
    z_fp, z_cl = fp(x), cl(x)
    assert z_cl.shape == z_fp.shape
    # SCS at eps 1e-10 (cvxpylayers' conic solve) vs fixed point at 1e-12
    assert float((z_fp - z_cl).abs().max()) < 1e-6
    (g_fp,) = torch.autograd.grad(z_fp.sum(), x)
    (g_cl,) = torch.autograd.grad(z_cl.sum(), x)
    assert float((g_fp - g_cl).norm() / g_fp.norm()) < 1e-4
    with pytest.raises(ce.OptionError, match="unknown option"):
        d.torch_module(backend="cvxpylayers", solver="anderson")
    with pytest.raises(ce.OptionError, match="unknown backend"):
        d.torch_module(backend="jax")
