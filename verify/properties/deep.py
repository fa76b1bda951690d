"""Deep OptEq (docs/theory.md §5, TPAMI §5): Lemma 3 (composition ↔ multi-block), Theorem 2
(monotone
inclusion), Corollary 1 (L = 2: a convex problem, vs CVXPY) and Theorem 3 (α → 0: the wide
one-layer model)."""

from __future__ import annotations

from typing import Any

import torch

import convex_eq as ce
import lowering

from .cases import DeepCase
from .common import CVX_TOL, FP_TOL, check, cvxpy_states, equilibrium, rel_err, t64

#: Theorem 2 / Lemma 3 residual tolerance: equilibria solved to FP_TOL (contraction ≤ 0.95² per
#: layer, so ≤ 1e-10 away), inner envelope solves to 1e-14·κ with κ ≤ 1/(1 − α) ≤ 10.
INCLUSION_TOL = 1e-9


def _blocks(comp: Any, x: torch.Tensor, z0: torch.Tensor) -> dict[str, torch.Tensor]:
    """``z_1 = f_1(z_0), …, z_{L-1} = f_{L-1}(z_{L-2})`` through the multi-block layer's nodes."""
    mb = lowering.lower(comp, deep_form="multiblock")
    names = [b.name for b in mb.blocks]
    Z = {n: torch.zeros_like(z0) for n in names}
    Z[names[-1]] = z0
    for i in range(len(names) - 1):
        Z[names[i]] = mb.apply({**Z, "x": x})[names[i]]
    return Z


def _grad_psi(phi: Any, block: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``∇ψ_l(w)`` from the declared ``φ_l = ψ_l* − ½||·||²`` (gradient rule of ψ's term)."""
    conj = next(t for t in phi.terms if isinstance(t, ce.SeparableAffineConjugate))
    return conj.primal().grad({block: w, "x": x})[block]


def envelope_grad(phi: Any, block: str, v: torch.Tensor, x: torch.Tensor, t: float
                  ) -> torch.Tensor:
    """``∇M^t_φ(v) = (v − prox_{tφ}(v))/t`` for ``φ = ψ* − ½||·||²``, ``t < 1``, computed
    independently of the layer: ``prox_{tφ}(v) = ∇ψ(w)`` where ``w`` minimizes the strongly
    convex ``t/2||w||² + (1−t)ψ(w) − <v, w>`` (gradient descent, exact gradients)."""
    conj = next(tt for tt in phi.terms if isinstance(tt, ce.SeparableAffineConjugate))
    lip = t + (1 - t) * conj.grad_lipschitz_of_primal()
    w = v.clone()
    for _ in range(20000):
        g = t * w + (1 - t) * _grad_psi(phi, block, w, x) - v
        if float(g.norm(dim=-1).max()) <= 1e-14 * max(1.0, float(v.norm(dim=-1).max())):
            break
        w = w - g / lip
    return (v - _grad_psi(phi, block, w, x)) / t


def lemma3_theorem2_multiblock(case: DeepCase) -> dict[str, float]:
    """Lemma 3 and Theorem 2 (docs/theory.md §5; TPAMI §5):

    * Lemma 3: with ``z_0*`` the equilibrium of ``T = f_L∘…∘f_1`` and ``z_l* = f_l(z_{l−1}*)``, the
      stacked ``z̃* = (z_1*, …, z_{L−1}*, z_0*)`` is a fixed point of the multi-block layer; and
      conversely the multi-block equilibrium's last block is the composition's equilibrium.
    * Theorem 2: ``0 ∈ ∂Φ(z̃*) + (I − P)z̃*``, ``Φ(z̃) = Σ_l αM^{1−α}_{φ_l}(z_l)``: blockwise
      ``α∇M^{1−α}_{φ_l}(z_l*) + z_l* − z_{l−1}* = 0`` with the envelope gradient computed from
      the declared ``φ_l`` (not from the layer).

    Tolerance: ``INCLUSION_TOL`` (relative to ``max(1, ||z||)``)."""
    comp = case.composition
    a = comp.alpha_value()
    comp_layer = lowering.lower(comp)
    mb = lowering.lower(comp, deep_form="multiblock")
    inp = {"x": case.x}
    Zc, _, _ = equilibrium(comp_layer, inp)
    names = [b.name for b in mb.blocks]
    Z = _blocks(comp, case.x, Zc[names[-1]])
    out = mb.apply({**Z, **inp})
    res = max(rel_err(out[n], Z[n]) for n in names)
    check(res <= INCLUSION_TOL, f"Lemma 3: stacked composition equilibrium is not a multi-block "
                                f"fixed point (residual {res:.3e})")
    Zm, _, _ = equilibrium(mb, inp)
    conv = rel_err(Zm[names[-1]], Zc[names[-1]])
    check(conv <= INCLUSION_TOL, f"Lemma 3 (converse): multi-block equilibrium's z_0 differs "
                                 f"from the composition equilibrium ({conv:.3e})")
    worst = 0.0
    if a < 1:
        for i, phi in enumerate(comp.layers):
            cur, prev = names[i], names[i - 1]
            g = envelope_grad(phi, cur, Z[cur], case.x, 1.0 - a)
            r = a * g + Z[cur] - Z[prev]
            worst = max(worst, rel_err(r, torch.zeros_like(r)))
        check(worst <= INCLUSION_TOL, f"Theorem 2: inclusion residual ||∇Φ(z̃) + (I−P)z̃|| = "
                                      f"{worst:.3e} (α = {a:g})")
    return {"multiblock_residual": res, "converse_distance": conv, "inclusion_residual": worst}


def corollary1_cvxpy(case: DeepCase) -> dict[str, float]:
    """Corollary 1 (docs/theory.md §5): for ``L = 2``, ``α < 1``, ``(z_1*, z_0*)`` minimizes
    ``αM^{1−α}_{φ_1}(z_1) + αM^{1−α}_{φ_2}(z_0) + ½||z_1 − z_0||²`` — compared with the CVXPY
    minimizer of ``corollary1_objective()`` (DCP activations).  Tolerance ``CVX_TOL``."""
    comp = case.composition
    check(comp.L == 2, "Corollary 1 needs L = 2")
    d = lowering.lower(comp)
    check(d.claim.kind == "minimizer", f"Corollary 1: claim should be a minimizer, got {d.claim}")
    Zc, _, _ = equilibrium(d, {"x": case.x})
    Z = _blocks(comp, case.x, Zc["z0"])
    obj = comp.corollary1_objective()
    worst = 0.0
    for i in range(case.x.shape[0]):
        states, _ = cvxpy_states(obj, x=case.x[i])
        for n in ("z1", "z0"):
            err = rel_err(Z[n][i], t64(states[n]))
            worst = max(worst, err)
            check(err <= CVX_TOL, f"Corollary 1: block {n} differs from the CVXPY minimizer "
                                  f"({err:.3e}, sample {i})")
    return {"cvxpy_error": worst}


def wide_solution(case: DeepCase, tol: float = 1e-14) -> torch.Tensor:
    """``y`` with ``L y = Σ_l W_lᵀσ(W_l y + U_l x + b_l)`` (docs/theory.md §5, Theorem 3), by the
    contraction ``y ← (1/L)Σ_l W_lᵀσ(…)`` (Lipschitz ``(1/L)Σ||W_l||₂² < 1``); written from the
    formula with the registry's σ, independent of the lowering."""
    act = ce.get_activation(case.activation)
    L = case.composition.L
    ws = [case.weights(i) for i in range(1, L + 1)]
    n = ws[0][0].shape[1]
    y = torch.zeros(case.x.shape[0], n, dtype=torch.float64)
    for _ in range(100000):
        new = sum(act.sigma(y @ w.T + case.x @ u.T + b) @ w for w, u, b in ws) / L
        if float((new - y).norm()) <= tol * max(1.0, float(new.norm())):
            return new
        y = new
    return y


THEOREM3_ALPHAS = (0.2, 0.05, 0.01)


def theorem3_wide_limit(case: DeepCase) -> dict[str, float]:
    """Theorem 3 (docs/theory.md §5): as ``α → 0`` every block ``z_l*(α)`` of the deep equilibrium
    tends to
    the wide solution ``y`` of ``L y = Σ_l W_lᵀσ(W_l y + U_l x + b_l)``.  Measured at
    ``α ∈ {0.2, 0.05, 0.01}`` (``case.alpha`` is ignored): the error
    ``e(α) = max_l ||z_l*(α) − y|| / max(1, ||y||)`` must not grow as α decreases, and must shrink
    at least in proportion ``e(0.01) ≤ 0.25·e(0.2)`` (it is O(α): ``z_l − z_{l−1} = α(…)``),
    up to the solve accuracy ``1e-9``."""
    y = wide_solution(case)
    errs = []
    for a in THEOREM3_ALPHAS:
        comp = ce.DeepComposition(case.composition.layers, a)
        d = lowering.lower(comp)
        Zc, _, _ = equilibrium(d, {"x": case.x}, max_iter=6000)
        Z = _blocks(comp, case.x, Zc["z0"])
        errs.append(max(rel_err(v, y) for v in Z.values()))
    slack = 1e-9 + 1e3 * FP_TOL / (1 - 0.95 ** 2)
    e2, e05, e01 = errs
    check(e05 <= e2 + slack and e01 <= e05 + slack,
          f"Theorem 3: distance to the wide solution does not shrink as α → 0: "
          f"{dict(zip(THEOREM3_ALPHAS, errs))}")
    check(e01 <= 0.25 * e2 + slack,
          f"Theorem 3: e(0.01) = {e01:.3e} is not ≤ ¼·e(0.2) = {0.25 * e2:.3e}")
    return {f"err_alpha_{a:g}": e for a, e in zip(THEOREM3_ALPHAS, errs)}
