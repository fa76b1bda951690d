"""Regression tests for verify's false alarms (each FAILed a correct layer on the old code).

Every test also keeps the check able to fail: a layer verified against a different objective
(another coefficient) must still FAIL.  Tolerances: the verified quantities are fixed-point /
projected-gradient residuals of float64 iterations that stop at 1e-12 and polished references
(≤ 1e-12); the bounds used (1e-8 and above) leave four orders of magnitude for BLAS/CPU
round-off differences.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
import verify
from convex_eq import L1, Input, Linear, Objective, Potential, SqNorm, State, Weight, models, moreau
from verify.report import SampleResult

T64 = torch.float64


def _check(obj, x=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify.check(lowering.lower(obj), {} if x is None else x, starts=2, **kw)


def _against(obj, other, x):
    """The layer of ``obj`` verified against ``other`` (must FAIL: the checks can fail)."""
    d = lowering.lower(obj)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify.check(dataclasses.replace(d, source=other), x, starts=2)


# 1 ------------------------------------------------------------------ zero minimizer, skip
def test_skip_of_an_input_free_objective_with_minimizer_zero() -> None:
    """``0.7·M^0.3[Σf_relu + ½||z||² − ½·½||Wz||²]``: the layer gives exactly z* = 0, Clarabel
    lands ~4e-6 away (degenerate interior point) and the envelope's lifted problem (auxiliary
    block) could not be polished: relative error 3.6e-4 (floor 1e-2) → FAIL.  The Moreau skip
    is now unwound (argmin λM^μ_φ = argmin φ) and the CVXPY point polished on φ."""
    rng = np.random.default_rng(0)
    z = State("z1", 4)
    W = Weight("W", (4, 4), np.linalg.qr(rng.normal(size=(4, 4)))[0] * 0.9)
    inner = Objective([Potential("relu", z), SqNorm(z), -SqNorm(ce.Dense(W) @ z) * 0.5])
    rep = _check(moreau(inner, 0.3) * 0.7)
    assert rep.passed, rep
    assert rep.samples[0].abs_error <= 1e-10
    assert any("polished" in n for n in rep.samples[0].notes)


# 2 ------------------------------------------------------------------ precomposed, active nonsmooth
def _gk(kind: str):
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U = Weight("U3", (4, 3), rng.normal(size=(4, 3)))
    a = rng.normal(size=(4, 4)) + np.eye(4)
    first = Potential("relu", z) if kind == "relu" else L1(z) * 0.3
    phi = Objective([first, SqNorm(z), -Linear(U @ x, z)])
    return phi, a, rng.normal(size=(3, 3))


@pytest.mark.parametrize("kind", ["relu", "l1"])
def test_precomposed_objective_with_an_active_nonsmooth_term(kind: str) -> None:
    """``(f + ½||u||² − <Ux, u> + 0.3·GaussianKernel(u))∘A``, f = Σf_relu or 0.3||u||₁ active
    at 0: the layer is stationary in u = Az, but the local reference took the projected
    gradient of φ∘A in z (no stationarity measure where u ≥ 0 / |u| is active): residuals
    1.2 and 0.4 → FAIL.  The local reference now works on φ at u = A(z)."""
    phi, a, x = _gk(kind)
    z = phi.states[0]
    rep = _check(ce.precompose(phi + ce.GaussianKernel(z, 1.0) * 0.3, a), x)
    assert rep.passed, rep
    assert rep.max_stationarity <= 1e-10
    bad = _against(ce.precompose(phi + ce.GaussianKernel(z, 1.0) * 0.3, a),
                   ce.precompose(phi + ce.GaussianKernel(z, 1.0) * 0.2, a), x)
    assert not bad.passed and any("stationarity" in f for f in bad.failures), bad


# 3 ------------------------------------------------------------------ one ulp outside a domain
@pytest.mark.parametrize("seed", [0, 1])
def test_precomposed_state_one_ulp_outside_a_clamp_box(seed: int) -> None:
    """``(Σf_clamp(u) + ½||u||² + 0.5·FeatureIncay(u) − <Ux, u>)∘M``, M = randn + 3I: after
    ``A⁻¹∘T∘A`` u lands an ulp outside [0, 1]; the value read +∞ (stationarity inf) — 20 of
    20 random M failed.  Evaluation now clips round-off (≤ 1e-10 relative) onto the domain."""
    rng = np.random.default_rng(seed)
    z, x = State("z1", 4), Input("x", 3)
    U = Weight("U3", (4, 3), rng.normal(size=(4, 3)) * 2)
    phi = Objective([Potential("clamp", z), SqNorm(z), ce.FeatureIncay(z) * 0.5,
                     -Linear(U @ x, z)])
    rep = _check(ce.precompose(phi, rng.normal(size=(4, 4)) + 3 * np.eye(4)),
                 rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert rep.max_stationarity <= 1e-10


def test_precomposed_conjugate_value_one_ulp_outside_its_domain() -> None:
    """``(f*_relu(u) + ½||u||² − <Ux, u>)∘M``: u one ulp below 0 outside dom f*_relu; the
    objective value read +∞ and the numeric reference's gap was inf → FAIL."""
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U = Weight("U3", (4, 3), rng.normal(size=(4, 3)) * 2)
    phi = Objective([ce.PotentialConjugate("relu", z), SqNorm(z), -Linear(U @ x, z)])
    rep = _check(ce.precompose(phi, rng.normal(size=(4, 4)) + 3 * np.eye(4)),
                 rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert all(s.gap is not None and math.isfinite(s.gap) for s in rep.samples)


# 4 ------------------------------------------------------------------ skip of a modified minimizer
def test_skip_of_a_prox_variant_edit_compares_with_the_claimed_objective() -> None:
    """``0.7·M^0.3[φ + 0.1||z||₁ + 0.3·½||z − Vx||²]``, φ Theorem 1 (conjugate form): the
    claim is the modified minimizer of ``φ + M¹[0.1||z||₁] + …`` (prox-variant edit), but the
    reference minimized the exact-ℓ1 objective: relative error 1.09 → FAIL."""
    phi = models.opteq(n=4, m=4, d=3, seed=0, activation="relu", form="conjugate")
    z = phi.states[0]
    x = next(s for s in phi.symbols if s.kind == "input")
    rng = np.random.default_rng(0)
    V = Weight("V", (4, 3), rng.normal(size=(4, 3)))
    inner = phi + L1(z) * 0.1 + SqNorm(z - V @ x) * 0.3
    rep = _check(moreau(inner, 0.3) * 0.7, rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert rep.label.startswith("modified minimizer") and rep.max_rel_error <= 1e-8


# 5 ------------------------------------------------------------------ HSIC batches
def test_hsic_objective_is_verified_on_its_batch() -> None:
    """OptEq + 0.05·HSIC with a batch of 4: verify lifted one sample at a time and HSIC raised
    "batch of at least 2, got 1".  The local reference is now one problem over the batch."""
    x = np.random.default_rng(0).normal(size=(4, 3))
    phi = models.opteq(n=4, m=4, d=3, seed=0)
    z = phi.states[0]
    rep = _check(phi + ce.HSIC(z) * 0.05, x)
    assert rep.passed, rep
    assert rep.max_stationarity <= 1e-10
    bad = _against(phi + ce.HSIC(z) * 0.05, phi + ce.HSIC(z) * 0.5, x)
    assert not bad.passed and any("stationarity" in f for f in bad.failures), bad


# 6 ------------------------------------------------------------------ NaN-aware maxima
def test_a_nan_sample_is_never_dropped_from_a_maximum() -> None:
    """The failure said "optimality residual = nan" while the table showed max 1.7e-15: the
    report's maximum skipped the NaN sample (and Python's ``max`` keeps or drops a NaN
    depending on its position, so a rule could pass with one)."""
    rep = _check(models.opteq(n=4, m=4, d=3, seed=0), np.ones((2, 3)))
    rep.samples[1] = SampleResult(1, residual=math.nan)
    rep.samples[0].residual = 1.7e-15
    assert math.isnan(rep.max_residual)
    row = next(r for r in rep.rows() if r[0].startswith("max optimality residual"))
    assert "nan" in row[1]
    from verify.report import worst

    assert math.isnan(worst([math.nan, 1.7e-15])) and math.isnan(worst([1.7e-15, math.nan]))
    assert worst([1.0, 2.0]) == 2.0 and worst([]) is None


# 7 ------------------------------------------------------------------ overflow-safe residual
def test_a_huge_state_never_reads_as_a_zero_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """``||z||²`` overflows float64 once ``|z| ≳ 1e154``: with ``z = 1e155·1`` and
    ``T(z) = 0.99z`` the residual read ``2e153/inf = 0`` ("ok").  Norms are now scaled by the
    largest entry: the relative residual is the true 1e-2 (exact in float64 to ~1e-15)."""
    import importlib

    from verify.report import EquilibriumInfo

    vc = importlib.import_module("verify.check")  # the module (the package exports a function)

    z = State("z1", 4)
    obj = Objective([Potential("identity", z), SqNorm(z), -SqNorm(z) * 0.99])  # T(z) = 0.99z
    huge = torch.full((1, 4), 1e155, dtype=T64)

    def stub(*args, **kwargs):  # a solver that (wrongly) reports this state as converged
        return huge, EquilibriumInfo("stub", 1e-12, [1], 0.0, True, np.zeros((1, 1)))

    monkeypatch.setattr(vc, "equilibrium", stub)
    rep = _check(obj)
    assert not rep.passed
    assert math.isclose(rep.samples[0].residual, 1e-2, rel_tol=1e-9)
    assert any(f.startswith("optimality residual") for f in rep.failures), rep.failures
