"""Theorem 5 (TPAMI, docs/theory.md §6): the SAM iteration selects ``argmin_{z ∈ Fix T} R(z)`` among
many
equilibria."""

from __future__ import annotations

import warnings

import numpy as np
import torch

import convex_eq as ce
import lowering

from .cases import SAMCase
from .common import T64, check, rel_err

#: iterations and accuracy: SAM converges like the vanishing weight β_k = ρ/k^c (ρ = 0.1,
#: c = 0.44: β_5000 ≈ 2.4e-3); measured relative error after 5000 steps: median 1.3e-3, max 6.8e-3
#: over 200 drawn instances (non-unit singular values ≤ 0.8); tolerance 2e-2 leaves 3x margin.
SAM_ITERS = 5000
SAM_TOL = 2e-2


def sam_reference(case: SAMCase) -> np.ndarray:
    """Closed form of ``argmin_{Fix T} ½||z − c||²`` for ``T(z) = Wᵀ(Wz + b)``, ``W = Q S Vᵀ``:
    ``Fix T = {z : (I − WᵀW)z = Wᵀb}``; in the ``V`` basis ``(1 − s_i²) v_iᵀz = s_i q_iᵀb``, so
    ``v_iᵀz = s_i q_iᵀb/(1 − s_i²)`` for ``s_i < 1`` and ``v_iᵀz`` is free (set to ``v_iᵀc``, the
    projection of ``c``) for ``s_i = 1`` (``q_iᵀb = 0`` by construction)."""
    s, Q, V, b, c = case.s, case.Q, case.V, case.b, case.c
    coef = np.where(s < 1.0, s * (Q.T @ b) / np.where(s < 1.0, 1.0 - s ** 2, 1.0), V.T @ c)
    return V @ coef


def theorem5_sam(case: SAMCase, rho: float = 0.1, c: float = 0.44,
                 max_iter: int = SAM_ITERS, tol: float = SAM_TOL) -> dict[str, float]:
    """Theorem 5 (docs/theory.md §6): on an affine ``T`` with a subspace of fixed points (identity
    activation, ``k ≥ 1`` singular values of ``W`` exactly 1), SAM with ``R = ½||z − c||²``
    (``β_k = λ_k = ρ/k^c``, ``γ = 1/(2L_R)``, ``ρ + 2c < 1``) converges to the exact
    ``argmin_{Fix T} R`` (closed form, :func:`sam_reference`).  Checked: relative error
    ``≤ tol`` after ``max_iter`` steps, and the result is (nearly) a fixed point of ``T``."""
    z = case.objective.states[0]
    cz = ce.Constant("c", case.c)
    cfg = lowering.SAMConfig(R=ce.SqNorm(z - cz), rho=rho, c=c, max_iter=max_iter, tol=tol)
    derived = lowering.lower(case.objective)
    mod = derived.torch_module(sam=cfg, dtype=T64, on_nonconvergence="warn", weight_control=None)
    x = torch.zeros(1, 1, dtype=T64)
    with torch.no_grad(), warnings.catch_warnings():
        # the module's own relative-residual test (||T(z) − z||/||T(z)||) is ill-conditioned
        # when argmin_(Fix T) R ≈ 0; this property judges the result itself, below
        warnings.simplefilter("ignore", ce.ConvergenceWarning)
        zs = mod(x)[0]
        tz = derived.apply({z.name: zs[None], "x": x})[z.name][0]
    ref = torch.as_tensor(sam_reference(case), dtype=T64)
    err = rel_err(zs, ref)
    fix = rel_err(tz, zs)
    check(fix <= tol, f"Theorem 5: SAM output is not a fixed point of T (residual {fix:.3e})")
    check(err <= tol, f"Theorem 5: SAM output is {err:.3e} (relative) from argmin_(Fix T) R")
    return {"error": err, "fixed_point_residual": fix}
