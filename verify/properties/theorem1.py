"""Theorem 1 (docs/theory.md §2) and Lemma 5 (NeurIPS OptEq appendix E.1): the OptEq layer is a
proximal
operator of a convex function.

``ψ(z) = (1/μ)Σσ̃(Wz + q)``, ``μ ≥ L_σ||W||₂²``, ``φ = ψ* − ½||·||²``:
``prox_φ = ∇ψ = (1/μ)Wᵀσ(Wz + q)``.
"""

from __future__ import annotations

from typing import Any

import torch

import lowering

from .cases import OptEqCase
from .common import ROUND, check, jacobian, nrm


def _layer(case: OptEqCase) -> tuple[Any, Any]:
    d = lowering.lower(case.objective)
    name = case.state.name

    def T(z: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        xx = case.x if x is None else x
        if xx.shape[0] != z.shape[0]:
            xx = xx[:1].expand(z.shape[0], -1)
        return d.apply({name: z, "x": xx})[name]

    return d, T


def theorem1_firm_nonexpansive(case: OptEqCase) -> dict[str, float]:
    """Theorem 1 (docs/theory.md §2): ``T = prox_φ`` with ``φ`` convex, hence firmly nonexpansive:
    ``||Tu − Tv||² ≤ <Tu − Tv, u − v>`` for all ``u, v`` (same input ``x``).

    Tolerance: ``ROUND·(1 + ||u|| + ||v||)·||u − v||`` — both sides are float64 expressions of
    O(1) quantities; their rounding error is proportional to ``||u − v||``."""
    d, T = _layer(case)
    check(d.is_prox, f"Theorem 1: the derived layer is not marked as prox_φ ({d.claim})")
    check(d.claim.kind == "minimizer", f"Theorem 1 claims a minimizer, got {d.claim.kind}")
    u, v = case.z, case.z2
    tu, tv = T(u), T(v)
    worst = -float("inf")
    for i in range(u.shape[0]):
        dt, dz = tu[i] - tv[i], u[i] - v[i]
        lhs, rhs = float(dt @ dt), float(dt @ dz)
        tol = ROUND * (1 + nrm(u[i]) + nrm(v[i])) * nrm(dz)
        worst = max(worst, lhs - rhs)
        check(lhs <= rhs + tol,
              f"Theorem 1: not firmly nonexpansive: ||Tu−Tv||² = {lhs:.6g} > <Tu−Tv, u−v> = "
              f"{rhs:.6g} (sample {i})")
    return {"max_excess": worst}


def theorem1_jacobian(case: OptEqCase) -> dict[str, float]:
    """Theorem 1 (docs/theory.md §2): ``J = ∂T/∂z = (1/μ)Wᵀ diag(σ') W`` is symmetric with
    eigenvalues in
    ``[0, 1]`` (``T = ∇ψ`` with ``ψ`` convex and 1-smooth), at every probe point (autograd's
    one-sided derivative at kinks is still in ``[0, L_σ]``, so the claim holds there too).

    Tolerances: symmetry ``ROUND·max(1, ||J||)``, spectrum ``[−ROUND, 1 + ROUND]``."""
    _, T = _layer(case)
    eig_min, eig_max, asym = float("inf"), -float("inf"), 0.0
    for i in range(case.z.shape[0]):
        x = case.x[i:i + 1]
        J = jacobian(lambda z, x=x: T(z, x), case.z[i].clone())
        a = float(torch.linalg.matrix_norm(J - J.T))
        asym = max(asym, a)
        check(a <= ROUND * max(1.0, float(torch.linalg.matrix_norm(J))),
              f"Theorem 1: Jacobian not symmetric (||J − Jᵀ||_F = {a:.3e}): T is not a gradient")
        ev = torch.linalg.eigvalsh(0.5 * (J + J.T))
        eig_min, eig_max = min(eig_min, float(ev.min())), max(eig_max, float(ev.max()))
        check(float(ev.min()) >= -ROUND,
              f"Theorem 1: Jacobian eigenvalue {float(ev.min()):.6g} < 0 (ψ not convex)")
        check(float(ev.max()) <= 1 + ROUND,
              f"Theorem 1: Jacobian eigenvalue {float(ev.max()):.6g} > 1 (T expansive)")
    return {"eig_min": eig_min, "eig_max": eig_max, "asymmetry": asym}


def lemma5_prox_characterization(case: OptEqCase) -> dict[str, float]:
    """Lemma 5 (NeurIPS OptEq, App. E.1; Gribonval–Nikolova Prop. 2): ``f`` is the prox of a
    proper convex l.s.c. ``φ`` iff (a) ``f = ∇ψ`` for a convex l.s.c. ``ψ`` and (b) ``f`` is
    nonexpansive; then ``φ = ψ* − ½||·||²``.

    Checked on the derived layer ``f`` and the *declared* ``ψ`` (the primal of the objective's
    conjugate term) and ``φ`` (the objective itself, evaluated through its own value rule):

    (a) ``f(z) = ∇ψ(z)`` with ``∇ψ`` by autograd of ``ψ``'s value (not its gradient rule), and
        the first-order convexity inequality ``ψ(v) ≥ ψ(u) + <f(u), v − u>``;
    (b) ``||f(u) − f(v)|| ≤ ||u − v||``;

    (i) ``f(x) = prox_φ(x)``: ``φ(f(x)) + ½||f(x) − x||² ≤ φ(w) + ½||w − x||²`` for the
        competitors ``w ∈ {f(x'), ½(f(x) + f(x'))}`` (points of ``dom φ``; outside it φ = +∞).

    Needs ``m ≤ n`` (``Wᵀ`` injective) so that ``φ`` has the closed-form value the toolkit
    evaluates.  Tolerance ``ROUND·(1 + |values|)``."""
    _, T = _layer(case)
    obj = case.objective
    conj = next(t for t in obj.terms if type(t).__name__ == "SeparableAffineConjugate")
    psi = conj.primal()
    z = case.state
    x = case.x
    u = case.z.clone().requires_grad_()
    vals = {z.name: u, "x": x}
    psi_u = psi.value(vals)
    (g,) = torch.autograd.grad(psi_u.sum(), u)
    fu = T(case.z).detach()
    err_a = nrm(fu - g) / max(1.0, nrm(g))
    check(err_a <= ROUND, f"Lemma 5 (a): f ≠ ∇ψ (relative error {err_a:.3e})")
    v = case.z2
    psi_v = psi.value({z.name: v, "x": x})
    lin = psi_u.detach() + ((fu * (v - case.z)).sum(-1))
    gap = psi_v - lin
    tol = ROUND * (1 + psi_v.abs() + lin.abs())
    check(bool((gap >= -tol).all()),
          f"Lemma 5 (a): ψ(v) < ψ(u) + <f(u), v−u> by {float((-gap).max()):.3e}: ψ not convex "
          "or f not its gradient")
    fv = T(v).detach()
    num = torch.linalg.vector_norm(fu - fv, dim=-1)
    den = torch.linalg.vector_norm(case.z - v, dim=-1)
    ratio = num / den.clamp_min(1e-300)
    # absolute rounding term: pairs a few ulps apart (or with ||u − v||² underflowing) carry
    # no Lipschitz information
    slack = 1e-13 * (1 + fu.norm(dim=-1) + fv.norm(dim=-1))
    check(bool((num <= den * (1 + ROUND) + slack).all()),
          f"Lemma 5 (b): f expansive (ratio {float(ratio.max()):.6g})")
    # (i) prox optimality of f(x) against competitors in dom φ
    fx = fu
    worst = -float("inf")
    for w in (fv, 0.5 * (fu + fv)):
        lhs = obj.value_tensor({z.name: fx, "x": x}) + 0.5 * ((fx - case.z) ** 2).sum(-1)
        rhs = obj.value_tensor({z.name: w, "x": x}) + 0.5 * ((w - case.z) ** 2).sum(-1)
        check(bool(torch.isfinite(lhs).all()), "Lemma 5 (i): φ(f(x)) = +∞: f(x) ∉ dom φ")
        fin = torch.isfinite(rhs)
        excess = torch.where(fin, lhs - rhs, torch.full_like(lhs, -float("inf")))
        tol = ROUND * (1 + lhs.abs() + torch.where(fin, rhs.abs(), torch.zeros_like(rhs)))
        worst = max(worst, float(excess.max()))
        check(bool((excess <= tol).all()),
              f"Lemma 5 (i): f(x) is not prox_φ(x): a competitor improves the prox objective by "
              f"{float(excess.max()):.3e}")
    return {"grad_error": err_a, "max_ratio": float(ratio.max()), "prox_excess": worst}
