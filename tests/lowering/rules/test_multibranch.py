"""The multi-branch rule's bounds (MOptEq/POptEq, docs/theory.md §3 row 4) against dense SVDs of
autograd Jacobians of ``T``, and the ball it maps into itself against sampled states."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models

T64 = torch.float64
SHAPES = ((2, 2, 2), (2, 1, 1))


def _jacobian_norm(d, ys: list[torch.Tensor], x: torch.Tensor) -> float:
    """``||∂T/∂y||₂`` at one sample by a dense SVD of the autograd Jacobian."""
    names = [b.name for b in d.blocks]
    sizes = [b.size for b in d.blocks]

    def t(flat: torch.Tensor) -> torch.Tensor:
        parts = dict(zip(names, torch.split(flat[None], sizes, dim=1)))
        out = d.apply({**parts, "x": x[None]})
        return torch.cat([out[n][0] for n in names])

    jac = torch.autograd.functional.jacobian(t, torch.cat(ys))
    return float(torch.linalg.matrix_norm(jac, 2))


def _set_orthogonal(obj, zeta: float) -> None:
    """``W_i = ζ·I`` and positive injections: the ReLU stays active, so ``T`` is linear with
    Jacobian exactly ``ζ²·½(P + Pᵀ-blocks)`` — the case where the block Schur bound is tight."""
    for i, s in enumerate(SHAPES):
        n = math.prod(s)
        obj.symbol(f"W{i + 1}").value = torch.eye(n, dtype=T64) * zeta
        obj.symbol(f"U{i + 1}").value = torch.zeros_like(obj.symbol(f"U{i + 1}").value)
        obj.symbol(f"b{i + 1}").value = torch.full((n,), 50.0, dtype=T64)


@pytest.mark.parametrize("fusion", ["H", "none"])
def test_branch_bound_is_valid_and_tight_where_the_relu_is_active(fusion: str) -> None:
    obj = models.mopteq(shapes=SHAPES, d=3, fusion=fusion)
    _set_orthogonal(obj, 0.8)
    d = lowering.lower(obj)
    bound = d.contraction.value()
    g = torch.Generator().manual_seed(0)
    ys = [torch.rand(math.prod(s), generator=g, dtype=T64) for s in SHAPES]
    measured = _jacobian_norm(d, ys, torch.zeros(3, dtype=T64))
    # the bound is an upper bound; here (W = ζI, active ReLU) the Jacobian attains it:
    # POptEq ζ² = 0.64, H-only ζ²·||½(P_{1:2} + P_{2:1}ᵀ)|| = 0.64·||avgpool2||₂ = 0.64·0.5
    # (2×2 average down-sampling has norm 1/2). 1e-9: power-iteration norms and one SVD.
    assert measured <= bound * (1 + 1e-9)
    assert measured >= bound * (1 - 1e-6), (measured, bound)


@pytest.mark.parametrize("decorrelation", ["smooth", "sign"])
def test_fusion_layer_maps_its_ball_into_itself(decorrelation: str) -> None:
    obj = models.mopteq(shapes=SHAPES, d=3, lam=0.2, weight_norm=0.6, seed=5,
                        decorrelation=decorrelation, width=0.5)
    d = lowering.lower(obj)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, generator=g, dtype=T64) * 2
    r, lip = d.contraction.on_ball({"x": x})
    assert torch.isfinite(r).all()
    for k in range(x.shape[0]):
        for _ in range(50):  # states on the sphere of radius R(x): T(y) must stay inside
            y = torch.randn(10, generator=g, dtype=T64).abs()  # ReLU layer: y ≥ 0 reachable
            y = y / torch.linalg.vector_norm(y) * r[k]
            out = d.apply({"y1": y[None, :8], "y2": y[None, 8:], "x": x[k:k + 1]})
            norm = torch.linalg.vector_norm(torch.cat([out["y1"], out["y2"]], 1))
            assert float(norm) <= float(r[k]) * (1 + 1e-12)
    if decorrelation == "sign":
        assert torch.isinf(lip).all() and math.isinf(d.contraction.value())


def test_smoothed_fusion_lipschitz_bound_holds_on_the_ball() -> None:
    obj = models.mopteq(shapes=SHAPES, d=3, lam=0.2, weight_norm=0.6, seed=5, width=0.5)
    d = lowering.lower(obj)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, generator=g, dtype=T64)
    r, lip = d.contraction.on_ball({"x": x})
    worst = 0.0
    for k in range(x.shape[0]):
        for _ in range(40):
            y = torch.randn(10, generator=g, dtype=T64)
            y = y / torch.linalg.vector_norm(y) * r[k] * torch.rand(1, generator=g, dtype=T64)
            jn = _jacobian_norm(d, [y[:8], y[8:]], x[k])
            worst = max(worst, jn / float(lip[k]))
    # the Jacobian norm inside the ball never exceeds the bound (1e-9: one SVD, one
    # power-iteration norm per operator)
    assert worst <= 1 + 1e-9, worst
    assert math.isinf(d.contraction.value())  # no global bound for the smoothed D


def test_rule_applies_to_multi_branch_layers_only() -> None:
    assert "multi-branch" in lowering.lower(models.mopteq()).derivation.rules()[-1]
    assert "independent branches" in lowering.lower(
        models.mopteq(fusion="none")).derivation.rules()[-1]
    assert all("branch" not in r for r in lowering.lower(models.opteq()).derivation.rules())


def test_sign_decorrelation_claim_states_its_condition() -> None:
    d = lowering.lower(models.mopteq(decorrelation="sign"))
    assert d.claim.kind == "stationary point"
    assert any("correlation is 0" in c for c in d.claim.conditions)
    assert "NO fixed point is guaranteed" in d.derivation.text()


def test_ball_radius_uses_the_injection_norm() -> None:
    """``R(x) = L_σ||q(x)||/(1 − κ)``, ``q_i = U_i x + b_i``: against numpy on the weights."""
    obj = models.mopteq(shapes=SHAPES, d=3, fusion="H", seed=2)
    d = lowering.lower(obj)
    x = np.random.default_rng(0).standard_normal((3, 3))
    q = np.concatenate([x @ obj.symbol(f"U{i}").value.numpy().T + obj.symbol(f"b{i}").value.numpy()
                        for i in (1, 2)], axis=1)
    r, _ = d.contraction.on_ball({"x": torch.as_tensor(x)})
    kappa = d.contraction.value()
    np.testing.assert_allclose(r.numpy(), np.linalg.norm(q, axis=1) / (1 - kappa), rtol=1e-12)


@pytest.mark.parametrize("state", ["anti-correlated", "orthogonal"])
def test_decorrelation_bound_covers_its_worst_states(state: str) -> None:
    """Equal branches (``P = I``), ``W_i = ζI``, active ReLU, C = 4 channels of 4 positions.
    Anti-correlated channels (every off-diagonal ``M < −ε``): the Jacobian has the eigenvalue
    ``ζ²(1 + λ(C−1))`` — the ``C−1`` of the bound is attained.  Orthogonal channels of norm s
    (``M = 0``, inside the Huber zone): the curvature ``s²/ε`` enters — the ``R²Δ`` part."""
    shapes = ((4, 2, 2), (4, 2, 2))
    zeta, lam, eps = 0.6, 0.3, 0.5
    obj = models.mopteq(shapes=shapes, d=3, lam=lam, width=eps)
    for i in (1, 2):
        obj.symbol(f"W{i}").value = torch.eye(16, dtype=T64) * zeta
        obj.symbol(f"U{i}").value = torch.zeros(16, 3, dtype=T64)
        obj.symbol(f"b{i}").value = torch.full((16,), 50.0, dtype=T64)
    d = lowering.lower(obj)
    x = torch.zeros(1, 3, dtype=T64)
    r, lip = d.contraction.on_ball({"x": x})
    e = torch.eye(4, dtype=T64)
    if state == "anti-correlated":
        z1, z2 = e[0].repeat(4) * 3.0, -e[0].repeat(4) * 3.0
    else:
        z1, z2 = e[0].repeat(4) * 4.0, e[1].repeat(4) * 4.0
    y1, y2 = z1 / zeta, z2 / zeta  # z̃ = Wᵀy
    assert float(torch.linalg.vector_norm(torch.cat([y1, y2]))) <= float(r[0])
    measured = _jacobian_norm(d, [y1, y2], x[0])
    gamma_only = zeta ** 2 * (1 + lam * 3)
    if state == "anti-correlated":
        assert measured >= gamma_only * (1 - 1e-9)  # the C−1 term is attained here
    else:
        assert measured > 2 * gamma_only  # the curvature term dominates here
    assert measured <= float(lip[0]) * (1 + 1e-9)


def test_growth_bound_is_attained_by_anti_correlated_branches() -> None:
    """``||∇S_fusion(y)|| ≤ (κ/L_σ)||y||``: with ``W_i = ζI``, active ReLU and every off-diagonal
    correlation far below −ε, ``T(y) − q = ∇S_fusion(y)`` has the ratio ``ζ²(1 + λ(C−1))``,
    which is κ itself (``P = I``)."""
    zeta, lam = 0.6, 0.3
    obj = models.mopteq(shapes=((4, 2, 2), (4, 2, 2)), d=3, lam=lam, width=0.01,
                        decorrelation="sign")
    for i in (1, 2):
        obj.symbol(f"W{i}").value = torch.eye(16, dtype=T64) * zeta
        obj.symbol(f"U{i}").value = torch.zeros(16, 3, dtype=T64)
        obj.symbol(f"b{i}").value = torch.full((16,), 50.0, dtype=T64)
    d = lowering.lower(obj)
    u = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=T64)
    y1, y2 = -u.repeat(4) / zeta, u.repeat(4) / zeta  # z̃_1^k = −u, z̃_2^l = u for all k, l
    out = d.apply({"y1": y1[None], "y2": y2[None], "x": torch.zeros(1, 3, dtype=T64)})
    grad = torch.cat([out["y1"][0], out["y2"][0]]) - 50.0
    ratio = float(torch.linalg.vector_norm(grad) / torch.linalg.vector_norm(torch.cat([y1, y2])))
    kappa = d.contraction.growth()
    assert ratio <= kappa * (1 + 1e-12)
    # h_i = (1 + λ(C−1))·u per channel here: the bound is attained (1e-9: power-iteration norms)
    assert ratio >= kappa * (1 - 1e-9)
