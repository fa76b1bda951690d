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

How a term is lifted is found by its type in ``STATE_BLOCKS`` and ``TERM_LIFTS`` (the plain value
rule otherwise).  Gradients are exact (torch autograd of the terms' value rules, float64); the
minimizers, polishing and Hessians that use them are in :mod:`verify.optimize`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.linalg
import torch

from convex_eq.affine import as_affine
from convex_eq.errors import ConvexEqError
from convex_eq.objective import Objective
from convex_eq.symbols import State
from convex_eq.terms.conjugate import SeparableAffineConjugate, inner_argmin
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
    (evaluated at the inputs, one row per sample of a batch lifted whole, None when absent or
    not a function of the inputs alone) define the inner problem of ``ψ*`` that determines
    ``y`` from ``z`` (:meth:`argmin`)."""

    block: str
    M: np.ndarray
    s: float
    act: Any = None
    q: np.ndarray | None = None
    q_known: bool = True

    def argmin(self, z: np.ndarray, sample: int = 0) -> np.ndarray | None:
        """``y(z) = argmin{Σσ̃*(y) − <q, y> : Mᵀy = z/s}`` with ``q`` of ``sample``
        (``inner_argmin``: the Fenchel dual by Newton from ``w = z``, exact at a fixed point
        ``z = sMᵀσ(Mz + q)``, accepted only at constraint residual ~1e-12); None where it is not
        found (``z`` outside ``dom ψ*``) or ``q`` is unknown."""
        if self.act is None or not self.q_known:
            return None
        m = torch.as_tensor(self.M, dtype=T64)
        q = torch.zeros(m.shape[0], dtype=T64) if self.q is None else \
            torch.as_tensor(self.q[sample if self.q.shape[0] > 1 else 0])
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

    def lift_point(self, z: Mapping[str, np.ndarray], sample: int = 0) -> np.ndarray | None:
        """A free vector ``v`` with the given top-level states (None if it is not determined
        by them: auxiliary envelope blocks; a dual ``y`` with ``Mᵀ`` not injective is the
        inner argmin of ``ψ*`` at the state and ``sample``'s inputs, :meth:`Dual.argmin`)."""
        v = np.zeros(self.n)
        for b in self.blocks:
            if b.origin == "state" and b.of in z:
                v[b.sl] = np.asarray(z[b.of], dtype=np.float64).reshape(-1)
            elif b.origin == "dual" and b.of in z:
                d = self.duals[b.of]
                if np.linalg.matrix_rank(d.M) < d.M.shape[0]:  # y not linear in z
                    y = d.argmin(np.asarray(z[b.of], dtype=np.float64), sample)
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
        vs = [self.one.lift_point({k: np.asarray(a)[b] for k, a in z.items()}, b)
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
@dataclass
class _Scope:
    """One objective being lifted into ``p``: its states' aliases (an envelope's inner objective
    is lifted onto an auxiliary copy of the outer state), its scale, the sample's inputs."""

    p: LiftedProblem
    obj: Objective
    alias: dict[str, str]
    scale: float
    inputs: dict[str, torch.Tensor]
    env: Any

    def block_of(self, name: str) -> str:
        """The block (or state function) that carries the objective's state ``name``."""
        return self.alias.get(name, name)

    def values(self) -> Callable[[V], dict[str, torch.Tensor]]:
        """``parts ↦`` the inputs and the objective's states, as its value rules take them."""
        p, inputs, names = self.p, self.inputs, [s.name for s in self.obj.states]

        def values(parts: V) -> dict[str, torch.Tensor]:
            k_rows = next(iter(parts.values())).shape[0]
            out = {k: v.expand(k_rows, -1) for k, v in inputs.items()}
            for k in names:
                out[k] = p.state_fns[self.block_of(k)](parts)
            return out

        return values


def lift(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Any) -> LiftedProblem:
    """Lift ``obj`` at one sample of ``inputs`` (name → ``(1, size)`` float64)."""
    p = LiftedProblem(env=env)
    _lift_into(_Scope(p, obj, {}, 1.0, dict(inputs), env))
    p.top_states = [s.name for s in obj.states]
    return p


def _lift_into(sc: _Scope) -> None:
    """Blocks for the objective's states, then one contribution per term (``TERM_LIFTS``)."""
    for s in sc.obj.states:
        if sc.block_of(s.name) not in sc.p.state_fns:
            _lift_state(sc, s)
    sc.p.coupled = sc.p.coupled or any(getattr(t, "batch_coupled", False) for t in sc.obj.terms)
    values = sc.values()
    substituted = {id(sub.term): sub for sub in sc.p.substitutions.values()}
    for t in sc.obj.terms:
        if id(t) in substituted:
            _substituted_term(sc, t, substituted[id(t)])
            continue
        special = lift_rule(TERM_LIFTS, t)
        if special is None or not special(sc, t, values):
            _value_term(sc, t, values)


def _lift_state(sc: _Scope, s: State) -> None:
    """The block of state ``s``: a term's own block (``STATE_BLOCKS``: a conjugate's dual), the
    substitution ``y = Mz + c``, or ``s`` itself boxed by its terms' domains."""
    p, env, name = sc.p, sc.env, sc.block_of(s.name)
    owners = [t for t in sc.obj.terms if lift_rule(STATE_BLOCKS, t) is not None
              and t.state is s and t.coef(env) > 0]
    if len(owners) == 1:
        lift_rule(STATE_BLOCKS, owners[0])(sc, owners[0], name)
        return
    if not sc.alias and _substitute(p, sc.obj, s, name, sc.inputs, env):
        return
    lo = np.full(s.size, -np.inf)
    hi = np.full(s.size, np.inf)
    for t in sc.obj.terms:  # each term states its own domain box (Term.domain_box)
        box = t.domain_box(s.size, env) if t.prox_state is s else None
        if box is not None:
            lo, hi = np.maximum(lo, box[0]), np.minimum(hi, box[1])
    blk = p.add_block(name, s.size, lo, hi, "state" if not sc.alias else "aux", name)
    p.state_fns[name] = (lambda parts, b=blk.name: parts[b])


def _dual_block(sc: _Scope, c: Any, name: str) -> None:
    """``z = s Mᵀy`` with ``y ∈ dom σ̃*`` for the conjugate ``c = ψ*``, ``ψ = sΣσ̃(Mz + q)``."""
    p = sc.p
    m = np.asarray(c.op.matrix(sc.env), dtype=np.float64)
    lo, hi = activation_box(*c.act.domain, m.shape[0], c.act.smooth_potential)
    blk = p.add_block(f"{name}__y", m.shape[0], lo, hi, "dual", name)
    mt = torch.as_tensor(m, dtype=T64)
    p.state_fns[name] = (lambda parts, b=blk.name, mt=mt, sc=c.s: sc * parts[b] @ mt)
    try:  # q at this sample (inputs and weights only), for Dual.argmin
        qv = None if c.q is None else c.q.evaluate(dict(sc.inputs), sc.env).to(T64)
        qn = None if qv is None else qv.reshape(-1, m.shape[0]).numpy().copy()  # (rows, m)
        known = True
    except (ConvexEqError, KeyError):
        qn, known = None, False
    p.duals[name] = Dual(blk.name, m, c.s, c.act, qn, known)


def _dual_term(sc: _Scope, t: Any, values: Callable[[V], dict[str, torch.Tensor]]) -> bool:
    """``ψ*(z) → s(Σσ̃*(y) − <q, y>)`` on the state's dual block; False when the state has none
    (then the term is evaluated by its own value rule)."""
    d = sc.p.duals.get(sc.block_of(t.state.name))
    if not t.coef(sc.env) > 0 or d is None:
        return False
    env = sc.env
    c = sc.scale * t.coef(env) * t.s

    def conj_val(parts: V) -> torch.Tensor:
        y = parts[d.block]
        val = t.act.antiderivative_conjugate(y).sum(-1)
        if t.q is not None:
            q = t.q.evaluate(values(parts), env).to(T64)
            val = val - (q * y).sum(-1)
        return c * val

    sc.p.contributions.append(conj_val)
    return True


def _envelope_term(sc: _Scope, t: MoreauEnvelope,
                   values: Callable[[V], dict[str, torch.Tensor]]) -> bool:
    """``c·M^μ_f(v) → c[f(u) + ||u − v||²/(2μ)]`` on an auxiliary copy ``u`` of the state (the
    inner ``f`` lifted onto ``u``); False when ``f`` has a closed-form prox (its value is used)."""
    p, env = sc.p, sc.env
    if _closed_form_prox(t, sc.inputs, env):
        return False
    outer = sc.block_of(t.state.name)
    aux = f"{outer}__env{next(_aux_ids)}"
    c, mu = sc.scale * t.coef(env), t.mu_value(env)
    _lift_into(_Scope(p, t.inner, {t.state.name: aux}, c, sc.inputs, env))

    def coupling(parts: V) -> torch.Tensor:
        diff = p.state_fns[aux](parts) - p.state_fns[outer](parts)
        return c / (2 * mu) * (diff * diff).sum(-1)

    p.contributions.append(coupling)
    return True


def _value_term(sc: _Scope, t: Any, values: Callable[[V], dict[str, torch.Tensor]]) -> None:
    """The term's own value rule; a separable non-smooth term with a 1-D prox on a plain block
    is also registered as that block's prox term (excluded from the smooth gradient)."""
    p, env, scale = sc.p, sc.env, sc.scale

    def term_val(parts: V) -> torch.Tensor:
        return scale * t.value(values(parts), env)

    st = t.prox_state
    blk = sc.block_of(st.name) if st is not None else None
    if (blk is not None and _prox_term(t) and t.coef(env) > 0 and blk not in p.prox_terms
            and any(b.name == blk for b in p.blocks) and scale == 1.0):
        p.prox_terms[blk] = t
        p.nonsmooth.add(len(p.contributions))
    p.contributions.append(term_val)


def _substituted_term(sc: _Scope, t: Any, sub: Substitution) -> None:
    """The term whose domain box the block ``y = Mz + c`` carries, evaluated at ``y`` itself
    (exactly inside its box)."""
    p, env, scale = sc.p, sc.env, sc.scale
    y_sym = State(f"{sub.block}__arg", sub.M.shape[0])
    ty = t.with_args([as_affine(y_sym)])

    def subst_val(parts: V) -> torch.Tensor:
        return scale * ty.value({y_sym.name: parts[sub.block]}, env)

    if scale == 1.0 and _prox_term(ty) and sub.block not in p.prox_terms:
        p.prox_terms[sub.block] = ty
        p.nonsmooth.add(len(p.contributions))
    p.contributions.append(subst_val)


def _prox_term(t: Any) -> bool:
    """A non-smooth ``Σ_j g(u_j)`` with 1-D proxes (``Term.lift_prox``; else ``separable``)."""
    separable = t.lift_prox if t.lift_prox is not None else getattr(t, "separable", False)
    return bool(not t.smooth and separable and t.has_prox)


def _closed_form_prox(t: MoreauEnvelope, inputs: V, env: Any) -> bool:
    """True if the envelope's inner objective has a closed-form prox (then its value is used)."""
    try:
        rows = next(iter(inputs.values())).shape[0] if inputs else 1
        vals = {s.name: torch.zeros(rows, s.size, dtype=T64) for s in t.inner.states}
        vals.update(inputs)
        out = t.value(vals, env)
        return bool(torch.isfinite(out).all())
    except (ConvexEqError, NotImplementedError):
        return False


#: term type → the block it gives its state (a conjugate ``ψ*(z)``: the dual ``y``)
STATE_BLOCKS: dict[type, Callable[[_Scope, Any, str], None]] = {
    SeparableAffineConjugate: _dual_block}
#: term type → its contribution to ``F`` when not its plain value rule (``_value_term``);
#: each returns False where it does not apply and the value rule is used
TERM_LIFTS: dict[type, Callable[[_Scope, Any, Callable[[V], dict[str, torch.Tensor]]], bool]] = {
    SeparableAffineConjugate: _dual_term, MoreauEnvelope: _envelope_term}


def lift_rule(table: Mapping[type, Any], t: Any) -> Any:
    """The entry of ``table`` for ``t``'s type or its nearest base class (None: no entry)."""
    for cls in type(t).__mro__:
        if cls in table:
            return table[cls]
    return None


def _affine_domain(t: Any, s: Any, env: Any) -> tuple[np.ndarray, Any, Any] | None:
    """``(M, c, box)`` if ``t``'s domain is the box ``box`` in its one argument ``u = Mz + c``
    with ``u`` not the bare state ``s`` (``c``: the affine offset of inputs/weights, or None)."""
    if len(t.args) != 1 or t.prox_state is not None or lift_rule(TERM_LIFTS, t) is not None:
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
