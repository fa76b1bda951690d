"""MOptEq (multi-branch OptEq, docs/theory.md §3 row 4 and §7): Proposition 1 (the equilibrium is a
stationary point of the declared G) and Proposition 2 (the perturbation bound)."""

from __future__ import annotations

import itertools
import math

import torch

import lowering

from .cases import MOptEqCase, OptEqCase
from .common import STAT_TOL, check, equilibrium, stationarity_residual


def mopteq_prop1_stationary(case: MOptEqCase) -> dict[str, float]:
    """MOptEq Proposition 1 (docs/theory.md §3 row 4): the equilibrium of the derived multi-branch
    layer is
    a stationary point of the declared ``G = Σ_i[Σf_σ(z_i) + ½||z_i||² − <q_i, z_i> −
    ½||W_i z_i||²] − ½Σ_i H(z_i, z_{i+1}) + (λ/2)Σ_i D(z_i, z_{i+1})``: the canonical-form
    residual ``||z − σ(z − ∇h(z))||`` (``∇h`` by autograd of the declared terms' values) is
    ``≤ STAT_TOL``; and the claim is never "minimizer" (G is not convex in general).

    An instance whose equilibrium solve does not converge raises ``ReferenceFailure`` (there is
    no equilibrium to check; the H/D layer has no contraction certificate)."""
    d = lowering.lower(case.objective)
    check(d.claim.kind != "minimizer",
          f"MOptEq: claim must not be 'minimizer' (G is non-convex), got {d.claim}")
    inp = {"x": case.x}
    Z, _, res = equilibrium(d, inp, max_iter=300, plain_fallback=0)
    r = stationarity_residual(case.objective, Z, inp)
    check(r <= STAT_TOL, f"MOptEq Prop. 1: equilibrium is not a stationary point of G "
                         f"(residual {r:.3e})")
    return {"stationarity_residual": r, "fixed_point_residual": res}


#: value tolerance for Proposition 2: G evaluated at equilibria solved to FP_TOL (first-order
#: stationary, so the value error is second order) — relative 1e-9
PROP2_TOL = 1e-9


def mopteq_prop2_perturbation_bound(case: OptEqCase) -> dict[str, float]:
    """MOptEq Proposition 2 (docs/theory.md §7) on the OptEq branch objective
    ``G(z; x) = Σf_σ(z) + ½||z||² − <Ux + b, z> − ½||Wz||²`` (reformulated variable, ``z̃ =
    W^{-T}z`` of the paper), with ``||W||₂, ||U||₂ ≤ 1`` and ``ε = case.extra["eps"]``:

    * the derived perturbation is ``δ = ε·sign(Uᵀz*)``, ``||δ||∞ ≤ ε``, and it maximizes
      ``G(z*; x − δ)`` over the ℓ∞ ball (checked against every vertex when ``d ≤ 6``);
    * with ``z'* = argmin G(·; x − δ)``, ``A = G(z'*; x − δ) − G(z*; x)``, ``N = d``:
      the paper's bound ``max{A, √Nε||z̃'* − z̃*||} ≥ ½(ε||Uᵀz*||₁ − Nε²)`` in the paper's
      variable ``z̃ = Wz`` (its proof uses ``||W||₂ ≤ 1``), and the sharper bound derived in the
      reformulated variable, ``A + √Nε||z'* − z*|| ≥ ε||Uᵀz*||₁``.

    Tolerance ``PROP2_TOL·(1 + |G|)``."""
    eps = float(case.extra["eps"])
    G = case.objective
    z = case.state.name
    d = lowering.lower(G)
    x = case.x
    Z, _, _ = equilibrium(d, {"x": x})
    zs = Z[z]
    pert = lowering.perturbation(G, eps)
    check(pert.exact, "Prop. 2: G is affine in x, the perturbation must be exact")
    delta = pert.delta({z: zs, "x": x})["x"]
    U = case.U
    check(float(delta.abs().max()) <= eps * (1 + 1e-12), f"Prop. 2: ||δ||∞ = "
          f"{float(delta.abs().max()):.6g} > ε = {eps:g}")
    g_star = G.value_tensor({z: zs, "x": x})
    Zp, _, _ = equilibrium(d, {"x": x - delta})
    zp = Zp[z]
    A = G.value_tensor({z: zp, "x": x - delta}) - g_star
    dd = x.shape[1]
    n_ = math.sqrt(dd) * eps
    dist = torch.linalg.vector_norm(zp - zs, dim=-1)
    dist_paper = torch.linalg.vector_norm((zp - zs) @ case.W.T, dim=-1)
    l1 = (zs @ U).abs().sum(-1)
    rhs = 0.5 * (eps * l1 - dd * eps ** 2)
    tol = PROP2_TOL * (1 + g_star.abs() + A.abs())
    lhs_paper = torch.maximum(A, n_ * dist_paper)
    check(bool((lhs_paper >= rhs - tol).all()),
          f"Prop. 2 (paper form): max{{A, √Nε||Δz̃||}} = {lhs_paper.tolist()} < "
          f"½(ε||Uᵀz*||₁ − Nε²) = {rhs.tolist()}")
    lhs_derived = A + n_ * dist
    check(bool((lhs_derived >= eps * l1 - tol).all()),
          f"Prop. 2 (derived form): A + √Nε||Δz|| = {lhs_derived.tolist()} < ε||Uᵀz*||₁ = "
          f"{(eps * l1).tolist()}")
    # the perturbation itself: closed form of docs/theory.md §7 and maximality over the ℓ∞ ball
    check(bool(torch.equal(delta, eps * torch.sign(zs @ U))),
          "Prop. 2: δ ≠ ε·sign(Uᵀz*) (docs/theory.md §7)")
    g_pert = G.value_tensor({z: zs, "x": x - delta})
    if dd <= 6:
        for signs in itertools.product((-1.0, 1.0), repeat=dd):
            v = eps * torch.tensor(signs, dtype=x.dtype)
            other = G.value_tensor({z: zs, "x": x - v})
            check(bool((other <= g_pert + PROP2_TOL * (1 + g_pert.abs())).all()),
                  "Prop. 2: δ does not maximize G(z*; x − δ) over the ℓ∞ ball")
    margin = float((torch.maximum(A, n_ * dist) - rhs).min())
    return {"margin": margin, "A_min": float(A.min()), "rhs_max": float(rhs.max())}
