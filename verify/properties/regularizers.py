"""Theorem 4 (TPAMI) / docs/theory.md §4: regularizer edits ``φ → φ + γR`` of a prox layer, both
variants,
each with its exact claim.

* gradient variant (``R`` smooth): ``T(z) = prox_φ(z − γ∇R(z))``; fixed points are exactly the
  stationary points of ``φ + γR`` (minimizers: it is convex here).
* prox variant (``R`` with a prox): ``T(z) = prox_φ(prox_{γR}(z))``; fixed points are the
  minimizers of ``φ + M^1_{γR}`` — and in general NOT of ``φ + γR``.
"""

from __future__ import annotations

from typing import Any

import torch

import convex_eq as ce
import lowering

from .cases import OptEqCase
from .common import CVX_TOL, ROUND, check, cvxpy_states, equilibrium, rel_err, t64


def _reg(case: OptEqCase) -> Any:
    z = case.state
    return ce.SqNorm(z) if case.extra.get("R", "sq") == "sq" else ce.L1(z)


def _prox_r(case: OptEqCase, v: torch.Tensor, gamma: float) -> torch.Tensor:
    """``prox_{γR}`` written from its definition (independent of the toolkit's rule)."""
    if case.extra.get("R", "sq") == "sq":
        return v / (1 + gamma)
    return torch.sign(v) * (v.abs() - gamma).clamp_min(0.0)


def _ref(objective: Any, case: OptEqCase, i: int) -> torch.Tensor:
    states, _ = cvxpy_states(objective, x=case.x[i])
    return t64(states[case.state.name])


def theorem4_gradient_variant(case: OptEqCase) -> dict[str, float]:
    """Theorem 4, gradient variant (docs/theory.md §4 row 3), ``R = ½||z||²``,
    ``γ = case.extra["gamma"]``:
    the layer is ``prox_φ(z − γ∇R(z))``, its claim is "minimizer of φ + γR", and its equilibrium
    equals the CVXPY minimizer of ``φ + γR`` (built here from ``φ`` and ``R``, not taken from the
    derivation).  Tolerances: layer identity ``ROUND``; state vs CVXPY ``CVX_TOL``."""
    gamma = float(case.extra["gamma"])
    phi, z = case.objective, case.state
    derived = lowering.lower(phi + gamma * ce.SqNorm(z), regularizer="gradient")
    base = lowering.lower(phi)
    inp = {"x": case.x}
    t = derived.apply({z.name: case.z, **inp})[z.name]
    ref_t = base.apply({z.name: case.z - gamma * case.z, **inp})[z.name]
    e0 = rel_err(t, ref_t)
    check(e0 <= ROUND, f"Theorem 4 (gradient): layer ≠ prox_φ(z − γ∇R(z)) ({e0:.3e})")
    check(derived.claim.kind == "minimizer",
          f"Theorem 4 (gradient): claim should be 'minimizer of φ + γR', got {derived.claim}")
    Z, _, _ = equilibrium(derived, inp)
    target = ce.Objective([*phi.terms, gamma * ce.SqNorm(z)])
    worst = 0.0
    for i in range(case.x.shape[0]):
        err = rel_err(Z[z.name][i], _ref(target, case, i))
        worst = max(worst, err)
        check(err <= CVX_TOL, f"Theorem 4 (gradient): equilibrium is not argmin φ + γR "
                              f"(relative error {err:.3e} vs CVXPY, sample {i})")
    return {"layer_error": e0, "cvxpy_error": worst}


def theorem4_prox_variant(case: OptEqCase) -> dict[str, float]:
    """Theorem 4, prox variant (docs/theory.md §4 row 4), ``R = ½||z||²`` or ``||z||₁``
    (``case.extra["R"]``): the layer is ``prox_φ(prox_{γR}(z))``; its claim is "modified
    minimizer" of ``φ + M^1_{γR}``; the equilibrium equals the CVXPY minimizer of the claimed
    objective (for ``R = ½||·||²`` also of the closed form ``φ + (γ/(1+γ))·½||z||²``) — and is
    NOT the minimizer of ``φ + γR`` whenever the two references differ (checked as
    ``||z* − argmin(φ+γR)|| ≥ ½||argmin(φ+M) − argmin(φ+γR)||`` when the latter exceeds
    ``1e-4``).  Tolerances: layer identity ``ROUND``, states vs CVXPY ``CVX_TOL``."""
    gamma = float(case.extra["gamma"])
    phi, z = case.objective, case.state
    r = _reg(case)
    derived = lowering.lower(phi + gamma * r, regularizer="prox")
    base = lowering.lower(phi)
    inp = {"x": case.x}
    t = derived.apply({z.name: case.z, **inp})[z.name]
    ref_t = base.apply({z.name: _prox_r(case, case.z, gamma), **inp})[z.name]
    e0 = rel_err(t, ref_t)
    check(e0 <= ROUND, f"Theorem 4 (prox): layer ≠ prox_φ(prox_γR(z)) ({e0:.3e})")
    check(derived.claim.kind == "modified minimizer",
          f"Theorem 4 (prox): claim should be 'modified minimizer', got {derived.claim.kind}")
    Z, _, _ = equilibrium(derived, inp)
    claimed = derived.source
    refs = [claimed]
    if case.extra.get("R", "sq") == "sq":
        refs.append(ce.Objective([*phi.terms, (gamma / (1 + gamma)) * ce.SqNorm(z)]))
    naive = ce.Objective([*phi.terms, gamma * r])
    worst, sep = 0.0, float("inf")
    for i in range(case.x.shape[0]):
        zi = Z[z.name][i]
        z_m = None
        for obj in refs:
            z_m = _ref(obj, case, i)
            err = rel_err(zi, z_m)
            worst = max(worst, err)
            check(err <= CVX_TOL, f"Theorem 4 (prox): equilibrium is not argmin of {obj} "
                                  f"(relative error {err:.3e}, sample {i})")
        z_r = _ref(naive, case, i)
        gap = float((z_m - z_r).norm())
        if gap > 1e-4 * max(1.0, float(z_m.norm())):
            dist = float((zi - z_r).norm())
            sep = min(sep, dist / gap)
            check(dist >= 0.5 * gap, f"Theorem 4 (prox): equilibrium is (close to) argmin φ + γR "
                                     f"though that differs from argmin φ + M_γR by {gap:.3e}")
    return {"layer_error": e0, "cvxpy_error": worst, "min_separation_ratio": sep}
