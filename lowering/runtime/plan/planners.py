"""Planning a node tree: a node-type → planner table (docs/theory.md §8, evaluation plans).

A planner ``(node, ctx) ↦ Plan | None`` turns one node of ``T`` (:mod:`lowering.nodes`) into a
:mod:`plan <lowering.runtime.plan.plans>` in the block ``ctx.var``, with its state-free parts
computed now; None means no plan (the layer keeps the general path: ``T`` by the node tree,
``Jᵀ`` by autograd).  Held builders ``(node, ctx) ↦ build`` make, once per module, the function
``build(values, env, like)`` that rebuilds the fused ``σ(c + zM)`` plan of later calls with the
node tree's analysis done; affine builders do the same for ``c + zM``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lowering.nodes import Combo, GradSum, Named, Node, Prox, Sigma, Substitute, Var, coef_value

from . import plans as pl
from .gradsum import AffineBuilder, affine_builder_gradsum, plan_gradsum

Z_t = Mapping[str, torch.Tensor]
Planner = Callable[[Any, pl.PlanContext], Any]
#: ``(values, env, like) ↦`` a fused plan ``σ(c + zM)`` or None
HeldBuilder = Callable[[Z_t, Any, torch.Tensor], "pl.AffineElementwise | None"]

PLANNERS: dict[type, Planner] = {}
HELD_BUILDERS: dict[type, Callable[[Any, pl.PlanContext], HeldBuilder | None]] = {}
AFFINE_BUILDERS: dict[type, Callable[[Any, pl.PlanContext], AffineBuilder | None]] = {}


def register_planner(node_type: type, table: dict[type, Any] = PLANNERS
                     ) -> Callable[[Callable], Callable]:
    """Decorator entering ``fn`` in ``table`` (by default :data:`PLANNERS`) for ``node_type``."""

    def deco(fn: Callable) -> Callable:
        table[node_type] = fn
        return fn

    return deco


def _lookup(table: dict[type, Any], node: Node) -> Any:
    """The entry for ``type(node)`` or its nearest base class in ``table`` (None: none)."""
    for cls in type(node).__mro__:
        fn = table.get(cls)
        if fn is not None:
            return fn
    return None


def plan_of(node: Node, ctx: pl.PlanContext) -> Any:
    """The plan of ``node`` in the block ``ctx.var``, or None (no planner, or none applies)."""
    fn = _lookup(PLANNERS, node)
    return None if fn is None else fn(node, ctx)


def held_builder_of(node: Node, ctx: pl.PlanContext) -> HeldBuilder | None:
    """The builder of ``node``'s fused ``σ(c + zM)`` plan, or None."""
    fn = _lookup(HELD_BUILDERS, node)
    return None if fn is None else fn(node, ctx)


def affine_builder_of(node: Node, ctx: pl.PlanContext) -> AffineBuilder | None:
    """The builder of ``node``'s fused ``c + zM`` (its ``(c, M)``), or None."""
    fn = _lookup(AFFINE_BUILDERS, node)
    return None if fn is None else fn(node, ctx)


PLANNERS[GradSum] = plan_gradsum
AFFINE_BUILDERS[GradSum] = affine_builder_gradsum


@register_planner(Var)
def _plan_var(node: Var, ctx: pl.PlanContext) -> Any:
    return pl.Identity() if node.block.name == ctx.var else None


#: per Sigma node ``(act, σ, σ' or None, σ in place or None, σ' from σ's value or None)``
_ACT_OPS: weakref.WeakKeyDictionary[Sigma, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _act_ops(node: Sigma) -> tuple[Any, ...]:
    """The activation's torch ops, looked up once per node (again if ``act`` is replaced)."""
    act = node.act
    ops = _ACT_OPS.get(node)
    if ops is None or ops[0] is not act:
        df = act.sigma_prime if getattr(act, "has_sigma_prime", False) else None
        ops = _ACT_OPS[node] = (act, act.torch_sigma, df, getattr(act, "torch_sigma_", None),
                                getattr(act, "sigma_prime_of_sigma", None))
    return ops


@register_planner(Sigma)
def _plan_sigma(node: Sigma, ctx: pl.PlanContext) -> Any:
    inner = plan_of(node.inner, ctx)
    if inner is None:
        return None
    ops = _act_ops(node)
    return pl.elementwise(ops[1], inner, ops[2], f_inplace=ops[3], df_of_value=ops[4])


@register_planner(Sigma, HELD_BUILDERS)
def _held_builder_sigma(node: Sigma, ctx: pl.PlanContext) -> HeldBuilder | None:
    """``elementwise(σ, c + zM)`` (an :class:`~lowering.runtime.plan.plans.AffineElementwise`
    over the inner node's fused form) from the inner node's affine builder."""
    parts = affine_builder_of(node.inner, ctx)
    if parts is None:
        return None
    _, f, df, f_inplace, df_of_value = _act_ops(node)
    fused = pl.AffineElementwise.fused

    def build(values: Z_t, env: Any, like: torch.Tensor) -> pl.AffineElementwise | None:
        cm = parts(values, env, like)
        return None if cm is None else fused(f, cm[0], cm[1], df, f_inplace, df_of_value)

    return build


@register_planner(Prox)
def _plan_prox(node: Prox, ctx: pl.PlanContext) -> Any:
    """Planned when ``g`` declares an elementwise prox (``prox_elementwise``)."""
    g = node.g
    if not getattr(g, "prox_elementwise", False) or not getattr(g, "has_prox", False):
        return None
    inner = plan_of(node.inner, ctx)
    if inner is None:
        return None
    t, env = node.t, ctx.env
    return pl.Elementwise(lambda v: g.prox(v, t, env), inner, has_params=True)


@register_planner(Combo)
def _plan_combo(node: Combo, ctx: pl.PlanContext) -> Any:
    parts = []
    for c, n in node.parts:
        p = plan_of(n, ctx)
        if p is None:
            return None
        parts.append((c if _is_one(c) else coef_value(c, ctx.env), p))
    return pl.Sum(parts)


@register_planner(Substitute)
def _plan_substitute(node: Substitute, ctx: pl.PlanContext) -> Any:
    inner = plan_of(node.inner, ctx)
    outer = plan_of(node.node, ctx.at(node.block.name)) if inner is not None else None
    return None if outer is None else pl.Compose(outer, inner)


@register_planner(Named)
def _plan_named(node: Named, ctx: pl.PlanContext) -> Any:
    return plan_of(node.node, ctx)


def _is_one(c: Any) -> bool:
    return isinstance(c, float) and c == 1.0
