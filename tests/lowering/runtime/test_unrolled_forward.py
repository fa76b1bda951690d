"""``backward="unroll"`` returns the plain iterate after ``K`` steps: its statistics say per
sample whether that iterate meets ``tol`` (against a float64 NumPy plain iteration), and the first
call whose iterate does not warns that the output is not an equilibrium."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceWarning

F64 = torch.float64


def _numpy_iterates(env: dict, x: np.ndarray, k: int) -> np.ndarray:
    """``z ← relu(U x + b + Wᵀ W z)`` ``k`` times from 0 (the layer written out in NumPy)."""
    U, b, W = (env[n].detach().double().numpy() for n in ("U", "b", "W"))
    z = np.zeros((x.shape[0], U.shape[0]))
    for _ in range(k):
        z = np.maximum(x @ U.T + b + z @ W.T @ W, 0.0)
    return z


def test_two_unrolled_steps_report_unconverged_samples_and_warn_once() -> None:
    d = lowering.lower(models.opteq(seed=2))
    m = d.torch_module(backward="unroll", unroll_steps=2, dtype=F64, tol=1e-6)
    x = torch.randn(4, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(ConvergenceWarning, match="after K = 2 steps.*not an equilibrium"):
        z, st = m(x, return_stats=True)
    ref = _numpy_iterates(m.env(), x.numpy(), 2)
    np.testing.assert_allclose(z.detach().numpy(), ref, rtol=1e-12, atol=1e-12)
    nxt = _numpy_iterates(m.env(), x.numpy(), 3)
    rel = np.linalg.norm(nxt - ref, axis=1) / np.linalg.norm(nxt, axis=1)
    # the statistics' residual is the NumPy one (float64, rounding only)
    np.testing.assert_allclose(st.final_residual.numpy(), rel, rtol=1e-9)
    assert st.solver == "unroll" and not bool(st.converged.any())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        m(x)  # warned once per module


def test_enough_unrolled_steps_converge_without_a_warning() -> None:
    d = lowering.lower(models.opteq(seed=2))
    m = d.torch_module(backward="unroll", unroll_steps=200, dtype=F64, tol=1e-6)
    x = torch.randn(4, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        _, st = m(x, return_stats=True)
    assert bool(st.converged.all())
