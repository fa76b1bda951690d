"""GEQ / KerDEQ (Gaussian-kernel equilibrium, docs/theory.md §3 rows 2-3): stationarity of the
declared G, the derived contraction/input-Lipschitz bounds (``geq_prop3_lipschitz``), and GEQ
Proposition 3 as the paper states it, Eq. (11) (``geq_prop3_paper``)."""

from __future__ import annotations

import math

import numpy as np
import torch

import convex_eq as ce
import lowering

from .cases import GEQCase
from .common import FP_TOL, STAT_TOL, check, equilibrium, jacobian, stationarity_residual

#: slack for measured-vs-bound comparisons ``||T(a) − T(b)|| ≤ c||a − b||(1 + LIP_SLACK) +
#: ABS_ROUND·(1 + ||T(a)|| + ||T(b)||)``: the absolute term is the float64 rounding of evaluating
#: ``T`` (cancellation in ``T(a) − T(b)``); without it, pairs a few ulps apart — or so close that
#: ``||a − b||²`` underflows (hypothesis finds both) — give meaningless ratios.  Ratios are
#: *reported* only for pairs with ``||a − b|| ≥ 1e-6``.
LIP_SLACK = 1e-9
ABS_ROUND = 1e-13


def geq_stationary(case: GEQCase) -> dict[str, float]:
    """GEQ (docs/theory.md §3 rows 2/3): the equilibrium of ``z = σ(∇S(z))`` with the Gaussian
    kernel
    ``S = (1/2γ)exp(−γ||q − Wz||²)`` (or its patch-split form) is a stationary point of the
    declared ``G = Σf_σ(z) + ½||z||² − S(z)``: canonical residual (``∇S`` by autograd of the
    declared kernel's value) ``≤ STAT_TOL``; the claim is "stationary point", never
    "minimizer" (Must-show 2)."""
    d = lowering.lower(case.objective)
    check(d.claim.kind == "stationary point",
          f"GEQ: claim must be 'stationary point', got {d.claim.kind}")
    inp = {"x": case.x}
    Z, _, res = equilibrium(d, inp)
    r = stationarity_residual(case.objective, Z, inp)
    check(r <= STAT_TOL, f"GEQ: equilibrium is not a stationary point of G (residual {r:.3e})")
    return {"stationarity_residual": r, "fixed_point_residual": res}


def _opnorm(t: torch.Tensor) -> float:
    return float(np.linalg.norm(t.detach().cpu().numpy(), 2))


def input_lipschitz_bound(case: GEQCase) -> float:
    """``Lip_x T ≤ L_σ·||W||₂·||U||₂`` (``·||W_h||₂²`` for the patch kernel): the map
    ``r ↦ e^{−γ||r||²} r`` has Jacobian ``e^{−γ||r||²}(I − 2γ r rᵀ)`` of norm
    ``max(1, |1 − 2t|)e^{−t} ≤ 1`` (``t = γ||r||²``); ``q = Ux + b``."""
    obj = case.objective
    act = ce.get_activation(case.activation)
    lx = act.lipschitz * _opnorm(obj.symbol("W").value) * _opnorm(obj.symbol("U").value)
    if case.patch:
        lx *= _opnorm(obj.symbol("W_h").value) ** 2
    return lx


def geq_prop3_lipschitz(case: GEQCase) -> dict[str, float]:
    """The derived bounds behind GEQ Proposition 3 (docs/theory.md §3 rows 2-3) — not the
    paper's statement, which :func:`geq_prop3_paper` tests:

    * the state-Lipschitz bound of the derivation, ``c = contraction.value() =
      L_σ||W||₂²(·||W_h||₂²)``, dominates every measured ratio ``||T(a) − T(b)||/||a − b||``
      (probe pairs and near-pairs) and the Jacobian norm ``||∂T/∂z||₂`` at the probes;
    * with ``c < 1`` the equilibria are Lipschitz in the input:
      ``||z*(x₁) − z*(x₂)|| ≤ Lip_x/(1 − c)·||x₁ − x₂||`` (``Lip_x`` from
      :func:`input_lipschitz_bound`): the structure of Prop. 3's ``L_geq`` with the kernel's
      damping ``β_max`` bounded by 1.

    Slack ``LIP_SLACK`` (rounding)."""
    d = lowering.lower(case.objective)
    c = d.contraction.value()
    z = d.blocks[0].name

    def T(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return d.apply({z: v, "x": x})[z]

    worst = 0.0
    a, b = case.z, case.z2
    for bb in (b, a + 1e-3 * (b - a)):
        ta, tb = T(a, case.x), T(bb, case.x)
        num = torch.linalg.vector_norm(ta - tb, dim=-1)
        den = torch.linalg.vector_norm(a - bb, dim=-1)
        slack = ABS_ROUND * (1 + ta.norm(dim=-1) + tb.norm(dim=-1))
        excess = num - c * den * (1 + LIP_SLACK) - slack
        check(bool((excess <= 0).all()),
              f"GEQ Prop. 3: ||T(a) − T(b)|| exceeds c·||a − b|| by {float(excess.max()):.3e} "
              f"(measured ratio {float((num / den.clamp_min(1e-300)).max()):.6g} exceeds the "
              f"derived bound {c:.6g})")
        ok = den >= 1e-6
        if bool(ok.any()):
            worst = max(worst, float((num[ok] / den[ok]).max()))
    for i in range(a.shape[0]):
        J = jacobian(lambda v, i=i: T(v, case.x[i:i + 1]), a[i].clone())
        jn = float(torch.linalg.matrix_norm(J, 2))
        worst = max(worst, jn)
        check(jn <= c * (1 + LIP_SLACK) + ABS_ROUND,
              f"GEQ Prop. 3: measured Lipschitz ratio ||∂T/∂z||₂ = {jn:.6g} exceeds the derived "
              f"bound {c:.6g}")
    out = {"state_ratio": worst, "state_bound": c}
    if c < 1:
        lx = input_lipschitz_bound(case)
        Z1, _, _ = equilibrium(d, {"x": case.x})
        Z2, _, _ = equilibrium(d, {"x": case.x2})
        num = torch.linalg.vector_norm(Z1[z] - Z2[z], dim=-1)
        den = torch.linalg.vector_norm(case.x - case.x2, dim=-1)
        bound = lx / (1 - c)
        # equilibria are solved to FP_TOL relative: absolute error ≤ FP_TOL·max(1,||z||)/(1 − c)
        zsc = 1 + Z1[z].norm(dim=-1) + Z2[z].norm(dim=-1)
        excess = num - bound * den * (1 + 1e-9) - 10 * FP_TOL * zsc / (1 - c)
        ok = den >= 1e-6
        ratio = float((num[ok] / den[ok]).max()) if bool(ok.any()) else 0.0
        check(bool((excess <= 0).all()),
              f"GEQ Prop. 3: equilibrium input-Lipschitz ratio {ratio:.6g} > Lip_x/(1 − c) = "
              f"{bound:.6g} (excess {float(excess.max()):.3e})")
        out.update(input_ratio=ratio, input_bound=bound)
    return out


def geq_prop3_paper(case: GEQCase) -> dict[str, float]:
    """GEQ Proposition 3, Eq. (11) as the paper states it (docs/theory.md §3 row 2): for GEQ
    with σ = ReLU and ``μ := max(||W||₂, ||U||₂) < 1``, per sample pair

        ``||z*(x₁) − z*(x₂)|| ≤ κ/(1 − κ)·||x₁ − x₂||``,  ``κ = β_max μ² + √γ B μ³``,

    with the paper's symbols pinned down at the two equilibria: ``β_max = max_i e^{−γ||r_i||²}``,
    ``r_i = Ux_i + b − Wz*(x_i)``, and ``B = max_i ||r_i||/μ`` (the paper's "norms bounded by B"
    read as the bound on the kernel's argument its proof needs).  Proof: ``σ`` is 1-Lipschitz
    and ``e₁Wᵀr₁ − e₂Wᵀr₂ = e₁Wᵀ(r₁ − r₂) + (e₁ − e₂)Wᵀr₂`` with ``|e₁ − e₂| ≤ √(2γ/e)||r₁ − r₂||``
    (the slope of ``s ↦ e^{−γs²}``) and ``||r₁ − r₂|| ≤ μ(||Δx|| + ||Δz||)``, so
    ``||Δz|| ≤ κ'(||Δx|| + ||Δz||)`` with ``κ' = β_max μ² + √(2γ/e)μ²·max||r_i|| ≤ κ``.
    Applies where ``κ < 1`` (returned ``applicable = 0`` otherwise: nothing is claimed);
    ``informative`` = 1 when the pair has ``z*(x₁) ≠ z*(x₂)`` (else both sides are trivially
    ordered).  Slack: the equilibria's own accuracy ``10·FP_TOL·(1 + ||z*||)/(1 − ||W||²)``."""
    check(case.activation == "relu" and not case.patch,
          "GEQ Prop. 3 (paper form) is stated for ReLU and the whole-vector kernel")
    obj = case.objective
    d = lowering.lower(obj)
    z = d.blocks[0].name
    w, u, b = (obj.symbol(k).value.detach().to(torch.float64) for k in ("W", "U", "b"))
    mu = max(_opnorm(w), _opnorm(u))
    check(mu < 1, f"GEQ Prop. 3 needs μ = max(||W||₂, ||U||₂) < 1, got {mu:.4g}")
    Z1, _, _ = equilibrium(d, {"x": case.x})
    Z2, _, _ = equilibrium(d, {"x": case.x2})
    z1, z2 = Z1[z], Z2[z]
    r1 = case.x @ u.T + b - z1 @ w.T
    r2 = case.x2 @ u.T + b - z2 @ w.T
    rn = torch.stack([r1.norm(dim=-1), r2.norm(dim=-1)])  # (2, B)
    beta = torch.exp(-case.gamma * rn * rn).max(dim=0).values
    bb = rn.max(dim=0).values / mu
    kappa = beta * mu**2 + math.sqrt(case.gamma) * bb * mu**3
    app = kappa < 1
    num = torch.linalg.vector_norm(z1 - z2, dim=-1)
    den = torch.linalg.vector_norm(case.x - case.x2, dim=-1)
    bound = torch.where(app, kappa / (1 - kappa).clamp_min(1e-300), torch.inf)
    c = _opnorm(w) ** 2
    slack = 10 * FP_TOL * (1 + z1.norm(dim=-1) + z2.norm(dim=-1)) / (1 - c)
    excess = torch.where(app, num - bound * den * (1 + 1e-9) - slack, -torch.inf)
    ratio = num / den.clamp_min(1e-300)
    i = int(torch.argmax(excess))
    check(bool((excess <= 0).all()),
          f"GEQ Prop. 3 (paper form): ||z*(x₁) − z*(x₂)||/||x₁ − x₂|| = {float(ratio[i]):.6g} > "
          f"κ/(1 − κ) = {float(bound[i]):.6g} (κ = {float(kappa[i]):.4g}, β_max = "
          f"{float(beta[i]):.4g}, B = {float(bb[i]):.4g}, μ = {mu:.4g}, γ = {case.gamma:g})")
    informative = app & (num > 1e-9 * (1 + z1.norm(dim=-1))) & (den > 0)
    return {"ratio": float(ratio[app].max()) if bool(app.any()) else 0.0,
            "bound": float(bound[app].min()) if bool(app.any()) else math.inf,
            "applicable": float(app.float().mean()),
            "informative": float(informative.float().mean())}
