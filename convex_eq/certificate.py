"""Convexity certificates: "convex", "convex if ||W||₂ ≤ 1 (now 1.37)", "not convex: … term".

Quadratic summands of all terms are collected into one symmetric form ``Q`` (plus strong
convexity moduli of convex terms); the objective is convex when every other term is convex and
``Q + diag(moduli) ⪰ 0``.  Recognized patterns give exact, readable conditions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .symbols import Env, Symbol
from .terms.base import Condition, Curvature, QuadPart, Term


class TermSum(Protocol):
    """What a certificate reads of an objective (``convex_eq.objective.Objective``, which
    imports this module): its terms and its state blocks."""

    @property
    def terms(self) -> Sequence[Term]: ...

    @property
    def states(self) -> list[Symbol]: ...


@dataclass
class Certificate:
    """Result of ``objective.certificate(...)``: the claim and whether it holds at these weights."""

    #: ``"convex"`` (unconditionally), ``"conditional"`` (convex under ``conditions``) or
    #: ``"nonconvex"``
    kind: str  # "convex" | "conditional" | "nonconvex"
    #: the conditions on the weights under which the objective is convex (e.g. ``||W||₂ ≤ 1``)
    conditions: list[Condition] = field(default_factory=list)
    #: each condition's left-hand side at the evaluated weights, in the order of ``conditions``
    values: list[float] = field(default_factory=list)
    #: True if every condition holds at the evaluated weights
    holds: bool = True
    #: the terms that make the objective nonconvex (``kind == "nonconvex"``)
    nonconvex_terms: list[str] = field(default_factory=list)
    #: why the objective is not certified convex (``kind == "nonconvex"``)
    reason: str = ""
    #: definitions of parameters that terms recompute from the state (the layer is then an
    #: iteration whose fixed points are not stationary points of this objective)
    iteration_parameters: list[str] = field(default_factory=list)

    @property
    def convex(self) -> bool:
        """True if the objective is certified convex at the evaluated weights."""
        return self.kind != "nonconvex" and self.holds

    @property
    def text(self) -> str:
        """One line: ``convex``, ``convex if ||W||₂ ≤ 1 (now 0.9)`` or ``not convex: <why>``."""
        if self.kind == "convex":
            return "convex"
        if self.kind == "conditional":
            conds = " and ".join(f"{c.text} (now {v:.4g})" for c, v in zip(self.conditions,
                                                                              self.values))
            return f"convex if {conds}"
        return f"not convex: {self.reason}"

    def long_text(self) -> str:
        """``text`` with what it means for the equilibria (stationary points only when not
        convex; a violated condition certifies nothing)."""
        if self.kind == "nonconvex" and self.iteration_parameters:
            return (f"{self.text} — recomputed from the state in every iteration: "
                    f"{'; '.join(self.iteration_parameters)}; the layer's fixed points are fixed "
                    "points of that iteration, not stationary points of this objective")
        if self.kind == "nonconvex":
            return f"{self.text} — equilibria are stationary points, not certified minimizers"
        if self.kind == "conditional" and not self.holds:
            return f"{self.text} — condition violated: convexity not certified here"
        return self.text

    def __str__(self) -> str:
        """``text``, plus a warning when a condition fails at the evaluated weights."""
        if self.kind == "conditional" and not self.holds:
            bad = [c.text for c, v in zip(self.conditions, self.values)
                   if not (v <= c.bound + c.tol if c.sense == "<=" else v >= c.bound - c.tol)]
            return f"{self.text} — VIOLATED here ({'; '.join(bad)} fails): convexity not certified"
        return self.text


def _single_op_state(u: object) -> tuple[object, float, object] | None:
    """If ``u = c·A z`` (one entry on a state), return (state, c, A or None)."""
    sp = u.state_part  # type: ignore[attr-defined]
    if sp is None or u.offset_part is not None or len(sp.entries) != 1:  # type: ignore[attr-defined]
        return None
    e = sp.entries[0]
    return e.symbol, e.coef, e.op


def analyze(obj: TermSum) -> Curvature:
    """Structural convexity analysis (conditions are evaluated later at given weights)."""
    bad: list[str] = []
    conditions: list[Condition] = []
    for t in obj.terms:
        if t.quad_parts(None):
            continue
        cur = t.curvature()
        if cur.kind in ("convex", "affine"):
            conditions.extend(cur.conditions)
        else:
            bad.append(f"{t.label} term {t}" + (f" ({cur.reason})" if cur.reason else ""))
    if bad:
        labels = sorted({b.split(" term ")[0] for b in bad})
        reason = ", ".join(f"{lab} term" for lab in labels)
        return Curvature("unknown", [], reason)
    conditions.extend(_quadratic_conditions(obj))
    return Curvature("convex", conditions)


def _quadratic_conditions(obj: TermSum) -> list[Condition]:
    parts: list[QuadPart] = [p for t in obj.terms for p in t.quad_parts(None)]
    mods = [m for t in obj.terms if (m := t.strong_convexity()) is not None]
    risky = [p for p in parts if p.u2 is not None or p.coef < 0]
    if not risky:
        return []
    # Pattern: per state, a·½||z||² (identity, incl. constant moduli) minus one ½κ||A z||²,
    # or plus one modulus factor/||M||² (conjugate term) against a negative identity.
    conds: list[Condition] = []
    states = obj.states
    if len(states) == 1 and all(p.u2 is None for p in parts):
        s = states[0]
        ident, negs, ok = 0.0, [], True
        for p in parts:
            info = _single_op_state(p.u1)
            if info is None or info[0] is not s:
                ok = False
                break
            _, c, op = info
            if op is None:
                ident += p.coef * c * c
            elif p.coef < 0:
                negs.append((-p.coef * c * c, op))
        const_mod = sum(m.factor for m in mods if m.op is None and m.arg is None and m.state is s)
        op_mods = [m for m in mods if m.op is not None and m.arg is None and m.state is s]
        ok = ok and not any(m.arg is not None for m in mods)  # AᵀA moduli: generic λ_min(Q)
        a = ident + const_mod
        if ok and len(negs) == 1 and not op_mods and a > 0:
            kappa, op = negs[0]
            bound = math.sqrt(a / kappa)
            conds.append(Condition(f"||{op}||₂ ≤ {bound:.4g}",
                                   f"\\|{op.latex()}\\|_2 \\le {bound:.4g}",
                                   lambda env, op=op: op.norm(env), bound, "<=", op=op))
            return conds
        if ok and not negs and len(op_mods) == 1 and a < 0:
            m = op_mods[0]
            bound = math.sqrt(m.factor / (-a))
            conds.append(Condition(f"||{m.op}||₂ ≤ {bound:.4g}",
                                   f"\\|{m.op.latex()}\\|_2 \\le {bound:.4g}",
                                   lambda env, op=m.op: op.norm(env), bound, "<=", op=m.op))
            return conds
    conds.append(Condition("λ_min(Q) ≥ 0, Q = Hessian of the quadratic terms + strong-convexity "
                           "moduli of the convex terms",
                           "\\lambda_{\\min}(Q) \\ge 0,\\ Q = \\nabla^2(\\text{quadratic terms}) + "
                           "\\text{strong-convexity moduli}",
                           lambda env: quadratic_eigmin(obj, env), 0.0, ">=",
                           reads=_quadratic_reads(obj)))
    return conds


def _quadratic_reads(obj: TermSum) -> tuple[str, ...]:
    """Names of the symbols :func:`quadratic_eigmin` reads: those of the quadratic terms and
    of the strong-convexity moduli (operators, arguments), with the terms' scalars."""
    out: list[str] = []

    def add(syms: list) -> None:
        out.extend(s.name for s in syms if s.name not in out)

    def affine(u: object) -> list:
        return [s for e in u.entries  # type: ignore[attr-defined]
                for s in (e.symbol, *(() if e.op is None else e.op.symbols()))]

    for t in obj.terms:
        m = t.strong_convexity()
        if t.quad_parts(None):
            add(t.symbols())
        elif m is not None:
            add([*(m.op.symbols() if m.op is not None else []),
                 *(affine(m.arg) if m.arg is not None else []), *t.scalars])
    return tuple(out)


def quadratic_eigmin(obj: TermSum, env: Env | None) -> float:
    """``λ_min`` of the collected quadratic form plus strong-convexity moduli (dense)."""
    states = obj.states
    offs, n = {}, 0
    for s in states:
        offs[s.name] = n
        n += s.size
    if n > 6000:
        raise MemoryError(f"dense certificate for {n} state entries is too large")
    q = np.zeros((n, n))

    def lift(u: object) -> np.ndarray:
        m = np.zeros((u.size, n))  # type: ignore[attr-defined]
        for s in u.states():  # type: ignore[attr-defined]
            o = offs[s.name]
            m[:, o:o + s.size] += u.matrix(s, env)  # type: ignore[attr-defined]
        return m

    for t in obj.terms:
        for p in t.quad_parts(env):
            a1 = lift(p.u1)
            if p.u2 is None:
                q += p.coef * a1.T @ a1
            else:
                a2 = lift(p.u2)
                q += p.coef * (a1.T @ a2 + a2.T @ a1)
        m = t.strong_convexity()
        if m is not None and m.arg is not None:
            a1 = lift(m.arg)
            q += m.modulus(env) * a1.T @ a1
        elif m is not None:
            o = offs[m.state.name]
            idx = np.arange(o, o + m.state.size)
            q[idx, idx] += m.modulus(env)
    return float(np.linalg.eigvalsh(0.5 * (q + q.T)).min())


def keep_default_weights_inside(obj: TermSum) -> None:
    """Scale the weights whose values are the library's draws (``Weight`` without a value) into
    the norm conditions ``||A||₂ ≤ bound`` of ``obj``'s certificate, to ``0.9·bound``
    (``Weight.keep_inside``; docs/theory.md §2): an objective built from defaults is certified
    as built.  Structural only until a value exists (declaring imports no torch)."""
    if not any(getattr(s, "is_default", False) for t in obj.terms for s in t.symbols()):
        return
    for c in analyze(obj).conditions:
        if c.op is None or c.sense != "<=":
            continue
        for s in c.op.symbols():
            if getattr(s, "is_default", False):
                s.keep_inside(c.op, c.bound)


def certify(obj: TermSum, env: Env | None = None) -> Certificate:
    """Evaluate the structural analysis at the given weights."""
    cur = analyze(obj)
    if cur.kind != "convex":
        names = [str(t) for t in obj.terms if not t.quad_parts(None)
                 and t.curvature().kind not in ("convex", "affine")]
        iters = [text for t in obj.terms for text, _ in t.state_parameters()]
        return Certificate("nonconvex", holds=False, nonconvex_terms=names, reason=cur.reason,
                           iteration_parameters=iters)
    if not cur.conditions:
        return Certificate("convex")
    vals = [c.value(env) for c in cur.conditions]
    holds = all(c.holds(env) for c in cur.conditions)
    return Certificate("conditional", cur.conditions, vals, holds)
