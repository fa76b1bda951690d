"""Conjugate of a separable function of an affine map (docs/theory.md §2):
``ψ(z) = s Σ σ̃(Mz + q)``  ⇒  ``ψ*(v) = s · min_y { Σ σ̃*(y) - <q, y> : Mᵀy = v/s }``."""

from __future__ import annotations

import itertools

import numpy as np

from .._lazy import cvxpy as cp
from .._lazy import torch
from ..activations import Activation
from ..affine import Affine, as_affine
from ..errors import LoweringError, NotDCPError, ShapeError, SolverError
from ..export import ExportContext
from ..operators import Dense
from ..symbols import Constant, Env, State, Symbol
from .base import CONJUGATE_RULES, Curvature, StrongConvexity, Term, single_arg
from .potential import Antiderivative, AntiderivativeConjugate
from .potential import act_latex as _sig
from .quadratic import QuadraticForm

_aux_ids = itertools.count()


def inner_argmin(act: Activation, m: torch.Tensor, q: torch.Tensor, t: torch.Tensor,
                 start: torch.Tensor | None = None, iters: int = 100) -> torch.Tensor | None:
    """``y = argmin{Σσ̃*(y) − <q, y> : Mᵀy = t}`` (the inner problem of ``ψ*``; unique, ``σ̃*``
    strictly convex) through its Fenchel dual: ``y = σ(Mw + q)`` with ``w`` minimizing the
    smooth convex ``Σσ̃(Mw + q) − <w, t>`` (Newton with backtracking from ``start``, default
    ``t``).  Any ``w`` with ``Mᵀσ(Mw + q) = t`` makes ``σ(Mw + q)`` a KKT point, so ``y`` is
    returned only at constraint residual ≤ 1e-11·max(1, ||t||); None otherwise (``t`` outside
    ``dom ψ*``, or Newton did not get there).  float64 1-d tensors, ``M``: m × n."""
    tol = 1e-12 * max(1.0, float(t.norm()))
    w = (t if start is None else start).clone()

    def dual(w: torch.Tensor) -> float:
        return float(act.antiderivative(m @ w + q).sum() - w @ t)

    eye = torch.eye(m.shape[1], dtype=m.dtype)
    with torch.no_grad():
        for _ in range(iters):
            u = m @ w + q
            g = m.T @ act.sigma(u) - t
            if not bool(torch.isfinite(g).all()):
                return None
            if float(g.norm()) <= tol:
                break
            h = m.T @ (act.sigma_prime(u)[:, None] * m)
            step = torch.linalg.lstsq(h + 1e-14 * eye, g[:, None]).solution[:, 0]
            f0, a, slope = dual(w), 1.0, float(g @ step)
            while a > 1e-12 and not dual(w - a * step) <= f0 - 1e-4 * a * slope:
                a *= 0.5
            w = w - a * step
        y = act.sigma(m @ w + q)
        if not float((m.T @ y - t).norm()) <= 10 * tol:
            return None
    return y


class SeparableAffineConjugate(Term):
    """``ψ*(v)`` for ``ψ = s Σσ̃(Mz + q)``; convex, ``(1/(s L_σ ||M||²))``-strongly convex.

    Exported with an auxiliary variable ``y`` and the substitution ``v = s Mᵀ y``."""

    label = "conjugate of σ̃∘affine"
    base_curvature = "convex"
    lift_role = "dual"  # lifted with its auxiliary y (z = s·Mᵀy), y ∈ dom σ̃* = dom f_σ
    smooth = False

    def __init__(self, act: Activation, op: object, q: Affine | None, s: float, state: Symbol):
        self.act, self.op, self.q, self.s = act, op, q, float(s)
        self.state = state
        #: ``ψ*`` evaluated at this affine argument instead of ``state`` (``φ∘A``), or None
        self.at: Affine | None = None
        if self.s <= 0:
            raise ShapeError("scale s of ψ = s Σσ̃(Mz+q) must be positive", term="ψ*")
        super().__init__(state)

    @classmethod
    def from_antiderivative(cls, term: Term) -> SeparableAffineConjugate:
        """Rule: conjugate of ``s·Σσ̃(c·M z + q)`` (one state, one operator)."""
        u = term.args[0]
        sp, off = u.state_part, u.offset_part
        if sp is None or len(sp.entries) != 1 or sp.entries[0].op is None:
            raise LoweringError(
                "separable∘affine conjugate rule needs the argument M z + q with one operator "
                "applied to one state", term=str(term),
            )
        e = sp.entries[0]
        op = e.op if e.coef == 1.0 else _Scaled(e.coef, e.op)
        return cls(term.act, op, off, term.scale, e.symbol)

    def check_shapes(self) -> None:
        """``M`` maps the state's size and ``q`` has the size of ``Mz`` (a ``ShapeError``
        otherwise)."""
        if self.op.in_size != self.state.size:
            raise ShapeError(f"M maps size {self.op.in_size}, state has {self.state.size}",
                             term=str(self))
        if self.q is not None and self.q.size != self.op.out_size:
            raise ShapeError(f"q has size {self.q.size}, M z has {self.op.out_size}",
                             term=str(self))

    def with_args(self, args: list[Affine]) -> Term:
        """``ψ*(u)`` at a new argument ``u`` of the state (affine precomposition ``ψ*∘A``)."""
        t = super().with_args(args)
        t.at = args[0]  # type: ignore[attr-defined]
        return t

    def symbols(self) -> list[Symbol]:
        """The state (or the precomposed argument's symbols), then ``M``'s weights and ``q``'s
        symbols."""
        if self.at is not None:
            out: list[Symbol] = list(self.at.symbols())
            for s in [*self.op.symbols(), *(self.q.symbols() if self.q is not None else [])]:
                if all(s is not o for o in out):
                    out.append(s)
            return out
        out = [self.state]
        extra = list(self.op.symbols())
        if self.q is not None:
            for e in self.q.entries:
                extra += [e.symbol, *([] if e.op is None else e.op.symbols())]
        extra += list(self.scalars)
        for s in extra:
            if all(s is not o for o in out):
                out.append(s)
        return out

    # ---------------------------------------------------------------- value
    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """Not used: ``ψ*`` is evaluated by ``value`` (an inner maximization), not per argument."""
        raise AssertionError("SeparableAffineConjugate overrides value()")

    def value(self, values: dict, env: Env | None = None) -> torch.Tensor:  # type: ignore[override]
        """``s · min_y {Σσ̃*(y) - <q,y> : Mᵀy = v/s}``; unique ``y`` when ``Mᵀ`` is injective."""
        v = values[self.state.name] if self.at is None else self.at.evaluate(values, env)
        m = torch.as_tensor(self.op.matrix(env), dtype=v.dtype, device=v.device)
        q = (self.q.evaluate(values, env) if self.q is not None
             else torch.zeros(v.shape[0], m.shape[0], dtype=v.dtype, device=v.device))
        q = q.expand(v.shape[0], -1)
        rank = np.linalg.matrix_rank(m.detach().cpu().numpy())
        target = v / self.s
        if rank == m.shape[0]:
            y = torch.linalg.lstsq(m.T, target.T).solution.T
            lo, hi = self.act.domain
            yc = y.clamp(min=lo if lo > -float("inf") else None,
                         max=hi if hi < float("inf") else None) if (lo, hi) != (
                -float("inf"), float("inf")) else y
            near = (y - yc).norm(dim=-1) <= 1e-9 * y.norm(dim=-1).clamp_min(1.0)
            y = torch.where(near[:, None], yc, y)
            resid = (y @ m - target).norm(dim=-1)
            scale = target.norm(dim=-1).clamp_min(1.0)
            inner = self.act.antiderivative_conjugate(y).sum(-1) - (q * y).sum(-1)
            inner = torch.where(resid <= 1e-8 * scale, inner, torch.full_like(inner, torch.inf))
            return self.coef(env) * self.s * inner
        return self.coef(env) * self.s * self._inner(m, q, target)

    def _inner(self, m: torch.Tensor, q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``min_y {Σσ̃*(y) − <q,y> : Mᵀy = v/s}`` per row: exact by :func:`inner_argmin`
        (float64, to ~1e-15), else (no dual point found) by CVXPY."""
        md, qd, td = (a.detach().to(torch.float64).cpu() for a in (m, q, target))
        out = []
        for qi, ti in zip(qd, td):
            y = inner_argmin(self.act, md, qi, ti, start=ti * self.s)
            out.append(float(self.act.antiderivative_conjugate(y).sum() - qi @ y) if y is not None
                       else float(self._inner_cvxpy(md, qi[None], ti[None])[0]))
        return torch.as_tensor(out, dtype=target.dtype, device=target.device)

    def _inner_cvxpy(self, m: torch.Tensor, q: torch.Tensor, target: torch.Tensor
                     ) -> torch.Tensor:
        out = []
        mn = m.detach().cpu().numpy()
        for qi, ti in zip(q.detach().cpu().numpy(), target.detach().cpu().numpy()):
            y = cp.Variable(mn.shape[0])
            try:
                quad, expr, cons = self.act.cvxpy_split(y)
            except NotDCPError as err:
                raise NotDCPError(
                    f"Mᵀ is not injective, so the value needs the inner problem min_y "
                    f"{{Σσ̃*(y) - <q,y> : Mᵀy = v/s}} in CVXPY, and {err.reason}", term=str(self),
                    hint="use an M with full row rank (Mᵀ injective) or a DCP activation",
                ) from err
            obj = 0.5 * (quad + 1.0) * cp.sum_squares(y) + expr - qi @ y
            prob = cp.Problem(cp.Minimize(obj), [*cons, mn.T @ y == ti])
            prob.solve(solver=cp.CLARABEL)
            if prob.status == cp.INFEASIBLE:
                out.append(np.inf)
            elif prob.status != cp.OPTIMAL:
                raise SolverError(f"inner conjugate problem status {prob.status}", term=str(self))
            else:
                out.append(prob.value)
        return torch.as_tensor(out, dtype=target.dtype, device=target.device)

    # ---------------------------------------------------------------- structure
    def raw_curvature(self) -> Curvature:
        """Convex: a convex conjugate (docs/theory.md §2)."""
        return Curvature("convex", reason="a convex conjugate")

    def strong_convexity(self) -> StrongConvexity | None:
        """``ψ*`` is ``1/(s L_σ ||M||₂²)``-strongly convex, since ``∇ψ`` is ``s L_σ
        ||M||₂²``-Lipschitz."""
        if self.coef_sign() < 0 or self.scalars:
            return None
        if self.at is not None:  # in z: (modulus)·AᵀA for ψ*(Az + c)
            states = self.at.states()
            return StrongConvexity(states[0], self.scale / (self.s * self.act.lipschitz),
                                   self.op, f"{self.op}", arg=self.at) if len(states) == 1 else None
        return StrongConvexity(self.state, self.scale / (self.s * self.act.lipschitz), self.op,
                               f"{self.op}")

    def grad_lipschitz_of_primal(self, env: Env | None = None) -> float:
        """``Lip(∇ψ) = s L_σ ||M||₂²``."""
        return self.s * self.act.lipschitz * self.op.norm(env) ** 2

    def primal(self) -> Term:
        """``ψ`` itself (the term this one is the conjugate of)."""
        u = as_affine(self.state).map(self.op)
        if self.q is not None:
            u = u + self.q
        return Antiderivative(self.act, u) * self.s

    def conjugate(self) -> Term:
        """``(ψ*)* = ψ = s Σσ̃(Mz + q)`` (closed, convex ``ψ``)."""
        if self.scale != 1.0 or self.scalars:
            return super().conjugate()
        return self.primal()

    # ---------------------------------------------------------------- export
    def declare(self, ctx: ExportContext) -> None:
        """Introduce ``y`` and substitute ``v = s Mᵀ y``."""
        if self.at is not None:
            raise NotDCPError(
                "ψ*∘A (a precomposed conjugate) has no CVXPY form here", term=str(self),
                hint="verify it with the numeric reference, which minimizes φ at u = A(z)")
        y = State(f"{self.state.name}_dual{next(_aux_ids)}", self.op.out_size)
        self._aux = y
        sl = ctx.add_aux_state(y)
        ctx.substitute(self.state, self.s * self.op.matrix(ctx.env).T, sl, term=str(self))

    def export(self, ctx: ExportContext) -> None:
        """The y-form ``coef·s·(Σσ̃*(y) − <q, y>)`` over the auxiliary ``y`` tied to the state
        (docs/theory.md §2)."""
        c = self.coef(ctx.env) * self.s
        try:
            AntiderivativeConjugate(self.act, self._aux).__mul__(c).export(ctx)
        except NotDCPError as err:  # name this term, not the auxiliary σ̃*(y) term
            raise NotDCPError(err.reason, term=str(self), hint=err.hint) from err
        if self.q is not None:  # −c<q, y>
            ctx.add_linear(-c, self.q, as_affine(self._aux), source=f"-{c:g}·<{self.q}, y>")

    # ---------------------------------------------------------------- printing
    def raw_latex(self) -> str:
        """LaTeX of ``ψ*(v), ψ = sΣσ̃(Mz + q)`` (without the coefficient)."""
        q = f" + {self.q.latex()}" if self.q is not None else ""
        sc = "" if self.s == 1.0 else f"{self.s:g}"
        inner = f"{sc} \\sum_j \\tilde{{{_sig(self.act)}}}({self.op.latex()} \\cdot{q})"
        at = self.state.latex() if self.at is None else self.at.latex()
        return f"\\big({inner}\\big)^*({at})"

    def raw_str(self) -> str:
        """Plain-text formula ``ψ*(v), ψ = sΣσ̃(Mz + q)`` (without the coefficient)."""
        q = f" + {self.q}" if self.q is not None else ""
        sc = "" if self.s == 1.0 else f"{self.s:g}·"
        at = self.state.name if self.at is None else str(self.at)
        return f"({sc}Σ ∫{self.act.name}({self.op}·{q}))*({at})"


class _Scaled:
    """``c·A`` as a linear operator (used to fold a coefficient into M)."""

    def __init__(self, c: float, op: object):
        self.c, self.op = c, op
        self.in_size, self.out_size = op.in_size, op.out_size

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        return self.c * self.op.apply(v, env)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        return self.c * self.op.adjoint(w, env)

    def matrix(self, env: Env | None = None) -> np.ndarray:
        return self.c * self.op.matrix(env)

    def norm(self, env: Env | None = None) -> float:
        return abs(self.c) * self.op.norm(env)

    def symbols(self) -> list[Symbol]:
        return self.op.symbols()

    def latex(self) -> str:
        return f"{self.c:g}{self.op.latex()}"

    def __str__(self) -> str:
        return f"{self.c:g}{self.op}"


def quadratic_form_conjugate(t: QuadraticForm) -> Term:
    """``ψ = c·½uᵀSu`` with ``S ⪰ 0`` a Constant and ``u = Wz + q``: ``ψ = c·Σσ̃_id(S^½u)``
    (``σ̃_id(a) = a²/2``), so ``ψ*`` is the separable∘affine conjugate of the identity
    activation on ``S^½Wz + S^½q`` (Theorem 1 then gives the layer ``c·WᵀS(Wz + q)``, the
    linear "activation" ``S`` of TPAMI Table 1)."""
    name = t.Q.name
    if t.scalars or t.scale <= 0:
        raise NotDCPError(f"conjugate of a non-positive or scalar-scaled ½uᵀ{name}u",
                          term=str(t), hint="use a positive numeric coefficient")
    if not isinstance(t.Q, Constant):
        raise NotDCPError(
            f"the conjugate of ½uᵀ{name}u needs {name}^½, fixed at declaration", term=str(t),
            hint=f"declare {name} as a Constant (or write ψ = Σσ̃_identity(R(Wz + q)) with R a "
                 "Weight, RᵀR = S)")
    q = t.Q.resolve(None).detach().cpu().numpy().astype(np.float64)
    lam, vec = np.linalg.eigh(0.5 * (q + q.T))
    if lam.min() < -1e-10 * max(1.0, float(np.abs(lam).max())):
        raise NotDCPError(f"{name} is not positive semidefinite (λ_min = {lam.min():.3g}): "
                          f"½uᵀ{name}u is not convex", term=str(t),
                          hint="a linear activation S needs S ⪰ 0")
    root = Constant(f"{name}_sqrt", (vec * np.sqrt(np.clip(lam, 0.0, None))) @ vec.T)
    return SeparableAffineConjugate.from_antiderivative(
        Antiderivative("identity", as_affine(single_arg(t)).map(Dense(root))) * t.scale)


CONJUGATE_RULES[QuadraticForm] = quadratic_form_conjugate


def antiderivative_conjugate(t: Antiderivative) -> Term | None:
    """``ψ*`` of ``ψ = s·Σσ̃(Mz + q)`` with ``s > 0`` a number (None: no closed form here)."""
    if t.scalars or t.scale <= 0:
        return None
    return SeparableAffineConjugate.from_antiderivative(t)


CONJUGATE_RULES[Antiderivative] = antiderivative_conjugate
