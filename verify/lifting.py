"""Numeric lifting of an objective for the scipy references (docs/theory.md §9.2 and §9.3).

``lift(obj, inputs, env)`` rewrites ``G`` as a function ``F(v)`` of free variable blocks with box
bounds, mirroring the CVXPY export without the DCP restriction:

* a state ``z`` with a conjugate term ``ψ*(z)``, ``ψ = s Σσ̃(Mz + q)``, becomes a dual block
  ``y`` (bounds: the domain of ``σ̃*``) with ``z = s Mᵀ y`` and ``ψ*(z) → s(Σσ̃*(y) - <q, y>)``
  (docs/theory.md §2, the y-form; convex exactly when the z-form is);
* a Moreau envelope ``c·M^μ_f(v)`` whose inner ``f`` has no closed-form prox becomes an
  auxiliary block ``u`` with ``c[f(u) + ||u - v||²/(2μ)]`` (inf-convolution, jointly convex when
  ``f`` is: the inner envelope is computed by minimizing over ``u`` together with the rest);
* a term whose domain is a box in an affine argument ``u = Mz + c`` of one state (``Σσ̃*(Mz)``
  of TPAMI Eq. 4: ``dom = {Mz ≥ 0}`` for ReLU, a polyhedron in ``z``), with ``M`` of full row
  rank, becomes the block ``y = Mz + c`` (bounds: the term's ``domain_box``) plus, when ``M``
  is wide, the block ``w = Nᵀz`` on ``ker M`` (``z = M⁺(y − c) + Nw``, an affine bijection,
  so stationary points and minimizers correspond); the term itself is evaluated at ``y``;
* every other term is evaluated by its own ``value`` rule; a potential ``Σf_σ(z)`` on a state
  gives the box bounds ``z ∈ dom f_σ``.

Gradients are exact (torch autograd of the terms' value rules, float64); Hessians for the
second-order check are central differences of those exact gradients.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.linalg
import scipy.optimize as so
import torch

from convex_eq.affine import as_affine
from convex_eq.errors import ConvexEqError, ShapeError
from convex_eq.objective import Objective
from convex_eq.symbols import State
from convex_eq.terms.conjugate import inner_argmin
from convex_eq.terms.moreau import MoreauEnvelope
from convex_eq.terms.potential import activation_box

T64 = torch.float64
_aux_ids = itertools.count()
V = Mapping[str, torch.Tensor]


@dataclass
class Block:
    """A block of free variables ``v[sl]`` with box bounds; ``origin`` state/dual/aux."""

    name: str
    size: int
    lo: np.ndarray
    hi: np.ndarray
    origin: str
    of: str
    sl: slice = field(default_factory=lambda: slice(0, 0))


@dataclass
class Dual:
    """State ``z = s Mᵀ y`` lifted to the dual block ``y`` (``M``: m × n); ``act`` and ``q``
    (evaluated at the sample, None when absent or not a function of the inputs alone) define
    the inner problem of ``ψ*`` that determines ``y`` from ``z`` (:meth:`argmin`)."""

    block: str
    M: np.ndarray
    s: float
    act: Any = None
    q: np.ndarray | None = None
    q_known: bool = True

    def argmin(self, z: np.ndarray) -> np.ndarray | None:
        """``y(z) = argmin{Σσ̃*(y) − <q, y> : Mᵀy = z/s}`` (``inner_argmin``: the Fenchel dual
        by Newton from ``w = z``, exact at a fixed point ``z = sMᵀσ(Mz + q)``, accepted only
        at constraint residual ~1e-12); None where it is not found (``z`` outside ``dom ψ*``)
        or ``q`` is unknown."""
        if self.act is None or not self.q_known:
            return None
        m = torch.as_tensor(self.M, dtype=T64)
        q = torch.zeros(m.shape[0], dtype=T64) if self.q is None else torch.as_tensor(self.q)
        zt = torch.as_tensor(np.asarray(z, dtype=np.float64).reshape(-1))
        y = inner_argmin(self.act, m, q, zt / self.s, start=zt)
        return None if y is None else y.numpy().copy()


@dataclass
class Substitution:
    """State ``z = M⁺(y − c) + N w`` lifted to ``y = Mz + c`` (a box) and ``w = Nᵀz`` (free;
    absent when ``M`` is square), ``M``: m × n of full row rank, ``N``: orthonormal basis of
    ``ker M``; ``term`` is the term whose domain box ``y`` carries."""

    block: str
    null_block: str | None
    M: np.ndarray
    c: np.ndarray
    N: np.ndarray
    term: Any


@dataclass
class MinResult:
    """Outcome of a bound-constrained local minimization of ``F``."""

    v: np.ndarray
    f: float
    pg: float
    nit: int
    message: str
    success: bool
    method: str


@dataclass
class LiftedProblem:
    """``F(v) = Σ contributions(v)`` over stacked free blocks; ``state_fns`` map back to states."""

    blocks: list[Block] = field(default_factory=list)
    contributions: list[Callable[[V], torch.Tensor]] = field(default_factory=list)
    state_fns: dict[str, Callable[[V], torch.Tensor]] = field(default_factory=dict)
    duals: dict[str, Dual] = field(default_factory=dict)
    #: states lifted to ``y = Mz + c`` (a term's domain box in an affine argument)
    substitutions: dict[str, Substitution] = field(default_factory=dict)
    top_states: list[str] = field(default_factory=list)
    n: int = 0
    coupled: bool = False
    #: non-smooth separable terms with a closed-form prox on a plain block (e.g. ``γ||z||₁``):
    #: block name → term; their contributions are excluded from the smooth gradient
    prox_terms: dict[str, Any] = field(default_factory=dict)
    nonsmooth: set[int] = field(default_factory=set)
    env: Any = None

    # ------------------------------------------------------------------ structure
    def add_block(self, name: str, size: int, lo: np.ndarray, hi: np.ndarray, origin: str,
                  of: str) -> Block:
        """Append a block of ``size`` free variables."""
        b = Block(name, size, lo, hi, origin, of, slice(self.n, self.n + size))
        self.blocks.append(b)
        self.n += size
        return b

    @property
    def lower(self) -> np.ndarray:
        """Lower bounds of the lifted variables (``-inf`` where unbounded)."""
        return np.concatenate([b.lo for b in self.blocks]) if self.blocks else np.zeros(0)

    @property
    def upper(self) -> np.ndarray:
        """Upper bounds of the lifted variables (``+inf`` where unbounded)."""
        return np.concatenate([b.hi for b in self.blocks]) if self.blocks else np.zeros(0)

    def clip(self, v: np.ndarray) -> np.ndarray:
        """Projection onto the box."""
        return np.clip(v, self.lower, self.upper)

    def split(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat ``(N,)`` or batched ``(K, N)`` → block name → ``(K, size)``."""
        vv = v.reshape(-1, self.n)
        return {b.name: vv[:, b.sl] for b in self.blocks}

    # ------------------------------------------------------------------ evaluation
    def values_t(self, v: torch.Tensor) -> torch.Tensor:
        """``F`` at each row of ``(K, N)`` (rows independent unless a term is batch-coupled)."""
        parts = self.split(v)
        tot = torch.zeros(v.reshape(-1, self.n).shape[0], dtype=T64)
        for c in self.contributions:
            tot = tot + c(parts)
        return tot

    def value_t(self, v: torch.Tensor) -> torch.Tensor:
        """``F(v)`` as a 0-d tensor (autograd-able)."""
        return self.values_t(v.reshape(1, self.n)).sum()

    def grads(self, vs: np.ndarray) -> np.ndarray:
        """``∇F`` at each row of ``(K, N)`` in one autograd call (a loop if batch-coupled)."""
        if self.coupled:
            return np.stack([self.grad(v) for v in vs])
        vt = torch.as_tensor(np.array(vs, dtype=np.float64)).requires_grad_()
        f = self.values_t(vt)
        if not f.requires_grad:  # F does not depend on v
            return np.zeros_like(vt.detach().numpy())
        (g,) = torch.autograd.grad(f.sum(), vt)
        return np.nan_to_num(g.detach().numpy(), nan=0.0, posinf=1e300, neginf=-1e300)

    def value(self, v: np.ndarray) -> float:
        """``F(v)`` (``inf`` outside the domain)."""
        with torch.no_grad():
            return float(self.value_t(torch.as_tensor(v, dtype=T64)))

    def fun_grad(self, v: np.ndarray) -> tuple[float, np.ndarray]:
        """``(F(v), ∇F(v))`` by autograd (float64)."""
        vt = torch.as_tensor(np.array(v, dtype=np.float64)).requires_grad_()
        f = self.value_t(vt)
        if not torch.isfinite(f):
            return math.inf, np.zeros_like(v)
        if not f.requires_grad:  # F does not depend on v
            return float(f), np.zeros_like(vt.detach().numpy())
        (g,) = torch.autograd.grad(f, vt)
        f = f.detach()
        g = g.detach().numpy()
        if not np.all(np.isfinite(g)):
            g = np.nan_to_num(g, nan=0.0, posinf=1e300, neginf=-1e300)
        return float(f), g

    def grad(self, v: np.ndarray) -> np.ndarray:
        """``∇F(v)`` of the lifted objective (exact, by autograd)."""
        return self.fun_grad(v)[1]

    def smooth_grad(self, v: np.ndarray, raw: bool = False) -> np.ndarray:
        """``∇h(v)``: autograd of every contribution except the prox terms (``raw``: NaN/Inf
        kept; otherwise replaced by 0 / ±1e300 for the optimizers)."""
        vt = torch.as_tensor(np.array(v, dtype=np.float64)).requires_grad_()
        parts = self.split(vt)
        tot = torch.zeros((), dtype=T64)
        for i, c in enumerate(self.contributions):
            if i not in self.nonsmooth:
                tot = tot + c(parts).sum()
        if not tot.requires_grad:  # no smooth contribution depends on v (e.g. only a prox term)
            return np.zeros_like(v, dtype=np.float64)
        (g,) = torch.autograd.grad(tot, vt, allow_unused=True)
        if g is None:
            return np.zeros_like(v)
        if raw:
            return g.detach().numpy()
        return np.nan_to_num(g.detach().numpy(), nan=0.0, posinf=1e300, neginf=-1e300)

    def prox_step(self, w: np.ndarray, t: float = 1.0) -> np.ndarray:
        """``prox_{t·g}(w)``, ``g`` = prox terms + box indicator (separable: the 1-D prox of a
        convex term followed by the clip is the prox of their sum)."""
        out = np.array(w, dtype=np.float64)
        for b in self.blocks:
            term = self.prox_terms.get(b.name)
            if term is not None:
                wt = torch.as_tensor(out[b.sl]).reshape(1, b.size)
                out[b.sl] = term.prox(wt, t, self.env)[0].detach().numpy()
        return self.clip(out)

    def projected_gradient(self, v: np.ndarray) -> float:
        """Forward–backward residual ``||v - prox_g(v - ∇h(v))||`` with unit step (the projected
        gradient when ``g`` is only the box); zero iff ``v`` is stationary; ``inf`` where ``F``
        is not finite (nothing is stationary outside the domain)."""
        if not math.isfinite(self.value(v)):
            return math.inf
        g = self.smooth_grad(v, raw=True)
        if not np.all(np.isfinite(g)):  # e.g. a domain edge where ∇f_σ* = σ(∞): not stationary
            return math.inf
        return float(np.linalg.norm(v - self.prox_step(v - g)))

    def states(self, v: np.ndarray) -> dict[str, np.ndarray]:
        """The top-level states at ``v`` (flat ``(size,)`` arrays)."""
        with torch.no_grad():
            parts = self.split(torch.as_tensor(v, dtype=T64))
            return {s: self.state_fns[s](parts)[0].numpy().copy() for s in self.top_states}

    def lift_point(self, z: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """A free vector ``v`` with the given top-level states (None if it is not determined
        by them: auxiliary envelope blocks; a dual ``y`` with ``Mᵀ`` not injective is the
        inner argmin of ``ψ*`` at the state, :meth:`Dual.argmin`)."""
        v = np.zeros(self.n)
        for b in self.blocks:
            if b.origin == "state" and b.of in z:
                v[b.sl] = np.asarray(z[b.of], dtype=np.float64).reshape(-1)
            elif b.origin == "dual" and b.of in z:
                d = self.duals[b.of]
                if np.linalg.matrix_rank(d.M) < d.M.shape[0]:  # y not linear in z
                    y = d.argmin(np.asarray(z[b.of], dtype=np.float64))
                    if y is None:
                        return None
                    v[b.sl] = y
                    continue
                target = np.asarray(z[b.of], dtype=np.float64).reshape(-1) / d.s
                y, *_ = np.linalg.lstsq(d.M.T, target, rcond=None)
                if np.linalg.norm(d.M.T @ y - target) > 1e-9 * max(1.0, np.linalg.norm(target)):
                    return None
                v[b.sl] = y
            elif b.origin == "subst" and b.of in z:
                sub = self.substitutions[b.of]
                zz = np.asarray(z[b.of], dtype=np.float64).reshape(-1)
                v[b.sl] = sub.M @ zz + sub.c if b.name == sub.block else sub.N.T @ zz
            else:
                return None
        # round-off outside a closed bound (e.g. -1e-17 for a ReLU state) is clipped; a real
        # violation stays and makes F infinite (nothing is stationary outside the domain)
        c = self.clip(v)
        small = np.abs(c - v) <= 1e-10 * np.maximum(1.0, np.abs(v))
        return np.where(small, c, v)

    def start_point(self) -> np.ndarray:
        """A deterministic interior start: 0 where admissible, else the box midpoint / lo+1."""
        lo, hi = self.lower, self.upper
        v = np.zeros(self.n)
        out = (v < lo) | (v > hi)
        both = np.isfinite(lo) & np.isfinite(hi)
        with np.errstate(invalid="ignore"):
            v = np.where(out & both, 0.5 * (lo + hi), v)
            v = np.where(out & ~both & np.isfinite(lo), lo + 1.0, v)
            v = np.where(out & ~both & np.isfinite(hi), hi - 1.0, v)
        return v

    def bounds(self) -> list[tuple[float | None, float | None]]:
        """The box ``lo ≤ v ≤ hi`` in scipy's format (``None`` for an infinite bound)."""
        return [(None if not np.isfinite(a) else float(a), None if not np.isfinite(b) else float(b))
                for a, b in zip(self.lower, self.upper)]

    def has_bounds(self) -> bool:
        """``True`` iff some lifted variable has a finite bound."""
        return bool(np.isfinite(self.lower).any() or np.isfinite(self.upper).any())


class BatchLifted(LiftedProblem):
    """The lifted problem of a batch-coupled objective over the whole batch: ``F(V) = Σ_b F_b``
    plus the coupled terms (HSIC, decorrelation) seen with all ``B`` rows at once; the free
    vector is the ``B`` per-sample lifted vectors stacked (``n = B·n_1``).  Lifting one sample
    would evaluate a coupled term on a batch of 1: a different function (or none, for HSIC)."""

    def __init__(self, per_sample: LiftedProblem, batch: int):
        super().__init__(blocks=per_sample.blocks, contributions=per_sample.contributions,
                         state_fns=per_sample.state_fns, duals=per_sample.duals,
                         substitutions=per_sample.substitutions,
                         top_states=per_sample.top_states, n=per_sample.n * batch,
                         coupled=False, prox_terms=per_sample.prox_terms,
                         nonsmooth=per_sample.nonsmooth, env=per_sample.env)
        self.one, self.batch = per_sample, batch

    @property
    def lower(self) -> np.ndarray:
        """Lower bounds of the stacked batch variables."""
        return np.tile(self.one.lower, self.batch)

    @property
    def upper(self) -> np.ndarray:
        """Upper bounds of the stacked batch variables."""
        return np.tile(self.one.upper, self.batch)

    def split(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """One stacked vector ``(B·n_1,)`` → block name → ``(B, size)``."""
        return self.one.split(v.reshape(self.batch, self.one.n))

    def values_t(self, v: torch.Tensor) -> torch.Tensor:
        """``F`` of the whole batch (one value: the batch objective couples the samples)."""
        return super().values_t(v.reshape(1, self.n)).sum().reshape(1)

    def grads(self, vs: np.ndarray) -> np.ndarray:
        """``∇F`` at each stacked batch point of ``vs`` (one gradient per row)."""
        return np.stack([self.grad(v) for v in vs])

    def prox_step(self, w: np.ndarray, t: float = 1.0) -> np.ndarray:
        """``prox_{t·g}`` applied sample by sample (``g`` is separable across samples)."""
        rows = np.asarray(w, dtype=np.float64).reshape(self.batch, self.one.n)
        return np.concatenate([self.one.prox_step(r, t) for r in rows])

    def rows(self, v: np.ndarray) -> np.ndarray:
        """The stacked variable ``(B·N,)`` as one row per sample, ``(B, N)``."""
        return np.asarray(v, dtype=np.float64).reshape(self.batch, self.one.n)

    def states(self, v: np.ndarray) -> dict[str, np.ndarray]:
        """Top-level states, ``(B, size)`` each."""
        with torch.no_grad():
            parts = self.split(torch.as_tensor(v, dtype=T64))
            return {s: self.state_fns[s](parts).numpy().copy() for s in self.top_states}

    def lift_point(self, z: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """``z``: name → ``(B, size)``."""
        vs = [self.one.lift_point({k: np.asarray(a)[b] for k, a in z.items()})
              for b in range(self.batch)]
        return None if any(v is None for v in vs) else np.concatenate(vs)

    def start_point(self) -> np.ndarray:
        """The single-sample start point repeated for every sample."""
        return np.tile(self.one.start_point(), self.batch)


def lift_batch(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Any) -> BatchLifted:
    """Lift a batch-coupled ``obj`` over the whole batch of ``inputs`` (name → ``(B, size)``)."""
    batch = next(iter(inputs.values())).shape[0] if inputs else 1
    return BatchLifted(lift(obj, inputs, env), batch)

# ---------------------------------------------------------------------- building
def _closed_form_prox(t: MoreauEnvelope, size: int, inputs: V, env: Any) -> bool:
    """True if the envelope's inner objective has a closed-form prox (then its value is used)."""
    try:
        rows = next(iter(inputs.values())).shape[0] if inputs else 1
        vals = {s.name: torch.zeros(rows, s.size, dtype=T64) for s in t.inner.states}
        vals.update(inputs)
        out = t.value(vals, env)
        return bool(torch.isfinite(out).all())
    except (ConvexEqError, NotImplementedError):
        return False


def lift(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Any) -> LiftedProblem:
    """Lift ``obj`` at one sample of ``inputs`` (name → ``(1, size)`` float64)."""
    p = LiftedProblem(env=env)
    _lift_into(p, obj, {}, 1.0, dict(inputs), env)
    p.top_states = [s.name for s in obj.states]
    return p


def _values_fn(p: LiftedProblem, obj: Objective, alias: dict[str, str], inputs: V
               ) -> Callable[[V], dict[str, torch.Tensor]]:
    names = [s.name for s in obj.states]

    def values(parts: V) -> dict[str, torch.Tensor]:
        k_rows = next(iter(parts.values())).shape[0]
        out = {k: v.expand(k_rows, -1) for k, v in inputs.items()}
        for k in names:
            out[k] = p.state_fns[alias.get(k, k)](parts)
        return out

    return values


def _lift_into(p: LiftedProblem, obj: Objective, alias: dict[str, str], scale: float,
               inputs: dict[str, torch.Tensor], env: Any) -> None:
    for s in obj.states:
        name = alias.get(s.name, s.name)
        if name in p.state_fns:
            continue
        conj = [t for t in obj.terms if t.lift_role == "dual"
                and t.state is s and t.coef(env) > 0]
        if len(conj) == 1:
            c = conj[0]
            m = np.asarray(c.op.matrix(env), dtype=np.float64)
            lo, hi = activation_box(*c.act.domain, m.shape[0], c.act.smooth_potential)
            blk = p.add_block(f"{name}__y", m.shape[0], lo, hi, "dual", name)
            mt = torch.as_tensor(m, dtype=T64)
            p.state_fns[name] = (lambda parts, b=blk.name, mt=mt, sc=c.s: sc * parts[b] @ mt)
            try:  # q at this sample (inputs and weights only), for Dual.argmin
                qv = None if c.q is None else c.q.evaluate(dict(inputs), env).to(T64)
                qn, known = (None if qv is None else qv.reshape(-1).numpy().copy()), True
            except (ConvexEqError, KeyError):
                qn, known = None, False
            p.duals[name] = Dual(blk.name, m, c.s, c.act, qn, known)
            continue
        if not alias and _substitute(p, obj, s, name, inputs, env):
            continue
        lo = np.full(s.size, -np.inf)
        hi = np.full(s.size, np.inf)
        for t in obj.terms:  # each term states its own domain box (Term.domain_box)
            box = t.domain_box(s.size, env) if t.prox_state is s else None
            if box is not None:
                lo, hi = np.maximum(lo, box[0]), np.minimum(hi, box[1])
        origin = "state" if not alias else "aux"
        blk = p.add_block(name, s.size, lo, hi, origin, name)
        p.state_fns[name] = (lambda parts, b=blk.name: parts[b])
    values = _values_fn(p, obj, alias, inputs)
    p.coupled = p.coupled or any(getattr(t, "batch_coupled", False) for t in obj.terms)
    subst_terms = {id(sub.term): sub for sub in p.substitutions.values()}
    for t in obj.terms:
        if id(t) in subst_terms:  # evaluated at its own block y = Mz + c (exactly in its box)
            sub = subst_terms[id(t)]
            y_sym = State(f"{sub.block}__arg", sub.M.shape[0])
            ty = t.with_args([as_affine(y_sym)])

            def subst_val(parts: V, ty: Any = ty, y: str = y_sym.name, b: str = sub.block
                          ) -> torch.Tensor:
                return scale * ty.value({y: parts[b]}, env)

            separable = ty.lift_prox if ty.lift_prox is not None else getattr(ty, "separable",
                                                                              False)
            if (not ty.smooth and separable and ty.has_prox and scale == 1.0
                    and sub.block not in p.prox_terms):
                p.prox_terms[sub.block] = ty
                p.nonsmooth.add(len(p.contributions))
            p.contributions.append(subst_val)
        elif t.lift_role == "dual" and t.coef(env) > 0 and \
                alias.get(t.state.name, t.state.name) in p.duals:
            d = p.duals[alias.get(t.state.name, t.state.name)]
            c = scale * t.coef(env) * t.s

            def conj_val(parts: V, t: Any = t, d: Dual = d, c: float = c) -> torch.Tensor:
                y = parts[d.block]
                val = t.act.antiderivative_conjugate(y).sum(-1)
                if t.q is not None:
                    q = t.q.evaluate(values(parts), env).to(T64)
                    val = val - (q * y).sum(-1)
                return c * val

            p.contributions.append(conj_val)
        elif t.lift_role == "envelope" and not _closed_form_prox(t, t.state.size, inputs, env):
            outer = alias.get(t.state.name, t.state.name)
            aux = f"{outer}__env{next(_aux_ids)}"
            c = scale * t.coef(env)
            mu = t.mu_value(env)
            _lift_into(p, t.inner, {t.state.name: aux}, c, inputs, env)

            def coupling(parts: V, aux: str = aux, outer: str = outer, c: float = c,
                         mu: float = mu) -> torch.Tensor:
                diff = p.state_fns[aux](parts) - p.state_fns[outer](parts)
                return c / (2 * mu) * (diff * diff).sum(-1)

            p.contributions.append(coupling)
        else:
            def term_val(parts: V, t: Any = t) -> torch.Tensor:
                return scale * t.value(values(parts), env)

            st = t.prox_state
            blk = alias.get(st.name, st.name) if st is not None else None
            # Σ_j g(u_j) with 1-D proxes (Term.lift_prox; a potential enters as its box)
            separable = t.lift_prox if t.lift_prox is not None else getattr(t, "separable",
                                                                             False)
            if (not t.smooth and st is not None
                    and separable and t.has_prox and t.coef(env) > 0
                    and blk is not None and blk not in p.prox_terms
                    and any(b.name == blk for b in p.blocks) and scale == 1.0):
                p.prox_terms[blk] = t
                p.nonsmooth.add(len(p.contributions))
            p.contributions.append(term_val)


def _affine_domain(t: Any, s: Any, env: Any) -> tuple[np.ndarray, Any, Any] | None:
    """``(M, c, box)`` if ``t``'s domain is the box ``box`` in its one argument ``u = Mz + c``
    with ``u`` not the bare state ``s`` (``c``: the affine offset of inputs/weights, or None)."""
    if len(t.args) != 1 or t.prox_state is not None or t.lift_role != "value":
        return None
    u = t.args[0]
    if u.states() != [s] or any(e.symbol.kind not in ("state", "input", "weight", "constant")
                                for e in u.entries):
        return None
    box = t.domain_box(u.size, env)
    if box is None or not (np.isfinite(box[0]).any() or np.isfinite(box[1]).any()):
        return None
    return u.matrix(s, env), u.offset_part, box


def _substitute(p: LiftedProblem, obj: Objective, s: Any, name: str, inputs: V, env: Any
                ) -> bool:
    """Lift state ``s`` to ``y = Mz + c`` (and ``w = Nᵀz``) when exactly one term constrains it
    through a box in an affine argument of full row rank and no term boxes ``z`` itself;
    False (nothing added) otherwise."""
    if any(t.prox_state is s and t.domain_box(s.size, env) is not None for t in obj.terms):
        return False
    found = [(t, d) for t in obj.terms if (d := _affine_domain(t, s, env)) is not None]
    if len(found) != 1:
        return False
    t, (m, off, (lo, hi)) = found[0]
    if m.shape[0] > m.shape[1] or np.linalg.matrix_rank(m) < m.shape[0]:
        return False  # {Mz + c ∈ box} is not a box in any coordinates of z
    rows = next(iter(inputs.values())).shape[0] if inputs else 1
    if off is None:
        c = np.zeros(m.shape[0])
    else:
        with torch.no_grad():
            cv = off.evaluate(dict(inputs), env).to(T64).reshape(-1, m.shape[0])
        if cv.shape[0] != 1 or rows != 1:
            return False  # one sample at a time
        c = cv[0].numpy().copy()
    null = scipy.linalg.null_space(m) if m.shape[0] < m.shape[1] else np.zeros((m.shape[1], 0))
    yb = p.add_block(f"{name}__Mz", m.shape[0], lo, hi, "subst", name)
    wb = (p.add_block(f"{name}__kerM", null.shape[1], np.full(null.shape[1], -np.inf),
                      np.full(null.shape[1], np.inf), "subst", name) if null.shape[1] else None)
    pinv_t = torch.as_tensor(np.linalg.pinv(m).T, dtype=T64)
    null_t = torch.as_tensor(null.T, dtype=T64)
    c_t = torch.as_tensor(c, dtype=T64)

    def z_of(parts: V, y: str = yb.name, w: str | None = None if wb is None else wb.name
             ) -> torch.Tensor:
        z = (parts[y] - c_t) @ pinv_t  # z = M⁺(y − c) + N w
        return z if w is None else z + parts[w] @ null_t

    p.state_fns[name] = z_of
    p.substitutions[name] = Substitution(yb.name, None if wb is None else wb.name, m, c, null, t)
    return True


# ---------------------------------------------------------------------- minimization
def minimize(p: LiftedProblem, v0: np.ndarray, *, gtol: float = 1e-12, maxiter: int = 20000,
             polish: bool = True) -> MinResult:
    """L-BFGS-B (exact gradients, box bounds) from ``v0``, then optional projected Newton
    polishing (Hessian by central differences of the exact gradient) to ~1e-13."""
    v0 = p.clip(np.asarray(v0, dtype=np.float64))
    method = "scipy L-BFGS-B (exact autograd gradients)"
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = so.minimize(p.fun_grad, v0, jac=True, method="L-BFGS-B", bounds=p.bounds(),
                          options={"maxiter": maxiter, "maxfun": 4 * maxiter, "ftol": 1e-16,
                                   "gtol": gtol, "maxcor": 30})
        v = p.clip(res.x)
        nit = int(res.get("nit", 0))  # absent when every variable is fixed (lo == hi)
        if p.prox_terms and np.all(np.isfinite(v)):
            # |·|-type terms: L-BFGS-B only gets close; FISTA identifies the support
            v, k = prox_gradient_polish(p, v, iters=300 if polish else 100)
            nit += k
            method += " + accelerated proximal-gradient"
        if polish and np.all(np.isfinite(v)):
            v, k = newton_polish(p, v)
            nit += k
            method += " + projected Newton polish"
        f = p.value(v) if np.all(np.isfinite(v)) else math.nan
        pg = p.projected_gradient(v) if np.all(np.isfinite(v)) else math.inf
    msg = res.message if isinstance(res.message, str) else str(res.message)
    if not np.isfinite(f) or f < -1e100:
        msg += " (objective unbounded below along this run)"
    return MinResult(v, f, pg, nit, msg, bool(np.isfinite(f)), method)


def prox_gradient_polish(p: LiftedProblem, v: np.ndarray, iters: int = 3000,
                         tol: float = 1e-14) -> tuple[np.ndarray, int]:
    """FISTA with backtracking and adaptive restart on ``h + g`` (``g``: prox terms + box)."""

    def h(u: np.ndarray) -> float:
        vt = torch.as_tensor(u, dtype=T64)
        with torch.no_grad():
            parts = p.split(vt)
            return float(sum(c(parts).sum() for i, c in enumerate(p.contributions)
                             if i not in p.nonsmooth))

    x, y, tk, lip = v.copy(), v.copy(), 1.0, 1.0
    k = 0
    if not math.isfinite(p.value(v)):
        return v, 0
    for k in range(1, iters + 1):
        gy, hy = p.smooth_grad(y), h(y)
        while True:
            xn = p.prox_step(y - gy / lip, 1.0 / lip)
            d = xn - y
            if h(xn) <= hy + float(gy @ d) + 0.5 * lip * float(d @ d) + 1e-15 * max(1.0, abs(hy)):
                break
            lip *= 2.0
        tn = 0.5 * (1 + math.sqrt(1 + 4 * tk * tk))
        restart = float((xn - x) @ (y - xn)) > 0
        y = xn if restart else xn + (tk - 1) / tn * (xn - x)
        tk = 1.0 if restart else tn
        x = xn
        lip = max(lip / 1.5, 1e-12)
        if k % 10 == 0 and p.projected_gradient(x) <= tol * max(1.0, float(np.linalg.norm(x))):
            break
    return x, k


def active_set(p: LiftedProblem, v: np.ndarray, g: np.ndarray, tol: float = 1e-10
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(at_lower, at_upper)`` masks of coordinates on their bound with the gradient pushing
    outwards (``g ≥ 0`` at a lower bound)."""
    lo, hi = p.lower, p.upper
    with np.errstate(invalid="ignore"):
        at_lo = np.isfinite(lo) & (v <= lo + tol * np.maximum(1.0, np.abs(lo))) & (g >= 0)
        at_hi = np.isfinite(hi) & (v >= hi - tol * np.maximum(1.0, np.abs(hi))) & (g <= 0)
    return at_lo, at_hi


def fd_hessian(p: LiftedProblem, v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Symmetrized Hessian of ``F`` on coordinates ``idx`` by central differences of ``∇F``
    (one-sided where a bound is closer than the step)."""
    k = len(idx)
    h = np.zeros((k, k))
    if k == 0:
        return h
    lo, hi = p.lower, p.upper
    pts = np.repeat(v[None, :], 2 * k, axis=0)
    widths = np.zeros(k)
    for a, j in enumerate(idx):
        step = 1e-6 * max(1.0, abs(v[j]))
        up = min(step, (hi[j] - v[j]) if np.isfinite(hi[j]) else step)
        dn = min(step, (v[j] - lo[j]) if np.isfinite(lo[j]) else step)
        pts[2 * a, j] += up
        pts[2 * a + 1, j] -= dn
        widths[a] = up + dn
    gs = p.grads(pts)
    for a in range(k):
        if widths[a] > 0:
            h[:, a] = (gs[2 * a, idx] - gs[2 * a + 1, idx]) / widths[a]
    return 0.5 * (h + h.T)


def exact_hessian(p: LiftedProblem, v: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    """Hessian of ``F`` on coordinates ``idx`` by autograd (the one-sided second derivative of
    a piecewise-quadratic term at ``v`` itself: central differences straddle a kink closer than
    their step, e.g. ``σ̃*`` of leaky ReLU at ``y ≈ 0``, and Newton then stalls); None where
    it is not finite."""
    vt = torch.as_tensor(np.asarray(v, dtype=np.float64))
    it = torch.as_tensor(np.asarray(idx, dtype=np.int64))

    def f(u: torch.Tensor) -> torch.Tensor:
        return p.value_t(vt.index_put((it,), u))

    try:
        h = torch.autograd.functional.hessian(f, vt[it]).detach().numpy()
    except RuntimeError:
        return None
    return 0.5 * (h + h.T) if np.all(np.isfinite(h)) else None


def newton_polish(p: LiftedProblem, v: np.ndarray, iters: int = 25) -> tuple[np.ndarray, int]:
    """Projected Newton steps on the free coordinates while the projected gradient decreases."""
    f, g = p.fun_grad(v)
    if not math.isfinite(f):
        return v, 0
    pg = p.projected_gradient(v)
    k = 0
    for _ in range(iters):
        k += 1
        if pg <= 1e-14 * max(1.0, float(np.linalg.norm(v))) or not math.isfinite(f):
            break
        at_lo, at_hi = active_set(p, v, g)
        fixed = at_lo | at_hi
        for b in p.blocks:  # on the support |·| is smooth; coordinates at a kink stay fixed
            if b.name in p.prox_terms:
                fixed[b.sl] |= np.abs(v[b.sl]) <= 1e-12
        free = np.where(~fixed)[0]
        if free.size == 0:
            break
        hess = exact_hessian(p, v, free) if free.size <= 64 else None
        hess = fd_hessian(p, v, free) if hess is None else hess
        w, q = np.linalg.eigh(hess)
        w = np.maximum(np.abs(w), 1e-10 * max(1.0, float(np.abs(w).max())))
        d = np.zeros_like(v)
        d[free] = -(q @ ((q.T @ g[free]) / w))
        improved = False
        t = 1.0
        for _ in range(30):
            vn = p.clip(v + t * d)
            fn, gn = p.fun_grad(vn)
            pgn = p.projected_gradient(vn)
            if math.isfinite(fn) and (fn < f - 1e-4 * t * abs(float(g @ d)) or
                                      (pgn < pg and fn <= f + 1e-13 * max(1.0, abs(f)))):
                v, f, g, pg = vn, fn, gn, pgn
                improved = True
                break
            t *= 0.5
        if not improved:
            break
    return v, k


def second_order(p: LiftedProblem, v: np.ndarray, tol: float = 1e-8) -> dict[str, Any]:
    """Second-order check at a stationary ``v``: smallest eigenvalue of the Hessian reduced to
    the free coordinates, and strict complementarity on the active bounds."""
    _, g = p.fun_grad(v)
    at_lo, at_hi = active_set(p, v, g, tol=1e-9)
    mult = np.concatenate([g[at_lo], -g[at_hi]])
    kink = np.zeros(p.n, dtype=bool)
    for b in p.blocks:  # a coordinate held at a kink of a prox term (|·| at 0) is fixed too
        if b.name in p.prox_terms:
            kink[b.sl] = np.abs(v[b.sl]) <= 1e-12
    free = np.where(~(at_lo | at_hi | kink))[0]
    lam = float(np.linalg.eigvalsh(fd_hessian(p, v, free)).min()) if free.size else math.inf
    strict = bool(mult.size == 0 or mult.min() > tol)
    if lam > tol and strict:
        verdict = "local minimizer"
    elif lam < -tol:
        verdict = "saddle"
    else:
        verdict = "inconclusive"
    return {"lambda_min": lam, "active": int(at_lo.sum() + at_hi.sum()),
            "min_multiplier": float(mult.min()) if mult.size else math.inf,
            "strict_complementarity": strict, "verdict": verdict}


def partial_value(p: LiftedProblem, z: Mapping[str, np.ndarray]) -> float | None:
    """``G(z) = min_{aux} F`` with the top-level states fixed (inner envelopes by inner
    minimization); None if a top-level state is not a plain block."""
    fixed = np.zeros(p.n, dtype=bool)
    v0 = p.start_point()
    for b in p.blocks:
        if b.of in z and b.origin == "state":
            fixed[b.sl] = True
            v0[b.sl] = np.asarray(z[b.of], dtype=np.float64).reshape(-1)
    if any(s not in [b.of for b in p.blocks if b.origin == "state"] for s in p.top_states):
        return None
    if fixed.all():
        return p.value(v0)
    lo, hi = p.lower.copy(), p.upper.copy()
    lo[fixed] = hi[fixed] = v0[fixed]
    free = ~fixed

    def fg(u: np.ndarray) -> tuple[float, np.ndarray]:
        w = v0.copy()
        w[free] = u
        f, g = p.fun_grad(w)
        return f, g[free]

    bnds = [(None if not np.isfinite(a) else float(a), None if not np.isfinite(b) else float(b))
            for a, b in zip(lo[free], hi[free])]
    u0 = np.clip(v0[free], lo[free], hi[free])
    res = so.minimize(fg, u0, jac=True, method="L-BFGS-B", bounds=bnds,
                      options={"maxiter": 20000, "ftol": 1e-16, "gtol": 1e-12, "maxcor": 30})
    return float(res.fun)


def check_finite(name: str, a: np.ndarray) -> None:
    """Refuse NaN/Inf in ``a`` with a typed error naming ``name``."""
    if not np.all(np.isfinite(a)):
        raise ShapeError(f"{name} contains NaN/Inf", term="verify")
