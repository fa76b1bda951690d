"""The planner of :class:`~lowering.nodes.GradSum` (``sign · Σ_k ∇ h_k``): a sum of planned parts,
one per term, by the term's declared ``grad_structure`` (docs/theory.md §8, evaluation plans).

``"bilinear"`` (``∇`` independent of the state: a constant), ``"identity"`` (``∇f(u) = u``:
linear in the state, a Gram matrix when cheap) or ``"elementwise"`` (``∇f(u)`` elementwise in
``u``); a term with another structure has no plan.  The per-term analysis (:class:`Recipe`) is
done once per node; a call evaluates the state-free parts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from convex_eq.affine import Affine
from convex_eq.symbols import Symbol
from convex_eq.terms.base import Term
from lowering.nodes import GRAM_MAX, GradSum

from . import plans as pl

Z_t = Mapping[str, torch.Tensor]
#: ``(values, env, like) ↦ (c, M)`` of a fused affine plan ``z ↦ c + zM``, or None
AffineBuilder = Callable[[Z_t, Any, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]

#: plans form the Gram matrix (then formed once per forward call and reused by the backward)
#: when ``n²m`` costs less than the ``2Bnm`` per application over the ~30 applications of a
#: forward and adjoint solve, i.e. ``n ≤ 80B``; with the weights trained, the Gram matrix's own
#: backward (``2n²m``) triples its cost: ``n ≤ 25B``
GRAM_BATCH_PLAN = 80
GRAM_BATCH_TRAIN = 25


def gram_batch(names: tuple[str, ...], env: Any) -> int:
    """The batch factor of the Gram test ``n ≤ factor·B``: :data:`GRAM_BATCH_TRAIN` when one
    of the operator's weights ``names`` takes a gradient in this call, else
    :data:`GRAM_BATCH_PLAN`."""
    if torch.is_grad_enabled() and env:
        for name in names:
            if getattr(env.get(name), "requires_grad", False):
                return GRAM_BATCH_TRAIN
    return GRAM_BATCH_PLAN


class Recipe:
    """What does not change between calls of one :class:`~lowering.nodes.GradSum`: per term
    ``(kind, term, folded coefficient or None, arg, offset)`` (``parts``; None when a term has
    no plan), the Gram facts of its Gram-form terms, and the zero placeholders of bilinear
    gradients."""

    __slots__ = ("block", "gram_facts", "parts", "zeros")

    def __init__(self, node: GradSum):
        # (no reference to the node: the recipe is the value of a weak-keyed cache entry)
        self.block = node.block
        self.gram_facts: dict[int, tuple[int, bool, tuple[str, ...]]] = {}
        self.zeros: dict[tuple, torch.Tensor] = {}
        self.parts = self._analyse(node)

    def _analyse(self, node: GradSum) -> list[tuple[str, Term, Any, Any, Any]] | None:
        """``bilinear``: ``arg`` the index of the argument holding the block and ``offset`` the
        function computing the term's constant (:meth:`bilinear_const`); otherwise ``arg`` the
        state part ``A z`` of the one argument and ``offset`` its state-free part."""
        out: list[tuple[str, Term, Any, Any, Any]] = []
        for t, idx, c in node.eval_plan:
            kind = getattr(t, "grad_structure", None)
            if node.at or idx is None or kind is None:
                return None
            if kind == "bilinear":
                if len(idx) != 1 or any(a.states() for j, a in enumerate(t.args) if j != idx[0]):
                    return None
                out.append((kind, t, c, idx[0], self.bilinear_const(t, idx[0])))
                continue
            if kind not in ("identity", "elementwise") or len(t.args) != 1:
                return None
            st, off = t.args[0].state_part, t.args[0].offset_part
            if st is None or any(e.symbol is not node.block for e in st.entries):
                return None
            out.append((kind, t, c, st, off))
        return out

    def zero_arg(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """A ``(1, n)`` zero of ``like``'s dtype and device: the placeholder for the state
        argument of a bilinear term's gradient (which does not read it), made once per dtype
        and device (never written: the gradients built from it are new tensors)."""
        key = (n, like.dtype, like.device)
        z = self.zeros.get(key)
        if z is None or z._version:  # (a term that wrote into it gets a fresh one)
            # a normal tensor also when made under inference_mode: an inference tensor has no
            # version counter to read on the next call, and cannot enter a later autograd call
            with torch.inference_mode(False):
                z = self.zeros[key] = torch.zeros(1, n, dtype=like.dtype, device=like.device)
        return z

    def facts(self, t: Term, op: Any) -> tuple[int, bool, tuple[str, ...]]:
        """Once per Gram-form term: the state size ``n``, whether ``AᵀA`` as a matrix can pay
        at all (``n²`` per sample less than the ``2·apply_cost`` of ``Aᵀ(A·)`` and
        ``n ≤ min(m, GRAM_MAX)``), its weights' names."""
        facts = self.gram_facts.get(id(t))
        if facts is None:
            n, m = op.in_size, op.out_size
            facts = self.gram_facts[id(t)] = (
                n, n <= min(m, GRAM_MAX) and n * n <= 2 * op.apply_cost,
                tuple(s.name for s in op.symbols()))
        return facts

    def bilinear_const(self, t: Term, k: int) -> Callable[[Z_t, Any], torch.Tensor | None]:
        """``(values, env) ↦ Aᵀ∇_{u_k} t`` (None where the term gives no gradient) for the
        bilinear term ``t`` whose argument ``k`` holds the block: where ``t`` declares the
        gradient to be another argument ``u_j`` (``grad_sources``) and argument ``k`` is the
        block itself, ``u_j``'s value (the input's own tensor when ``u_j`` is one input), else
        the gradient call."""
        args, block = t.args, self.block
        src = getattr(t, "grad_sources", None)
        if src is not None and args[k].is_state(block):
            a = args[src[k]]
            e = a.entries[0] if len(a.entries) == 1 else None
            if e is not None and e.symbol.kind == "input" and e.op is None and e.coef == 1.0:
                name = e.symbol.name
                return lambda values, env: values[name] if name in values else \
                    a.evaluate(values, env)  # (the latter: evaluate's typed error)
            return a.evaluate
        size = args[k].size
        zero_arg = self.zero_arg

        def general(values: Z_t, env: Any) -> torch.Tensor | None:
            us = [None if j == k else a.evaluate(values, env) for j, a in enumerate(args)]
            ref = next(u for u in us if u is not None)
            us[k] = zero_arg(size, ref)
            g = t.raw_grad(us, env)[k]
            return None if g is None else args[k].adjoint(g, block, env)

        return general


#: one :class:`Recipe` per node (made on first use, dropped with the node)
_RECIPES: weakref.WeakKeyDictionary[GradSum, Recipe] = weakref.WeakKeyDictionary()


def recipe_of(node: GradSum) -> Recipe:
    """The node's :class:`Recipe`, made once."""
    r = _RECIPES.get(node)
    if r is None:
        r = _RECIPES[node] = Recipe(node)
    return r


def plan_gradsum(node: GradSum, ctx: pl.PlanContext) -> Any:
    """The plan of ``sign · Σ_k ∇ h_k`` in the block ``ctx.var`` (None: no plan)."""
    if node.block.name != ctx.var:
        return None
    recipe = recipe_of(node)
    if recipe.parts is None:
        return None
    env = ctx.env
    parts: list[tuple[Any, Any]] = []
    const = None
    for kind, t, c, arg, off in recipe.parts:
        c = node.sign * t.coef_t(env) if c is None else c
        if kind == "bilinear":  # (off: the constant's function, Recipe.bilinear_const)
            contrib = off(ctx.values, env)
            if contrib is not None:
                const = pl.add(const, contrib if _is_one(c) else c * contrib)
            continue
        b = None if off is None else off.evaluate(ctx.values, env)
        if kind == "elementwise":
            parts.append((1.0, pl.ElementwiseGrad(
                _forward(arg, node.block, env), _adjoint(arg, node.block, env), b,
                _raw_grad(t, env), c)))
            continue
        if b is not None:  # c·Aᵀ(Az + b) = c·AᵀA z + c·Aᵀb
            contrib = arg.adjoint(b, node.block, env)
            const = pl.add(const, contrib if _is_one(c) else c * contrib)
        parts.append((c, _linear_plan(node, recipe, t, arg, ctx)))
    if const is not None:
        parts.insert(0, (1.0, pl.Constant(const)))
    return pl.Sum(parts) if parts else None


def _linear_plan(node: GradSum, recipe: Recipe, t: Term, st: Affine, ctx: pl.PlanContext
                 ) -> Any:
    """``AᵀA z`` for the state part ``A z`` of an ``"identity"``-gradient term: the Gram
    matrix when forming it costs less than the applications it replaces, else ``Aᵀ(Az)`` per
    application."""
    form = node.gram_forms.get(id(t))
    if form is not None:
        op, e = form
        n, cheap, names = recipe.facts(t, op)
        if cheap and n <= gram_batch(names, ctx.env) * ctx.batch:
            like = ctx.like
            if like is None:  # no state given: a weight's, else an input's dtype
                syms = op.symbols()
                like = ctx.env.get(syms[0].name) if ctx.env and syms else None
                like = like if like is not None else next(iter(ctx.values.values()))
            gram = op.gram(like, ctx.env)
            # AᵀA: symmetric (Jᵀ applies it as is, without a transpose view)
            return pl.Matrix(gram if e * e == 1.0 else (e * e) * gram, symmetric=True)
        like = ctx.like if ctx.like is not None else next(iter(ctx.values.values()), None)
        if like is not None:  # e²·Aᵀ(A z) with A's weights resolved once
            fwd, adj = op.bound(ctx.env, like)
            ee = e * e
            if ee == 1.0:
                return pl.SelfAdjoint(lambda z: adj(fwd(z)))
            return pl.SelfAdjoint(lambda z: ee * adj(fwd(z)))
    fwd, adj = _forward(st, node.block, ctx.env), _adjoint(st, node.block, ctx.env)
    return pl.SelfAdjoint(lambda z: adj(fwd(z)))


def affine_builder_gradsum(node: GradSum, ctx: pl.PlanContext) -> AffineBuilder | None:
    """:func:`plan_gradsum`'s fused ``c + zM`` where the recipe makes one: every term bilinear
    (a state-free constant) but one ``"identity"`` term ``½||e·Az||²`` with a Gram form and unit
    coefficient, every coefficient a number.  Per call the builder computes what the plan
    computes for that recipe — the constants, then ``e²·AᵀA`` where the plan forms it (else
    None) — and ``c`` must be 2-D, as the fused plan asks (else None)."""
    if node.block.name != ctx.var or node.at:
        return None
    recipe = recipe_of(node)
    if recipe.parts is None:
        return None
    consts: list[tuple[Callable[[Z_t, Any], torch.Tensor | None], float]] = []
    gram_term = None
    for kind, t, c, _arg, off in recipe.parts:
        if c is None:  # a learnable scalar: read from env on every call by the plan
            return None
        if kind == "bilinear":
            consts.append((off, c))
        elif kind == "identity" and off is None and gram_term is None and _is_one(c) \
                and id(t) in node.gram_forms:
            gram_term = t
        else:
            return None
    if not consts or gram_term is None:
        return None
    op, e = node.gram_forms[id(gram_term)]
    n, cheap, names = recipe.facts(gram_term, op)
    if not cheap:
        return None
    ee = e * e

    def build(values: Z_t, env: Any, like: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        const = None
        for fn, c in consts:
            contrib = fn(values, env)
            if contrib is None:
                continue
            contrib = contrib if _is_one(c) else c * contrib
            const = contrib if const is None else const + contrib
        if const is None or const.ndim != 2 or n > gram_batch(names, env) * like.shape[0]:
            return None
        gram = op.gram(like, env)
        return const, (gram if ee == 1.0 else ee * gram)

    return build


def _forward(st: Affine, block: Symbol, env: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``z ↦ A z`` for the state part ``A z`` of an argument (one block)."""
    name = block.name
    return lambda z: st.evaluate({name: z}, env)


def _adjoint(st: Affine, block: Symbol, env: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``w ↦ Aᵀ w`` for the state part of an argument."""
    return lambda w: st.adjoint(w, block, env)


def _raw_grad(t: Term, env: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``u ↦ ∇f(u)`` of a one-argument term (without its coefficient)."""
    return lambda u: t.raw_grad([u], env)[0]


def _is_one(c: Any) -> bool:
    return isinstance(c, float) and c == 1.0
