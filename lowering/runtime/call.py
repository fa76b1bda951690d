"""The general call of the emitted module: inputs checked and cast, ``T`` planned where it can
be (:mod:`lowering.runtime.plan`), the forward solve (a registered solver, SAM, or the unrolled
loop), the verdict on failures, the backward strategy attached, the output shaped (docs/guide.md,
the emitted module; docs/theory.md §8).  The common call takes a shorter way with the same
results (:mod:`lowering.runtime.express`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import ConvergenceWarning
from lowering.nodes import partial_evaluation

from .backward import AdjointConfig, FixedPointProblem
from .failures import expand_stats, judge, spread_stats
from .grad_mode import grad_off
from .guards import indices, initial_state, inputs_of, nonfinite_inputs, refuse_forward_ad
from .layer import Layer
from .parameters import checked_env
from .plan import PlanContext, Root, plan_of
from .sam import sam_iterate
from .solvers import CompiledSteps, SolverStats, Tracker, empty_stats, rel_residual

#: dtypes solved internally in float32 (their 8-/11-bit mantissas cannot reach useful tolerances)
HALF = (torch.float16, torch.bfloat16)

TFn = Callable[[torch.Tensor, Any], torch.Tensor]
Planned = tuple[Any, list[torch.Tensor]]


@dataclass
class Call:
    """One forward call after its inputs were read: ``T`` as ``fn(z, tensors)`` with the
    tensors (inputs first, ``n_in`` of them, then weights), the start, the batch size ``b`` and
    the samples dropped for NaN/Inf inputs, and what the output must be."""

    fn: TFn
    tensors: list[torch.Tensor]
    n_in: int
    inputs: dict[str, torch.Tensor]
    env: dict[str, torch.Tensor]
    z0: torch.Tensor
    b: int
    out_dtype: torch.dtype
    return_stats: bool
    bad_in: torch.Tensor | None = None
    planned: Planned | None = None
    compiled: tuple[CompiledSteps, CompiledSteps] | None = None
    #: the samples' indices in the module's warm-start cache (None: no warm start)
    sample_ids: torch.Tensor | None = None


def t_fn(m: Layer, keys_in: list[str], keys_env: list[str]) -> TFn:
    """``T(z, tensors)`` with the tensors in the order inputs (``keys_in``) then weights
    (``keys_env``): what the backward strategies differentiate."""
    n_in = len(keys_in)

    def fn(z: torch.Tensor, ts: Any) -> torch.Tensor:
        return m.T(z, dict(zip(keys_in, ts[:n_in])), dict(zip(keys_env, ts[n_in:])))

    return fn


def general_call(m: Layer, x: Any, z0: Any, return_stats: bool, steps: int,
                 weights: dict[str, torch.Tensor], out_dtype: torch.dtype,
                 env: dict[str, torch.Tensor] | None, ids: torch.Tensor | None = None) -> Any:
    """:meth:`~lowering.runtime.module.EquilibriumModule.forward` for any call."""
    inputs = inputs_of(m, x, out_dtype)
    if env is None:
        env = checked_env(m, weights) if "env" not in m.__dict__ else m.env()
    if out_dtype in HALF:  # solved in float32; gradients flow back through the casts
        inputs = {k: v.float() for k, v in inputs.items()}
        env = {k: (v.float() if v.dtype in HALF else v) for k, v in env.items()}
    if torch.autograd.forward_ad._current_level >= 0:  # (-1: no dual level entered)
        refuse_forward_ad(m, inputs, env)
    call = _read_call(m, inputs, env, z0, out_dtype, return_stats)
    call.sample_ids = ids
    if steps:
        call.compiled = compiled_steps_of(m, steps)
    f = _applied(call.fn, call.tensors)
    m.config.backward.strategy()  # (options set in place since construction are checked here)
    if m.config.backward.mode == "unroll":
        z_star, stats = unroll(m, f, call.z0)
    else:
        call.planned = plan_layer(m, list(call.inputs), list(env), call.tensors, call.z0)
        if call.planned is None:  # only a plan's T is compiled
            call.compiled = None
        steps_fwd = call.compiled and call.compiled[0]
        z_star, stats = solve_forward(m, f if call.planned is None else call.planned[0].fn,
                                      call.z0, call.inputs, env, steps_fwd,
                                      call.planned is not None)
    stats.__dict__.pop("image", None)  # (not kept by last_stats)
    return finish(m, call, z_star, stats)


def _applied(fn: TFn, tensors: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda z: fn(z, tensors)


def _read_call(m: Layer, inputs: dict[str, torch.Tensor],
               env: dict[str, torch.Tensor], z0: Any, out_dtype: torch.dtype,
               return_stats: bool) -> Call:
    """The call's batch, start and tensors; samples with NaN/Inf inputs dropped (mask mode,
    with a warning naming them) or refused (:func:`~lowering.runtime.guards.nonfinite_inputs`)."""
    ref = next(iter(inputs.values()), None)
    b = ref.shape[0] if ref is not None else \
        (z0.shape[0] if isinstance(z0, torch.Tensor) and z0.ndim else 1)
    if ref is None:
        ref = next((v for v in env.values() if v.is_floating_point()),
                   torch.zeros((), dtype=out_dtype))
    dt = torch.float32 if out_dtype in HALF else out_dtype
    bad_in = nonfinite_inputs(m, inputs)  # None: every input finite
    start = initial_state(m, z0, b, dt, ref.device, bad_in)
    if bad_in is not None:
        keep = ~bad_in
        warnings.warn(f"forward: samples {indices(bad_in)} have NaN/Inf inputs; their outputs "
                      "are NaN and they are excluded from the solve and the backward "
                      "(on_nonconvergence='mask')", ConvergenceWarning, stacklevel=5)
        inputs = {k: v[keep] for k, v in inputs.items()}
        start = start[keep]
    keys_in, keys_env = list(inputs), list(env)
    tensors = [inputs[k] for k in keys_in] + [env[k] for k in keys_env]
    return Call(t_fn(m, keys_in, keys_env), tensors, len(keys_in), inputs, env, start, b,
                out_dtype, return_stats, bad_in)


def compiled_steps_of(m: Layer, steps: int
                      ) -> tuple[CompiledSteps, CompiledSteps] | None:
    """The module's compiled chunks (forward, adjoint) of ``steps`` iterations, made on first
    use inside ``torch.compile`` (own dynamo caches; not pickled); None for 0/1."""
    if steps < 2:
        return None
    have = m.__dict__.get("_compiled")
    if have is None or have[0].chunk != steps:
        have = (CompiledSteps(steps), CompiledSteps(steps))
        m.__dict__["_compiled"] = have
    return have


def plan_layer(m: Layer, keys_in: list[str], keys_env: list[str],
               tensors: list[torch.Tensor], z0: torch.Tensor, mode: str | None = None
               ) -> Planned | None:
    """``T`` planned for these inputs and weights: state-free parts computed once, the
    transpose Jacobian as a closure.  With gradients needed (implicit backward) the plan is
    built with autograd from leaf copies of ``tensors``, so that the backward differentiates it
    with respect to them (returned with the plan; ``[]`` when no gradient is needed).  None for
    layers without a plan (several state blocks, or a node that has none)."""
    if len(m.blocks) != 1 or not m.__dict__.get("_plannable", True):
        return None
    on = torch.is_grad_enabled()
    grad = on and (mode or m.config.backward.mode) == "implicit" and \
        any(t.requires_grad for t in tensors)
    leaves = ([t.detach().requires_grad_() if t.requires_grad else t for t in tensors]
              if grad else tensors)
    n_in = len(keys_in)
    ctx = PlanContext(m.blocks[0].name, dict(zip(keys_in, leaves[:n_in])),
                      dict(zip(keys_env, leaves[n_in:])), z0.shape[0], z0)
    node = m.derived.nodes[m.blocks[0].name]
    if grad == on:  # (no grad-mode switch to pay for)
        plan = plan_of(node, ctx)
    else:
        with torch.set_grad_enabled(grad):
            plan = plan_of(node, ctx)
    if plan is None:
        m._plannable = False  # the node tree does not change: do not ask again
        return None
    # without gradients the plan holds the tensors themselves (no leaves for a backward); a
    # plan whose value always has the state's shape needs no Root (nothing to broadcast)
    return (plan if getattr(plan, "batch_shaped", False) else Root(plan)), \
        (leaves if grad else [])


def solve_forward(m: Layer, f: Any, z0: torch.Tensor, inputs: dict, env: dict,
                  steps: CompiledSteps | None = None, planned: bool = False
                  ) -> tuple[torch.Tensor, SolverStats]:
    """The forward solve.  Its data-dependent loop is never traced; under ``torch.compile``
    (``steps`` given) plain iterations of the planned ``T`` run in compiled chunks, the
    injections and Gram matrices still computed once per call (docs/guide.md).  ``planned``:
    ``f`` is a plan's evaluation, whose state-free parts are computed already."""
    cfg = m.config
    fc = cfg.forward
    with grad_off():
        if cfg.sam is not None:
            with partial_evaluation():
                return sam_iterate(m, f, z0, inputs, env)
        solver = fc.solve_fn()
        if planned:
            return solver(f, z0, tol=fc.tol, max_iter=fc.max_iter, compiled=steps,
                          **fc.options)
        with partial_evaluation():
            return solver(f, z0, tol=fc.tol, max_iter=fc.max_iter, **fc.options)


def unroll(m: Layer, f: Any, z0: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
    """``K`` plain iterations with autograd; the returned point is the last iterate (its
    residual measured, and reported against ``tol``)."""
    if z0.shape[0] == 0:  # an empty batch (e.g. every sample masked out): nothing to measure;
        # one application keeps the (empty) output in the graph of the weights
        return f(z0), empty_stats("unroll", z0, m.tol)
    tr = Tracker("unroll", z0, m.tol)
    z = z0
    for _ in range(m.config.backward.unroll_steps):
        fz = f(z)
        tr.record_residual(rel_residual(fz.detach(), z.detach()))
        z = fz
    with torch.no_grad():
        tr.record(z.detach(), f(z.detach()))  # the residual of the returned iterate
    return z, tr.stats()


def adjoint_config(m: Layer, steps: CompiledSteps | None,
                   rows: torch.Tensor | None) -> AdjointConfig:
    """How this module's adjoint fixed points are solved (``rows``: the batch index of each
    row of a subset, None for the whole batch)."""
    cfg = m.config
    return AdjointConfig(*cfg.adjoint_settings(), cfg.on_nonconvergence, cfg.backward.adjoint,
                         not m._batch_coupled, steps, rows)


def backward_sink(m: Layer, rows: torch.Tensor | None = None, batch: int = 0
                  ) -> Callable[[SolverStats], None]:
    """Where the adjoint solve's statistics go: ``last_backward_stats`` (a plain attribute, as
    ``last_stats``), spread over the whole batch when the solve held a subset ``rows``
    (samples left out of the backward then read not converged, residual NaN)."""
    d = m.__dict__
    if rows is None:
        def sink(st: SolverStats) -> None:
            d["last_backward_stats"] = st
    else:
        def sink(st: SolverStats) -> None:
            d["last_backward_stats"] = spread_stats(st, rows, batch, dropped_nonfinite=False)
    return sink


def attach(m: Layer, fn: TFn, tensors: list[torch.Tensor], z_star: torch.Tensor,
           z0: torch.Tensor, planned: Planned | None = None, steps: CompiledSteps | None = None,
           rows: torch.Tensor | None = None, batch: int = 0) -> torch.Tensor:
    """The backward strategy's differentiable output at ``z_star`` (detached when no tensor
    needs a gradient); ``planned``: the forward's plan and the leaves it was built from (the
    implicit backward then linearises the plan instead of ``T``); ``rows``: the batch index of
    each row of ``z_star`` when it holds a subset of the ``batch`` samples."""
    if planned is None or not planned[1]:  # (a plan built with leaves: both hold)
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return z_star.detach()
    cfg = m.config
    # (made per call: the options are read on every call, as config is mutable)
    adj = adjoint_config(m, steps if planned is not None else None, rows)
    problem = FixedPointProblem(fn, tensors, adj, backward_sink(m, rows, batch))
    if planned is not None and planned[1]:  # built with autograd from leaf copies
        problem.plan, problem.leaves = planned
    return cfg.backward.strategy().attach(problem, z_star, z0, cfg.backward)


def finish(m: Layer, call: Call, z_star: torch.Tensor, stats: SolverStats) -> Any:
    """After the solve: judge it (raise / warn / mask), attach the backward strategy, apply
    the output map, put masked samples back, shape the output."""
    mode = m.config.backward.mode
    bad_in, b = call.bad_in, call.b
    # over the whole batch (dropped samples: non-finite), kept when judge raises
    batch_stats = stats if bad_in is None else expand_stats(stats, ~bad_in)
    # the weights' content keys of this call's env (None where it was not checked here)
    batch_stats.weights_keys = m.__dict__.pop("_env_keys", None)
    m.__dict__["last_stats"] = batch_stats
    ok, all_ok = judge(m, stats, bad_in)
    if call.sample_ids is not None:  # the converged equilibria start these samples next time
        ids = call.sample_ids if bad_in is None else call.sample_ids[~bad_in.to(
            call.sample_ids.device)]
        m.warm_start_cache.store(ids, z_star, stats.converged)  # type: ignore[union-attr]
    # batch index of each solved sample (None: the solve saw the whole batch), so that the
    # backward's statistics and messages name batch samples, not rows of a subset
    solved = torch.nonzero(~bad_in).flatten() if bad_in is not None else None
    if all_ok:
        z = z_star if mode == "unroll" else attach(
            m, call.fn, call.tensors, z_star, call.z0, call.planned,
            call.compiled and call.compiled[1], solved, b)
    else:  # gradients through the accepted samples only; the others are NaN
        z = _accepted_only(m, call, z_star, ok, solved)
    derived = m.derived
    if derived.outputs is not None:  # the layer's outputs (the state without a map)
        z = derived.output(z, call.inputs, call.env)
    if bad_in is not None:  # put the dropped samples back (NaN)
        full = torch.full((b, z.shape[1]), float("nan"), dtype=z.dtype, device=z.device)
        z = full.index_put((torch.nonzero(~bad_in).flatten(),), z)
        stats = batch_stats
    if call.out_dtype in HALF:
        z = z.to(call.out_dtype)
    out = m.shape_out(z)
    return (out, stats) if call.return_stats else out


def _accepted_only(m: Layer, call: Call, z_star: torch.Tensor, ok: Any,
                   solved: torch.Tensor | None) -> torch.Tensor:
    """The output with gradients through the accepted samples ``ok`` only, NaN elsewhere."""
    assert ok is not None
    rows = torch.nonzero(ok).flatten()
    sub = [t[ok] if i < call.n_in else t for i, t in enumerate(call.tensors)]
    if m.config.backward.mode == "unroll":
        z_ok, _ = unroll(m, lambda z: call.fn(z, sub), call.z0[ok])
    else:
        z_ok = attach(m, call.fn, sub, z_star[ok], call.z0[ok], None, None,
                      rows if solved is None else solved[rows], call.b)
    z = z_star.detach().clone().index_put((rows,), z_ok)
    return torch.where(ok[:, None], z, torch.full_like(z, float("nan")))
