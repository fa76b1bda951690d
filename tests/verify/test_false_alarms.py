"""verify never FAILs a correct layer: each test is a correct layer on which a reference, a
stationarity check or a tolerance produced a false alarm (the docstring says which), and it
passes.

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
from convex_eq import (
    L1,
    Input,
    Linear,
    Objective,
    Potential,
    SqNorm,
    State,
    Weight,
    models,
    moreau,
)
from convex_eq.operators import Dense
from tests.verify.helpers import verified
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
    is unwound (argmin λM^μ_φ = argmin φ) and the CVXPY point polished on φ."""
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
    1.2 and 0.4 → FAIL.  The local reference works on φ at u = A(z)."""
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
    20 random M failed.  Evaluation clips round-off (≤ 1e-10 relative) onto the domain."""
    rng = np.random.default_rng(seed)
    z, x = State("z1", 4), Input("x", 3)
    U = Weight("U3", (4, 3), rng.normal(size=(4, 3)) * 2)
    phi = Objective([Potential("clamp", z), SqNorm(z), ce.FeatureIncay(z) * 0.5,
                     -Linear(U @ x, z)])
    rep = _check(ce.precompose(phi, rng.normal(size=(4, 4)) + 3 * np.eye(4)),
                 rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert rep.max_stationarity <= 1e-10


@pytest.mark.parametrize("seed, n", [(0, 2), (1, 4), (2, 3), (3, 4)])
def test_batch_decorrelation_of_one_sample_at_a_zero_feature(seed: int, n: int) -> None:
    """``(Σf_tanh(u) + ½||u||² − a·FeatureIncay(u) + a·BatchDecorrelation(u))∘(M, c)`` with no
    input: one sample, whose stationary point is ``u = My + c = 0`` (``y = −M⁻¹c``, entries of
    ``u`` at round-off ~1e-16).  Autograd through the decorrelation's row normalization read a
    stationarity residual of 2e-3…0.3 there (5 of 12 such cases FAILed); with one sample the
    term is locally constant, its gradient exactly 0."""
    rng = np.random.default_rng(seed)
    z, a = State("z1", n), 0.19239
    phi = Objective([Potential("tanh", z), SqNorm(z),
                     ce.FeatureIncay(z, ce.Scalar("eps2", 0.7, low=0.0, low_open=True)) * (-a),
                     ce.BatchDecorrelation(z) * a])
    A = rng.standard_normal((n, n))
    M = A + (1.0 + float(np.linalg.norm(A, 2))) * np.eye(n)
    c = rng.standard_normal(n)
    rep = _check(ce.precompose(phi, M, c, name="y3"))
    assert rep.passed, rep
    # the layer's y is −M⁻¹c (u = 0 is the stationary point: ∇ of the other terms vanishes only
    # there); float64 solve of a well-conditioned M (cond ≤ 3): 1e-12 leaves a wide margin
    np.testing.assert_allclose(np.asarray(rep.z_layer).reshape(-1), -np.linalg.solve(M, c),
                               atol=1e-12)


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
    "batch of at least 2, got 1".  The local reference is one problem over the batch."""
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
    ``T(z) = 0.99z`` the residual read ``2e153/inf = 0`` ("ok").  Norms are scaled by the
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


@pytest.mark.parametrize("norm", [1.0, 0.5])
def test_input_free_theorem1_minimizer_zero_with_a_wide_dual(norm: float) -> None:
    """``(c·Σ∫relu(W·))*(z) − ½||z||²`` without input, W 6×4: z* = 0 (T(0) = 0 exactly),
    Clarabel ~2e-6 away (relative error 6e-5 with the 1e-2 floor), and the CVXPY point could
    not be polished (the dual y is not determined by z: Wᵀ is not injective) → FAIL (found by
    the thorough fuzz's adjudicator: 3 of 4 unconfirmed FAILs).  The certified-convex numeric
    reference, a second method, replaced such a point when it is stationary and at least as
    good in value; since the dual is lifted as the inner argmin of ψ* at z (Dual.argmin), the
    CVXPY point is polished in y directly."""
    rng = np.random.default_rng(1)
    z = State("z1", 4)
    w = rng.normal(size=(6, 4))
    w2 = Weight("W2", (6, 4), w / np.linalg.norm(w, 2) * norm)
    phi = Objective([(ce.Antiderivative("relu", ce.Dense(w2) @ z) * 0.578799).conjugate(),
                     -SqNorm(z)])
    rep = _check(phi)
    assert rep.passed, rep
    assert rep.samples[0].abs_error <= 1e-10
    assert any("numeric reference instead" in n or "CVXPY point polished" in n
               for n in rep.samples[0].notes)


# 8 ------------------------------------------------------------------ from the thorough fuzz
def test_stationarity_allowance_follows_the_accepted_fixed_point_residual(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward–backward with step 0.5: a state accepted with fixed-point residual 6.8e-9
    (≤ 1e-8) has unit-step stationarity residual 1.4e-8 (twice it: the step) and FAILed
    "stationarity 1.4e-8 > 1e-8" (an fb case of the thorough fuzz, unconfirmed by the
    adjudicator).  Stationarity is allowed 10× the sample's own residual."""
    import importlib

    vc = importlib.import_module("verify.check")
    rng = np.random.default_rng(0)
    z = State("z1", 4)
    a = rng.normal(size=(4, 4))
    q = ce.Constant("Q", a @ a.T / 4 + 0.5 * np.eye(4))
    c = ce.Constant("c", rng.normal(size=4) * 2)
    d = lowering.lower(L1(z) * 0.3 + ce.QuadraticForm(q, z) - Linear(c, z), tau=0.5)
    orig = vc.equilibrium

    def off(derived, inputs, env, tol=1e-12, **kw):  # the fixed point, moved to r ≈ 7e-9
        zz, eq = orig(derived, inputs, env, tol=tol, **kw)
        f = vc.operator(derived, inputs, env)
        e = torch.zeros_like(zz)
        e[0, int(torch.argmax(zz.abs()))] = 1.0
        slope = float((zz + 1e-6 * e - f(zz + 1e-6 * e)).norm()) / 1e-6
        return zz + e * (8e-9 / slope), eq

    monkeypatch.setattr(vc, "equilibrium", off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify.check(d, {})
    s = rep.samples[0]
    assert 1e-9 < s.residual <= 1e-8 and s.stationarity > 1e-8
    assert rep.passed, rep


@pytest.mark.parametrize("path", ["cvxpy", "numeric"])
def test_a_reference_on_a_flat_minimum_a_little_away_is_not_a_failure(
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """``ι(||z||∞ ≤ 1) + <c, z>`` with c₃ = 0: every z₃ ∈ [−1, 1] is a minimizer; a reference
    2e-5 away along it FAILed (relative error 1.4e-5 < the 1e-3 'second minimizer' bound, an
    fb case of the thorough fuzz).  A stationary layer of a certified-convex objective with
    the reference's value is a minimizer whatever the distance: reported, not failed."""
    import importlib

    vc = importlib.import_module(f"verify.references.{path}")
    z = State("z1", 3)
    phi = ce.LinfBallIndicator(z, 1.0) + Linear(ce.Constant("c", np.array([1.0, -2.0, 0.0])), z)
    fn = "cvxpy_reference" if path == "cvxpy" else "numeric_reference"
    orig = getattr(vc, fn)

    def shifted(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.states = {k: v + np.array([0.0, 0.0, 2e-5]) for k, v in out.states.items()}
        return out

    monkeypatch.setattr(vc, fn, shifted)
    rep = _check(phi, reference=path)
    assert rep.passed, rep
    assert rep.samples[0].stationarity <= 1e-12


def test_a_state_error_within_an_unconverged_solves_bound_is_not_a_layer_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``T(z) = 0.999z + b`` (c = 0.999): a tight solve stopped at relative residual 5e-9
    (accepted, ≤ 1e-8) leaves the state 5e-6 off (r/(1 − c)); that FAILed as "relative error
    … (layer vs reference)" (an fb case of the thorough fuzz, unconfirmed by the adjudicator).
    It is "equilibrium not accurate enough to compare" — verify's own limit."""
    import importlib

    from verify.report import EquilibriumInfo

    vc = importlib.import_module("verify.check")
    z = State("z1", 3)
    bvec = np.array([1.0, -2.0, 0.5])
    obj = Objective([Potential("identity", z), SqNorm(z), -SqNorm(z) * 0.999,
                     -Linear(ce.Constant("b", bvec), z)])
    d = lowering.lower(obj)
    assert abs(d.contraction.value() - 0.999) <= 1e-12
    zstar = bvec / 0.001
    zz = zstar + 5e-9 * np.linalg.norm(zstar) / 0.001 * np.array([1.0, 0.0, 0.0])

    def early(*args, **kwargs):
        return (torch.as_tensor(zz, dtype=T64).reshape(1, 3),
                EquilibriumInfo("stub", 1e-12, [9], 5e-9, False, np.zeros((1, 1))))

    monkeypatch.setattr(vc, "equilibrium", early)
    rep = _check(obj)
    assert not rep.passed
    assert rep.failures[0].startswith("equilibrium not accurate enough"), rep.failures
    assert not any(f.startswith("relative error") for f in rep.failures)


def test_verify_numeric_reference_starts_inside_an_open_conjugate_domain() -> None:
    """``Σf*_softplus(z) + ...``: dom f*_softplus = (−∞, 0); the numeric reference started on
    the boundary, where the NaN gradient read as 0, and "converged" to z = 0 (objective 0.82
    above the layer's, which is right: z* = −0.68845 by scalar minimization)."""
    z = State("z1", 1)
    phi = (ce.PotentialConjugate("softplus", z) + moreau(ce.LinfBallIndicator(z, 0.5), 1.0) * 0.05
           + SqNorm(z))
    rep = verified(phi)
    assert rep.passed, rep
    assert rep.samples[0].rel_error <= 1e-9
    # independent reference: bounded scalar minimization of G with scipy (xatol 1e-12); the
    # layer's fixed point agrees to 1e-7 (scipy's bracketing accuracy on a flat minimum)
    from scipy.optimize import minimize_scalar

    def g(v: float) -> float:
        return float(phi.value_tensor({"z1": torch.tensor([[v]], dtype=T64)}))

    ref = minimize_scalar(g, bounds=(-20.0, -1e-12), method="bounded",
                          options={"xatol": 1e-12}).x
    z_layer = lowering.lower(phi).apply({"z1": torch.tensor([[ref]], dtype=T64)})["z1"]
    assert abs(float(z_layer) - ref) <= 1e-7  # T(z_ref) ≈ z_ref: the scipy point is a fixed point
    assert abs(ref + 0.68845) <= 1e-5


def test_verify_minimizer_at_zero_is_not_failed_by_interior_point_noise() -> None:
    """``Σf_relu(z) + ½||z||²``: z* = 0 on z ≥ 0 with a zero multiplier (degenerate); Clarabel
    at gap 1e-11 lands 1.6e-6 away (interior points converge like sqrt(gap) there), a false
    FAIL (relative error 1.6e-3).  The disagreeing CVXPY point is polished by local
    minimization from that point (not from the layer's) before comparing."""
    z = State("z1", (1, 2, 2))
    rep = verified(Objective([Potential("relu", z), SqNorm(z)]))
    assert rep.passed, rep
    assert rep.samples[0].abs_error <= 1e-12
    assert any("polished" in n for n in rep.samples[0].notes)


def test_verify_reports_a_second_minimizer_of_a_flat_convex_objective() -> None:
    """``ι(||z||∞ ≤ 1) + ½M^½[Σf_leaky_relu]``: every z ∈ [0, 1]ⁿ is a minimizer; the layer and
    CVXPY pick different ones (relative error 1.0, gap 0, stationarity 0) — a false FAIL."""
    z = State("z1", 3)
    phi = ce.LinfBallIndicator(z, 1.0) + moreau(Objective([Potential("leaky_relu", z)]), 0.5) * 0.5
    rep = verified(phi)
    assert rep.passed, rep
    s = rep.samples[0]
    assert s.argmin_not_unique and s.rel_error > 0.5 and abs(s.gap) <= 1e-12
    assert any("not a single point" in n for n in s.notes)


def test_verify_batch_coupled_objective_uses_the_batch_gradient() -> None:
    """OptEq + batch decorrelation: the stationarity check lifted one sample at a time, where the
    coupled term is a different function (residual 6e-2, false FAIL).  Now the smooth gradient is
    the batch objective's; a layer for another coefficient still fails."""
    import dataclasses

    x = np.random.default_rng(0).normal(size=(5, 3))
    phi = models.opteq(n=4, m=4, d=3, seed=0)
    z = phi.states[0]
    d = lowering.lower(phi + ce.BatchDecorrelation(z) * 0.05)
    import verify

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify.check(d, x, starts=2)
        # the second-order check sees the batch problem (one function of all samples)
        assert rep.passed and rep.label == "local minimizer", rep
        assert max(s.stationarity for s in rep.samples) <= 1e-10
        wrong = dataclasses.replace(d, source=phi + ce.BatchDecorrelation(z) * 0.5)
        bad = verify.check(wrong, x, starts=2)
    assert not bad.passed and any("stationarity" in f for f in bad.failures), bad


def test_verify_unwraps_nested_precompositions_and_polishes_through_them() -> None:
    """(φ∘A)∘B with φ = c||u||₁ + ½uᵀQu: the stationarity check unwrapped one level only, so ℓ1
    was differentiated (residual 0.48, false FAIL); a degenerate minimizer of a precomposed
    relu objective was compared with the unpolished CVXPY point (relative error 2e-4)."""
    rng = np.random.default_rng(3)
    z = State("z1", 4)
    a = rng.normal(size=(4, 4))
    q = ce.Constant("Q2", a @ a.T / 4 + 0.1 * np.eye(4))
    phi = L1(z) * 0.41 + ce.QuadraticForm(q, z) * 0.41
    nested = ce.precompose(ce.precompose(phi, np.linalg.qr(rng.normal(size=(4, 4)))[0],
                                         rng.normal(size=4)), rng.normal(size=(4, 4)))
    rep = verified(nested)
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12
    rng = np.random.default_rng(0)
    W = Weight("W2", (4, 4), np.linalg.qr(rng.normal(size=(4, 4)))[0] * 0.9)
    relu = Objective([Potential("relu", z), SqNorm(z), -SqNorm(Dense(W) @ z) * 0.5])
    rep = verified(ce.precompose(relu, np.linalg.qr(rng.normal(size=(4, 4)))[0]))
    assert rep.passed, rep
    assert any("polished" in n for n in rep.samples[0].notes)


def test_verify_polishes_an_inaccurate_cvxpy_solution_instead_of_failing() -> None:
    """``Σf_tanh(z) + ½||z||² − <c, z>``: Clarabel at gap 1e-11 ends 'optimal_inaccurate' (the
    entropy cones); that was "reference solver failed".  The point is polished by local
    minimization and used only if it is stationary to the reference tolerance."""
    z = State("z1", 4)
    c = ce.Constant("c", np.random.default_rng(0).normal(size=4) * 3)
    rep = verified(Objective([Potential("tanh", z), SqNorm(z), -Linear(c, z)]))
    assert rep.passed, rep
    assert rep.reference.statuses == ["optimal_inaccurate → polished"]
    assert rep.samples[0].rel_error <= 1e-12


@pytest.mark.parametrize("alpha", [float(np.nextafter(1.0, 0.0)), 1.0 - 1e-9])
def test_deep_composition_with_alpha_a_rounding_below_one(alpha: float) -> None:
    """Corollary 1 at α one ulp (or 1e-9) below 1: Theorem 2's gradient form divides by
    μ = 1 − α, so its residual was round-off times 1/μ (0.57 at one ulp, 1e-8 at 1e-9) and
    FAILed a correct layer; below μ = 1e-6 the prox form alone decides (measured 5e-18 here)."""
    from convex_eq.composition import DeepComposition

    deep = models.deep_opteq(L=2, n=6, m=6, d=3, seed=0)
    d = lowering.lower(DeepComposition(deep.layers, alpha, name="deep"), deep_form="multiblock")
    x = torch.as_tensor(np.random.default_rng(0).standard_normal((2, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify.check(d, x)
    assert not any("gradient-form" in f for f in rep.failures), rep.failures
    # float64 prox evaluations of a fixed point solved to 1e-12: 1e-10 leaves a wide margin
    assert rep.max_block_residual("prox-form") <= 1e-10
    assert all("gradient-form" not in s.block_residuals for s in rep.samples)
