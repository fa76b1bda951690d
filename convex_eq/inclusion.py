"""Monotone inclusions ``0 ∈ F(z) + ∂g(z)`` and convex–concave saddle objectives
``min_z max_w G(z) + ⟨Kz + c, w⟩ − H(w)`` (docs/monotone.md).

``F(z) = Σ_k ∇h_k(z) + Σ_j L_j z`` is affine: ``h_k`` are quadratic or linear terms (their
gradients, e.g. ``m·½||z||² + ½||Az||² − ⟨Ux + b, z⟩``) and ``L_j`` linear operators of the state
(``Skew(B)``, ``MonotoneMatrix(A, B, m)``, any ``LinOp``).  ``g`` is a sum of existing terms
with a closed-form prox.  A symmetric ``F`` (no ``L_j``) is the gradient of ``Σh_k``: the
inclusion is stationarity of the objective ``g + Σh_k`` (:meth:`Inclusion.as_objective`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._lazy import torch
from .affine import as_affine
from .errors import CurvatureError, LoweringError, ShapeError
from .objective import Objective
from .operators.base import LinOp, op_latex
from .operators.base import unique_symbols as _unique
from .operators.monotone import Margin, monotone_margin
from .symbols import Env, Symbol
from .terms.base import Condition, Term
from .terms.quadratic import SqNorm

#: splitting methods an inclusion may ask for (``"auto"``: the lowering rules' order decides)
SPLITTINGS = ("auto", "forward-backward", "peaceman-rachford", "douglas-rachford")


def _terms(x: Any, what: str) -> list[Term]:
    if x is None:
        return []
    if isinstance(x, Objective):
        return list(x.terms)
    if isinstance(x, Term):
        return [x]
    out = []
    for t in x:
        out.extend(_terms(t, what))
    for t in out:
        if not isinstance(t, Term):
            raise ShapeError(f"{what} must be terms, got {type(t).__name__}", term=what)
    return out


def _identity_coef(t: Term, z: Symbol) -> float | None:
    """``c`` if ``t = c·½||z||²`` exactly (no scalars), else None."""
    if isinstance(t, SqNorm) and t.prox_state is z and not t.scalars:
        return t.scale
    return None


@dataclass
class MonotonicityCertificate:
    """``F`` is ``m``-strongly monotone and ``L``-Lipschitz: the inclusion has exactly one
    solution when ``m > 0``; ``for_every_weight``: ``m`` comes from the parametrisation (holds
    for every value of the weights ``weights``), else it was measured at the given weights."""

    margin: float
    lipschitz: float
    for_every_weight: bool
    why: str
    weights: tuple[str, ...] = ()
    #: a margin measured at the weights (not for every weight): ``λ_min(½(M + Mᵀ)) > 0``,
    #: which training can make false (no weight control keeps it)
    conditions: list[Condition] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        """``m > 0``: strongly monotone, one solution."""
        return self.margin > 0

    @property
    def kind(self) -> str:
        return "unconditional" if self.for_every_weight and self.holds else "conditional"

    @property
    def text(self) -> str:
        if not self.holds:
            return (f"not strongly monotone (m = {self.margin:.4g}): uniqueness not certified; "
                    f"{self.why}")
        where = (f"for every {', '.join(self.weights)}" if self.for_every_weight and self.weights
                 else "for every weight" if self.for_every_weight else "at these weights")
        return (f"unique equilibrium {where} (F strongly monotone, margin m = {self.margin:.4g}; "
                f"{self.why})")

    def long_text(self) -> str:
        return f"{self.text}; Lip(F) ≤ {self.lipschitz:.4g} here"

    def __str__(self) -> str:
        return self.text


class Inclusion:
    """``0 ∈ F(z) + ∂g(z)``, ``F(z) = Σ_k ∇h_k(z) + Σ_j L_j z`` (affine, monotone)."""

    def __init__(self, g: Any, *, grad: Any = (), linear: Any = (), name: str = "",
                 splitting: str = "auto"):
        self.g_terms = _terms(g, "g")
        self.h_terms = _terms(grad, "grad")
        self.linear: list[LinOp] = list(linear) if not isinstance(linear, LinOp) else [linear]
        self.name = name
        if splitting not in SPLITTINGS:
            raise ShapeError(f"unknown splitting {splitting!r}", term=name or "Inclusion",
                             hint=f"use one of {SPLITTINGS}")
        self.splitting = splitting
        if not self.g_terms:
            raise ShapeError("an inclusion needs g (e.g. an activation potential Σf_σ(z))",
                             term=name or "Inclusion", hint="pass g=Potential('relu', z)")
        states = _unique([t.states() for t in self.g_terms + self.h_terms])
        if len(states) != 1:
            names = [s.name for s in states]
            twice = sorted({n for n in names if names.count(n) > 1})
            hint = (f"reuse the State object '{twice[0]}' you declared first in every term "
                    f"instead of declaring State({twice[0]!r}, …) again" if twice else
                    "declare one State z (a saddle objective: use Saddle)")
            raise ShapeError(f"an inclusion acts on one state block, found {names}"
                             + (" (different objects with the same name)" if twice else ""),
                             term=name or "Inclusion", hint=hint)
        self.z = states[0]
        for t in self.h_terms:
            affine_grad = t.smooth and (t.quad_parts(None) or t.curvature().kind == "affine")
            if not affine_grad:
                raise ShapeError(f"F must be affine: the gradient of '{t}' ({t.label}) is not",
                                 term=str(t), hint="put non-quadratic terms into g (prox-able)"
                                 " or write F with quadratic/linear terms and linear operators")
        for op in self.linear:
            if getattr(op, "in_size", None) != self.z.size or op.out_size != self.z.size:
                raise ShapeError(f"linear part {op} maps {op.in_size} → {op.out_size}, the state "
                                 f"'{self.z.name}' has size {self.z.size}", term=str(op),
                                 hint="a monotone operator maps the state to itself")
        bad = [t for t in self.g_terms if not (t.has_prox and t.coef(None) > 0)]
        if bad:
            raise ShapeError(f"g must be prox-able: '{bad[0]}' ({bad[0].label}) has no closed-form"
                             " prox here", term=str(bad[0]),
                             hint="use activation potentials, ℓ1 or other terms with a prox on "
                             "the bare state (positive coefficient)")
        if len(self.g_terms) > 1:
            from .terms.quadratic import Linear

            core = [t for t in self.g_terms if not isinstance(t, (SqNorm, Linear))]
            if len(core) > 1:
                raise ShapeError("g has several non-quadratic terms (" +
                                 ", ".join(f"'{t}'" for t in core) + "); its prox is not "
                                 "known in closed form", term="g",
                                 hint="keep one prox-able term in g and move quadratic/linear "
                                 "terms to grad=")

    # ------------------------------------------------------------------ symbols
    @property
    def symbols(self) -> list[Symbol]:
        return _unique([*(t.symbols() for t in self.g_terms + self.h_terms),
                        *(op.symbols() for op in self.linear)])

    def _kind(self, k: str) -> list[Symbol]:
        return [s for s in self.symbols if s.kind == k]

    @property
    def states(self) -> list[Symbol]:
        return [self.z]

    @property
    def inputs(self) -> list[Symbol]:
        return self._kind("input")

    @property
    def weights(self) -> list[Symbol]:
        return self._kind("weight")

    @property
    def terms(self) -> list[Term]:
        """``g``'s and ``h``'s terms (read by batch-coupling checks)."""
        return [*self.g_terms, *self.h_terms]

    @property
    def g(self) -> Objective:
        """``g`` as an objective (its prox is ``Objective.prox``)."""
        return Objective(self.g_terms, name="g")

    @property
    def symmetric(self) -> bool:
        """``F = ∇(Σh_k)`` (no linear operator part): the inclusion is an objective's
        stationarity."""
        return not self.linear

    def as_objective(self) -> Objective:
        """``g + Σh_k`` (symmetric ``F`` only): its stationary points are the solutions."""
        if not self.symmetric:
            raise LoweringError("F has a linear operator part (" +
                                ", ".join(map(str, self.linear)) + "): it is not a gradient",
                                term=str(self), hint="lower the inclusion itself")
        return Objective([*self.g_terms, *self.h_terms], name=self.name)

    def with_splitting(self, splitting: str) -> Inclusion:
        """The same inclusion, lowered with ``splitting`` (see :data:`SPLITTINGS`)."""
        out = Inclusion(self.g_terms, grad=self.h_terms, linear=self.linear, name=self.name,
                        splitting=splitting)
        if hasattr(self, "reference"):
            out.reference = self.reference  # type: ignore[attr-defined]
        return out

    # ------------------------------------------------------------------ numerics
    def F(self, values: dict[str, torch.Tensor], env: Env | None = None) -> torch.Tensor:
        """``F(z) = Σ∇h_k(z) + Σ L_j z`` on flat batched values (``values`` holds z and inputs)."""
        z = values[self.z.name]
        out = torch.zeros_like(z)
        for t in self.h_terms:
            g = t.grad(values, env).get(self.z.name)
            if g is not None:
                out = out + g
        for op in self.linear:
            out = out + op.apply(z, env)
        return out

    def affine_part(self, values: dict[str, torch.Tensor], env: Env | None = None
                    ) -> torch.Tensor:
        """``F(0) = −q`` at the given inputs (the gradient terms at ``z = 0``; the linear
        operators vanish there), batched like ``values``' inputs."""
        b = max((x.shape[0] for x in values.values()), default=1)
        v = dict(values)
        ref = next(iter(values.values()), None)
        dev = ref.device if ref is not None else None
        dt = ref.dtype if ref is not None else torch.float64
        v[self.z.name] = torch.zeros(b, self.z.size, dtype=dt, device=dev)
        out = v[self.z.name]
        for t in self.h_terms:
            g = t.grad(v, env).get(self.z.name)
            if g is not None:
                out = out + g
        return out

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """The dense matrix ``M`` of ``F(z) = Mz − q`` (float64)."""
        n = self.z.size
        vals = {s.name: torch.zeros(n + 1, s.size, dtype=torch.float64) for s in self.inputs}
        e = torch.zeros(n + 1, n, dtype=torch.float64)
        e[1:] = torch.eye(n, dtype=torch.float64)
        vals[self.z.name] = e
        with torch.no_grad():
            f = self.F(vals, env)
        return (f[1:] - f[:1]).T.detach().cpu().numpy().copy()

    def shift(self, values: dict[str, torch.Tensor], env: Env | None = None) -> torch.Tensor:
        """``q`` of ``F(z) = Mz − q`` at the given inputs: ``q = −F(0)``."""
        return -self.affine_part(dict(values), env)

    def margin(self, env: Env | None = None) -> Margin:
        """``m ≤ λ_min(½(M + Mᵀ))``: from the structure (identity quadratics, convex quadratics,
        registered operator margins) when every piece has one, else measured at ``env``."""
        m, whys, every = 0.0, [], True
        for t in self.h_terms:
            c = _identity_coef(t, self.z)
            if c is not None:
                m += c
                whys.append(f"{c:g}·I from {t}")
            elif t.quad_parts(None):
                cur = t.curvature()
                if not (cur.kind == "convex" and not cur.conditions and t.coef(None) >= 0):
                    every = False
        for op in self.linear:
            mo = monotone_margin(op, env)
            if not mo.for_every_weight:
                every = False
                break
            m += mo.value
            whys.append(mo.why)
        if every:
            return Margin(m, True, "; ".join(whys) or "no quadratic part")
        mat = self.matrix(env)
        lam = float(np.linalg.eigvalsh(0.5 * (mat + mat.T)).min())
        return Margin(lam, False, f"λ_min(½(M + Mᵀ)) = {lam:.4g} measured at the current weights")

    def lipschitz(self, env: Env | None = None) -> float:
        """An upper bound of ``Lip(F) = ||M||₂``: exact (dense SVD) up to 64 state entries,
        else ``√(||M||₁||M||_∞) ≥ ||M||₂`` (Hölder; no SVD at every training step)."""
        m = self.matrix(env)
        if self.z.size <= 64:
            return float(np.linalg.norm(m, 2))
        return float(np.sqrt(np.abs(m).sum(0).max() * np.abs(m).sum(1).max()))

    def lipschitz_estimate(self, env: Env | None = None, iters: int = 50) -> float:
        """``||M||₂``: exact up to 64 state entries, else power iteration on ``MᵀM`` (a lower
        estimate; enough for a step that only has to be positive, e.g. Peaceman–Rachford's)."""
        m = self.matrix(env)
        if self.z.size <= 64:
            return float(np.linalg.norm(m, 2))
        v = np.random.default_rng(0).standard_normal(m.shape[1])
        est = 0.0
        for _ in range(iters):
            u = m.T @ (m @ v)
            nu = float(np.linalg.norm(u))
            if nu == 0.0:
                break
            est, v = math.sqrt(nu), u / nu
        return est

    def certificate(self, env: Env | None = None) -> MonotonicityCertificate:
        """Strong monotonicity (uniqueness) of the inclusion at ``env`` or for every weight."""
        mo = self.margin(env)
        names = tuple(s.name for op in self.linear for s in op.symbols() if s.kind == "weight")
        names += tuple(s.name for t in self.h_terms if t.quad_parts(None)
                       for s in t.symbols() if s.kind == "weight" and s.name not in names
                       and _identity_coef(t, self.z) is None)
        conds = []
        if not mo.for_every_weight:  # measured: training the weights can make it false
            reads = [s.name for op in self.linear for s in op.symbols()]
            reads += [s.name for t in self.h_terms if t.quad_parts(None) for s in t.symbols()]
            conds.append(Condition("λ_min(½(M + Mᵀ)) > 0",
                                   "\\lambda_{\\min}(\\tfrac12(M + M^\\top)) > 0",
                                   lambda e: self.margin(e).value, 0.0, ">", tol=0.0,
                                   reads=tuple(dict.fromkeys(reads))))
        return MonotonicityCertificate(mo.value, self.lipschitz(env), mo.for_every_weight,
                                       mo.why, tuple(dict.fromkeys(names)), conds)

    def require_strongly_monotone(self, env: Env | None = None) -> MonotonicityCertificate:
        """The certificate, or ``CurvatureError`` when ``F`` is not strongly monotone."""
        cert = self.certificate(env)
        if cert.margin < 0:
            raise CurvatureError(f"F is not monotone: {cert.why} < 0, so the inclusion may have "
                                 "no or many solutions and no splitting converges",
                                 term=str(self), hint="use a monotone parametrisation, e.g. "
                                 "MonotoneMatrix(A, B, m) (I − W ⪰ mI for every A, B)")
        if cert.margin == 0:
            raise CurvatureError("F is monotone but not strongly monotone (m = 0): uniqueness "
                                 "and linear convergence are not certified", term=str(self),
                                 hint="add a margin, e.g. grad=[m * SqNorm(z), …] with m > 0")
        return cert

    # ------------------------------------------------------------------ printing
    def F_text(self, latex: bool = False) -> str:
        parts = []
        for t in self.h_terms:
            parts.append(f"\\nabla\\big[{t.latex()}\\big]" if latex else f"∇[{t}]")
        for op in self.linear:
            parts.append(f"{op_latex(op)}\\,{self.z.latex()}" if latex else f"{op} {self.z.name}")
        return " + ".join(parts) or "0"

    def latex(self) -> str:
        z = self.z.latex()
        return (f"0 \\in {self.F_text(True)} + \\partial\\big[{self.g.latex()}\\big]({z})")

    def __str__(self) -> str:
        return f"0 ∈ {self.F_text()} + ∂[{self.g}]({self.z.name})"

    def __repr__(self) -> str:
        return f"Inclusion({self})"


# ----------------------------------------------------------------------------- saddle
def _modulus(terms: list[Term], s: Symbol) -> float:
    """A strong-convexity modulus of ``Σ terms`` in ``s`` valid for every weight (identity
    quadratics and the terms' own constant moduli), 0 if none is known."""
    m = 0.0
    for t in terms:
        c = _identity_coef(t, s)
        if c is not None:
            m += c
            continue
        sc = t.strong_convexity()
        if sc is not None and sc.op is None and sc.arg is None and sc.state is s:
            m += sc.modulus(None)
    return m


class Saddle:
    """``min_z max_w L(z, w) = G(z) + ⟨Kz + c, w⟩ − H(w)``, ``G``, ``H`` convex: its saddle
    points solve ``0 ∈ [Kᵀw; −Kz − c] + [∂G(z); ∂H(w)]`` (a skew linear part: monotone)."""

    def __init__(self, G: Any, H: Any, K: LinOp, c: Any = None, *, name: str = ""):
        self.G_terms, self.H_terms = _terms(G, "G"), _terms(H, "H")
        self.name = name
        sz = _unique([t.states() for t in self.G_terms])
        sw = _unique([t.states() for t in self.H_terms])
        if len(sz) != 1 or len(sw) != 1 or sz[0] is sw[0]:
            raise ShapeError("a saddle objective needs G on one state z and H on another state w"
                             f" (found {[s.name for s in sz]} and {[s.name for s in sw]})",
                             term=name or "Saddle", hint="declare State('z', n), State('w', k)")
        self.z, self.w = sz[0], sw[0]
        if K.in_size != self.z.size or K.out_size != self.w.size:
            raise ShapeError(f"K maps {K.in_size} → {K.out_size}, need {self.z.size} → "
                             f"{self.w.size}", term=str(K), hint="K maps z into w's space")
        self.K = K
        self.c = as_affine(c) if c is not None else None
        if self.c is not None and (self.c.states() or self.c.size != self.w.size):
            raise ShapeError(f"c must be state-free with {self.w.size} entries", term=str(c))
        for part, terms in (("G", self.G_terms), ("H", self.H_terms)):
            for t in terms:
                cur = t.curvature()
                convex = cur.kind == "affine" or (cur.kind == "convex" and t.coef(None) >= 0)
                if not convex or cur.conditions:
                    raise CurvatureError(f"{part} must be convex for every weight: '{t}' is "
                                         f"{cur.kind}" + (" under conditions" if cur.conditions
                                                          else ""), term=str(t),
                                         hint=f"min_z max_w needs a convex {part}; move "
                                         "couplings into K")

    @property
    def symbols(self) -> list[Symbol]:
        c = self.c.symbols() if self.c is not None else []
        return _unique([*(t.symbols() for t in self.G_terms + self.H_terms), self.K.symbols(),
                        c])

    @property
    def states(self) -> list[Symbol]:
        return [self.z, self.w]

    @property
    def inputs(self) -> list[Symbol]:
        return [s for s in self.symbols if s.kind == "input"]

    @property
    def terms(self) -> list[Term]:
        return [*self.G_terms, *self.H_terms]

    @property
    def G(self) -> Objective:
        return Objective(self.G_terms, name="G")

    @property
    def H(self) -> Objective:
        return Objective(self.H_terms, name="H")

    def moduli(self) -> tuple[float, float]:
        """Strong-convexity moduli ``(μ_G, μ_H)`` valid for every weight (0: none known)."""
        return _modulus(self.G_terms, self.z), _modulus(self.H_terms, self.w)

    def offset(self, values: dict[str, torch.Tensor], env: Env | None) -> torch.Tensor | None:
        """``c`` at the given inputs (None without one)."""
        return None if self.c is None else self.c.evaluate(values, env)

    def value(self, values: dict[str, torch.Tensor], env: Env | None = None) -> torch.Tensor:
        """``L(z, w)`` per sample."""
        z, w = values[self.z.name], values[self.w.name]
        kz = self.K.apply(z, env)
        c = self.offset(values, env)
        if c is not None:
            kz = kz + c
        return (self.G.value_tensor(values, env) + (kz * w).sum(-1)
                - self.H.value_tensor(values, env))

    def latex(self) -> str:
        z, w = self.z.latex(), self.w.latex()
        c = f" + {self.c.latex()}" if self.c is not None else ""
        return (f"\\min_{{{z}}}\\max_{{{w}}}\\; {self.G.latex()} + \\langle {op_latex(self.K)}"
                f"{z}{c}, {w}\\rangle - \\big({self.H.latex()}\\big)")

    def __str__(self) -> str:
        c = f" + {self.c}" if self.c is not None else ""
        return (f"min_{self.z.name} max_{self.w.name} {self.G} + <{self.K} {self.z.name}{c}, "
                f"{self.w.name}> − ({self.H})")

    def __repr__(self) -> str:
        return f"Saddle({self})"


def saddle_step_sizes(K: LinOp, env: Env | None, safety: float = 0.9) -> tuple[float, float]:
    """``τ = σ = safety/||K||₂``: ``τσ||K||₂² = safety² < 1`` (Chambolle–Pock's condition)."""
    n = K.norm(env)
    if not math.isfinite(n):
        raise CurvatureError("||K||₂ is not finite", term=str(K))
    t = safety / n if n > 0 else 1.0
    return t, t


__all__ = ["SPLITTINGS", "Inclusion", "MonotonicityCertificate", "Saddle", "saddle_step_sizes"]
