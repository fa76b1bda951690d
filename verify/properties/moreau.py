"""Moreau-envelope edit (docs/theory.md §4, Table 1 of the TPAMI paper): ``φ → α M_φ^{1−α}`` derives
the
skip connection ``α prox_φ(z) + (1 − α) z``, which has the same fixed points as ``prox_φ``."""

from __future__ import annotations

import convex_eq as ce
import lowering

from .cases import OptEqCase
from .common import FP_TOL, ROUND, check, equilibrium, rel_err


def moreau_edit_keeps_fixed_points(case: OptEqCase) -> dict[str, float]:
    """docs/theory.md §4 row 1: for ``α ∈ (0, 1]`` (``case.extra["alpha"]``) the layer derived from
    ``α M_φ^{1−α}`` is ``α T + (1 − α) id`` (``T`` the layer of ``φ``, identity
    ``prox_{λM_f^μ}(x) = x + λ/(μ+λ)(prox_{(μ+λ)f}(x) − x)``), and ``Fix(T_α) = Fix(T)``:
    the equilibrium of each layer is a fixed point of the other, and they coincide.

    Also: ``T_α`` is ``prox_{αM_φ^{1−α}}`` of a convex function, so it is firmly nonexpansive.

    Tolerances: pointwise identity ``ROUND`` (same float64 expression); fixed points solved to
    ``FP_TOL`` with contraction ``≤ 0.95²``: cross-residuals ``≤ 1e3·FP_TOL``."""
    a = float(case.extra.get("alpha", 0.5))
    phi = case.objective
    z = case.state.name
    base = lowering.lower(phi)
    edit = lowering.lower(a * ce.moreau(phi, 1.0 - a)) if a < 1 else lowering.lower(phi)
    inp = {"x": case.x}
    tz = base.apply({z: case.z, **inp})[z]
    ta = edit.apply({z: case.z, **inp})[z]
    err = rel_err(ta, a * tz + (1 - a) * case.z)
    check(err <= ROUND, f"Moreau edit: layer ≠ α T + (1−α) z (α = {a:g}, rel. error {err:.3e})")
    check(edit.claim.kind == base.claim.kind,
          f"Moreau edit changed the claim: {base.claim.kind} → {edit.claim.kind}")
    # firm nonexpansiveness of T_α (it is a prox of a convex function)
    tb = edit.apply({z: case.z2, **inp})[z]
    dt, dz = ta - tb, case.z - case.z2
    lhs, rhs = (dt * dt).sum(-1), (dt * dz).sum(-1)
    scale = (1 + case.z.norm(dim=-1) + case.z2.norm(dim=-1)) * dz.norm(dim=-1)
    check(bool((lhs <= rhs + ROUND * scale).all()),
          "Moreau edit: α T + (1−α) id is not firmly nonexpansive")
    zb, _, _ = equilibrium(base, inp)
    za, _, _ = equilibrium(edit, inp)
    cross_a = rel_err(edit.apply({z: zb[z], **inp})[z], zb[z])
    cross_b = rel_err(base.apply({z: za[z], **inp})[z], za[z])
    tol = 1e3 * FP_TOL
    check(cross_a <= tol, f"Moreau edit: a fixed point of T is not fixed by T_α ({cross_a:.3e})")
    check(cross_b <= tol, f"Moreau edit: a fixed point of T_α is not fixed by T ({cross_b:.3e})")
    same = rel_err(za[z], zb[z])
    check(same <= tol, f"Moreau edit: equilibria differ ({same:.3e})")
    return {"identity_error": err, "cross_residual": max(cross_a, cross_b), "distance": same}
