"""verify's lifted problem (verify/lifting.py): it reads each term's own domain box and lifting
role (``Term.domain_box``, ``Term.lift_role``, ``Term.lift_prox``) instead of a type switch, takes
a box in an affine argument in the coordinates where it is a box, and lifts the domains and
nonsmooth terms that made the stationarity check or the references fail correct layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
import verify
from convex_eq import (
    L1,
    AntiderivativeConjugate,
    Input,
    Linear,
    Potential,
    SqNorm,
    State,
    Weight,
    moreau,
)
from convex_eq.terms.base import Term
from tests.verify.helpers import verified
from verify.lifting import lift
from verify.optimize import minimize
from verify.references import CLARABEL_TIGHT, cvxpy_reference


def test_built_in_terms_state_their_domain_boxes():
    z = ce.State("z", 3)
    lo, hi = Potential("relu", z).domain_box(3)
    assert np.all(lo == 0) and np.all(np.isinf(hi))  # dom f_relu = [0, ∞)
    lo, hi = ce.LinfBallIndicator(z, 2.0).domain_box(3)
    assert np.all(lo == -2) and np.all(hi == 2)
    lo, hi = Potential("tanh", z).domain_box(3)  # open (−1, 1): moved inside by 1e-12
    assert np.all(-1 < lo) and np.all(lo < -1 + 1e-11) and np.all(hi < 1)
    assert Term.domain_box(ce.SqNorm(z), 3) is None
    assert ce.L1(z).lift_role == "value" and Potential("relu", z).lift_prox is False


def test_lifting_takes_the_box_a_term_declares():
    """A term that declares a different box changes the lifted bounds: the lifting has no
    private table of domains."""
    z = ce.State("z", 2)
    obj = ce.Objective([Potential("relu", z), ce.SqNorm(z)])
    p = lift(obj, {}, None)
    assert np.all(p.bounds()[0][0] == 0.0)

    class Shifted(Potential):
        def domain_box(self, size, env=None):
            return np.full(size, 0.5), np.full(size, np.inf)

    p2 = lift(ce.Objective([Shifted("relu", z), ce.SqNorm(z)]), {}, None)
    assert p2.bounds()[0][0] == 0.5


T64 = torch.float64


def _wide(rank_deficient: bool = False):
    """``Σσ̃*_relu(Mz + Ux) + ½||z||² − <a, z>`` with ``M``: 3 × 5 (full row rank, or rank 2)."""
    rng = np.random.default_rng(11)
    m = rng.normal(size=(3, 5))
    if rank_deficient:
        m[2] = m[0] + m[1]
    z, x = ce.State("z", 5), ce.Input("x", 2)
    u = ce.Constant("M", m) @ z + ce.Constant("U", rng.normal(size=(3, 2))) @ x
    a = ce.Constant("a", rng.normal(size=5))
    obj = ce.Objective([AntiderivativeConjugate("relu", u), ce.SqNorm(z), -ce.Linear(a, z)])
    return obj, m


def test_a_wide_affine_domain_is_lifted_to_y_and_the_kernel_of_m() -> None:
    obj, _m = _wide()
    xs = np.array([[0.7, -1.3]])
    p = lift(obj, {"x": torch.as_tensor(xs)}, None)
    assert [b.origin for b in p.blocks] == ["subst", "subst"] and p.n == 5
    assert np.all(p.lower[:3] == 0) and np.all(np.isinf(p.lower[3:]))  # y ≥ 0, w free
    # lift_point and states are inverse maps (an affine bijection z ↔ (y, w))
    z0 = np.random.default_rng(0).normal(size=5)
    v = p.lift_point({"z": z0})
    np.testing.assert_allclose(p.states(v)["z"], z0, atol=1e-12)  # float64 round trip: ~1e-15
    # the minimizer of the lifted problem is CVXPY's (an independent solver on the z-form)
    res = minimize(p, p.start_point())
    ref = cvxpy_reference(obj, {"x": xs[0]}, {}, CLARABEL_TIGHT)
    assert ref.ok
    # Clarabel at 1e-11 gap: ~1e-6 accurate at a degenerate corner, far tighter elsewhere;
    # L-BFGS-B + Newton polish: ~1e-12. 1e-5 absorbs both on any BLAS
    np.testing.assert_allclose(p.states(res.v)["z"], ref.states["z"], atol=1e-5)
    assert res.pg <= 1e-10 and abs(res.f - ref.value) <= 1e-7 * max(1.0, abs(ref.value))
    assert np.sum(res.v[:3] == 0.0) >= 1  # informative: the minimizer is on the boundary y = 0
    # the residual at CVXPY's point, lifted: ~1e-6 at most (Clarabel's accuracy, above)
    assert p.projected_gradient(p.lift_point({"z": ref.states["z"]})) <= 1e-5


def test_a_rank_deficient_map_is_not_substituted() -> None:
    """``{Mz + c ≥ 0}`` with rank M < rows is not a box in any coordinates: z stays a plain
    block (the residual then reads inf on the boundary, reported, never a false PASS)."""
    obj, _ = _wide(rank_deficient=True)
    p = lift(obj, {"x": torch.zeros(1, 2, dtype=T64)}, None)
    assert [b.origin for b in p.blocks] == ["state"] and not p.substitutions


@pytest.mark.parametrize("which", ["l1", "linf"])
def test_verify_an_input_free_envelope_whose_lifted_problem_has_no_smooth_part(which: str) -> None:
    """``M^μ[c·||z||₁]`` lifts to a prox term only (no smooth part): verify passes it as a
    minimizer.

    Pins: the stationarity residual took the autograd gradient of a constant and raised an
    untyped RuntimeError."""
    z = State("z", 4)
    inner = L1(z) * 0.3 if which == "l1" else ce.LinfBallIndicator(z, 0.5)
    phi = moreau(inner, 0.5) if which == "l1" else moreau(inner, 1.0) * 0.9
    report = verify.check(lowering.lower(phi), {})
    assert report.passed, report
    assert report.label == "minimizer"


def test_verify_linf_ball_is_a_box_in_the_stationarity_check() -> None:
    """``−<c, z> + ι(||z||∞ ≤ 1)``: the ball is a box of the lifted problem, so the projected
    gradient at the layer's point is ~0 and verify passes.

    Pins: the projected gradient ignored the ball (residual ||c|| ≈ 1.6: a false FAIL)."""
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U, b = Weight("U3", (4, 3), rng.normal(size=(4, 3))), Weight("b2", 4, rng.normal(size=4))
    rep = verified(-Linear(U @ x + b, z) + ce.LinfBallIndicator(z, 1.0), rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12


@pytest.mark.parametrize("act", ["softplus", "clamp"])
def test_verify_conjugate_antiderivative_domain_is_a_box(act: str) -> None:
    """dom σ̃* = range of σ ((0, ∞) for softplus, [0, 1] for clamp) is a box of the lifted
    problem: the numeric reference and the stationarity check both respect it, and verify
    passes.

    Pins: the numeric reference stuck at the edge (relative error 1.5e2) and the stationarity
    check ignored the bound (residual ≈ 1.2): two false FAILs."""
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U, b = Weight("U3", (4, 3), rng.normal(size=(4, 3))), Weight("b2", 4, rng.normal(size=4))
    if act == "softplus":
        phi = (AntiderivativeConjugate(act, z) * 0.5
               + moreau(ce.LinfBallIndicator(z, 1.0), 0.733) * 0.49)
        rep = verified(phi)
    else:
        rep = verified(AntiderivativeConjugate(act, z) * 0.97 - Linear(U @ x + b, z),
                        rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12


def test_verify_nonsmooth_conjugate_potential_is_a_prox_term_of_the_lifted_problem() -> None:
    """f*_hardtanh(w) = |w| is nonsmooth: it is a prox term of the lifted problem, and verify
    passes the layer.

    Pins: L-BFGS-B stalled on it (reference projected gradient 1.2) and the stationarity check
    took a gradient of |·| (0.83): "reference solver failed"."""
    rng = np.random.default_rng(0)
    z = State("z1", 4)
    c = ce.Constant("c", rng.normal(size=4) * 3)
    rep = verified(ce.PotentialConjugate("hardtanh", z) + SqNorm(z - c) * 1.78)
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12


def test_verify_point_conjugate_domain_stays_a_closed_box() -> None:
    """f*_identity = ι{0}: its domain stays the closed box [0, 0] and verify passes.

    Pins: moving the 'open' ends inside by 1e-12 made lo > hi and scipy raised an untyped
    ValueError from verify.check."""
    z = State("z1", 3)
    rep = verified(ce.precompose(ce.PotentialConjugate("identity", z) + SqNorm(z),
                                  np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))[0]))
    assert rep.passed, rep


def test_a_batch_lifted_dual_uses_each_samples_own_injection() -> None:
    """A batch-coupled objective (batch decorrelation) over a conjugate with a tall ``M``
    (``Mᵀ`` not injective): lifting the whole batch, sample ``b``'s dual ``y_b`` is the inner
    argmin at its own ``q_b = U x_b + b``.  With the identity activation that argmin is closed
    form (``y = M w + q_b``, ``Mᵀ y = z_b``), solved here in numpy."""
    from verify.lifting import lift_batch

    rng = np.random.default_rng(0)
    m, n, d = 3, 2, 1
    W, U = 0.3 * rng.standard_normal((m, n)), rng.standard_normal((m, d))
    b0 = rng.standard_normal(m)
    z, x = State("z1", n), Input("x", d)
    arg = -1.0 * (ce.Dense(Weight("W2", (m, n), W)) @ z) + ce.Dense(Weight("U4", (m, d), U)) @ x \
        + Weight("b3", m, b0)
    phi = ce.Objective([ce.Antiderivative("identity", arg).conjugate(), -SqNorm(z),
                        ce.BatchDecorrelation(z) * 0.1])
    xs = np.array([[-2.3], [-0.2]])
    zs = rng.standard_normal((2, n))
    p = lift_batch(phi, {"x": torch.as_tensor(xs)}, None)
    v = p.lift_point({"z1": zs})
    assert v is not None
    M = -W
    for k, y in enumerate(p.rows(v)):
        q = U @ xs[k] + b0
        w = np.linalg.solve(M.T @ M, zs[k] - M.T @ q)
        # Newton on the inner problem stops at constraint residual ≤ 1e-11: y agrees to ~1e-10
        np.testing.assert_allclose(y, M @ w + q, atol=1e-9)


def test_verify_a_batch_decorrelated_conjugate_with_a_tall_map() -> None:
    """The case the thorough fuzz profile found: verify crashed lifting the batch's duals."""
    rng = np.random.default_rng(1)
    z, x = State("z1", 2), Input("x", 1)
    arg = -1.0 * (ce.Dense(Weight("W2", (3, 2), 0.3 * rng.standard_normal((3, 2)))) @ z) \
        + ce.Dense(Weight("U4", (3, 1), rng.standard_normal((3, 1)))) @ x \
        + Weight("b3", 3, rng.standard_normal(3))
    phi = ce.Objective([ce.Antiderivative("identity", arg).conjugate(), -SqNorm(z),
                        ce.BatchDecorrelation(z) * 0.1])
    rep = verify.check(lowering.lower(phi, regularizer="auto"),
                       {"x": torch.tensor([[-2.3], [-0.2]], dtype=torch.float64)})
    assert rep.passed, rep.failures
