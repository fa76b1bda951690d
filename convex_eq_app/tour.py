"""A guided tour of the objective language: declare → certify → export → derive."""

from __future__ import annotations

import numpy as np

import lowering
from convex_eq import models
from convex_eq.errors import ConvexEqError
from convex_eq.terms import L1, moreau


def _h(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run(seed: int = 0) -> None:
    """Print the tour (each step uses only public API)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(4)

    _h("1. OptEq (Theorem 1): φ = ψ* − ½||·||², ψ = Σσ̃(Wz + Ux + b)")
    phi = models.opteq(n=6, m=6, d=4, activation="relu", form="conjugate", seed=seed)
    print("objective:  ", phi)
    print("LaTeX:      ", phi.latex())
    print("certificate:", phi.certificate())
    ex = phi.to_cvxpy(x=x)
    val = ex.solve()
    print(f"CVXPY:       status {ex.problem.status}, min φ = {val:.6f}, solver "
          f"{ex.problem.solver_stats.solver_name}")
    z_cvx = ex.state_values()["z"]
    layer = lowering.lower(phi)
    print(layer.describe())
    z = np.zeros(6)
    for _ in range(200):
        z = layer.T(z=z, x=x)[0]
    print(f"layer fixed point vs CVXPY minimizer: max |Δz| = {np.abs(z - z_cvx).max():.2e}")

    _h("2. The same weights at ||W||₂ = 1.37: the certificate says what breaks")
    w = phi.symbol("W").value
    print("certificate:", phi.certificate(W=w * (1.37 / 0.9)))

    _h("3. Edit: add an ℓ1 feature regularizer (prox variant) and its Moreau skip")
    z_sym = phi.states[0]
    edited = phi + 0.05 * L1(z_sym)
    print(lowering.lower(edited).describe())
    skip = 0.5 * moreau(phi, 0.5)
    print(lowering.lower(skip).describe())

    _h("4. tanh potential: convex by curvature, not DCP")
    g = models.opteq(n=6, m=6, d=4, activation="tanh", seed=seed)
    print("objective:  ", g)
    print("certificate:", g.certificate())
    try:
        g.to_cvxpy(x=x)
    except ConvexEqError as err:
        print("to_cvxpy refused:", err)

    _h("5. Gaussian kernel (GEQ): not convex — stationary points only")
    geq = models.geq(n=6, p=6, d=4, seed=seed)
    print("certificate:", geq.certificate().long_text())
    print(lowering.lower(geq).formula())
