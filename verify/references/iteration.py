"""The reference for a fixed point of an iteration that recomputes a parameter from the state
(GEQ's bandwidth ``γ(x, z)``, claim "fixed point of the iteration", docs/theory.md §3.2 and
§9.3).  Such a layer claims no stationary point of one objective, so none is checked.  Per
sample ``b``:

1. the fixed-point residual ``||z* − T(z*)||`` (the check's first step: the claim itself);
2. the parameters at the layer's state, e.g. ``γ̄_b = γ(x_b, z*_b)``, by the terms' own rule;
3. the objective ``G(·; x_b, γ̄_b)`` with those parameters frozen (``Term.frozen_at``) and its
   independent stationarity residual at ``z*_b`` (projected gradient of the lifted objective,
   autograd of the terms' *values*, not the layer's gradient rules): a fixed point of the
   iteration is stationary there, so a wrong ``T`` (a wrong gradient rule, a parameter read
   from the wrong place) fails it.

No reference point is computed (the module's output is judged against the tight equilibrium
and its own fixed-point residual, docs/theory.md §9.5); the label is "fixed point of the
iteration", never "stationary point" or "local minimizer"."""

from __future__ import annotations

import math
from typing import Any

import torch

from convex_eq.objective import Objective

from ..comparison import check_stationarity, independent_stationarity
from ..context import CheckContext
from ..report import ReferenceInfo
from .base import Situation

#: the claim kind this reference verifies (``lowering.trace.ClaimKind.ITERATION``)
ITERATION = "fixed point of the iteration"


def frozen_objectives(ctx: CheckContext, obj: Objective) -> list[Objective]:
    """Per sample, ``obj`` with every state-dependent parameter frozen at its value at the
    layer's state."""
    values: dict[str, torch.Tensor] = {**ctx.inputs, **ctx.states}
    env = ctx.env_for(obj)
    per_term = {id(t): t.frozen_at(values, env) for t in obj.terms if t.state_parameters()}
    return [Objective([per_term[id(t)][b] if id(t) in per_term else t for t in obj.terms],
                      name=obj.name) for b in range(ctx.bsz)]


def run_iteration(ctx: CheckContext, obj: Objective) -> None:
    """Label every sample by its residual and its stationarity at the frozen parameters."""
    for b, frozen in enumerate(frozen_objectives(ctx, obj)):
        s = ctx.samples[b]
        s.stationarity = independent_stationarity(ctx, frozen, b)
        fixed = s.residual <= ctx.tols.residual
        consistent = s.stationarity is not None and s.stationarity <= max(
            ctx.tols.stationarity, 10.0 * s.residual if math.isfinite(s.residual) else 0.0)
        s.label = ITERATION if fixed and consistent else (
            "not a fixed point of the iteration" if not fixed
            else "not stationary at its frozen parameters")
        s.status = "frozen parameters from the layer's state"
    ctx.label = ITERATION if all(s.label == ITERATION for s in ctx.samples) else \
        next(s.label for s in ctx.samples if s.label != ITERATION)
    ctx.ref = ReferenceInfo(
        "iteration", "fixed point of the iteration: its residual, and the stationarity of the "
        "objective with the state-dependent parameters frozen at the layer's state (projected "
        "gradient, autograd of the terms' values)", "torch autograd (float64)",
        [s.status for s in ctx.samples], {"stationarity": ctx.tols.stationarity})
    ctx.rules["reference"] = True
    check_stationarity(ctx)
    ctx.notes.append("a parameter is recomputed from the state in every iteration: the "
                     "equilibrium is verified as a fixed point of that iteration and as a "
                     "stationary point of the objective at its own frozen parameters; it is not "
                     "claimed, and not checked, to be a stationary point of the objective with "
                     "the parameter varying")


class IterationReference:
    """A fixed point of an iteration with state-dependent parameters (module docstring)."""

    kind = "iteration"

    def applies(self, s: Situation) -> bool:
        """The claim is a fixed point of the iteration (an objective source)."""
        return s.claim_kind == ITERATION and s.family == "objective"

    def answers(self, requested: str, s: Situation) -> bool:
        """``auto`` only: the other references verify stationary points or minimizers."""
        return requested == "auto"

    def scope(self, s: Situation) -> str:
        return ("the claim is a fixed point of an iteration that recomputes a parameter from "
                "the state: it is verified by its residual and by stationarity at the frozen "
                "parameters; the local, numeric and CVXPY references verify stationary points "
                "and minimizers of one objective, which this layer does not claim")

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Run the iteration reference."""
        run_iteration(ctx, source)
