"""Expression nodes of a derived fixed-point operator ``T`` (closed-form torch, printable).

A node evaluates on ``Z`` (dict block name → flat batched tensor, plus the inputs) and ``env``
(weights); it prints as plain text and LaTeX and bounds its Lipschitz constant in the state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from convex_eq._lazy import torch
from convex_eq.affine import Affine
from convex_eq.symbols import Env, Symbol
from convex_eq.terms.base import Term
from convex_eq.terms.moreau import MoreauEnvelope
from convex_eq.terms.potential import act_latex as _sig

#: states by name (a string annotation: declaring and deriving load no torch)
Z_t = Mapping[str, "torch.Tensor"]

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


class without_partial_evaluation:  # lower case: used like a function
    """Within the block, nothing is taken from (or put into) the running partial evaluation's
    cache: for an evaluation whose inputs are not the solve's (an input replaced by a value
    that depends on the state, e.g. MOptEq's perturbation-enhanced branch input)."""

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = _PARTIAL.set(None)

    def __exit__(self, *exc: object) -> None:
        _PARTIAL.reset(self.token)


def solve_cache() -> dict[Any, Any] | None:
    """The cache of the running :class:`partial_evaluation` block (one forward solve, whose
    inputs and weights do not change), or None outside one: what a node computes once per
    solve from the weights can be kept there."""
    return _PARTIAL.get()


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

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_ops", None)  # (a planning cache of an older pickle: made again)
        self.__dict__.update(state)

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
                tt = getattr(e.op, "transpose_text", None)
                adj = (tt(latex) if tt is not None
                       else (f"{e.op.latex()}^\\top" if latex else f"{e.op}ᵀ"))
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
        self.eval_plan: list[tuple[Term, list[int] | None, float | None]] = []
        #: terms ``c·½||e·A z||²`` of this block alone: ∇ = c·e²·AᵀA z, the Gram AᵀA formed once
        #: per forward solve when that is cheaper (partial evaluation)
        self.gram_forms: dict[int, tuple[Any, float]] = _gram_forms(self.terms, block)
        for t in self.terms:
            if type(t).grad is not Term.grad or not t.smooth:
                self.eval_plan.append((t, None, None))
                continue
            idx = [k for k, a in enumerate(t.args) if any(s is block for s in a.symbols("state"))]
            self.eval_plan.append((t, idx, None if t.scalars else sign * t.scale))

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        if self.at:  # the arguments read other values than the solve's: no cached parts
            vals = dict(Z)
            for k, n in self.at.items():
                vals[k] = n.eval(Z, env)
            with without_partial_evaluation():
                return self._eval(vals, env)
        return self._eval(Z, env)

    def _eval(self, vals: Z_t, env: Env | None) -> torch.Tensor:
        Z = vals
        out = None
        for t, idx, c in self.eval_plan:
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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("gram_forms", None)  # keyed by the terms' ids, which a copy's terms lack
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_plan" in state:  # an older pickle: its evaluation plan under the former name
            state["eval_plan"] = state.pop("_plan")
        for stale in ("_gram", "_zero_args", "_gram_facts", "_recipe_cache"):
            state.pop(stale, None)  # planning caches of an older pickle: made again on use
        self.__dict__.update(state)
        # keyed by the ids of *these* terms (a copy's, an unpickled node's): stale keys would
        # drop the Gram plan, or, where a freed term's id is reused, apply another term's A
        self.gram_forms = _gram_forms(self.terms, self.block)

    def _gram_matrix(self, t: Term, vals: Z_t, env: Env | None) -> torch.Tensor | None:
        """``e²·AᵀA`` (``n × n``) for a Gram-form term inside :func:`partial_evaluation`, when
        ``n ≤ min(m, GRAM_MAX)`` and ``n ≤ GRAM_BATCH·B`` (forming it, ``n²m``, then costs less
        than the ``2Bnm`` per evaluation it saves over a solve's iterations); else None."""
        form = self.gram_forms.get(id(t))
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
        if self.block.kind != "state":  # an input replaced: the solve's cached parts are stale
            with without_partial_evaluation():
                return self.node.eval(vals, env)
        return self.node.eval(vals, env)

    def lip(self, env: Env | None) -> float:
        return self.node.lip(env) * self.inner.lip(env)

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
