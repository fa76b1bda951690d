"""The local reference for non-convex or uncertified claims (docs/theory.md §9.3): multi-start
local minimization of the lifted objective (one start next to the layer's state, the others
random), the independent stationarity residual at the layer's state and a second-order check
there.  The label is "stationary point" or "local minimizer", never "minimizer"."""

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
