"""The Moreau-skip rule (lowering/rules/moreau_skip.py): ``λ·M^μ[φ]`` lowers to a skip of the
prox of ``φ`` (and a precomposed objective to ``A⁻¹T(Az)``), checked against the closed forms;
where ``prox_{(μ+λ)φ}`` or the inner prox is not available the objective is refused or falls
back to the gradient step, and the claimed Lipschitz bound holds for weakly convex inner
functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import (
    L1,
    Objective,
    Potential,
    SqNorm,
    State,
    Weight,
    models,
    moreau,
)
from convex_eq.operators import Dense
from tests.lowering.helpers import W, close, prox_relu_phi, randn, relu_phi, theorem1

T64 = torch.float64


def test_moreau_skip_and_precomposition() -> None:
    """``0.3·M^0.7[φ]`` is ``0.3·prox_φ + 0.7·id``; ``φ∘(Az + c)`` is ``A⁻¹(T(Az + c) − c)``
    (not a prox); both against closed forms (1e-10: float64 solves of a 5×5 system)."""
    phi = relu_phi()
    z_v, x = randn(4, 6), randn(4, 3)
    d = lowering.lower(0.3 * ce.moreau(phi, 0.7))
    close(d.apply({"z": z_v, "x": x})["z"], 0.3 * prox_relu_phi(phi, z_v, x) + 0.7 * z_v)
    g = models.opteq(n=5, m=5, d=2, activation="tanh", seed=4)
    m = randn(5, 5) + 3 * torch.eye(5, dtype=T64)
    c = randn(5)
    dp = lowering.lower(ce.precompose(g, m, c))
    w, u, b = W(g, "W"), W(g, "U"), W(g, "b")
    zz, xx = randn(3, 5), randn(3, 2)
    a = zz @ m.T + c
    t = torch.tanh(a @ w.T @ w + xx @ u.T + b)
    ref = torch.linalg.solve(m, (t - c).T).T  # A⁻¹(T(Az))
    close(dp.apply({dp.blocks[0].name: zz, "x": xx})[dp.blocks[0].name], ref, 1e-10)
    assert "not a prox" in dp.derivation.text()


def test_moreau_general_rule_refuses_an_inner_objective_without_closed_form_prox() -> None:
    """μ + λ ≠ 1 needs prox_{(μ+λ)φ} in closed form: for φ = ψ* − ½||·||² the objective is
    refused at lowering; a prox-able inner objective lowers and T evaluates.

    Pins: ``lower`` derived a layer whose T raised LoweringError on every evaluation."""
    phi, z, _x = theorem1()
    with pytest.raises(ce.LoweringError, match="no prox_") as err:
        lowering.lower(Objective([moreau(phi, 0.3) * 0.5]))
    assert "M^0.3" in str(err.value)
    # a prox-able inner objective still lowers, and T evaluates
    ok = Objective([moreau(Objective([L1(z) * 0.5, SqNorm(z) * -0.2]), 0.3) * 0.5])
    d = lowering.lower(ok)
    assert torch.isfinite(d.apply({"z": torch.randn(2, 3, dtype=T64)})["z"]).all()
    too_concave = Objective([moreau(Objective([L1(z), SqNorm(z) * -2.0]), 0.3) * 0.5])
    with pytest.raises(ce.LoweringError, match="quadratic coefficient"):
        lowering.lower(too_concave)


def test_envelope_used_through_its_gradient_needs_the_inner_prox() -> None:
    """∇M^μ_φ = (v − prox_{μφ}(v))/μ: with φ = ||z||₁ − ½||z||² and μ ≥ 1, prox_{μφ} does not
    exist (the envelope is −∞) and the objective is refused naming the envelope; a regularizer
    edit whose prox variant would need it falls back to the gradient step.

    Pins: ``lower`` derived a canonical layer whose T raised."""
    z = State("z", 3)
    env = moreau(Objective([L1(z) * 0.5, -SqNorm(z)]), 1.4) * 0.05
    obj = Objective([Potential("relu", z), SqNorm(z), env,
                     SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z) * -1.0])
    with pytest.raises(ce.LoweringError, match="Moreau envelope") as err:
        lowering.lower(obj)
    assert err.value.term == str(env)
    # prox variant of a regularizer edit needs prox_{(μ+λ)φ}: falls back to the gradient step
    phi, zz, _x = theorem1()
    reg = moreau(Objective([L1(zz) * 0.5, SqNorm(zz) * -0.6]), 1.0) * 0.8  # μ ok, μ + λ not
    d = lowering.lower(phi + reg)
    assert d.info["variant"] == "gradient"
    assert torch.isfinite(d.apply({"z": torch.randn(2, 3, dtype=T64),
                                   "x": torch.randn(2, 2, dtype=T64)})["z"]).all()


def test_general_envelope_rule_of_a_weakly_convex_inner_function_bounds_lip_honestly() -> None:
    """``0.25·M^0.5[||z||₁ − ½||z||²]``: T expands by up to a/(1 + tq) + 1 − a = 2, the bound
    the layer claims, and a pair of points past the kink expands by more than 1.

    Pins: the layer claimed "prox of a convex function is nonexpansive" (Lip 1)."""
    z = State("z1", 1)
    d = lowering.lower(moreau(L1(z) - SqNorm(z), ce.Scalar("mu2", 0.5)) * 0.25)
    bound = d.contraction.value(None)
    assert bound == pytest.approx(2.0, rel=1e-12)
    a, b = torch.tensor([[1.0]], dtype=T64), torch.tensor([[1.1]], dtype=T64)  # past 0.75
    ratio = float((d.apply({"z1": a})["z1"] - d.apply({"z1": b})["z1"]).norm() / 0.1)
    assert 1.0 < ratio <= bound * (1 + 1e-12)
