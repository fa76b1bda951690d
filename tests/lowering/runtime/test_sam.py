"""Lowering: derived T vs hand-written docs/theory.md formulas, derivation text, backward modes,
solvers, converter, SAM, emitted-module behaviour.  References are written here from
docs/theory.md directly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import models
from convex_eq.errors import (
    ConvergenceError,
    ConvergenceWarning,
    OptionError,
)

T64 = torch.float64


# ------------------------------------------------------------------ 6. SAM
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


F64 = torch.float64


# 5. With ``sam=`` the SAM iteration stops by ``SAMConfig.tol``/``max_iter`` (defaults 1e-2 and
#    5000): a ``tol=1e-8`` passed next to it was silently ignored (``module.tol`` read 1e-8, the
#    flags said "converged" at a residual of 1e-2), and a failure's hint said "raise max_iter
#    (now 100)", an option SAM does not read.
def _sam_layer():
    from convex_eq.models import opteq

    return lowering.lower(opteq(n=4, m=4, d=2, seed=0))


def test_sam_refuses_forward_solve_options() -> None:
    import convex_eq as ce

    d = _sam_layer()
    cfg = lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]))
    for opts in ({"tol": 1e-8}, {"max_iter": 50}, {"solver": "anderson"}):
        with pytest.raises(OptionError, match=r"SAMConfig\(tol=\.\.\., max_iter=\.\.\.\)"):
            d.torch_module(sam=cfg, **opts)
    d.torch_module(sam=cfg, backward_tol=1e-8)  # the adjoint's options stay available


def test_sam_failure_hint_names_sam_options() -> None:
    import convex_eq as ce

    d = _sam_layer()
    m = d.torch_module(sam=lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]), tol=1e-12, max_iter=3),
                       dtype=F64)
    with pytest.raises(ConvergenceError) as err:
        m(torch.randn(2, 2, dtype=F64, generator=torch.Generator().manual_seed(0)))
    assert "SAMConfig.max_iter (now 3)" in str(err.value)
    assert "raise max_iter" not in str(err.value)


@pytest.mark.parametrize("case", ["empty", "all_nan_inputs"])
def test_sam_over_no_sample(case: str) -> None:
    """The same for the SAM iteration (its own tracker crashed on zero samples)."""
    import convex_eq as ce

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
    import convex_eq as ce

    d = lowering.lower(models.opteq(n=4, m=4, d=2, seed=0))
    cfg = lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]))
    with pytest.raises(OptionError, match="SAM with backward='unroll'"):
        d.torch_module(sam=cfg, backward="unroll")
