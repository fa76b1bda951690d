"""verify's lifted problem takes a term whose domain is a box in an affine argument ``u = Mz + c``
(``Σσ̃*(Mz + c)``: ``dom = {Mz + c ≥ 0}`` for ReLU, a polyhedron in ``z``) in the coordinates
``y = Mz + c`` (plus ``w = Nᵀz`` on ``ker M`` when ``M`` is wide), where it is a box."""

from __future__ import annotations

import numpy as np
import torch

import convex_eq as ce
from convex_eq.terms.potential import AntiderivativeConjugate
from verify.lifting import lift
from verify.optimize import minimize
from verify.references import CLARABEL_TIGHT, cvxpy_reference

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
