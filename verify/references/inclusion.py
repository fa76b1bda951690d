"""The inclusion reference (docs/monotone.md §6): splitting layers checked against references
that do not reuse the splitting, one unit each in :data:`INCLUSION_REFERENCES`.

* ``gap``: the regularised gap ``γ_α(z) = sup_y ⟨F(z), z − y⟩ + g(z) − g(y) − ||y − z||²/(2α)``
  of ``0 ∈ F(z) + ∂g(z)``, by CVXPY on ``g``'s own export (strongly concave in ``y``: finite,
  ``≥ 0``, ``0`` exactly at solutions); its maximiser ``y*`` bounds the distance to the solution:
  ``||z − z*|| ≤ (1 + αL)/(αm) · ||z − y*||`` (F ``m``-strongly monotone, ``L``-Lipschitz).
* ``lcp``: ``g = Σf_relu`` (``ι_{z ≥ 0}``): the monotone LCP ``z ≥ 0, Mz − q ≥ 0, zᵀ(Mz − q) = 0``
  as the convex QP ``min zᵀ(Mz − q)`` over ``z ≥ 0, Mz ≥ q`` (CVXPY), refined on its active set.
* ``duality-gap``: saddle objectives ``min_z max_w G(z) + ⟨Kz + c, w⟩ − H(w)``: the primal value
  ``p(z*) = max_w L(z*, w)`` and the dual value ``d(w*) = min_z L(z, w*)`` by two CVXPY solves;
  ``p(z*) − d(w*) ≥ 0`` with equality exactly at saddle points.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import cvxpy as cp
import numpy as np
import torch

from convex_eq.errors import ExportError
from convex_eq.inclusion import Inclusion, Saddle
from convex_eq.objective import Objective
from convex_eq.symbols import Constant
from convex_eq.terms.potential import Potential
from convex_eq.terms.quadratic import Linear, SqNorm

from ..report import InclusionReport


@dataclass
class InclusionContext:
    """One check: the layer, its equilibrium (outputs and state), inputs, weights, options."""

    derived: Any
    source: Any
    inputs: dict[str, torch.Tensor]
    env: dict[str, torch.Tensor]
    outputs: dict[str, np.ndarray]
    opts: dict[str, Any]
    report: InclusionReport

    def sample_inputs(self, b: int) -> dict[str, torch.Tensor]:
        return {k: v[b:b + 1] for k, v in self.inputs.items()}

    def measure(self, name: str, b: int, value: float) -> None:
        bsz = next(iter(self.outputs.values())).shape[0]
        vals = self.report.measures.setdefault(name, [math.nan] * bsz)
        vals[b] = value


class InclusionReference(Protocol):
    """One reference: ``applies(source)`` and ``run(ctx, b)`` for sample ``b``."""

    kind: str

    def applies(self, source: Any) -> bool: ...

    def run(self, ctx: InclusionContext, b: int) -> None: ...



#: Clarabel's tolerances that :func:`_solve` loosens tenfold for its one retry
_CLARABEL_TOLS = ("tol_gap_abs", "tol_gap_rel", "tol_feas")


def _solve_once(prob: cp.Problem, opts: Mapping[str, Any]) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            prob.solve(**dict(opts))
    except cp.SolverError as err:
        return f"solver_error: {str(err).splitlines()[0]}"
    return str(prob.status)


#: the loosest tolerance :func:`_solve`'s retry uses (four orders of magnitude below the
#: verify tolerances the reports accept)
_RETRY_TOL = 1e-10


def _solve(prob: cp.Problem, opts: Mapping[str, Any], notes: list[str] | None = None) -> str:
    """Solve; a Clarabel solve that stops ``optimal_inaccurate`` (its reduced-accuracy stop)
    with gap and feasibility tolerances below ``_RETRY_TOL`` (the default 1e-11) is solved once
    more with them ten times looser, never looser than ``_RETRY_TOL`` (a user's own
    tolerances at or above it are kept: no retry), and ``notes`` says so.  The exponential
    cones of a tanh inclusion's gap problem can stop just short of 1e-11 depending on the last
    digits of the layer's point, which says nothing about the layer."""
    status = _solve_once(prob, opts)
    if status == cp.OPTIMAL_INACCURATE and str(opts.get("solver", "")).upper() == "CLARABEL" \
            and all(k in opts and float(opts[k]) < _RETRY_TOL for k in _CLARABEL_TOLS):
        looser = {k: min(10.0 * float(opts[k]), _RETRY_TOL) for k in _CLARABEL_TOLS}
        status = _solve_once(prob, {**opts, **looser})
        if notes is not None:
            note = (f"a Clarabel reference stopped optimal_inaccurate and was solved again at "
                    f"tolerance {max(looser.values()):g} ({status})")
            if note not in notes:
                notes.append(note)
    return status


def _min_plus_linear(obj: Objective, lin: np.ndarray, center: np.ndarray | None, rho: float,
                     inputs: Mapping[str, torch.Tensor], env: Mapping[str, Any],
                     opts: Mapping[str, Any], notes: list[str] | None = None
                     ) -> tuple[str, float, np.ndarray]:
    """``min_y obj(y) + ⟨lin, y⟩ (+ ||y − center||²/(2ρ))`` by CVXPY on the export of that
    objective (the added terms join its collected quadratic form, so e.g. a tanh potential's
    ``−½u²`` part is offset by ``1/ρ ≥ 1``); ``(status, value, argmin)``; a source that cannot
    be exported gives status ``"not exportable: …"``."""
    s = obj.states[0]
    terms = [*obj.terms, Linear(Constant("ref_linear", lin), s)]
    if center is not None:
        terms.append(SqNorm(s - Constant("ref_center", center)) * (1.0 / rho))
    full = Objective(terms)
    names = {x.name for x in full.symbols}
    ins = {k: v[0].numpy() for k, v in inputs.items() if k in names}
    envs = {k: v for k, v in env.items() if k in names}
    try:
        ex = full.to_cvxpy(**ins, **envs)
    except ExportError as err:
        return f"not exportable: {err}", math.nan, np.full(s.size, np.nan)
    status = _solve(ex.problem, opts, notes)
    if status != cp.OPTIMAL:
        return status, math.nan, np.full(s.size, np.nan)
    y = ex.state_maps[s.name] @ np.asarray(ex.variable.value, dtype=np.float64)
    return status, float(ex.problem.value) + ex.constant, y


def _value(obj: Objective, vals: Mapping[str, np.ndarray], inputs: Mapping[str, torch.Tensor],
           env: Mapping[str, Any]) -> float:
    v = {k: torch.as_tensor(np.asarray(a, dtype=np.float64)).reshape(1, -1)
         for k, a in vals.items()}
    v.update(inputs)
    with torch.no_grad():
        return float(obj.value_tensor(v, env)[0])


class GapReference:
    """The regularised gap function by CVXPY and the distance bound from its maximiser."""

    kind = "gap"

    def applies(self, source: Any) -> bool:
        return isinstance(source, Inclusion)

    def run(self, ctx: InclusionContext, b: int) -> None:
        inc: Inclusion = ctx.source
        z = ctx.outputs[inc.z.name][b]
        cert = inc.certificate(ctx.env)
        m, lip = cert.margin, cert.lipschitz
        alpha = min(1.0, 1.0 / lip)  # any α > 0 works; α ≤ 1 keeps f_σ's export DCP
        M = inc.matrix(ctx.env)
        q = inc.shift(ctx.sample_inputs(b), ctx.env)[0].numpy()
        fz = M @ z - q
        status, val, y = _min_plus_linear(inc.g, fz, z, alpha, {}, ctx.env, ctx.opts,
                                          ctx.report.notes)
        if status != cp.OPTIMAL:
            ctx.report.failures.append(f"sample {b}: gap reference not solved ({status})")
            return
        gz = _value(inc.g, {inc.z.name: z}, {}, ctx.env)
        gap = float(fz @ z) + gz - val
        r = float(np.linalg.norm(z - y))
        bound = (1 + alpha * lip) / (alpha * m) * r / max(1.0, float(np.linalg.norm(z)))
        ctx.measure("gap", b, gap)
        ctx.measure("distance bound", b, bound)
        if gap < -ctx.report.tolerance:  # a gap is ≥ 0 by definition: the solve is off
            ctx.report.failures.append(f"sample {b}: gap {gap:.3e} < 0 beyond the tolerance: "
                                       "the CVXPY maximiser is inaccurate")
        if not bound <= ctx.report.tolerance:
            ctx.report.failures.append(
                f"sample {b}: ||z − z*||/max(1,||z||) ≤ (1 + αL)/(αm)·||z − y*|| = {bound:.3e} "
                f"> {ctx.report.tolerance:g} (gap {gap:.3e}, α = {alpha:.4g}, m = {m:.4g})")


#: floor of the denominator of the LCP solution's relative error
LCP_FLOOR = 1e-3


def _relu_only(inc: Inclusion) -> bool:
    return (len(inc.g_terms) == 1 and isinstance(inc.g_terms[0], Potential)
            and inc.g_terms[0].act.name == "relu" and inc.g_terms[0].prox_state is inc.z)


class LcpReference:
    """ReLU: the monotone LCP as a convex QP (CVXPY), refined on its active set."""

    kind = "lcp"

    def applies(self, source: Any) -> bool:
        return isinstance(source, Inclusion) and _relu_only(source)

    def run(self, ctx: InclusionContext, b: int) -> None:
        inc: Inclusion = ctx.source
        M = inc.matrix(ctx.env)
        q = inc.shift(ctx.sample_inputs(b), ctx.env)[0].numpy()
        n = M.shape[0]
        P = 0.5 * (M + M.T)
        x = cp.Variable(n)
        prob = cp.Problem(cp.Minimize(cp.quad_form(x, cp.psd_wrap(P)) - q @ x),
                          [x >= 0, M @ x - q >= 0])
        status = _solve(prob, ctx.opts, ctx.report.notes)
        if status != cp.OPTIMAL:
            ctx.report.failures.append(f"sample {b}: LCP QP not solved ({status})")
            return
        zr = np.asarray(x.value, dtype=np.float64)
        zr = _active_set(M, q, zr)
        z = ctx.outputs[inc.z.name][b]
        err = float(np.linalg.norm(z - zr)) / max(float(np.linalg.norm(zr)), LCP_FLOOR)
        ctx.measure("lcp rel. error", b, err)
        ctx.report.z_reference = _put(ctx.report.z_reference, b, zr, len(ctx.outputs[inc.z.name]))
        if not err <= ctx.report.tolerance:
            ctx.report.failures.append(f"sample {b}: layer vs LCP solution: relative error "
                                       f"{err:.3e} > {ctx.report.tolerance:g}")


def _active_set(M: np.ndarray, q: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The exact LCP solution on the active set the QP found (``z_S = M_SS⁻¹ q_S``, ``z_N = 0``)
    when it is feasible to round-off, else the QP point."""
    w = M @ z - q
    S = z > w
    out = np.zeros_like(z)
    if S.any():
        try:
            out[S] = np.linalg.solve(M[np.ix_(S, S)], q[S])
        except np.linalg.LinAlgError:
            return z
    w2 = M @ out - q
    scale = max(1.0, float(np.abs(q).max(initial=0.0)))
    ok = (out >= -1e-12 * scale).all() and (w2[~S] >= -1e-12 * scale).all()
    return out if ok else z


def _put(arr: np.ndarray | None, b: int, row: np.ndarray, bsz: int) -> np.ndarray:
    if arr is None:
        arr = np.full((bsz, row.size), np.nan)
    arr[b] = row
    return arr


class DualityGapReference:
    """Saddle objectives: ``p(z*) − d(w*)`` by a primal and a dual CVXPY solve."""

    kind = "duality-gap"

    def applies(self, source: Any) -> bool:
        return isinstance(source, Saddle)

    def run(self, ctx: InclusionContext, b: int) -> None:
        sad: Saddle = ctx.source
        ins = ctx.sample_inputs(b)
        z, w = ctx.outputs[sad.z.name][b], ctx.outputs[sad.w.name][b]
        kt = torch.as_tensor(z).reshape(1, -1)
        with torch.no_grad():
            kz = sad.K.apply(kt, ctx.env)[0]
            c = sad.offset(dict(ins), ctx.env)
            c = np.zeros(sad.w.size) if c is None else c.reshape(-1).numpy()
            ktw = sad.K.adjoint(torch.as_tensor(w).reshape(1, -1), ctx.env)[0].numpy()
        kzc = kz.numpy() + c
        # p(z*) = G(z*) − min_w [H(w) − ⟨Kz* + c, w⟩]
        s1, v1, w_best = _min_plus_linear(sad.H, -kzc, None, 1.0, ins, ctx.env, ctx.opts,
                                          ctx.report.notes)
        # d(w*) = ⟨c, w*⟩ − H(w*) + min_z [G(z) + ⟨Kᵀw*, z⟩]
        s2, v2, z_best = _min_plus_linear(sad.G, ktw, None, 1.0, ins, ctx.env, ctx.opts,
                                          ctx.report.notes)
        if s1 != cp.OPTIMAL or s2 != cp.OPTIMAL:
            ctx.report.failures.append(f"sample {b}: primal/dual reference not solved "
                                       f"({s1}, {s2})")
            return
        gz = _value(sad.G, {sad.z.name: z}, ins, ctx.env)
        hw = _value(sad.H, {sad.w.name: w}, ins, ctx.env)
        p = gz - v1
        d = float(c @ w) - hw + v2
        gap = (p - d) / max(1.0, abs(p))
        ctx.measure("duality gap", b, gap)
        zz = np.concatenate([z, w])
        ref = np.concatenate([z_best, w_best])
        err = float(np.linalg.norm(zz - ref)) / max(float(np.linalg.norm(ref)), 1e-3)
        mu_g, mu_h = sad.moduli()
        if mu_g > 0 and mu_h > 0:  # unique best responses: they are the saddle point
            ctx.measure("best-response rel. error", b, err)
            if not err <= math.sqrt(ctx.report.tolerance):
                ctx.report.failures.append(f"sample {b}: best responses differ from the layer's "
                                           f"saddle point by {err:.3e}")
        if not (-ctx.report.tolerance <= gap <= ctx.report.tolerance):
            ctx.report.failures.append(f"sample {b}: duality gap (p(z*) − d(w*))/max(1,|p|) = "
                                       f"{gap:.3e} outside ±{ctx.report.tolerance:g}")


#: the references ``check_inclusion`` runs (each where ``applies``)
INCLUSION_REFERENCES: list[InclusionReference] = [GapReference(), LcpReference(),
                                                   DualityGapReference()]


def handles(source: Any) -> bool:
    """True if ``source`` is verified by these references rather than the objective ones."""
    return any(r.applies(source) for r in INCLUSION_REFERENCES)
