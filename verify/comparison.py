"""The rules every point reference shares (docs/theory.md §9): relative state error and
objective gap against the reference, the error bound of an unconverged tight solve, and the
independent stationarity residual of the layer's state with its allowance."""

from __future__ import annotations

import math

import numpy as np
import torch

from convex_eq.errors import ConvexEqError
from convex_eq.objective import Objective

from .context import CheckContext, batch_coupled
from .lifting import lift, lift_batch
from .report import worst
from .unwind import unwind


def check_rel_gap(ctx: CheckContext, rel_tol: float, gap: bool = True) -> None:
    """Relative state error and objective gap vs the reference.  For a convex claim (``gap``)
    a sample whose state differs but whose objective equals the reference's (gap ≤ tol) and
    which is independently stationary (≤ tol) is *a* minimizer of a convex objective with a
    non-unique argmin: the state error is then reported, not failed (e.g. f_hardtanh =
    ι([-1, 1]ⁿ): every point of the box is a minimizer).  Below ``distinct_minimizer`` the
    difference is numerical: it is then accepted only where the layer is at least as
    stationary as a numeric reference (a flat minimum that the reference, the less accurate of
    the two, approached from elsewhere)."""
    if gap:
        _mark_non_unique_argmin(ctx, rel_tol)
    unresolved_equilibrium(ctx, rel_tol)
    errs = [s.rel_error for s in ctx.samples if s.rel_error is not None
            and not (gap and s.argmin_not_unique) and not s.unresolved]
    if errs:
        w = worst(errs)
        ctx.rule("rel_error", w <= rel_tol,
                 f"relative error {w:.3e} > {rel_tol:g} (layer vs reference)")
    gaps = [abs(s.gap) for s in ctx.samples if s.gap is not None]
    if gap and gaps:
        w = worst(gaps)
        ctx.rule("gap", w <= ctx.tols.gap, f"objective gap {w:.3e} > {ctx.tols.gap:g}")


def _mark_non_unique_argmin(ctx: CheckContext, rel_tol: float) -> None:
    """Flag the samples that are another minimizer of a convex objective (``check_rel_gap``)."""
    t = ctx.tols
    for s in ctx.samples:
        if (s.rel_error is not None and s.rel_error > rel_tol and s.gap is not None
                and abs(s.gap) <= t.gap and s.stationarity is not None
                and s.stationarity <= t.stationarity
                and (s.rel_error > t.distinct_minimizer
                     or (s.reference_stationarity is not None
                         and s.stationarity <= s.reference_stationarity))):
            what = ("the convex objective's argmin is not a single point here"
                    if s.rel_error > t.distinct_minimizer else
                    "a flat minimum: the layer's point is the more stationary one")
            s.notes.append(f"state differs from the reference (relative error "
                           f"{s.rel_error:.2e}) but has its objective value (gap {s.gap:.1e}) "
                           f"and is stationary ({s.stationarity:.1e}): {what}")
            s.argmin_not_unique = True


def unresolved_equilibrium(ctx: CheckContext, rel_tol: float) -> None:
    """A tight solve that stopped above its tolerance leaves the state only
    ``r·max(1,||z||)/(1 − c)``-accurate (``r`` its residual, ``c < 1`` the contraction bound):
    a state error within that bound is verify's own inaccuracy, reported as "equilibrium not
    accurate enough to compare", never as a layer-vs-reference error."""
    if ctx.eq is None or ctx.eq.converged:
        return
    try:
        c = float(ctx.derived.contraction.value(ctx.env))
    except (ConvexEqError, TypeError, ValueError, RuntimeError):
        return
    if not c < 1:
        return
    for s in ctx.samples:
        if s.rel_error is None or s.rel_error <= rel_tol or s.argmin_not_unique:
            continue
        zn = float(np.linalg.norm(ctx.layer_flat(s.index)))
        bound = s.residual * max(1.0, zn) / (1.0 - c)
        if s.abs_error is not None and s.abs_error <= bound * (1 + 1e-6):  # + round-off
            s.unresolved = True
            s.notes.append(f"state error {s.abs_error:.2e} is within the error bound "
                           f"{bound:.2e} = r·max(1,||z||)/(1 − c) of the tight solve "
                           f"(r = {s.residual:.1e}, c = {c:.6f}): not a layer error")
    bad = [s.index for s in ctx.samples if s.unresolved]
    if bad:
        ctx.rule("equilibrium", False, f"equilibrium not accurate enough to compare: the "
                 f"tight solve stopped above its tolerance and the state error of "
                 f"sample(s) {bad} is within its error bound r/(1 − c)")


def check_stationarity(ctx: CheckContext) -> None:
    """The rule on the samples' independent stationarity residuals (skipped where Theorem 2's
    gradient form already rules on them)."""
    if "inclusion_gradient-form" in ctx.rules:
        return
    # a state accepted with fixed-point residual r (≤ the residual tolerance) is only
    # r-accurate, so its stationarity residual is allowed 10·r (a Lipschitz factor of the
    # unit-step forward–backward map); a wrong T, exactly at its own fixed point (r ≈ 0),
    # still faces the full tolerance
    tol = ctx.tols.stationarity
    allowed = [max(tol, 10.0 * s.residual) if math.isfinite(s.residual) else tol
               for s in ctx.samples]
    stats = [(s.stationarity, a) for s, a in zip(ctx.samples, allowed)
             if s.stationarity is not None]
    if stats:
        bad = [(v, a) for v, a in stats if not v <= a]
        v, a = bad[0] if bad else (worst([v for v, _ in stats]), tol)
        ctx.rule("stationarity", not bad, f"independent stationarity residual {v:.3e} > {a:g}")


def independent_stationarity(ctx: CheckContext, obj: Objective, b: int) -> float | None:
    """Projected gradient of the lifted objective at the layer's state (autograd); for ``φ∘A``
    at ``u = A(z)`` on ``φ`` (whose potentials then act on plain states)."""
    uw = unwind(obj, ctx.env)  # φ∘A∘B… and λM^μ_φ: down to the innermost φ at u = A(…z)
    obj = uw.inner
    zs = uw.forward({k: v.detach().to(torch.float64).numpy() for k, v in ctx.states.items()})
    env = ctx.env_for(obj)
    if batch_coupled(obj):
        # batch-coupled terms (decorrelation, HSIC): the objective is one function of the
        # whole batch; sample b's rows of its forward–backward residual
        pb = lift_batch(obj, ctx.inputs, env)
        vb = pb.lift_point(zs)
        if vb is None:
            return None
        if not math.isfinite(pb.value(vb)):
            return math.inf
        g = pb.smooth_grad(vb, raw=True)
        if not np.all(np.isfinite(g)):
            return math.inf
        r, vr = pb.rows(vb - pb.prox_step(vb - g))[b], pb.rows(vb)[b]
        return float(np.linalg.norm(r)) / max(1.0, float(np.linalg.norm(vr)))
    p = lift(obj, ctx.sample_inputs_t(b), env)
    v = p.lift_point({k: a[b] for k, a in zs.items()})
    if v is None:
        return None
    return p.projected_gradient(v) / max(1.0, float(np.linalg.norm(v)))
