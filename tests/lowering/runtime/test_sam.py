"""SAM (lowering/sam.py, Theorem 5 of docs/theory.md): the module with ``sam=`` selects the
minimiser of ``R`` over the layer's fixed points (against the closed form), stops by its own
``SAMConfig`` options and refuses the forward solve's, names them in its failures, and handles a
batch with no sample left."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceError, ConvergenceWarning, OptionError
from convex_eq.models import opteq

T64 = F64 = torch.float64


def test_sam_selects_argmin_of_r_on_a_subspace_of_fixed_points() -> None:
    n = 6
    g = np.random.default_rng(0)
    q_, _ = np.linalg.qr(g.standard_normal((n, n)))
    v_, _ = np.linalg.qr(g.standard_normal((n, n)))
    s = np.array([1.0, 1.0, 0.6, 0.5, 0.3, 0.1])  # two singular values exactly 1
    wmat = q_ @ np.diag(s) @ v_.T
    bvec = q_[:, 2:] @ g.standard_normal(n - 2)  # b ⟂ left singular vectors with s = 1
    z, x = ce.State("z", n), ce.Input("x", 1)
    w = ce.Weight("W", (n, n), wmat)
    u = ce.Weight("U", (n, 1), np.zeros((n, 1)))
    b = ce.Weight("b", n, bvec)
    phi = ce.Objective([ce.Antiderivative("identity", w @ z + u @ x + b).conjugate(),
                        -ce.SqNorm(z)])
    c = g.standard_normal(n)
    cz = ce.Constant("c", c)
    cfg = lowering.SAMConfig(R=ce.SqNorm(z - cz), rho=0.1, c=0.44, max_iter=5000, tol=1e-2)
    mod = lowering.lower(phi).torch_module(sam=cfg, dtype=T64)
    with torch.no_grad():
        zs = mod(torch.zeros(1, 1, dtype=T64))[0].numpy()
    # closed form: Fix T = {(I - WᵀW)z = Wᵀb}; argmin ½||z - c||² over it
    a = np.eye(n) - wmat.T @ wmat
    zp = np.linalg.pinv(a) @ wmat.T @ bvec
    v1 = v_[:, :2]
    ref = zp + v1 @ v1.T @ c
    err = np.linalg.norm(zs - ref) / np.linalg.norm(ref)
    print(f"SAM relative error to argmin_(Fix T) R after 5000 steps: {err:.2e}")
    assert err < 1e-2
    # plain iteration from 0 converges to a different fixed point (not the R-minimizer)
    plain = lowering.lower(phi).torch_module(solver="plain", tol=1e-10, max_iter=2000, dtype=T64)
    with torch.no_grad():
        zp2 = plain(torch.zeros(1, 1, dtype=T64))[0].numpy()
    assert np.linalg.norm(zp2 - ref) / np.linalg.norm(ref) > 10 * err


def _sam_layer():
    return lowering.lower(opteq(n=4, m=4, d=2, seed=0))


def test_sam_refuses_forward_solve_options() -> None:
    """The SAM iteration stops by ``SAMConfig.tol`` / ``max_iter``: ``tol``, ``max_iter`` and
    ``solver`` next to ``sam=`` are refused, naming ``SAMConfig``; the adjoint's options stay.

    Pins: ``tol=1e-8`` next to ``sam=`` was silently ignored (``module.tol`` read 1e-8, the
    flags said "converged" at a residual of 1e-2)."""
    d = _sam_layer()
    cfg = lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]))
    for opts in ({"tol": 1e-8}, {"max_iter": 50}, {"solver": "anderson"}):
        with pytest.raises(OptionError, match=r"SAMConfig\(tol=\.\.\., max_iter=\.\.\.\)"):
            d.torch_module(sam=cfg, **opts)
    d.torch_module(sam=cfg, backward_tol=1e-8)  # the adjoint's options stay available


def test_sam_failure_hint_names_sam_options() -> None:
    """A SAM iteration that fails names ``SAMConfig.max_iter`` in its hint, not ``max_iter``.

    Pins: the hint said "raise max_iter", an option SAM does not read."""
    d = _sam_layer()
    m = d.torch_module(sam=lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]), tol=1e-12, max_iter=3),
                       dtype=F64)
    with pytest.raises(ConvergenceError) as err:
        m(torch.randn(2, 2, dtype=F64, generator=torch.Generator().manual_seed(0)))
    assert "SAMConfig.max_iter (now 3)" in str(err.value)
    assert "raise max_iter" not in str(err.value)


@pytest.mark.parametrize("case", ["empty", "all_nan_inputs"])
def test_sam_over_no_sample(case: str) -> None:
    """A SAM layer in mask mode with no sample left (an empty batch, every input NaN): NaN
    outputs, no sample converged, and a backward with zero input gradients.

    Pins: the SAM iteration's tracker crashed on zero samples."""
    d = _sam_layer()
    m = d.torch_module(sam=lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]), max_iter=50),
                       dtype=F64, on_nonconvergence="mask")
    x = torch.randn(3, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    x = x[:0] if case == "empty" else x * float("nan")
    xs = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        out, st = m(xs, return_stats=True)
    assert bool(torch.isnan(out).all()) and not bool(st.converged.any())
    torch.nansum(out).backward()
    assert xs.grad is not None and float(xs.grad.abs().sum()) == 0.0


def test_sam_with_unroll_is_refused():
    """SAM with ``backward='unroll'`` is refused with a typed error naming the combination."""
    d = lowering.lower(models.opteq(n=4, m=4, d=2, seed=0))
    cfg = lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]))
    with pytest.raises(OptionError, match="SAM with backward='unroll'"):
        d.torch_module(sam=cfg, backward="unroll")
