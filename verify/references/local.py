"""The references for non-convex claims (docs/theory.md §9.3).

:class:`LocalReference` (non-convex or uncertified claims): multi-start local minimization of
the lifted objective (one start next to the layer's state, the others random), the independent
stationarity residual at the layer's state and a second-order check there.  The label is
"stationary point" or "local minimizer", never "minimizer".

:class:`IterationReference`: a fixed point of an iteration that recomputes a parameter from the
state (GEQ's bandwidth ``γ(x, z)``, claim "fixed point of the iteration", docs/theory.md §3.2).
Such a layer claims no stationary point of one objective, so none is checked.  Per sample ``b``:

1. the fixed-point residual ``||z* − T(z*)||`` (the check's first step: the claim itself);
2. the parameters at the layer's state, e.g. ``γ̄_b = γ(x_b, z*_b)``, by the terms' own rule;
3. the objective ``G(·; x_b, γ̄_b)`` with those parameters frozen (``Term.frozen_at``) and its
   independent stationarity residual at ``z*_b`` (projected gradient of the lifted objective,
   autograd of the terms' *values*, not the layer's gradient rules): a fixed point of the
   iteration is stationary there, so a wrong ``T`` (a wrong gradient rule, a parameter read
   from the wrong place) fails it.

It computes no reference point (the module's output is judged against the tight equilibrium and
its own fixed-point residual, docs/theory.md §9.5); its label is "fixed point of the iteration",
never "stationary point" or "local minimizer"."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convex_eq.objective import Objective

from ..comparison import check_stationarity, independent_stationarity
from ..context import CheckContext, batch_coupled, flat
from ..lifting import LiftedProblem, lift, lift_batch
from ..optimize import MinResult, minimize, second_order
from ..report import ReferenceInfo, SampleResult
from ..unwind import Unwound, unwind
from .base import Situation


@dataclass
class LocalOutcome:
    """Local reference at one sample (non-convex objectives)."""

    starts: int
    solutions: list[MinResult]
    nearest: dict[str, np.ndarray] | None
    nearest_distance: float
    layer_value: float | None
    best_value: float
    stationarity: float | None
    second_order: dict[str, Any] | None
    lifted_layer: np.ndarray | None
    at_layer: int
    problem: LiftedProblem


def local_reference(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Mapping[str, Any],
                    z_layer: Mapping[str, np.ndarray], starts: int, rng: np.random.Generator
                    ) -> LocalOutcome:
    """Multi-start local minimization (one start next to the layer's state, the others random),
    the independent stationarity residual at the layer's state (projected gradient of the
    lifted objective, autograd) and the second-order check there."""
    with np.errstate(all="ignore"):
        return _local_reference(lift(obj, inputs, env), z_layer, starts, rng)


def batch_local_reference(obj: Objective, inputs: Mapping[str, torch.Tensor],
                          env: Mapping[str, Any], z_layer: Mapping[str, np.ndarray],
                          starts: int, rng: np.random.Generator) -> LocalOutcome:
    """``local_reference`` for a batch-coupled objective: one problem over the whole batch
    (``lift_batch``; inputs and ``z_layer`` are ``(B, size)``); states come back ``(B, size)``
    and values are those of the batch objective."""
    with np.errstate(all="ignore"):
        return _local_reference(lift_batch(obj, inputs, env), z_layer, starts, rng)


def _local_reference(p: LiftedProblem, z_layer: Mapping[str, np.ndarray], starts: int,
                     rng: np.random.Generator) -> LocalOutcome:
    v_star = p.lift_point(z_layer)
    inits: list[np.ndarray] = []
    scale = max(1.0, float(np.sqrt(sum(float(np.sum(np.square(v))) for v in z_layer.values()) /
                                   max(1, p.n))))
    if v_star is not None:
        pert = rng.standard_normal(p.n) * 1e-3 * max(1.0, float(np.linalg.norm(v_star))) / \
            math.sqrt(p.n)
        inits.append(v_star + pert)
    while len(inits) < max(1, starts):
        inits.append(p.start_point() + scale * rng.uniform(-1.0, 1.0, p.n))
    sols = [minimize(p, v0, polish=False, gtol=1e-11, maxiter=2000) for v0 in inits]
    zl = np.concatenate([np.asarray(z_layer[s]).reshape(-1) for s in p.top_states])
    best_d, nearest = math.inf, None
    at_layer = 0
    for r in sols:
        zs = p.states(r.v)
        zz = np.concatenate([np.asarray(zs[s]).reshape(-1) for s in p.top_states])
        d = float(np.linalg.norm(zz - zl)) / max(float(np.linalg.norm(zl)), 1e-3)
        at_layer += int(d <= 1e-5)
        if d < best_d:
            best_d, nearest = d, zs
    stat = so_info = None
    layer_value = None
    if v_star is not None:
        stat = p.projected_gradient(v_star) / max(1.0, float(np.linalg.norm(v_star)))
        so_info = second_order(p, v_star)
        layer_value = p.value(v_star)
    finite = [r.f for r in sols if math.isfinite(r.f)]
    return LocalOutcome(len(inits), sols, nearest, best_d, layer_value,
                        min(finite) if finite else math.inf, stat, so_info, v_star, at_layer, p)


def run_local(ctx: CheckContext, obj: Objective) -> None:
    """Run the local reference on every sample and label each one."""
    # φ∘A (and λM^μ_φ): starts, stationarity and second-order check on the innermost φ at
    # u = A(z) — A invertible, so local minimizers and stationary points correspond, and
    # φ's non-smooth terms act on plain variables there (boxes, separable proxes)
    uw = unwind(obj, ctx.env)
    inner = uw.inner
    env = ctx.env_for(inner)
    coupled = batch_coupled(inner)
    whole = None
    if coupled:  # one problem over the whole batch (a coupled term needs every sample)
        whole = batch_local_reference(inner, ctx.inputs, env,
                                      uw.forward({k: v.numpy() for k, v in ctx.states.items()}),
                                      ctx.starts, ctx.rng)
    refs = []
    for b in range(ctx.bsz):
        out = whole if whole is not None else local_reference(
            inner, ctx.sample_inputs_t(b), env, uw.forward(ctx.layer_state(b)), ctx.starts,
            ctx.rng)
        r = _record_sample(ctx, ctx.samples[b], out, uw, coupled)
        if r is not None:
            refs.append(r)
        if coupled:
            # one function of the whole batch: starts, values and the second-order check
            # are those of the batch problem; stationarity is sample b's share of it
            ctx.samples[b].stationarity = independent_stationarity(ctx, obj, b)
            ctx.samples[b].notes.append(
                "batch-coupled objective: local starts, objective values and second-order "
                "check on the whole batch (one problem)")
        _label(ctx, ctx.samples[b], out)
    ctx.ref = ReferenceInfo(
        "local", "local reference: multi-start L-BFGS-B on the lifted objective (one start "
        "next to the layer's state, the others random), stationarity residual and "
        "second-order check (reduced Hessian, strict complementarity)",
        "scipy L-BFGS-B (exact autograd gradients)", [s.status for s in ctx.samples],
        {"gtol": 1e-11, "hessian": "central differences of exact gradients"},
        max(1, ctx.starts))
    ctx.rules["reference"] = True
    ctx.z_ref = np.stack(refs) if len(refs) == ctx.bsz else None
    _conclude(ctx)


def _record_sample(ctx: CheckContext, s: SampleResult, out: LocalOutcome, uw: Unwound,
                   coupled: bool) -> np.ndarray | None:
    """Sample ``s``'s stationarity, distance to the nearest local minimizer (returned, in the
    layer's coordinates), values and second-order verdict."""
    b = s.index
    s.stationarity = out.stationarity
    r = None
    if out.nearest is not None:
        near = {k: v[b] for k, v in out.nearest.items()} if coupled else out.nearest
        r = flat(uw.backward(near), ctx.compare_names)
        ctx.compare(b, r)
    s.objective = out.layer_value
    s.reference_objective = out.best_value
    if out.best_value < -1e100:
        s.notes.append("a start ran off to an unbounded-below direction: G has no "
                       "global minimizer here")
    elif out.layer_value is not None and math.isfinite(out.best_value):
        s.gap = (out.layer_value - out.best_value) / max(1.0, abs(out.best_value))
        if s.gap > ctx.tols.gap:
            s.notes.append(f"a start reached a lower value (by {s.gap:.3e}): the "
                           "equilibrium is not a global minimizer")
    if out.second_order is not None:
        s.lambda_min = out.second_order["lambda_min"]
        s.second_order = out.second_order["verdict"]
    return r


def _label(ctx: CheckContext, s: SampleResult, out: LocalOutcome) -> None:
    """"not stationary" | "local minimizer" | "stationary point", and the starts' status."""
    stationary = s.residual <= ctx.tols.residual and (
        s.stationarity is None or s.stationarity <= ctx.tols.stationarity)
    if not stationary:
        s.label = "not stationary"
    elif s.second_order == "local minimizer":
        s.label = "local minimizer"
    else:
        s.label = "stationary point"
    s.status = f"{out.at_layer}/{out.starts} starts at the layer's state"


def _conclude(ctx: CheckContext) -> None:
    """The check's label from the samples', the stationarity rule, the closing notes."""
    labels = [s.label for s in ctx.samples]
    if "not stationary" in labels:
        ctx.label = "not stationary"
    elif labels and all(lab == "local minimizer" for lab in labels):
        ctx.label = "local minimizer"
    else:
        ctx.label = "stationary point"
    if any(s.stationarity is not None for s in ctx.samples):
        check_stationarity(ctx)
    else:
        ctx.notes.append("independent stationarity residual unavailable (the lifted "
                         "variables are not determined by the state); the fixed-point "
                         "residual is the stationarity certificate")
    ctx.notes.append("non-convex objective: the equilibrium is verified as a stationary "
                     "point (local minimizer where the second-order check is conclusive), "
                     "never as a global minimizer")


class LocalReference:
    """Non-convex or uncertified claims: multi-start local minimization (docs/theory.md §9.3)."""

    kind = "local"

    def applies(self, s: Situation) -> bool:
        """Asked for by name, a non-convex claim, or a convex claim not certified here."""
        return s.requested == "local" or not s.convex_claim or not s.certified

    def answers(self, requested: str, s: Situation) -> bool:
        """``auto`` or ``local``."""
        return requested in ("auto", "local")

    def scope(self, s: Situation) -> str:
        return (f"the claim is '{s.claim_kind}', not a minimizer: it is verified by the local "
                "reference (stationary points); CVXPY and the numeric reference verify "
                "minimizers of certified-convex objectives")

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Run the local reference (a refused ``numeric`` request is noted)."""
        if s.requested == "numeric":
            ctx.notes.append("numeric (convex) reference refused: the objective is not "
                             "certified convex here; using the local reference")
        run_local(ctx, source)


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
