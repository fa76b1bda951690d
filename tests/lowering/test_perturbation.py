"""The perturbation read from an objective (lowering/perturbation.py ``lowering.perturbation``):
the worst-case ℓ∞ input perturbation of an objective affine in its input."""

from __future__ import annotations

import torch

import lowering
from convex_eq import models
from tests.lowering.helpers import W, close, randn

T64 = torch.float64


def test_perturbation_from_objective() -> None:
    """``δ = ε·sign(Uᵀz)`` for OptEq, and it maximises ``G(z; x − δ)`` over the ℓ∞ ball (no
    random sign pattern does better; 1e-12: float64 sums of the same terms)."""
    g = models.opteq(n=6, m=6, d=4, seed=0)
    p = lowering.perturbation(g, 0.05)
    assert p.exact and "sign(Uᵀ(z))" in str(p)
    z, x = randn(3, 6), randn(3, 4)
    delta = p.delta({"z": z, "x": x})["x"]
    close(delta, 0.05 * torch.sign(z @ W(g, "U")))
    # it maximizes G(z; x - δ) over the ℓ∞ ball (G affine in x): compare with random signs
    base = g.value_tensor({"z": z, "x": x - delta})
    for _ in range(5):
        other = 0.05 * torch.sign(randn(3, 4))
        assert bool((g.value_tensor({"z": z, "x": x - other}) <= base + 1e-12).all())
