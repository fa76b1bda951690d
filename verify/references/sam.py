"""The SAM reference (docs/theory.md §6, Theorem 5): ``argmin_{Fix T} R`` with ``Fix T = argmin φ``,
as the limit of the Tikhonov path ``z(ε) = argmin φ + εR`` (ε → 0), each an ordinary strongly
convex CVXPY solve; the estimated error of the point kept is the reference's stated accuracy."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cvxpy as cp
import numpy as np

from convex_eq.errors import ShapeError
from convex_eq.objective import Objective

from ..comparison import check_rel_gap
from ..conic import CvxpyOutcome, cvxpy_reference, solve_exported, solver_tolerances
from ..context import CheckContext, flat
from ..report import ReferenceInfo, worst
from .base import Situation


@dataclass
class SamOutcome(CvxpyOutcome):
    """The SAM reference at one sample: the Tikhonov point ``z(ε_K)`` kept and its estimated
    error ``||z(ε_K) − z(ε_{K−1})||`` (absolute; NaN unless two weights solved)."""

    eps: float = math.nan
    error: float = math.nan
    levels: list[tuple[float, str]] = field(default_factory=list)


#: Tikhonov weights ``ε`` of ``φ + ε R``, largest first (ratio 10)
SAM_LEVELS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)


def sam_reference(phi: Objective, R: Objective, inputs: Mapping[str, np.ndarray],
                  env: Mapping[str, Any], opts: Mapping[str, Any],
                  levels: tuple[float, ...] = SAM_LEVELS) -> SamOutcome:
    """``argmin_{z ∈ Fix T} R(z)``, ``Fix T = argmin φ``, as the limit of the Tikhonov path
    ``z(ε) = argmin φ + ε R`` (ε → 0; φ convex, R strongly convex).

    Each ``φ + ε R`` is an ordinary, strongly convex CVXPY problem — well posed, unlike the
    value-function form ``min R s.t. φ ≤ min φ + δ`` whose constraint is degenerate (no
    Slater point).  ``z(ε) → z*`` like ``ε^p`` (``p = 1`` when φ grows quadratically off its argmin,
    e.g. any convex quadratic), so with ratio 10 between weights the error of ``z(ε_k)`` is
    at most ``||z(ε_k) − z(ε_{k−1})||`` for any ``p ≥ log 2 / log 10``.  The weight kept is the
    one with the smallest such difference (at tiny ε the solver's ``tol/ε`` error takes over):
    that difference is the stated accuracy.  Fewer than two solved weights: a failure."""
    first = cvxpy_reference(phi, inputs, env, opts)
    if not first.ok:
        return SamOutcome(first.status, first.solver, False, message=first.message,
                          options=dict(opts))
    e_phi = first.exported
    assert e_phi is not None
    r_inputs = {s.name: inputs[s.name] for s in R.inputs}
    r_env = {s.name: env[s.name] for s in R.symbols if s.name in env}
    e_r = R.to_cvxpy(**r_inputs, **r_env)
    cons = list(e_phi.problem.constraints) + list(e_r.problem.constraints)
    for k, m in e_r.state_maps.items():
        if k not in e_phi.state_maps:
            raise ShapeError(f"SAM objective R uses state '{k}' that the layer does not have",
                             term="sam_reference")
        cons.append(m @ e_r.variable == e_phi.state_maps[k] @ e_phi.variable)
    phi_expr, r_expr = e_phi.problem.objective.args[0], e_r.problem.objective.args[0]
    path: list[tuple[float, dict[str, np.ndarray], float]] = []
    tried: list[tuple[float, str]] = []
    status, solver, msg = "not solved", str(opts.get("solver")), ""
    for eps in levels:
        prob = cp.Problem(cp.Minimize(phi_expr + eps * r_expr), cons)
        status, solver, msg = solve_exported(e_phi, opts, prob)
        tried.append((eps, status))
        if status != cp.OPTIMAL:
            continue
        f = np.asarray(e_phi.variable.value, dtype=np.float64)
        r_val = float(r_expr.value) + e_r.constant
        path.append((eps, {k: m @ f for k, m in e_phi.state_maps.items()}, r_val))
    diffs = []
    for (e0, z0, _), (e1, z1, _) in itertools.pairwise(path):
        if abs(e0 / e1 - 10.0) <= 1e-9 * 10.0:  # consecutive weights only
            diffs.append((math.sqrt(sum(float(np.sum((z1[k] - z0[k]) ** 2)) for k in z1)), e1))
    if not diffs:
        return SamOutcome(status if not path else "path too short", solver, False,
                          exported=e_phi, message=msg, levels=tried, options=dict(opts))
    err, eps = min(diffs)
    _, states, value = next(p for p in path if p[0] == eps)
    return SamOutcome(cp.OPTIMAL, solver, True, states=states, value=value, exported=e_phi,
                      message=msg, options=dict(opts), eps=eps, error=err, levels=tried)


def run_sam(ctx: CheckContext, obj: Objective) -> None:
    """Compare every sample's SAM equilibrium with the Tikhonov-path point, when that point is
    accurate to a tenth of the SAM tolerance."""
    cfg = ctx.module.sam  # type: ignore[union-attr]
    env = ctx.env_for(obj)
    outs = [sam_reference(obj, cfg.R, ctx.sample_inputs_np(b), env, ctx.opts)
            for b in range(ctx.bsz)]
    epss = [o.eps for o in outs if o.ok]
    ctx.ref = ReferenceInfo(
        "sam", "argmin_(Fix T) R as the limit of the Tikhonov path z(ε) = argmin φ + ε R "
        "(ε = 1e-2 … 1e-7, each an ordinary strongly convex CVXPY solve), Fix T = argmin φ; "
        "the ε kept (" + (f"{max(epss):.0e}" if epss else "n/a") + ") minimizes the "
        "estimated error ||z(ε) − z(10ε)||, stated as the reference accuracy",
        outs[0].solver, [o.status for o in outs],
        {**{f"stage1 {k}": v for k, v in solver_tolerances(ctx.opts).items()},
         **{f"stage2 {k}": v for k, v in solver_tolerances(outs[-1].options).items()}})
    bad = [b for b, o in enumerate(outs) if not o.ok]
    if bad:
        o = outs[bad[0]]
        ctx.ref.ok = False
        ctx.ref.failure = f"status {o.status}"
        ctx.rule("reference", False, f"reference solver failed: {o.solver} status "
                 f"'{o.status}' on sample(s) {bad} (weights tried: "
                 + ", ".join(f"ε={d:.0e} {st}" for d, st in o.levels) + ") — not compared")
        return
    refs, accs = [], []
    for b, o in enumerate(outs):
        s = ctx.samples[b]
        r = flat(o.states, ctx.compare_names)
        refs.append(r)
        ctx.compare(b, r)
        acc = o.error / max(float(np.linalg.norm(r)), ctx.tols.scale_floor)
        accs.append(acc)
        s.status = o.status
        s.notes.append(f"SAM reference at ε = {o.eps:.0e}: estimated relative accuracy "
                       f"{acc:.1e}")
        s.label = "argmin over Fix T of R (Theorem 5)"
    ctx.ref.tolerances["estimated reference accuracy (relative)"] = worst(accs)
    # a reference whose own error is not ≤ tol/10 cannot decide a comparison at tol
    ok = worst(accs) <= 0.1 * ctx.tols.sam
    ctx.rule("reference", ok, f"reference not accurate enough: estimated relative error "
             f"{worst(accs):.2e} > {0.1 * ctx.tols.sam:g} (a tenth of the SAM tolerance) — "
             "not compared")
    if not ok:
        ctx.ref.ok = False
        return
    ctx.z_ref = np.stack(refs)
    ctx.label = "argmin over Fix T of R (Theorem 5)"
    check_rel_gap(ctx, ctx.tols.sam, gap=False)


class SamReference:
    """SAM modules: ``argmin_{Fix T} R`` by the Tikhonov path (docs/theory.md §6)."""

    kind = "sam"

    def applies(self, s: Situation) -> bool:
        """A SAM module (its claim is Theorem 5's, whatever the objective)."""
        return s.sam

    def answers(self, requested: str, s: Situation) -> bool:
        """``auto`` or ``cvxpy`` (the Tikhonov path is solved by CVXPY)."""
        return requested in ("auto", "cvxpy")

    def scope(self, s: Situation) -> str:
        return ("a SAM module is verified against the Tikhonov path of argmin over Fix T of R, "
                "solved by CVXPY (Theorem 5)")

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Compare the SAM equilibrium with the selected fixed point."""
        run_sam(ctx, source)
