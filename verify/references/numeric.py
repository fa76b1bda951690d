"""The certified-convex numeric reference (docs/theory.md §9.2): convex objectives that are not
DCP (tanh / sigmoid / softplus potentials, Corollary 1 envelopes of ``ψ* − ½||·||²``) minimized
by scipy on the lifted objective with exact gradients, from a start independent of the layer;
stationarity of a convex objective proves global optimality."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convex_eq.objective import Objective

from ..comparison import check_rel_gap, check_stationarity, independent_stationarity
from ..context import CheckContext, flat
from ..lifting import LiftedProblem, lift
from ..optimize import MinResult, minimize
from ..report import ReferenceInfo, worst
from ..values import objective_value
from .base import Situation

T64 = torch.float64


@dataclass
class NumericOutcome:
    """Certified-convex numeric reference at one sample."""

    states: dict[str, np.ndarray]
    value: float
    stationarity: float
    result: MinResult
    problem: LiftedProblem


def numeric_reference(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Mapping[str, Any]
                      ) -> NumericOutcome:
    """Minimize the lifted objective from a deterministic interior start (independent of the
    layer); ``stationarity = ||v - P(v - ∇F(v))|| / max(1, ||v||)``."""
    pc = getattr(obj, "precomposition", None)
    if pc is not None:
        # φ∘A with A(z) = Mz + c: minimize φ itself (its potentials' domains are boxes in u),
        # then z_ref = M⁻¹(u_ref - c); A(z*) ∈ argmin φ is exactly the claim
        inner = numeric_reference(pc.inner, inputs, env)
        m = pc.M.resolve(env).detach().to(T64).numpy()
        u = inner.states[pc.old.name]
        if pc.c is not None:
            u = u - pc.c.resolve(env).detach().to(T64).numpy().reshape(-1)
        z = np.linalg.solve(m, u)
        return NumericOutcome({pc.new.name: z}, inner.value, inner.stationarity, inner.result,
                              lift(obj, inputs, env))
    p = lift(obj, inputs, env)
    res = minimize(p, p.start_point(), polish=True)
    stat = res.pg / max(1.0, float(np.linalg.norm(res.v)))
    return NumericOutcome(p.states(res.v), res.f, stat, res, p)


def run_numeric(ctx: CheckContext, obj: Objective, label: str) -> None:
    """Compare every sample with the numeric minimizer of ``obj``; the reference counts only
    where it is stationary to ``reference_stationarity``."""
    env = ctx.env_for(obj)
    refs, stats, methods = [], [], set()
    for b in range(ctx.bsz):
        out = numeric_reference(obj, ctx.sample_inputs_t(b), env)
        s = ctx.samples[b]
        r = flat(out.states, ctx.compare_names)
        refs.append(r)
        ctx.compare(b, r)
        s.reference_objective = out.value
        g = objective_value(obj, ctx.layer_state(b), ctx.sample_inputs_np(b), env,
                            lifted=out.problem)
        s.objective = g
        s.gap = None if g is None else (g - out.value) / max(1.0, abs(out.value))
        s.reference_stationarity = out.stationarity
        if s.stationarity is None:
            s.stationarity = independent_stationarity(ctx, obj, b)
        s.status = "stationary" if out.stationarity <= ctx.tols.reference_stationarity \
            else "not stationary"
        s.label = label
        stats.append(out.stationarity)
        methods.add(out.result.method)
    ctx.ref = ReferenceInfo(
        "numeric", "certified-convex numeric reference: the lifted objective minimized "
        "from an interior start, independent of the layer", " / ".join(sorted(methods)),
        [s.status for s in ctx.samples],
        {"gtol": 1e-12, "ftol": 1e-16, "newton_stop": 1e-14}, 1)
    w = worst(stats)
    ok = w <= ctx.tols.reference_stationarity
    ctx.ref.ok = ok
    ctx.rule("reference_stationarity", ok, f"reference solver failed: numeric reference "
             f"not stationary (projected gradient {w:.3e} > "
             f"{ctx.tols.reference_stationarity:g}) — not a certified minimizer")
    ctx.rules["reference"] = ok
    ctx.z_ref = np.stack(refs)
    ctx.label = label
    check_rel_gap(ctx, ctx.tols.rel_error)
    check_stationarity(ctx)


def note_modified_minimizer(ctx: CheckContext, s: Situation) -> None:
    """A modified-minimizer claim: say which objective the reference minimizes."""
    if s.claim_kind == "modified minimizer":
        ctx.notes.append("modified minimizer: the reference minimizes the objective the "
                         f"prox-variant edit really has, {ctx.derived.claim.objective_text}")


class NumericReference:
    """Convex by curvature, not DCP: an independent scipy minimization (docs/theory.md §9.2)."""

    kind = "numeric"

    def applies(self, s: Situation) -> bool:
        """Asked for by name (``reference="numeric"``) on a certified convex claim."""
        return s.requested == "numeric"

    def answers(self, requested: str, s: Situation) -> bool:
        """``numeric`` only (``auto`` takes it where CVXPY cannot export the objective)."""
        return requested == "numeric"

    def scope(self, s: Situation) -> str:
        return "the numeric reference verifies minimizers of certified-convex objectives"

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Minimize numerically, compare, and note a modified-minimizer claim."""
        run_numeric(ctx, source, f"{s.claim_kind} (convex, numeric reference)")
        note_modified_minimizer(ctx, s)
