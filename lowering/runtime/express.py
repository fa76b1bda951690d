"""The express call: the common call (one flat finite input of the module's dtype, a planned
layer, eager, no warm start) on its shortest way — the same checks, plan, solver, statistics and
backward strategy as the general call (:mod:`lowering.runtime.call`), without the steps only
other calls need (docs/theory.md §8, the express call)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .backward import FixedPointProblem
from .call import (
    Call,
    adjoint_config,
    attach,
    backward_sink,
    finish,
    plan_layer,
    t_fn,
)
from .grad_mode import grad_off, set_grad_enabled
from .layer import Layer
from .plan import PlanContext, held_builder_of, plan_of


def express_width(m: Layer) -> int:
    """The width of the one flat input when the layer can take the express call, else -1: one
    state block with a plan, one input, no SAM, no unrolled backward, no output map, the state
    itself as the output.  The layer's part is decided once (the node tree does not change;
    ``_plannable`` turns False once a plan is refused); the options are read on every call
    (``config`` is mutable: a field changed in place keeps the same object)."""
    cfg = m.config
    d = m.__dict__
    if cfg.sam is not None or cfg.backward.mode == "unroll" or not d.get("_plannable", True):
        return -1
    width = d.get("_express_spec")
    if width is None:
        derived = m.derived
        blocks, syms = m.blocks, m.input_syms
        outs = derived.output_blocks
        ok = (len(blocks) == 1 and len(syms) == 1 and derived.outputs is None
              and len(outs) == 1 and tuple(outs[0].shape) == (blocks[0].size,))
        width = d["_express_spec"] = syms[0].size if ok else -1
    return width


def express_call(m: Layer, x: torch.Tensor, env: dict[str, torch.Tensor],
                 return_stats: bool, z0: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None) -> Any:
    """The common call.  With the implicit backward and a plan that holds its state-free
    tensors in closed form (``plan.held``: the canonical ``σ(c + zM)``), the problem is posed
    on those tensors (``problem.held``: the implicit strategy differentiates the plan in closed
    form).  None when the input has NaN/Inf or the layer has no plan: nothing was solved, and
    the general call (which reports or masks those samples) takes it with the same ``env``.
    ``z0``, ``ids``: a warm start from the module's cache and the samples' indices there (their
    new equilibria are stored back)."""
    on = torch.is_grad_enabled()  # (grad_off's work inline: every call's first step)
    if on:
        set_grad_enabled(False)
    try:  # one reduction: a finite norm means finite entries
        finite = math.isfinite(float(torch.linalg.vector_norm(x)))
    finally:
        if on:
            set_grad_enabled(True)
    if not finite:
        return None
    d = m.__dict__
    b = x.shape[0]
    if z0 is None:
        z0 = torch.zeros(b, d.get("_state_size") or m.state_size, dtype=x.dtype,
                         device=x.device)
    name = m.input_syms[0].name
    plan = None
    misses = d.get("_held_misses")
    bc = m.config.backward
    if bc.mode == "implicit" and on and (misses is None or b not in misses) \
            and (x.requires_grad or any(t.requires_grad for t in env.values())):
        plan = plan_held(m, name, x, env, z0)
        if plan is None and not d.get("_plannable", True):
            return None
    if plan is None:
        return _express_leaves(m, x, env, z0, name, return_stats, ids)
    fc = m.config.forward
    solve = fc.solve_fn()
    if on:
        set_grad_enabled(False)
    try:
        z_star, stats = solve(plan.fn, z0, tol=fc.tol, max_iter=fc.max_iter, **fc.options)
    finally:
        if on:
            set_grad_enabled(True)
    image = stats.__dict__.pop("image", None)  # (not kept by last_stats)
    if not stats.all_converged:  # judged, masked or warned as any other call
        call = Call(t_fn(m, [name], list(env)), [x, *env.values()], 1, {name: x}, env, z0, b,
                    x.dtype, return_stats, sample_ids=ids)
        return finish(m, call, z_star, stats)
    stats.weights_keys = d.pop("_env_keys", None)
    d["last_stats"] = stats
    if ids is not None:
        m.warm_start_cache.store(ids, z_star, None)  # type: ignore[union-attr]
    problem = FixedPointProblem(plan.eval_with, list(plan.held), adjoint_config(m, None, None),
                                backward_sink(m), plan, None, True, image)
    z = bc.strategy().attach(problem, z_star, z0, bc)
    return (z, stats) if return_stats else z


def plan_held(m: Layer, name: str, x: torch.Tensor, env: dict[str, torch.Tensor],
              z0: torch.Tensor) -> Any:
    """The plan of ``T`` built with autograd from ``x`` and the weights themselves, when it
    holds its state-free tensors in closed form (``plan.held``); None otherwise (no plan:
    ``_plannable`` turns False; a plan of another kind: the batch size joins ``_held_misses``,
    and later calls of that size plan with leaf copies directly — the node tree decides a
    plan's kind by the batch size, e.g. whether a Gram matrix pays)."""
    d = m.__dict__
    build = d.get("_held_builder")
    if build:  # the node tree's builder of this plan (made below, on the first call)
        plan = build({name: x}, env, z0)
        if plan is not None and (plan.c.requires_grad or plan.m.requires_grad):
            return plan
    if len(m.blocks) != 1 or not d.get("_plannable", True):
        return None
    block = m.blocks[0].name
    ctx = PlanContext(block, {name: x}, env, z0.shape[0], z0)
    node = m.derived.nodes[block]
    plan = plan_of(node, ctx)
    if plan is None:
        m._plannable = False
        return None
    # (held tensors without gradients while some weight has one, e.g. a weight that does not
    # reach T: the leaf path, whose output keeps a graph as on every other path)
    if not getattr(plan, "batch_shaped", False) or not hasattr(plan, "held") \
            or not any(t.requires_grad for t in plan.held):
        misses = d.setdefault("_held_misses", set())
        if len(misses) >= 64:  # (bounded: a stream of batch sizes)
            misses.clear()
        misses.add(z0.shape[0])
        return None
    if build is None:
        d["_held_builder"] = checked_builder(held_builder_of(node, ctx), plan, ctx)
    return plan


def _express_leaves(m: Layer, x: torch.Tensor, env: dict[str, torch.Tensor],
                    z0: torch.Tensor, name: str, return_stats: bool,
                    ids: torch.Tensor | None) -> Any:
    """The express call for a plan differentiated through leaf copies of the tensors it was
    built from, or without gradients."""
    b = x.shape[0]
    keys_in, keys_env = [name], list(env)
    tensors = [x, *env.values()]
    planned = plan_layer(m, keys_in, keys_env, tensors, z0)
    if planned is None:
        return None
    fc = m.config.forward
    with grad_off():
        z_star, stats = fc.solve_fn()(planned[0].fn, z0, tol=fc.tol, max_iter=fc.max_iter,
                                      **fc.options)
    stats.__dict__.pop("image", None)
    fn = t_fn(m, keys_in, keys_env)
    if not stats.all_converged:  # judged, masked or warned as any other call
        call = Call(fn, tensors, 1, {name: x}, env, z0, b, x.dtype, return_stats,
                    planned=planned, sample_ids=ids)
        return finish(m, call, z_star, stats)
    stats.weights_keys = m.__dict__.pop("_env_keys", None)
    m.__dict__["last_stats"] = stats
    if ids is not None:
        m.warm_start_cache.store(ids, z_star, None)  # type: ignore[union-attr]
    z = attach(m, fn, tensors, z_star, z0, planned, None, None, b)
    return (z, stats) if return_stats else z


def checked_builder(build: Any, plan: Any, ctx: PlanContext) -> Any:
    """``build`` (a node tree's held builder, :func:`~lowering.runtime.plan.held_builder_of`)
    when it rebuilds ``plan`` — made by the general path at ``ctx`` — exactly: the same input
    tensor ``c`` or an equal one, an equal ``M`` (symmetric alike), the same activation
    functions (``σ``, its in-place form, ``σ'``, ``σ'`` from the value); else False (the general
    path is kept: a builder that disagrees is a bug, never a different layer).  Checked once
    per module, on the call that made ``plan``."""
    if build is None:
        return False
    again = build(ctx.values, ctx.env, ctx.like)  # (in the call's grad mode: the same test)
    same = again is not None and type(again) is type(plan) and again.f is plan.f \
        and again.f_inplace is plan.f_inplace and again.df is plan.df \
        and again.df_of_value is plan.df_of_value and again.mat.symmetric == plan.mat.symmetric \
        and (again.c is plan.c or torch.equal(again.c, plan.c)) and torch.equal(again.m, plan.m)
    return build if same else False


__all__ = ["checked_builder", "express_call", "express_width", "plan_held"]
