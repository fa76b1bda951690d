"""Exact ℓ1 with a smooth potential: ``prox_{f_σ + λ|·|} = σ ∘ soft_λ`` iff ``σ(0) = 0``; the
layer ``z = σ(soft_λ(∇S(z)))`` finds the minimizer of the exact-ℓ1 objective (not its Huber
smoothing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import convex_eq as ce
import lowering
from convex_eq.activations import get_activation
from convex_eq.errors import LoweringError
from verify.check import check

T64 = torch.float64


def _objective(act: str, lam: float = 0.3, seed: int = 0):
    rng = np.random.default_rng(seed)
    z, x = ce.State("z", 6), ce.Input("x", 3)
    w = rng.normal(size=(6, 6))
    w *= 0.7 / np.linalg.norm(w, 2)  # ||W||₂ = 0.7 < 1: G is convex
    W = ce.Weight("W", (6, 6), w)
    U = ce.Weight("U", (6, 3), 0.3 * rng.normal(size=(6, 3)))
    b = ce.Weight("b", 6, 0.1 * rng.normal(size=6))
    G = (ce.Potential(act, z) + ce.SqNorm(z) - ce.Linear(U @ x + b, z) - ce.SqNorm(W @ z)
         + lam * ce.L1(z))
    return G, w, U.value.detach().double(), b.value.detach().double()


def _soft(v: torch.Tensor, t: float) -> torch.Tensor:
    return torch.sign(v) * torch.clamp(v.abs() - t, min=0.0)


def test_tanh_exact_l1_layer_matches_hand_formula_and_the_exact_minimizer() -> None:
    G, w, u, b = _objective("tanh")
    d = lowering.lower(G)
    assert "prox_{f_σ + c|·|} = σ ∘ soft_c" in d.derivation.text()
    assert "σ(0) = 0" in d.derivation.steps[1].condition
    gen = torch.Generator().manual_seed(1)
    z, x = torch.randn(4, 6, generator=gen, dtype=T64), torch.randn(4, 3, generator=gen, dtype=T64)
    wt = torch.as_tensor(w)
    ref = torch.tanh(_soft(x @ u.T + b + z @ wt.T @ wt, 0.3))  # σ(soft_λ(Ux + b + WᵀWz))
    # the same closed form in float64 on both sides: rounding only
    torch.testing.assert_close(d.apply({"z": z, "x": x})["z"], ref, atol=1e-12, rtol=1e-12)
    assert d.claim.kind == "minimizer" and "||z||₁" in d.claim.objective_text
    rep = check(d, x[:2].numpy())
    assert rep.passed, rep
    # the equilibrium has exact zeros (ℓ1), which the Huber/envelope smoothing would not give
    eq = d.torch_module(tol=1e-12, max_iter=2000)(x[:2])
    assert (eq.abs() < 1e-12).any()


def test_sigmoid_exact_l1_is_refused_with_a_hint_that_names_the_envelope() -> None:
    G, *_ = _objective("sigmoid")  # σ(0) = ½: σ∘soft is not the prox (v = 0 gives ½, not 0)
    with pytest.raises(LoweringError, match="moreau") as e:
        lowering.lower(G)
    assert "Huber" in str(e.value)


def _prox_violation(act, lam: float, v: float, compose) -> float:
    """|compose(v) − argmin_u f_σ(u) + λ|u| + ½(u − v)²| (bounded scalar minimization)."""
    from scipy.optimize import minimize_scalar

    lo, hi = act.domain
    lo, hi = max(lo, -50.0) + 1e-12, min(hi, 50.0) - 1e-12

    def g(u: float) -> float:
        f = float(act.potential(torch.tensor([u], dtype=T64))[0])
        return f + lam * abs(u) + 0.5 * (u - v) ** 2

    ref = minimize_scalar(g, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12}).x
    return abs(float(compose(torch.tensor([v], dtype=T64), lam)[0]) - ref)


def _sigma_soft(act):
    return lambda v, lam: act.sigma(_soft(v, lam))


def _soft_sigma(act):  # the wrong order
    return lambda v, lam: _soft(act.sigma(v), lam)


@settings(deadline=None)
@given(v=st.floats(-3, 3), lam=st.floats(0.01, 1.5))
def test_prop_sigma_after_soft_is_the_prox_when_sigma_fixes_zero(v: float, lam: float) -> None:
    act = get_activation("tanh")
    # bounded Brent search to xatol 1e-12 on a 1-D strongly convex function: error ≲ 1e-8
    assert _prox_violation(act, lam, v, _sigma_soft(act)) <= 1e-6


def test_prop_fails_for_the_wrong_composition_and_for_sigma_0_not_0() -> None:
    tanh, sig = get_activation("tanh"), get_activation("sigmoid")
    assert _prox_violation(tanh, 0.5, 2.0, _soft_sigma(tanh)) > 1e-2  # soft∘σ is not the prox
    assert _prox_violation(sig, 0.5, 0.0, _sigma_soft(sig)) > 1e-2  # σ(0) = ½ ≠ 0
