"""Expression nodes of a derived fixed-point operator ``T`` (closed-form torch, printable).

A node evaluates on ``Z`` (dict block name → flat batched tensor, plus the inputs) and ``env``
(weights); it prints as plain text and LaTeX and bounds its Lipschitz constant in the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import torch

from convex_eq.affine import Affine
from convex_eq.symbols import Env, Symbol
from convex_eq.terms.base import Term
from convex_eq.terms.moreau import MoreauEnvelope
from convex_eq.terms.potential import act_latex as _sig

from . import plan as pl

Z_t = Mapping[str, torch.Tensor]
#: ``(values, env, like) ↦`` a fused plan ``σ(c + zM)`` or None (:meth:`Node.held_builder`)
HeldBuilder = Callable[[Z_t, Any, torch.Tensor], "pl.AffineElementwise | None"]
#: ``(values, env, like) ↦ (c, M)`` or None (:meth:`Node.affine_builder`)
AffineBuilder = Callable[[Z_t, Any, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]

#: active during a forward solve (``partial_evaluation()``): the parts of the terms' affine
#: arguments that do not depend on the state (input injections ``U x + b``), computed once
_PARTIAL: ContextVar[dict[Any, Any] | None] = ContextVar("convex_eq_partial_evaluation",
                                                         default=None)


class partial_evaluation:  # lower case: used like the function it was
    """Within the block, ``T`` computes the state-independent parts of its arguments (e.g. the
    injection ``U x + b``, the Gram matrix ``AᵀA`` of a ``½||Az||²`` term) once instead of at
    every evaluation.  For repeated evaluations with the same inputs and weights: a forward
    solve (no autograd), or the single differentiable evaluation the implicit backward
    differentiates (the cached parts then carry their gradients).  Each entry starts an empty
    cache."""

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = _PARTIAL.set({})

    def __exit__(self, *exc: object) -> None:
        _PARTIAL.reset(self.token)


def eval_arg(a: Affine, vals: Z_t, env: Env | None) -> torch.Tensor:
    """``a`` at ``vals``; inside :func:`partial_evaluation` its state-free part is computed once."""
    cache = _PARTIAL.get()
    if cache is None:
        return a.evaluate(vals, env)
    hit = cache.get(id(a))
    if hit is None:
        st = [e for e in a.entries if e.symbol.kind == "state"]
        rest = [e for e in a.entries if e.symbol.kind != "state"]
        if not rest:
            hit = (a, None)
        elif not st:
            hit = (None, a.evaluate(vals, env))
        else:
            hit = (Affine(st), Affine(rest).evaluate(vals, env))
        cache[id(a)] = hit
    part, const = hit
    if part is None:
        return const  # type: ignore[return-value]
    v = part.evaluate(vals, env)
    return v if const is None else v + const


class Node:
    """A closed-form sub-expression of ``T``."""

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.eval")

    def lip(self, env: Env | None) -> float:
        """Upper bound on the Lipschitz constant with respect to the stacked state."""
        return math.inf

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        """This node as a :class:`~lowering.plan.Plan` in the block ``ctx.var`` (state-free
        parts computed now), or None when it has no plan (the general path is used)."""
        return None

    def held_builder(self, ctx: pl.PlanContext) -> HeldBuilder | None:
        """``(values, env, like) ↦`` the plan :meth:`plan` builds for those values when that
        plan is the fused ``σ(c + zM)`` (:class:`~lowering.plan.AffineElementwise`), the same
        tensors from the same operations, with this node's per-call analysis done once, here
        (the express call re-plans with it: docs/theory.md §8, evaluation plans).  The builder
        returns None for a call where :meth:`plan` would build another form.  None: no builder
        (the general :meth:`plan` is used)."""
        return None

    def affine_builder(self, ctx: pl.PlanContext) -> AffineBuilder | None:
        """``(values, env, like) ↦ (c, M)`` of the fused affine plan ``z ↦ c + zM`` that
        :meth:`plan` builds for those values (None for a call where it builds another form);
        None: no builder.  ``like``: the state's ``z0`` (its batch, dtype and device)."""
        return None

    def text(self) -> str:
        return type(self).__name__

    def latex(self) -> str:
        return self.text()

    def __str__(self) -> str:
        return self.text()


class Var(Node):
    """The current value of a state block."""

    def __init__(self, block: Symbol):
        self.block = block

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        return Z[self.block.name]

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        return pl.Identity() if self.block.name == ctx.var else None

    def lip(self, env: Env | None) -> float:
        return 1.0

    def text(self) -> str:
        return self.block.name

    def latex(self) -> str:
        return self.block.latex()


class Sigma(Node):
    """``σ(inner)`` elementwise."""

    def __init__(self, act: Any, inner: Node):
        self.act, self.inner = act, inner

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        return self.act.sigma(self.inner.eval(Z, env))

    def _act_ops(self) -> tuple[Any, ...]:
        """``(act, σ, σ' or None, σ in place or None, σ' from σ's value or None)``: the
        activation's torch ops, looked up once."""
        act = self.act
        ops = self.__dict__.get("_ops")
        if ops is None or ops[0] is not act:
            df = act.sigma_prime if getattr(act, "has_sigma_prime", False) else None
            ops = self.__dict__["_ops"] = (act, act.torch_sigma, df,
                                           getattr(act, "torch_sigma_", None),
                                           getattr(act, "sigma_prime_of_sigma", None))
        return ops

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        inner = self.inner.plan(ctx)
        if inner is None:
            return None
        ops = self._act_ops()
        return pl.elementwise(ops[1], inner, ops[2], f_inplace=ops[3], df_of_value=ops[4])

    def held_builder(self, ctx: pl.PlanContext) -> HeldBuilder | None:
        """:meth:`plan`'s ``elementwise(σ, c + zM)`` (an :class:`~lowering.plan.AffineElementwise`
        over the inner node's fused form) from the inner node's :meth:`affine_builder`."""
        parts = self.inner.affine_builder(ctx)
        if parts is None:
            return None
        _, f, df, f_inplace, df_of_value = self._act_ops()
        fused = pl.AffineElementwise.fused

        def build(values: Z_t, env: Any, like: torch.Tensor) -> pl.AffineElementwise | None:
            cm = parts(values, env, like)
            return None if cm is None else fused(f, cm[0], cm[1], df, f_inplace, df_of_value)

        return build

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_ops", None)  # looked up again after unpickling
        return state

    def lip(self, env: Env | None) -> float:
        return self.act.lipschitz * self.inner.lip(env)

    def text(self) -> str:
        return f"{self.act.name}({self.inner.text()})"

    def latex(self) -> str:
        return f"{_sig(self.act)}\\big({self.inner.latex()}\\big)"


def _term_grad_text(term: Term, block: Symbol, sign: float, latex: bool) -> str:
    """Text of ``sign·∇_block term`` from the term's own gradient rule."""
    parts = []
    c = sign * term.scale
    sc = "".join((s.latex() if latex else s.name) + " " for s in term.scalars)
    inner = term.grad_text(latex) if hasattr(term, "grad_text") else None
    for k, a in enumerate(term.args):
        g = None if inner is None else inner[k]
        if g is None:
            continue
        for e in a.entries:
            if e.symbol is not block:
                continue
            cc = c * e.coef
            gg = g
            if gg.startswith("-"):
                cc, gg = -cc, gg[1:]
            if e.op is None:
                body = gg
            else:
                adj = (f"{e.op.latex()}^\\top" if latex else f"{e.op}ᵀ")
                body = f"{adj}({gg})"
            coef = "" if cc == 1.0 else ("-" if cc == -1.0 else f"{cc:g}·")
            if (coef or sc) and e.op is None and (" + " in body or " - " in body):
                body = f"({body})"  # −(z − U x), not −z − U x
            parts.append(f"{coef}{sc}{body}")
    if not parts:
        name = term.latex() if latex else str(term)
        return (f"\\nabla_{{{block.latex()}}}[{name}]" if latex else f"∇_{block.name}[{name}]") \
            if sign > 0 else (f"-\\nabla_{{{block.latex()}}}[{name}]" if latex
                              else f"-∇_{block.name}[{name}]")
    return " + ".join(parts).replace("+ -", "- ")


class GradSum(Node):
    """``sign · Σ_k ∇_block h_k(Z)``: gradients from the terms' closed-form rules."""

    def __init__(self, terms: list[Term], block: Symbol, sign: float = -1.0,
                 at: Mapping[str, Node] | None = None):
        self.terms = [t for t in terms if any(s is block for s in t.states())]
        self.block, self.sign = block, sign
        self.at = dict(at or {})
        # evaluation plan, fixed at construction: per term the arguments that contain the block
        # and the folded coefficient sign·scale (None: scalars, read from env at each call;
        # args None: the term has its own grad rule)
        self._plan: list[tuple[Term, list[int] | None, float | None]] = []
        #: terms ``c·½||e·A z||²`` of this block alone: ∇ = c·e²·AᵀA z, the Gram AᵀA formed once
        #: per forward solve when that is cheaper (partial evaluation)
        self._gram: dict[int, tuple[Any, float]] = _gram_forms(self.terms, block)
        for t in self.terms:
            if type(t).grad is not Term.grad or not t.smooth:
                self._plan.append((t, None, None))
                continue
            idx = [k for k, a in enumerate(t.args) if any(s is block for s in a.symbols("state"))]
            self._plan.append((t, idx, None if t.scalars else sign * t.scale))

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        vals = Z
        if self.at:
            vals = dict(Z)
            for k, n in self.at.items():
                vals[k] = n.eval(Z, env)
        out = None
        for t, idx, c in self._plan:
            if idx is None:
                g = t.grad(vals, env).get(self.block.name)
                if g is not None:
                    g = g if self.sign == 1.0 else self.sign * g
                    out = g if out is None else out + g
                continue
            # Term.grad with the term coefficient and the sign folded into one scalar (no
            # multiplication at all when it is 1, e.g. -(-<q,z>) and -(-½||Wz||²))
            if c is None:
                c = self.sign * t.coef_t(env)
            gram = self._gram_matrix(t, vals, env)
            if gram is not None:
                contrib = vals[self.block.name] @ gram
                contrib = contrib if _is_one(c) else c * contrib
                out = contrib if out is None else out + contrib
                continue
            gs = t.raw_grad([eval_arg(a, vals, env) for a in t.args], env)
            for k in idx:
                if gs[k] is None:
                    continue
                contrib = t.args[k].adjoint(gs[k], self.block, env)
                contrib = contrib if _is_one(c) else c * contrib
                out = contrib if out is None else out + contrib
        if out is None:
            return torch.zeros_like(Z[self.block.name])
        return out

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        """A sum of planned parts, one per term, by the term's declared ``grad_structure``:
        ``"bilinear"`` (``∇`` independent of the state: a constant), ``"identity"``
        (``∇f(u) = u``: linear in the state, a Gram matrix when cheap) or ``"elementwise"``
        (``∇f(u)`` elementwise in ``u``); any other term: no plan.  The per-term analysis is
        done once (:meth:`_recipe`); a call evaluates the state-free parts."""
        if self.block.name != ctx.var:
            return None
        recipe = self._recipe()
        if recipe is None:
            return None
        env = ctx.env
        parts: list[tuple[Any, pl.Plan]] = []
        const = None
        for kind, t, c, arg, off in recipe:
            c = self.sign * t.coef_t(env) if c is None else c
            if kind == "bilinear":  # (off: the constant's function, _bilinear_const)
                contrib = off(ctx.values, env)
                if contrib is not None:
                    if not (isinstance(c, float) and c == 1.0):  # (_is_one)
                        contrib = c * contrib
                    const = contrib if const is None else const + contrib
                continue
            b = None if off is None else off.evaluate(ctx.values, env)
            if kind == "elementwise":
                parts.append((1.0, pl.ElementwiseGrad(
                    _forward(arg, self.block, env), _adjoint(arg, self.block, env), b,
                    _raw_grad(t, env), c)))
                continue
            if b is not None:  # c·Aᵀ(Az + b) = c·AᵀA z + c·Aᵀb
                contrib = arg.adjoint(b, self.block, env)
                const = pl.add(const, contrib if _is_one(c) else c * contrib)
            parts.append((c, self._linear_plan(t, arg, ctx)))
        if const is not None:
            parts.insert(0, (1.0, pl.Constant(const)))
        return pl.Sum(parts) if parts else None

    def _zeros(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """A ``(1, n)`` zero of ``like``'s dtype and device: the placeholder for the state
        argument of a bilinear term's gradient (which does not read it), made once per dtype
        and device (never written: the gradients built from it are new tensors)."""
        cache = self.__dict__.setdefault("_zero_args", {})
        key = (n, like.dtype, like.device)
        z = cache.get(key)
        if z is None or z._version:  # (a term that wrote into it gets a fresh one)
            # a normal tensor also when made under inference_mode: an inference tensor has no
            # version counter to read on the next call, and cannot enter a later autograd call
            with torch.inference_mode(False):
                z = cache[key] = torch.zeros(1, n, dtype=like.dtype, device=like.device)
        return z

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_zero_args", None)  # tensors on some device: made again on use
        state.pop("_gram_facts", None)  # keyed by the terms' ids: made again on use
        state.pop("_gram", None)  # keyed by the terms' ids, which a copy's terms do not have
        state.pop("_recipe_cache", None)  # functions closing over this node: made again on use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a node pickled before the recipe held functions carries its recipe: made again)
        state.pop("_recipe_cache", None)
        self.__dict__.update(state)
        # keyed by the ids of *these* terms (a copy's, an unpickled node's): stale keys would
        # drop the Gram plan, or, where a freed term's id is reused, apply another term's A
        self._gram = _gram_forms(self.terms, self.block)

    def _recipe(self) -> list[tuple[str, Term, Any, Any, Any]] | None:
        """Per term ``(kind, term, folded coefficient or None, arg, offset)`` — for
        ``"bilinear"`` ``arg`` is the index of the argument holding the block and ``offset``
        the function computing the term's constant (:meth:`_bilinear_const`), else ``arg`` is
        the state part ``A z`` of the one argument and ``offset`` its state-free part — or None
        when a term has no plan.  Computed once (the node does not change; not pickled: its
        functions close over this node)."""
        if hasattr(self, "_recipe_cache"):
            return self._recipe_cache
        recipe: list[tuple[str, Term, Any, Any, Any]] | None = []
        for t, idx, c in self._plan:
            kind = getattr(t, "grad_structure", None)
            if self.at or idx is None or kind is None:
                recipe = None
                break
            if kind == "bilinear":
                if len(idx) != 1 or any(a.states() for j, a in enumerate(t.args) if j != idx[0]):
                    recipe = None
                    break
                recipe.append((kind, t, c, idx[0], self._bilinear_const(t, idx[0])))
                continue
            if kind not in ("identity", "elementwise") or len(t.args) != 1:
                recipe = None
                break
            st, off = t.args[0].state_part, t.args[0].offset_part
            if st is None or any(e.symbol is not self.block for e in st.entries):
                recipe = None
                break
            recipe.append((kind, t, c, st, off))
        self._recipe_cache = recipe
        return recipe

    def _linear_plan(self, t: Term, st: Affine, ctx: pl.PlanContext) -> pl.Plan:
        """``AᵀA z`` for the state part ``A z`` of an ``"identity"``-gradient term: the Gram
        matrix when forming it costs less than the applications it replaces, else
        ``Aᵀ(Az)`` per application."""
        form = self._gram.get(id(t))
        if form is not None:
            op, e = form
            n, cheap, names = self._gram_facts_of(t, op)
            if cheap and n <= _gram_batch(names, ctx.env) * ctx.batch:
                like = ctx.like
                if like is None:  # no state given: a weight's, else an input's dtype
                    syms = op.symbols()
                    like = ctx.env.get(syms[0].name) if ctx.env and syms else None
                    like = like if like is not None else next(iter(ctx.values.values()))
                gram = op.gram(like, ctx.env)
                # AᵀA: symmetric (Jᵀ applies it as is, without a transpose view)
                return pl.Matrix(gram if e * e == 1.0 else (e * e) * gram, symmetric=True)
        fwd, adj = _forward(st, self.block, ctx.env), _adjoint(st, self.block, ctx.env)
        return pl.SelfAdjoint(lambda z: adj(fwd(z)))

    def _gram_facts_of(self, t: Term, op: Any) -> tuple[int, bool, tuple[str, ...]]:
        """What does not change between calls, once per Gram-form term: the state size ``n``,
        whether ``AᵀA`` as a matrix can pay at all (``n²`` per sample less than the
        ``2·apply_cost`` of ``Aᵀ(A·)``: ``m·n`` each for a dense ``A``, far less for a
        convolution, and ``n ≤ min(m, GRAM_MAX)``), its weights' names."""
        facts = self.__dict__.setdefault("_gram_facts", {}).get(id(t))
        if facts is None:
            n, m = op.in_size, op.out_size
            facts = self._gram_facts[id(t)] = (
                n, n <= min(m, GRAM_MAX) and n * n <= 2 * op.apply_cost,
                tuple(s.name for s in op.symbols()))
        return facts

    def affine_builder(self, ctx: pl.PlanContext) -> AffineBuilder | None:
        """:meth:`plan`'s fused ``c + zM`` where the recipe makes one: every term bilinear (a
        state-free constant) but one ``"identity"`` term ``½||e·Az||²`` with a Gram form and unit
        coefficient, every coefficient a number.  Per call the builder computes what
        :meth:`plan` computes for that recipe — the constants, then ``e²·AᵀA`` where
        :meth:`_linear_plan` forms it (else None: :meth:`plan` applies ``Aᵀ(A·)``) — and
        ``c`` must be 2-D, as :func:`~lowering.plan._affine_form` asks (else None)."""
        if self.block.name != ctx.var or self.at:
            return None
        recipe = self._recipe()
        if recipe is None:
            return None
        consts: list[tuple[Callable[[Z_t, Any], torch.Tensor | None], float]] = []
        gram_term = None
        for kind, t, c, _arg, off in recipe:
            if c is None:  # a learnable scalar: read from env on every call by plan()
                return None
            if kind == "bilinear":
                consts.append((off, c))
            elif kind == "identity" and off is None and gram_term is None and _is_one(c) \
                    and id(t) in self._gram:
                gram_term = t
            else:
                return None
        if not consts or gram_term is None:
            return None
        op, e = self._gram[id(gram_term)]
        n, cheap, names = self._gram_facts_of(gram_term, op)
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
            if const is None or const.ndim != 2 or n > _gram_batch(names, env) * like.shape[0]:
                return None
            gram = op.gram(like, env)
            return const, (gram if ee == 1.0 else ee * gram)

        return build

    def _bilinear_const(self, t: Term, k: int) -> Callable[[Z_t, Any], torch.Tensor | None]:
        """``(values, env) ↦ Aᵀ∇_{u_k} t`` (None where the term gives no gradient) for the
        bilinear term ``t`` whose argument ``k`` holds the block (the constant :meth:`plan` and
        :meth:`affine_builder` add up): where ``t`` declares the gradient to be another
        argument ``u_j`` (``grad_sources``) and argument ``k`` is the block itself, ``u_j``'s
        value (the input's own tensor when ``u_j`` is one input, as ``Affine.evaluate`` returns
        it), else the gradient call."""
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

        def general(values: Z_t, env: Any) -> torch.Tensor | None:
            us = [None if j == k else a.evaluate(values, env) for j, a in enumerate(args)]
            ref = next(u for u in us if u is not None)
            us[k] = self._zeros(size, ref)
            g = t.raw_grad(us, env)[k]
            return None if g is None else args[k].adjoint(g, block, env)

        return general

    def _gram_matrix(self, t: Term, vals: Z_t, env: Env | None) -> torch.Tensor | None:
        """``e²·AᵀA`` (``n × n``) for a Gram-form term inside :func:`partial_evaluation`, when
        ``n ≤ min(m, GRAM_MAX)`` and ``n ≤ GRAM_BATCH·B`` (forming it, ``n²m``, then costs less
        than the ``2Bnm`` per evaluation it saves over a solve's iterations); else None."""
        form = self._gram.get(id(t))
        cache = _PARTIAL.get()
        if form is None or cache is None:
            return None
        key = ("gram", id(t))
        if key not in cache:
            op, e = form
            n, m = op.in_size, op.out_size
            z = vals[self.block.name]
            if n > min(m, GRAM_MAX) or n > GRAM_BATCH * z.shape[0] or n * n > 2 * op.apply_cost:
                cache[key] = None
            else:
                gram = op.gram(z, env)
                cache[key] = gram if e * e == 1.0 else (e * e) * gram
        return cache[key]

    def lip(self, env: Env | None) -> float:
        inner = max([n.lip(env) for n in self.at.values()], default=1.0)
        return sum(t.grad_lipschitz(env) for t in self.terms) * inner

    def text(self) -> str:
        s = " + ".join(_term_grad_text(t, self.block, self.sign, False) for t in self.terms)
        return (s.replace("+ -", "- ") or "0") + _at_text(self.at, False)

    def latex(self) -> str:
        s = " + ".join(_term_grad_text(t, self.block, self.sign, True) for t in self.terms)
        return (s.replace("+ -", "- ") or "0") + _at_text(self.at, True)


#: plans (the Gram matrix is then formed once per forward call and reused by the backward):
#: formed when ``n²m`` costs less than the ``2Bnm`` per application over the ~30 applications
#: of a forward and adjoint solve (~40 each), i.e. ``n ≤ 80B``; with the weights trained, the
#: Gram matrix's own backward (``2n²m``) triples its cost: ``n ≤ 25B``
GRAM_BATCH_PLAN = 80
GRAM_BATCH_TRAIN = 25


def _gram_batch(names: tuple[str, ...], env: Any) -> int:
    """The batch factor of the Gram test ``n ≤ factor·B``: :data:`GRAM_BATCH_TRAIN` when one
    of the operator's weights ``names`` takes a gradient in this call, else
    :data:`GRAM_BATCH_PLAN`."""
    if torch.is_grad_enabled() and env:
        for name in names:
            if getattr(env.get(name), "requires_grad", False):
                return GRAM_BATCH_TRAIN
    return GRAM_BATCH_PLAN


def _forward(st: Affine, block: Symbol, env: Env | None) -> Any:
    """``z ↦ A z`` for the state part ``A z`` of an argument (one block)."""
    name = block.name
    return lambda z: st.evaluate({name: z}, env)


def _adjoint(st: Affine, block: Symbol, env: Env | None) -> Any:
    """``w ↦ Aᵀ w`` for the state part of an argument."""
    return lambda w: st.adjoint(w, block, env)


def _raw_grad(t: Term, env: Env | None) -> Any:
    """``u ↦ ∇f(u)`` of a one-argument term (without its coefficient)."""
    return lambda u: t.raw_grad([u], env)[0]


#: largest state size for which the Gram matrix ``AᵀA`` of a ``½||Az||²`` term is formed, and
#: the largest ratio state size / batch (a solve evaluates ``T`` ~10–20 times: ``n²m`` to form
#: ``AᵀA`` is then below the ``2Bnm`` per evaluation it saves)
GRAM_MAX = 1024
GRAM_BATCH = 8


def _gram_forms(terms: list[Term], block: Symbol) -> dict[int, tuple[Any, float]]:
    """``id(t) → (A, e)`` for the terms ``t = c·½||e·A z||²`` (closed-form gradient, smooth) of
    ``block`` (:func:`_gram_form`)."""
    out: dict[int, tuple[Any, float]] = {}
    for t in terms:
        if type(t).grad is Term.grad and t.smooth:
            g = _gram_form(t, block)
            if g is not None:
                out[id(t)] = g
    return out


def _gram_form(t: Term, block: Symbol) -> tuple[Any, float] | None:
    """``(A, e)`` when ``t = c·½||e·A z||²`` with ``z`` this block and ``A`` a linear operator
    (its gradient is ``c·e²·AᵀA z``), else None."""
    if len(t.args) != 1:
        return None
    parts = t.quad_parts(None)
    if len(parts) != 1 or parts[0].u2 is not None or parts[0].u1 is not t.args[0]:
        return None
    entries = t.args[0].entries
    if len(entries) != 1 or entries[0].symbol is not block or entries[0].op is None:
        return None
    return entries[0].op, float(entries[0].coef)


def _at_text(at: Mapping[str, Node], latex: bool) -> str:
    if not at:
        return ""
    inner = ", ".join(f"{k} = {n.latex() if latex else n.text()}" for k, n in at.items())
    return f"\\big|_{{{inner}}}" if latex else f" |_({inner})"


class Prox(Node):
    """``prox_{t·g}(inner)`` with g a term or objective with a closed-form prox."""

    def __init__(self, g: Any, inner: Node, t: float = 1.0, text: str | None = None,
                 latex: str | None = None):
        self.g, self.inner, self.t = g, inner, t
        self._text, self._latex = text, latex

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        v = self.inner.eval(Z, env)
        from convex_eq.objective import Objective

        if isinstance(self.g, Objective):
            return self.g.prox(v, self.t, Z, env)
        if isinstance(self.g, MoreauEnvelope):  # its inner objective may read inputs (<Ux, z>)
            return self.g.prox(v, self.t, env, values=Z)
        return self.g.prox(v, self.t, env)

    def lip(self, env: Env | None) -> float:
        return self.inner.lip(env)  # a prox of a convex function is nonexpansive

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        """Planned when ``g`` declares an elementwise prox (``prox_elementwise``)."""
        if not getattr(self.g, "prox_elementwise", False) or not getattr(self.g, "has_prox",
                                                                          False):
            return None
        inner = self.inner.plan(ctx)
        if inner is None:
            return None
        g, t, env = self.g, self.t, ctx.env
        return pl.Elementwise(lambda v: g.prox(v, t, env), inner, has_params=True)

    def text(self) -> str:
        if hasattr(self.g, "prox_text"):
            return self.g.prox_text(self.inner.text(), self.t)
        name = self._text or str(self.g)
        t = "" if self.t == 1.0 else f"{self.t:g}·"
        return f"prox_{{{t}{name}}}({self.inner.text()})"

    def latex(self) -> str:
        if hasattr(self.g, "prox_text"):
            return self.g.prox_text(self.inner.latex(), self.t, latex=True)
        name = self._latex or self.g.latex()
        t = "" if self.t == 1.0 else f"{self.t:g}"
        return f"\\mathrm{{prox}}_{{{t}{name}}}\\big({self.inner.latex()}\\big)"


def _is_one(c: Any) -> bool:
    return isinstance(c, float) and c == 1.0


class ScalarCoef:
    """``offset + factor·s`` for a scalar hyper-parameter ``s`` (e.g. ``α`` and ``1 − α`` of a
    skip connection): read from ``env`` at each evaluation, so a learnable ``s`` gets its
    gradient (``Scalar.coef_value``)."""

    def __init__(self, scalar: Symbol, factor: float = 1.0, offset: float = 0.0):
        self.scalar, self.factor, self.offset = scalar, factor, offset

    def value(self, env: Env | None) -> Any:
        v = self.scalar.coef_value(env)
        v = v if self.factor == 1.0 else self.factor * v
        return v if self.offset == 0.0 else self.offset + v

    def float(self, env: Env | None) -> float:
        return self.offset + self.factor * self.scalar.float(env)

    def fmt(self, latex: bool) -> str:
        name = self.scalar.latex() if latex else self.scalar.name
        if self.offset == 0.0:
            return name if self.factor == 1.0 else f"{self.factor:g}{name}"
        sign = "-" if self.factor < 0 else "+"
        f = abs(self.factor)
        body = name if f == 1.0 else f"{f:g}{name}"
        return f"({self.offset:g} {sign} {body})"


Coef = float | ScalarCoef


def coef_value(c: Coef, env: Env | None) -> Any:
    """A Combo coefficient's value (a float, or a scalar's value read from ``env``)."""
    return c if isinstance(c, float) else c.value(env)


def coef_float(c: Coef, env: Env | None) -> float:
    return c if isinstance(c, float) else c.float(env)


class Combo(Node):
    """``Σ c_k node_k`` (e.g. the skip connection ``α T(z) + (1-α) z``); a coefficient is a
    number or a :class:`ScalarCoef` (a hyper-parameter, possibly learnable)."""

    def __init__(self, parts: list[tuple[Coef, Node]]):
        self.parts = [(c if isinstance(c, ScalarCoef) else float(c), n) for c, n in parts]

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        out = None
        for c, n in self.parts:
            v = n.eval(Z, env)
            v = v if _is_one(c) else coef_value(c, env) * v
            out = v if out is None else out + v
        return out

    def lip(self, env: Env | None) -> float:
        return sum(abs(coef_float(c, env)) * n.lip(env) for c, n in self.parts)

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        parts = []
        for c, n in self.parts:
            p = n.plan(ctx)
            if p is None:
                return None
            parts.append((c if _is_one(c) else coef_value(c, ctx.env), p))
        return pl.Sum(parts)

    def _fmt(self, latex: bool) -> str:
        items = []
        for c, n in self.parts:
            s = n.latex() if latex else n.text()
            cs = c.fmt(latex) if isinstance(c, ScalarCoef) else f"{c:g}"
            items.append(s if _is_one(c) else f"{cs}{' ' if latex else '·'}({s})")
        return " + ".join(items).replace("+ -", "- ")

    def text(self) -> str:
        return self._fmt(False)

    def latex(self) -> str:
        return self._fmt(True)


class Substitute(Node):
    """``node`` evaluated with block ``b`` replaced by ``inner`` (composition ``f(g(z))``)."""

    def __init__(self, node: Node, block: Symbol, inner: Node):
        self.node, self.block, self.inner = node, block, inner

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        vals = dict(Z)
        vals[self.block.name] = self.inner.eval(Z, env)
        return self.node.eval(vals, env)

    def lip(self, env: Env | None) -> float:
        return self.node.lip(env) * self.inner.lip(env)

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        inner = self.inner.plan(ctx)
        outer = self.node.plan(ctx.at(self.block.name)) if inner is not None else None
        return None if outer is None else pl.Compose(outer, inner)

    def text(self) -> str:
        return f"[{self.node.text()}]_({self.block.name} ← {self.inner.text()})"

    def latex(self) -> str:
        return (f"\\big[{self.node.latex()}\\big]_{{{self.block.latex()} \\leftarrow "
                f"{self.inner.latex()}}}")


class Named(Node):
    """A node shown under a short name (e.g. ``f_1``) while evaluating the full expression."""

    def __init__(self, name: str, latex_name: str, node: Node, arg: Node | None = None):
        self.name, self.latex_name, self.node, self.arg = name, latex_name, node, arg

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        return self.node.eval(Z, env)

    def lip(self, env: Env | None) -> float:
        return self.node.lip(env)

    def plan(self, ctx: pl.PlanContext) -> pl.Plan | None:
        return self.node.plan(ctx)

    def text(self) -> str:
        return f"{self.name}({self.arg.text()})" if self.arg is not None else self.name

    def latex(self) -> str:
        return (f"{self.latex_name}({self.arg.latex()})" if self.arg is not None
                else self.latex_name)


class LinearMap(Node):
    """``c·A(inner) + b`` for a linear operator ``A`` (and optional inverse)."""

    def __init__(self, apply: Any, inner: Node, text: str, latex: str, lip: float):
        self._apply, self.inner, self._text, self._latex, self._lip = apply, inner, text, latex, lip

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        return self._apply(self.inner.eval(Z, env), env)

    def lip(self, env: Env | None) -> float:
        return self._lip * self.inner.lip(env)

    def text(self) -> str:
        return self._text.replace("◊", self.inner.text())

    def latex(self) -> str:
        return self._latex.replace("◊", self.inner.latex())


def broadcast_batch(v: torch.Tensor, batch: int) -> torch.Tensor:
    """``(1, n)`` → ``(batch, n)`` (a batch-independent update); other shapes unchanged."""
    if v.ndim == 2 and v.shape[0] == 1 and batch != 1:
        return v.expand(batch, -1).contiguous()
    return v
