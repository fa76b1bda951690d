"""The CVXPY reference (docs/theory.md §9.1): the claim objective exported per sample and solved
at tight tolerances; a point that disagrees with the layer is refined from where CVXPY left it
(never replaced by the layer's), and a status other than ``optimal`` is never compared."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from convex_eq.errors import ConvexEqError, ExportError
from convex_eq.objective import Objective

from ..comparison import check_rel_gap, check_stationarity, independent_stationarity
from ..conic import CvxpyOutcome, cvxpy_reference, solver_tolerances
from ..context import CheckContext, flat
from ..lifting import lift
from ..optimize import minimize
from ..report import ReferenceInfo
from ..unwind import unwind
from ..values import objective_value
from .base import Situation
from .numeric import note_modified_minimizer, numeric_reference, run_numeric

#: projected gradient below which a CVXPY point is refined by local minimization (a point
#: farther from stationarity is a solver failure, reported and never compared)
POLISH_FROM = 1e-4


def polish_reference(ctx: CheckContext, obj: Objective, b: int,
                     states: Mapping[str, np.ndarray]
                     ) -> tuple[dict[str, np.ndarray], float, float] | None:
    """Polish a CVXPY point: local minimization of the lifted claim objective *from the CVXPY
    point* (independent of the layer).  Interior-point solvers are only ~sqrt(gap)-accurate at
    degenerate minimizers (``z* = 0`` on ``z ≥ 0`` with a zero multiplier: ~3e-6 at gap 1e-11).
    The polished point replaces the CVXPY one only if it is at least as good and more
    stationary, and only starting from a point already near-stationary (projected gradient
    ≤ ``POLISH_FROM``).  Returns ``(states, projected gradient before, after)``; None where
    not applicable."""
    # φ∘A: polish φ at u = A(z), map back z = A⁻¹(u); λM^μ_φ: polish φ (same argmin)
    uw = unwind(obj, ctx.env)
    inner = uw.inner
    st = uw.forward({k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in states.items()})
    try:
        p = lift(inner, ctx.sample_inputs_t(b), ctx.env_for(inner))
        v0 = p.lift_point(st)
        if v0 is None or p.n > 512 or p.coupled:  # Newton polish: O(n) gradients
            return None
        f0, pg0 = p.value(v0), p.projected_gradient(v0)
        if not pg0 <= POLISH_FROM:  # refine a near-optimal point only, never replace one
            return None
        res = minimize(p, v0)
    except (ConvexEqError, ValueError, RuntimeError):
        return None
    if not (res.success and res.pg < pg0 and res.f <= f0 + 1e-12 * max(1.0, abs(f0))):
        return None
    return uw.backward(p.states(res.v)), pg0, res.pg


def second_reference(ctx: CheckContext, obj: Objective, b: int, o: CvxpyOutcome,
                     r: np.ndarray) -> np.ndarray:
    """A CVXPY point that disagrees and cannot be polished (its lifted variables are not
    determined by the state, e.g. a conjugate's dual with ``Mᵀ`` not injective): the
    certified-convex numeric reference, a second method from its own start, replaces it only
    if it is stationary to the reference tolerance and at least as good in value (interior
    points are ~√gap-accurate at a degenerate minimizer).  Returns the point compared with."""
    s = ctx.samples[b]
    try:
        num = numeric_reference(obj, ctx.sample_inputs_t(b), ctx.env_for(obj))
    except (ConvexEqError, ValueError, RuntimeError, np.linalg.LinAlgError):
        return r
    if not (num.stationarity <= ctx.tols.reference_stationarity and math.isfinite(num.value)
            and num.value <= o.value + 1e-9 * max(1.0, abs(o.value))):
        return r
    r2 = flat(num.states, ctx.compare_names)
    before = s.rel_error
    ctx.compare(b, r2)
    s.notes.append(f"CVXPY point (relative error {before:.2e}) not polishable; compared "
                   f"with the certified-convex numeric reference instead (stationary to "
                   f"{num.stationarity:.1e}, value {num.value - o.value:+.1e} vs CVXPY)")
    return r2


def run_cvxpy(ctx: CheckContext, obj: Objective, label: str) -> bool:
    """CVXPY per sample; returns False (nothing recorded) if the objective is not DCP and the
    caller may fall back to the numeric reference (``reference="auto"``)."""
    env = ctx.env_for(obj)
    outs = _solve_samples(ctx, obj, env)
    if outs is None:
        return False
    if not outs:  # forced CVXPY on an objective it cannot take: recorded as a failure
        return True
    _polish_inaccurate(ctx, obj, outs, env)
    bad = _record_provenance(ctx, obj, outs)
    refs = _compare_samples(ctx, obj, outs, env, label)
    if not bad:
        ctx.z_ref = np.stack(refs)
        ctx.label = label
        check_rel_gap(ctx, ctx.tols.rel_error)
    check_stationarity(ctx)
    return True


def _solve_samples(ctx: CheckContext, obj: Objective, env: dict[str, Any]
                   ) -> list[CvxpyOutcome] | None:
    """One CVXPY solve per sample; None (with a note) when the objective is not DCP under
    ``"auto"``; ``[]`` (with a failed ``reference`` rule) when CVXPY was asked for by name."""
    outs: list[CvxpyOutcome] = []
    for b in range(ctx.bsz):
        try:
            outs.append(cvxpy_reference(obj, ctx.sample_inputs_np(b), env, ctx.opts))
        except ExportError as err:
            if ctx.requested == "auto":
                ctx.notes.append(f"not DCP-exportable ({err.reason}): using the "
                                 "certified-convex numeric reference (docs/theory.md §9.2)")
                return None
            ctx.ref = ReferenceInfo("cvxpy", "CVXPY", ok=False,
                                    failure=f"not DCP-exportable: {err}")
            ctx.rule("reference", False, f"reference unavailable: not DCP-exportable "
                     f"({err.reason})")
            return []
    return outs


def _polish_inaccurate(ctx: CheckContext, obj: Objective, outs: list[CvxpyOutcome],
                       env: dict[str, Any]) -> None:
    """An ``optimal_inaccurate`` interior point polished to reference stationarity counts as
    solved (its value recomputed at the polished point)."""
    for b, o in enumerate(outs):
        if not (o.status == "optimal_inaccurate" and o.states):
            continue
        polished = polish_reference(ctx, obj, b, o.states)
        if polished is None or not polished[2] <= ctx.tols.reference_stationarity:
            continue
        states, _, pg = polished
        val = objective_value(obj, states, ctx.sample_inputs_np(b), env, exported=o.exported,
                              opts=ctx.opts)
        if val is not None and math.isfinite(val):
            o.states, o.value, o.ok = states, val, True
            o.status = "optimal_inaccurate → polished"
            ctx.samples[b].notes.append(
                f"CVXPY returned optimal_inaccurate; its point was polished by local "
                f"minimization to projected gradient {pg:.1e}")


def _record_provenance(ctx: CheckContext, obj: Objective, outs: list[CvxpyOutcome]
                       ) -> list[int]:
    """The reference record and rule; returns the samples whose solve failed."""
    solver = outs[0].solver if outs else ""
    ctx.ref = ReferenceInfo("cvxpy", f"CVXPY on {obj.name or 'the claim objective'}"
                            f" ({len(outs)} exported instance(s))", solver,
                            [o.status for o in outs], solver_tolerances(ctx.opts))
    bad = [b for b, o in enumerate(outs) if not o.ok]
    if bad:
        o = outs[bad[0]]
        ctx.ref.ok = False
        ctx.ref.failure = f"status {o.status}"
        ctx.rule("reference", False, f"reference solver failed: {o.solver} status "
                 f"'{o.status}' on sample(s) {bad}" + (f" ({o.message})" if o.message else "")
                 + " — not compared")
    else:
        ctx.rules["reference"] = True
    return bad


def _compare_samples(ctx: CheckContext, obj: Objective, outs: list[CvxpyOutcome],
                     env: dict[str, Any], label: str) -> list[np.ndarray]:
    """State error, objective gap and stationarity of every solved sample; a disagreeing
    point is polished, or checked by a second method, before it is compared."""
    refs = []
    for b, o in enumerate(outs):
        s = ctx.samples[b]
        s.status = o.status
        if not o.ok:
            s.notes.append(f"reference {o.status}: not compared")
            continue
        r = flat(o.states, ctx.compare_names)
        ctx.compare(b, r)
        if s.rel_error > ctx.tols.rel_error:
            r = _refine(ctx, obj, b, o, r)
        refs.append(r)
        s.reference_objective = o.value
        g = objective_value(obj, ctx.layer_state(b), ctx.sample_inputs_np(b), env,
                            exported=o.exported, opts=ctx.opts)
        s.objective = g
        s.gap = None if g is None else (g - o.value) / max(1.0, abs(o.value))
        if s.stationarity is None:
            s.stationarity = independent_stationarity(ctx, obj, b)
        s.label = label
    return refs


def _refine(ctx: CheckContext, obj: Objective, b: int, o: CvxpyOutcome, r: np.ndarray
            ) -> np.ndarray:
    """The point sample ``b`` is compared with after polishing (or a second method)."""
    s = ctx.samples[b]
    polished = polish_reference(ctx, obj, b, o.states)
    if polished is not None:
        states, pg0, pg1 = polished
        r = flat(states, ctx.compare_names)
        before = s.rel_error
        ctx.compare(b, r)
        s.notes.append(f"CVXPY point polished (projected gradient {pg0:.1e} → {pg1:.1e}); "
                       f"relative error {before:.2e} before polishing")
        return r
    if s.rel_error <= ctx.tols.distinct_minimizer:  # a numerical disagreement
        return second_reference(ctx, obj, b, o, r)
    return r


class CvxpyReference:
    """Certified convex claims: CVXPY at tight tolerances (docs/theory.md §9.1)."""

    kind = "cvxpy"

    def applies(self, s: Situation) -> bool:
        """Every certified convex claim not sent to another reference (``auto``/``cvxpy``)."""
        return True

    def answers(self, requested: str, s: Situation) -> bool:
        """``auto`` or ``cvxpy``."""
        return requested in ("auto", "cvxpy")

    def scope(self, s: Situation) -> str:
        return "CVXPY verifies minimizers of certified-convex, DCP-exportable objectives"

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Solve with CVXPY, or the numeric reference when the objective is not DCP."""
        if not run_cvxpy(ctx, source, s.claim_kind):  # not DCP, "auto": numeric
            run_numeric(ctx, source, f"{s.claim_kind} (convex, numeric reference)")
        note_modified_minimizer(ctx, s)
