"""Regularizer edits (lowering/rules/regularizers.py, Theorem 4 of docs/theory.md): ``φ + γR``
lowered in the prox variant (``prox_φ ∘ prox_{γR}``, a modified minimizer) or the gradient
variant (``prox_φ(z − γ∇R)``), against the formulas written out here; the derivation text and
claim say which; refusals where a variant does not exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import (
    L1,
    Antiderivative,
    SqNorm,
    State,
    Weight,
    moreau,
)
from convex_eq.operators import Dense
from tests.lowering.helpers import close, prox_relu_phi, randn, relu_phi, theorem1
from tests.verify.helpers import verified

T64 = torch.float64


def _hand_decorrelation(zb: torch.Tensor) -> torch.Tensor:
    zm = zb.T  # m × B
    d = torch.diag(1 / zm.norm(dim=1))
    c = d @ zm @ zm.T @ d
    return 0.5 * ((c - torch.eye(zm.shape[0], dtype=T64)) ** 2).sum()


def _hand_hsic(zb: torch.Tensor, s: float) -> torch.Tensor:
    bsz = zb.shape[0]
    h = torch.eye(bsz, dtype=T64) - 1.0 / bsz
    ks = [torch.exp(-((r[:, None] - r[None, :]) ** 2) / (2 * s * s)) for r in zb.T]
    tot = 0.0
    for i in range(len(ks)):
        for j in range(i + 1, len(ks)):
            tot = tot + torch.trace(ks[i] @ h @ ks[j] @ h)
    return tot / (bsz - 1) ** 2


@pytest.mark.parametrize("case", ["sq-prox", "sq-grad", "l1-prox", "incay-grad", "decor-grad",
                                  "hsic-grad"])
def test_regularizer_edits_both_variants(case: str) -> None:
    """Each edit against ``prox_φ`` of the hand-written inner step (1e-10: float64 closed forms;
    the batch terms' gradients by autograd of their hand-written values)."""
    phi = relu_phi()
    z = phi.states[0]
    gam = 0.3
    z_v, x = randn(5, 6), randn(5, 3)
    if case.startswith("sq"):
        reg, variant = gam * ce.SqNorm(z), {"prox": "prox", "grad": "gradient"}[case[3:]]
        inner = z_v / (1 + gam) if variant == "prox" else z_v - gam * z_v
    elif case == "l1-prox":
        reg, variant = gam * ce.L1(z), "prox"
        inner = torch.sign(z_v) * (z_v.abs() - gam).clamp_min(0)
    elif case == "incay-grad":
        reg, variant = gam * ce.FeatureIncay(z, 0.5), "gradient"
        nrm = (z_v ** 2).sum(1, keepdim=True)
        inner = (1 + 4 * gam / (nrm + 2 * 0.5) ** 2) * z_v  # docs/theory.md §4, derived sign
    else:
        hand = _hand_decorrelation if case == "decor-grad" else (lambda t: _hand_hsic(t, 1.0))
        term = ce.BatchDecorrelation(z) if case == "decor-grad" else ce.HSIC(z, 1.0)
        reg, variant = gam * term, "gradient"
        zz = z_v.clone().requires_grad_()
        (g,) = torch.autograd.grad(hand(zz), zz)
        inner = z_v - gam * g
    d = lowering.lower(phi + reg, regularizer=variant)
    close(d.apply({"z": z_v, "x": x})["z"], prox_relu_phi(phi, inner, x), 1e-10)
    expected = "modified minimizer" if variant == "prox" and case != "sq-prox" else None
    if case == "l1-prox":
        assert d.claim.kind == expected
    if case in ("incay-grad", "decor-grad", "hsic-grad"):
        assert d.claim.kind == "stationary point"


def test_l1_gradient_variant_is_refused() -> None:
    """ℓ1 has no gradient step: ``regularizer="gradient"`` is refused."""
    phi = relu_phi()
    with pytest.raises(ce.LoweringError, match="no closed-form prox|neither smooth"):
        lowering.lower(phi + 0.1 * ce.L1(phi.states[0]), regularizer="gradient")


def test_l1_prox_derivation_text_and_incay_sign() -> None:
    """The ℓ1 prox variant's derivation and claim name the envelope it minimizes (not φ + λℓ1);
    the incay gradient step's sign is the term's (checked by finite differences of R)."""
    phi = relu_phi()
    z = phi.states[0]
    d = lowering.lower(phi + 0.1 * ce.L1(z))
    text = d.describe()
    assert "soft-threshold" in text and "regularizer edit, prox variant" in text
    assert "minimizer of" in str(d.claim) and "M^1[0.1·||z||₁]" in str(d.claim)
    assert "NOT of φ + 0.1·||z||₁" in d.derivation.text()
    assert "\\mathrm{soft}" in d.latex()
    # incay gradient variant: sign from the term, checked by finite differences of R
    eps, gam = 0.5, 0.2
    di = lowering.lower(phi + gam * ce.FeatureIncay(z, eps), regularizer="gradient")
    zv, x = randn(1, 6), randn(1, 3)
    rfun = lambda t: 2.0 / ((t ** 2).sum() + 2 * eps)  # noqa: E731
    fd = torch.zeros(6, dtype=T64)
    for i in range(6):
        e = torch.zeros(1, 6, dtype=T64)
        e[0, i] = 1e-6
        fd[i] = (rfun(zv + e) - rfun(zv - e)) / 2e-6
    ref = prox_relu_phi(phi, zv - gam * fd, x)
    # central differences, h = 1e-6: ~1e-9 accuracy on ∇R
    close(di.apply({"z": zv, "x": x})["z"], ref, 1e-7)


def test_negative_smooth_regularizer_uses_the_gradient_step() -> None:
    """φ − 0.1·½||z||² is smooth, so the gradient variant applies: T(z) = prox_φ(1.1 z); the
    prox variant of a negative multiple is refused.

    Pins: the auto variant picked the prox step of the negative multiple (T raised
    ScaleError)."""
    phi, z, _x = theorem1()
    d = lowering.lower(phi + SqNorm(z) * -0.1)
    assert d.info["variant"] == "gradient"
    zv, xv = torch.randn(4, 3, dtype=T64), torch.randn(4, 2, dtype=T64)
    w, u = phi.symbol("W_z").value, phi.symbol("U_z").value
    ref = torch.relu(1.1 * zv @ w.T + xv @ u.T) @ w
    torch.testing.assert_close(d.apply({"z": zv, "x": xv})["z"], ref, rtol=1e-12, atol=1e-12)
    env = moreau(L1(z) * 0.5, 1.0) * -0.1  # a negative envelope: gradient step as well
    d2 = lowering.lower(phi + env)
    assert torch.isfinite(d2.apply({"z": zv, "x": xv})["z"]).all()
    with pytest.raises(ce.LoweringError, match="non-positive"):
        lowering.lower(phi + SqNorm(z) * -0.1, regularizer="prox")


def test_gradient_and_prox_regularizer_edits_together_are_not_nested() -> None:
    """φ + R_g (gradient variant) + R_p (prox variant) lowers to prox_φ(prox_{R_p}(z) − ∇R_g(z)),
    whose fixed points satisfy the claim's stationarity condition exactly: verify passes it.

    Pins: the edits were nested, prox_φ(prox_{R_p}(z − ∇R_g(z))), whose fixed points are not
    stationary for the claimed φ + R_g + M¹[R_p] (relative error 4e-2)."""
    rng = np.random.default_rng(0)
    z = State("z1", 4)
    W = Weight("W2", (4, 4), np.linalg.qr(rng.normal(size=(4, 4)))[0] * 0.9)
    phi = (Antiderivative("sigmoid", Dense(W) @ z).conjugate() - SqNorm(z)
           + moreau(L1(z), 1.0) * 0.5 - SqNorm(z) * 0.5)
    d = lowering.lower(phi)
    assert "prox_{0.5·M^1[||z1||₁](z1)}(z1) + 0.5·z1" in d.describe()
    rep = verified(phi)
    assert rep.passed, rep
    assert rep.label.startswith("modified minimizer")
