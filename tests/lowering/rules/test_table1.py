"""TPAMI Table 1, row 4 / Eq. 4: the closed form ``Σσ̃*(W⁻ᵀz) − <Ux + b, W⁻ᵀz> − ½||z||²`` of
Theorem 1's objective for invertible ``W`` lowers to ``Wᵀσ(Wz + Ux + b)``; its certificate is
about the actual quadratic form (no false "λ_min(Q) ≥ 0 (now −1)")."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq.terms.potential import AntiderivativeConjugate
from verify.check import check

T64 = torch.float64


def _eq4(act: str = "relu", norm: float = 0.8, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(5, 5))
    w *= norm / np.linalg.norm(w, 2)
    z, x = ce.State("z", 5), ce.Input("x", 3)
    m = ce.Constant("Minv", np.linalg.inv(w).T)  # M = W⁻ᵀ
    u = rng.normal(size=(5, 3))
    b = 0.1 * rng.normal(size=5)
    q = ce.Weight("U", (5, 3), u) @ x + ce.Weight("b", 5, b)
    phi = AntiderivativeConjugate(act, m @ z) - ce.Linear(q, m @ z) - ce.SqNorm(z)
    return phi, torch.as_tensor(w), torch.as_tensor(u), torch.as_tensor(b)


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_eq4_closed_form_lowers_to_theorem1_layer(act: str) -> None:
    phi, w, u, b = _eq4(act)
    d = lowering.lower(phi)
    assert d.derivation.rules()[:2] == ["closed form of ψ* for invertible W (TPAMI Eq. 4)",
                                        "Theorem 1 (OptEq): prox of ψ* − ½||·||² is ∇ψ"]
    assert d.is_prox and d.claim.kind == "minimizer"
    gen = torch.Generator().manual_seed(3)
    z, x = torch.randn(4, 5, generator=gen, dtype=T64), torch.randn(4, 3, generator=gen, dtype=T64)
    sig = torch.relu if act == "relu" else torch.tanh
    ref = sig(z @ w.T + x @ u.T + b) @ w  # Wᵀσ(Wz + Ux + b)
    # float64; the layer solves with M = W⁻ᵀ (cond(W) ~ 10): rounding ~1e-14, margin 100×
    torch.testing.assert_close(d.apply({"z": z, "x": x})["z"], ref, atol=1e-11, rtol=1e-11)
    rep = check(d, x[:2].numpy())
    # tanh is not DCP: the certified-convex numeric reference; ReLU: CVXPY.  Both pass the
    # independent stationarity check, measured in y = Mz (dom σ̃*(Mz) = {Mz ∈ dom f_σ} is a
    # box in y, a polyhedron in z: verify/lifting.py substitutes y for z)
    assert rep.passed, rep
    assert rep.reference.kind == ("numeric" if act == "tanh" else "cvxpy"), rep
    assert all(s.stationarity is not None for s in rep.samples), rep


def _perturbed(d, eps: float = 1e-3):
    """The same layer with ``T(z) + eps·z``: its fixed point is not the minimizer."""
    from lowering.nodes import Combo, Var

    (b,) = d.blocks
    return dataclasses.replace(d, nodes={b.name: Combo([(1.0, d.nodes[b.name]), (eps, Var(b))])})


def test_eq4_relu_verify_fails_a_deliberately_wrong_layer() -> None:
    """The lifted stationarity check is not blind: ``T + 1e-3·id`` (a fixed point off the
    minimizer by ~1e-3) fails it, and the CVXPY comparison, on both samples."""
    phi, *_ = _eq4("relu")
    d = _perturbed(lowering.lower(phi))
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(3), dtype=T64)
    rep = check(d, x.numpy())
    assert not rep.passed and rep.pass_rules["residual"] is True, rep
    assert rep.pass_rules["stationarity"] is False and rep.pass_rules["rel_error"] is False, rep
    # a 1e-3 perturbation of T moves the stationarity residual to ~1e-4, four orders above
    # verify's 1e-8 tolerance; the correct layer reads ~1e-14 (test above)
    assert all(s.stationarity is not None and s.stationarity > 1e-6 for s in rep.samples), rep


def test_eq4_certificate_sees_the_strong_convexity_of_the_conjugate() -> None:
    phi, *_ = _eq4(norm=0.8)
    cert = phi.certificate()
    assert cert.holds and "Q = Hessian" in cert.text
    # Q = W⁻¹W⁻ᵀ − I: λ_min = 1/||W||₂² − 1 = 1/0.64 − 1
    assert cert.values[0] == pytest.approx(1 / 0.64 - 1, rel=1e-9)
    bad, *_ = _eq4(norm=1.25)
    assert not bad.certificate().holds and "VIOLATED" in str(bad.certificate())


def test_linear_activation_s_psd_is_the_conjugate_of_a_quadratic_form() -> None:
    from convex_eq.errors import NotDCPError
    from convex_eq.terms.quadratic import QuadraticForm

    rng = np.random.default_rng(4)
    a = rng.normal(size=(5, 3))
    s = a @ a.T / np.linalg.norm(a @ a.T, 2)  # S ⪰ 0, rank 3, ||S||₂ = 1
    z, x = ce.State("z", 5), ce.Input("x", 3)
    w, u, b = 0.3 * rng.normal(size=(5, 5)), rng.normal(size=(5, 3)), 0.1 * rng.normal(size=5)
    psi = QuadraticForm(ce.Constant("S", s),
                        ce.Weight("W", (5, 5), w) @ z + ce.Weight("U", (5, 3), u) @ x
                        + ce.Weight("b", 5, b))
    d = lowering.lower(psi.conjugate() - ce.SqNorm(z))
    assert d.is_prox and d.claim.kind == "minimizer"
    gen = torch.Generator().manual_seed(6)
    zz = torch.randn(4, 5, generator=gen, dtype=T64)
    xx = torch.randn(4, 3, generator=gen, dtype=T64)
    wt, ut, bt, st = (torch.as_tensor(v) for v in (w, u, b, s))
    ref = (zz @ wt.T + xx @ ut.T + bt) @ st @ wt  # WᵀS(Wz + Ux + b), S symmetric
    # S = (S^½)² from an eigendecomposition: float64 rounding ~1e-15 relative, margin 1e4
    torch.testing.assert_close(d.apply({"z": zz, "x": xx})["z"], ref, atol=1e-11, rtol=1e-11)
    rep = check(d, xx[:2].numpy())
    assert rep.passed, rep
    with pytest.raises(NotDCPError, match="not positive semidefinite"):
        QuadraticForm(ce.Constant("S2", -s), z).conjugate()


def test_affine_map_on_the_theorem1_form() -> None:
    """Table 1 row 3: ``ψ*(A(z)) − ½||A(z)||²`` ⇒ ``A⁻¹(Wᵀσ(W A(z) + Ux + b))``."""
    from convex_eq import models

    phi = models.opteq(n=5, m=5, d=3, form="conjugate", seed=0)
    rng = np.random.default_rng(1)
    m = np.eye(5) + 0.3 * rng.normal(size=(5, 5))
    c = 0.2 * rng.normal(size=5)
    pc = ce.precompose(phi, m, c)
    d = lowering.lower(pc)
    assert d.derivation.rules()[-1] == "affine precomposition φ → φ∘A"
    assert d.claim.kind == "minimizer" and pc.certificate().holds
    w, u, b = (phi.symbol(n).value.detach() for n in ("W", "U", "b"))
    gen = torch.Generator().manual_seed(8)
    z, x = torch.randn(4, 5, generator=gen, dtype=T64), torch.randn(4, 3, generator=gen, dtype=T64)
    mt, ct = torch.as_tensor(m), torch.as_tensor(c)
    a = z @ mt.T + ct  # A(z) = Mz + c
    ref = torch.linalg.solve(mt, (torch.relu(a @ w.T + x @ u.T + b) @ w - ct).T).T
    # float64 with one solve (cond(M) ≈ 3): rounding ~1e-15, margin 1e4
    torch.testing.assert_close(d.apply({"z_A": z, "x": x})["z_A"], ref, atol=1e-11, rtol=1e-11)
    rep = check(d, x[:2].numpy())
    assert rep.passed and rep.reference.kind == "numeric", rep
