"""Seeds that lower with the registry: POptEq (MOptEq without fusion), deep-composition
certificates, and the friction items (input-free layers, ``0.5 * lam * term``, the
``regularizer=`` hint, ``deep_form`` return types, ``str(certificate)`` when violated)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import models
from convex_eq.errors import LoweringError, ShapeError
from verify.check import check

T64 = torch.float64
GEN = torch.Generator().manual_seed(11)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=T64)


def test_popteq_has_no_fusion_terms_and_lowers_to_independent_branches() -> None:
    g = models.mopteq(shapes=((2, 2, 2), (1, 2, 2)), d=3, seed=2, fusion="none")
    assert not any(isinstance(t, (ce.terms.Coupling, ce.terms.ChannelDecorrelation))
                   for t in g.terms)
    assert sum(isinstance(t, ce.terms.Coupling) for t in
               models.mopteq(shapes=((2, 2, 2), (2, 1, 1)), fusion="H").terms) == 2
    d = lowering.lower(g)
    y1, y2, x = randn(3, 8), randn(3, 4), randn(3, 3)
    out = d.apply({"y1": y1, "y2": y2, "x": x})
    for i, yi in ((1, y1), (2, y2)):
        w, u, b = (g.symbol(f"{n}{i}").value for n in ("W", "U", "b"))
        ref = torch.relu(yi @ w @ w.T + x @ u.T + b)  # POptEq Eq. 10: σ(W_iW_iᵀy_i + U_i x + b_i)
        # the same closed form in float64 on both sides: rounding only
        torch.testing.assert_close(out[f"y{i}"], ref, atol=1e-12, rtol=1e-12)
    assert d.claim.kind == "minimizer"  # independent convex branches (||W_i||₂ = 0.5)
    rep = check(d, x[:2].numpy())
    assert rep.passed and rep.reference.kind == "cvxpy", rep
    with pytest.raises(ShapeError, match="POptEq"):
        models.mopteq(fusion="parallel")


def test_deep_composition_certificate_names_every_layer_weight() -> None:
    comp = models.deep_opteq(L=3, n=5, m=5, d=2, seed=1)
    d = lowering.lower(comp)
    cert = d.certificate
    assert cert is not None and cert.kind == "conditional" and cert.holds
    texts = [c.text for c in cert.conditions]
    for i in (1, 2, 3):
        assert any(f"||W{i}||₂" in t for t in texts), texts
    assert "certificate: convex if ||W1||₂" in d.describe()
    # the claim states the same hypotheses
    assert all(t in d.claim.conditions for t in texts)
    # weight control sees each condition once (certificate and payload list the same objects)
    from lowering.runtime.weight_control import norm_conditions
    assert len(norm_conditions(d)) == 3


def test_deep_form_return_types() -> None:
    comp = models.deep_opteq(L=2, n=4, m=4, d=2, seed=0)
    z0, z1, x = np.zeros((1, 4)), np.zeros((1, 4)), np.ones((1, 2))
    single = lowering.lower(comp, deep_form="composition").T(z0=z0, x=x)
    multi = lowering.lower(comp, deep_form="multiblock").T(z0=z0, z1=z1, x=x)
    assert isinstance(single, np.ndarray) and single.shape == (1, 4)
    assert isinstance(multi, dict) and set(multi) == {"z0", "z1"}


def test_input_free_objective_runs_with_none_and_empty_dict() -> None:
    z = ce.State("z", 4)
    w = models.spectral_weight("W", (4, 4), 0.5, seed=0)
    b = ce.Weight("b", 4, np.linspace(-1, 1, 4))
    g = ce.Potential("relu", z) + ce.SqNorm(z) - ce.Linear(b, z) - ce.SqNorm(w @ z)
    mod = lowering.lower(g).torch_module(tol=1e-12, max_iter=500)
    a, e = mod(None), mod({})
    torch.testing.assert_close(a, e, atol=0, rtol=0)  # the same deterministic solve
    wv, bv = w.value.detach().to(a.dtype), b.value.detach().to(a.dtype)
    # fixed point of z = relu(WᵀWz + b) (the module computes in its weights' float32): float32
    # rounding of 4-term sums of O(1) entries is ~1e-7; 1e-5 leaves two orders of margin
    torch.testing.assert_close(a, torch.relu(a @ wv.T @ wv + bv), atol=1e-5, rtol=0)
    assert a.shape == (1, 4)


def test_number_times_scalar_times_term() -> None:
    lam = ce.Scalar("lam", 0.3, low=0)
    z = ce.State("z", 3)
    for t in (0.5 * lam * ce.L1(z), ce.L1(z) * lam * 0.5, lam * 0.5 * ce.L1(z)):
        assert t.coef() == pytest.approx(0.15) and t.scalars == (lam,)


def test_prox_variant_hint_names_the_regularizer_keyword() -> None:
    phi = models.opteq(n=4, m=4, d=2, form="conjugate", seed=0)
    z = phi.states[0]
    with pytest.raises(LoweringError) as e:
        lowering.lower(phi + 0.1 * ce.L1(z) + 0.2 * ce.L1(z))
    assert "regularizer='gradient'" in str(e.value) and "variant=" not in str(e.value)


def test_str_of_a_violated_certificate_says_so() -> None:
    phi = models.opteq(n=4, m=4, d=2, form="conjugate", seed=0)
    w = phi.symbol("W").value
    bad = phi.certificate(W=w * 1.5)
    assert "VIOLATED" in str(bad) and "||W||₂ ≤ 1 fails" in str(bad)
    assert "VIOLATED" not in str(phi.certificate())
