"""Evaluation plans: ``T`` of a one-block layer specialised to fixed inputs and weights.

A solve evaluates ``T(·, x)`` tens of times with the same ``x`` and weights.  A plan is ``T``
with everything that does not depend on the state computed once (input injections ``Ux + b``,
Gram matrices ``AᵀA``, folded coefficients), and with its *transpose Jacobian at a point* as a
closure (``linearize``): the adjoint solve ``g = Jᵀg + v`` then applies ``Jᵀ`` as a few tensor
operations instead of one ``autograd.grad`` per iteration (``docs/theory.md`` §8).

Each node of :mod:`lowering.nodes` plans itself (``Node.plan``); a node that cannot (several
blocks, a prox without an elementwise form, a term without a declared gradient structure)
returns ``None`` and the layer keeps the general path (``T`` by the node tree, ``Jᵀ`` by
autograd).  Plans are built from tensors that may carry gradients: evaluated with autograd on,
a plan's output is differentiable with respect to the weights and inputs it was built from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .transpose import (
    ComposeT,
    DiagonalThenT,
    FunctionT,
    IdentityT,
    Lin,
    MatrixT,
    Pairs,
    SumT,
    Transpose,
    add,
    join,
    weighted_sum,
)


class Plan(Protocol):
    """``z ↦ node(z)`` for one state block, with its transpose Jacobian on demand."""

    def __call__(self, z: torch.Tensor) -> torch.Tensor: ...

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        """``(node(z), v ↦ (∂node/∂z)ᵀ v)`` (the map is ``None`` when it is zero); with
        ``value=False`` the caller wants the map only, and a plan may return ``None`` for the
        value when computing it would be extra work."""
        ...

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        """``(∂node/∂c)ᵀ g`` for each state-free tensor ``c`` the plan holds, as ``(c,
        cotangent)`` pairs (autograd carries them on to the weights and inputs ``c`` was built
        from); None when some part holds tensors it cannot differentiate in closed form."""
        ...


@dataclass
class PlanContext:
    """What a node plans against: the planned block's name, the state-free values (inputs),
    the weights, and the batch size (for cost decisions such as forming a Gram matrix)."""

    var: str
    values: Mapping[str, torch.Tensor]
    env: Any
    batch: int
    #: a tensor of the state's dtype and device (what matrices formed by the plan are made of)
    like: torch.Tensor | None = None

    def at(self, var: str) -> PlanContext:
        """The same context planning with respect to another block (composition)."""
        return PlanContext(var, self.values, self.env, self.batch, self.like)


def elementwise_derivative(fn: Callable[[torch.Tensor], torch.Tensor], p: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fn(p), fn'(p))`` for an elementwise ``fn``: one autograd call (the Jacobian is
    diagonal, so the gradient of ``Σ fn(p)`` is its diagonal), the same derivative the general
    path's autograd would use at kinks."""
    with torch.enable_grad():
        pp = p.detach().requires_grad_()
        out = fn(pp)
        (d,) = torch.autograd.grad(out.sum(), pp)
    return out.detach(), d




class Identity:
    """``z ↦ z``."""

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        return z, IdentityT()

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        return []


class Constant:
    """``z ↦ c`` (a state-free value, e.g. ``−∇<q, z> = q``)."""

    def __init__(self, c: torch.Tensor):
        self.c = c

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.c

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        return self.c, None

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        c = self.c
        if not c.requires_grad:
            return []
        return [(c, g if g.shape == c.shape else g.sum_to_size(c.shape))]


class Matrix:
    """``z ↦ z M`` with ``M`` formed once (e.g. the Gram matrix ``c·AᵀA`` of ``c·½||Az||²``;
    ``symmetric``: ``Mᵀ = M`` by construction, as a Gram matrix, so ``Jᵀ`` needs no transpose)."""

    def __init__(self, m: torch.Tensor, symmetric: bool = False):
        self.m, self.symmetric = m, symmetric

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.m

    def transposed(self) -> torch.Tensor:
        """``Mᵀ`` out of the autograd graph (``M`` itself when symmetric)."""
        m = _const(self.m)
        return m if self.symmetric else m.T

    def transpose_map(self) -> MatrixT:
        """``v ↦ v Mᵀ`` (self-adjoint when ``M`` is symmetric by construction)."""
        return MatrixT(self.transposed(), self.symmetric)

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        return z @ self.m, self.transpose_map()

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        return [(self.m, z.T @ g)] if self.m.requires_grad else []  # ∂<g, zM>/∂M


class SelfAdjoint:
    """``z ↦ L(z)`` for a self-adjoint linear map given as a function (e.g. ``c·Aᵀ(Az)``)."""

    def __init__(self, apply: Callable[[torch.Tensor], torch.Tensor]):
        self.apply = apply

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.apply(z)

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        return self.apply(z), FunctionT(self.apply, self_adjoint=True)

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        return None  # the weights sit inside the function: autograd


class ElementwiseGrad:
    """``z ↦ c·Aᵀ g(Az + b)`` with ``g`` elementwise (the gradient of a separable term of an
    affine argument, e.g. ``αWᵀσ(Wz + Ux + b)``); ``Jᵀv = c·Aᵀ(g'(u) ⊙ Av)``."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor],
                 adjoint: Callable[[torch.Tensor], torch.Tensor], offset: torch.Tensor | None,
                 g: Callable[[torch.Tensor], torch.Tensor], c: Any):
        self.forward, self.adjoint, self.offset, self.g, self.c = forward, adjoint, offset, g, c

    def _u(self, z: torch.Tensor) -> torch.Tensor:
        u = self.forward(z)
        return u if self.offset is None else u + self.offset

    def _scale(self, v: torch.Tensor) -> torch.Tensor:
        return v if isinstance(self.c, float) and self.c == 1.0 else self.c * v

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self._scale(self.adjoint(self.g(self._u(z))))

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        u = self._u(z)
        gu, d = elementwise_derivative(self.g, u)
        if torch.is_grad_enabled() and u.requires_grad:
            gu = self.g(u)  # keep the graph to the weights and inputs
        c = self.c.detach() if isinstance(self.c, torch.Tensor) else self.c

        def jt(v: torch.Tensor) -> torch.Tensor:
            w = self.adjoint(d * self.forward(v))
            return w if isinstance(c, float) and c == 1.0 else c * w

        return self._scale(self.adjoint(gu)), FunctionT(jt)

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        return None  # the weights sit inside the argument's map: autograd


class Elementwise:
    """``z ↦ f(inner(z))`` with ``f`` elementwise (an activation, a separable prox);
    ``Jᵀv = J_innerᵀ(f'(p) ⊙ v)`` (``f'`` in closed form when given as ``df``, else by
    autograd)."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor], inner: Plan,
                 df: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 has_params: bool = False,
                 f_inplace: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.f, self.inner, self.df = f, inner, df
        #: ``f`` reads weights or scalars (a prox with a coefficient): no closed-form param_vjp
        self.has_params = has_params
        self._point: tuple[torch.Tensor, torch.Tensor] | None = None  # (z, f'(inner(z)))
        inner_fn = getattr(inner, "fn", inner)
        #: the output has the state's shape ``(B, N)`` whenever the inner value has
        self.batch_shaped = getattr(inner, "batch_shaped", False)
        #: the evaluation as one flat function (fewer Python frames per solver iteration); in
        #: place (``f_inplace``) only on the fused ``c + zM``, a new tensor at every call,
        #: never on an inner value that may alias ``z`` or a stored tensor
        affine = getattr(inner, "affine", None)
        if affine is not None:  # σ(c + zM) in one frame
            c, m = affine[0], affine[1].m
            act = f_inplace if f_inplace is not None else f
            self.fn = lambda z: act(torch.addmm(c, z, m))
        else:
            self.fn = lambda z: f(inner_fn(z))

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.fn(z)

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        p, jt_in = self.inner.linearize(z)
        if self.df is not None:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    d = self.df(p)
            else:
                d = self.df(p)
            out = self.f(p) if value else None
        else:
            out, d = elementwise_derivative(self.f, p)
            if torch.is_grad_enabled() and p.requires_grad:
                out = self.f(p)  # keep the graph to the weights and inputs
        self._point = (z, d)
        if jt_in is None:
            return out, None
        return out, DiagonalThenT(d, jt_in)

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        if self.has_params:
            return None
        if self._point is not None and self._point[0] is z:  # linearised here already
            d = self._point[1]
        else:
            p = self.inner(z)
            d = self.df(p) if self.df is not None else elementwise_derivative(self.f, p)[1]
        return self.inner.param_vjp(z, d * g)


class AffineElementwise:
    """``z ↦ f(c + zM)`` with ``f`` elementwise: :class:`Elementwise` over the fused affine
    :class:`Sum` (the canonical OptEq form ``σ(Ux + b + Wz)``), as one flat type:
    ``Jᵀv = (f'(p) ⊙ v) Mᵀ`` at ``p = c + zM`` and ``(∂/∂c, ∂/∂M)ᵀ g = (f'(p) ⊙ g,
    zᵀ(f'(p) ⊙ g))``, the same values as the nested form in fewer Python frames per call
    (docs/theory.md §8, solver bookkeeping).  Built by :func:`elementwise`."""

    #: the value is a new ``(B, N)`` tensor at every evaluation (no broadcast to check)
    batch_shaped = True

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor], inner: Sum,
                 df: Callable[[torch.Tensor], torch.Tensor] | None,
                 f_inplace: Callable[[torch.Tensor], torch.Tensor] | None,
                 df_of_value: Callable[[torch.Tensor], torch.Tensor] | None = None):
        assert inner.affine is not None
        self.f, self.inner, self.df = f, inner, df
        self.f_inplace = f_inplace  # (what ``fn`` applies; compared by the module's builder check)
        #: ``u ↦ f'(p)`` at ``u = f(p)`` where ``f``'s value decides its derivative (None
        #: otherwise): :meth:`linearize_at` reads ``f'`` from a known image, no ``c + zM``
        self.df_of_value = df_of_value
        self.c, self.mat = inner.affine
        self.m = self.mat.m
        self._point: tuple[torch.Tensor, torch.Tensor] | None = None  # (z, f'(c + zM))
        c, m = self.c, self.m
        act = f_inplace if f_inplace is not None else f
        self.fn = lambda z: act(torch.addmm(c, z, m))

    @classmethod
    def fused(cls, f: Callable[[torch.Tensor], torch.Tensor], c: torch.Tensor, m: torch.Tensor,
              df: Callable[[torch.Tensor], torch.Tensor] | None,
              f_inplace: Callable[[torch.Tensor], torch.Tensor] | None,
              df_of_value: Callable[[torch.Tensor], torch.Tensor] | None
              ) -> AffineElementwise:
        """``f(c + zM)`` for a Gram matrix ``M`` (symmetric by construction): what
        :func:`elementwise` builds over ``Sum([(1, Constant(c)), (1, Matrix(M))])``."""
        return cls(f, Sum([(1.0, Constant(c)), (1.0, Matrix(m, symmetric=True))]), df,
                   f_inplace, df_of_value)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.fn(z)

    def _derivative(self, p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(f(p) or None, f'(p))``: ``f'`` in closed form when given (no graph), else by
        autograd (then ``f(p)`` comes with it)."""
        df = self.df
        if df is None:
            return elementwise_derivative(self.f, p)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return None, df(p)
        return None, df(p)

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        p = torch.addmm(self.c, z, self.m)
        out, d = self._derivative(p)
        if value and (out is None or (torch.is_grad_enabled() and p.requires_grad)):
            out = self.f(p)  # (with autograd on: the graph to the weights and inputs)
        self._point = (z, d)
        return out, DiagonalThenT(d, self.mat.transpose_map())

    # --- the held-tensor protocol of the express call (lowering/backward.py, _PlannedFixedPoint):
    # the plan's state-free tensors are the autograd inputs, differentiated in closed form
    @property
    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The state-free tensors ``T`` is a function of here: ``(c, M)``."""
        return self.c, self.m

    def eval_with(self, z: torch.Tensor, held: Sequence[torch.Tensor]) -> torch.Tensor:
        """``f(c + zM)`` with ``(c, M)`` replaced by ``held`` (a differentiable function of both:
        the second-order implicit backward differentiates it)."""
        return self.f(torch.addmm(held[0], z, held[1]))

    def linearize_at(self, z: torch.Tensor, image: torch.Tensor | None = None
                     ) -> tuple[Transpose, torch.Tensor]:
        """``(v ↦ Jᵀv, f'(c + zM))`` at ``z``; ``image``: ``f(c + zM)`` when the caller has it
        (the solver's last evaluation), from which ``f'`` is read where ``f`` allows
        (``df_of_value``) instead of forming ``c + zM`` again."""
        dv = self.df_of_value
        if image is not None and dv is not None:
            d = dv(image)
        else:
            d = self._derivative(torch.addmm(self.c, z, self.m))[1]
        return DiagonalThenT(d, self.mat.transpose_map()), d

    def held_vjp(self, z: torch.Tensor, g: torch.Tensor, d: torch.Tensor,
                 needs: Sequence[bool]) -> list[torch.Tensor | None]:
        """``(∂T/∂c)ᵀ g`` and ``(∂T/∂M)ᵀ g = zᵀ(f' ⊙ g)`` at ``z`` (``d = f'(c + zM)``), each
        where ``needs`` asks for it (aligned with :attr:`held`)."""
        dg = d * g
        c = self.c
        return [(dg if dg.shape == c.shape else dg.sum_to_size(c.shape)) if needs[0] else None,
                z.T @ dg if needs[1] else None]

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        point = self._point
        if point is not None and point[0] is z:  # linearised here already
            d = point[1]
        else:
            d = self._derivative(torch.addmm(self.c, z, self.m))[1]
        dg = d * g
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        c, m = self.c, self.m
        if c.requires_grad:
            out.append((c, dg if dg.shape == c.shape else dg.sum_to_size(c.shape)))
        if m.requires_grad:
            out.append((m, z.T @ dg))  # ∂<dg, zM>/∂M
        return out


def elementwise(f: Callable[[torch.Tensor], torch.Tensor], inner: Plan,
                df: Callable[[torch.Tensor], torch.Tensor] | None = None,
                has_params: bool = False,
                f_inplace: Callable[[torch.Tensor], torch.Tensor] | None = None,
                df_of_value: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Plan:
    """The plan of ``f(inner(z))``: :class:`AffineElementwise` over a fused ``c + zM`` (``f``
    without weights of its own), :class:`Elementwise` otherwise."""
    if not has_params and getattr(inner, "affine", None) is not None:
        return AffineElementwise(f, inner, df, f_inplace,  # type: ignore[arg-type]
                                 df_of_value)
    return Elementwise(f, inner, df, has_params, f_inplace)


def _affine_form(parts: list[Any]) -> tuple[torch.Tensor, Matrix] | None:
    """``(c, the Matrix part M)`` when the sum is exactly a constant and a matrix with unit
    coefficients (the canonical OptEq pre-activation ``q + WᵀWz``): ``z ↦ c + zM`` is then one
    fused ``addmm``; None otherwise."""
    if len(parts) != 2:
        return None
    (ca, a), (cb, b) = parts
    # numbers only (_is_one): a trained scalar must stay in T
    if not (isinstance(ca, float) and ca == 1.0 and isinstance(cb, float) and cb == 1.0):
        return None
    if isinstance(a, Matrix) and isinstance(b, Constant):
        a, b = b, a
    if not (isinstance(a, Constant) and isinstance(b, Matrix)) or a.c.ndim != 2:
        return None
    return a.c, b


class Sum:
    """``z ↦ Σ_k c_k p_k(z)`` (coefficients are numbers or scalar tensors)."""

    def __init__(self, parts: list[tuple[Any, Plan]]):
        self.parts = parts
        #: ``(c, the Matrix part M)`` of the fused ``c + zM`` (None otherwise): its value is a
        #: new ``(B, N)`` tensor at every evaluation
        self.affine = _affine_form(parts)
        #: the value is a new ``(B, N)`` tensor at every evaluation when fused
        self.batch_shaped = self.affine is not None

    @property
    def fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The evaluation as one flat function (made when asked: a Sum inside
        :class:`AffineElementwise` is never evaluated on its own; no bound method kept on the
        instance, which would be a reference cycle)."""
        if self.affine is not None:
            c, m = self.affine[0], self.affine[1].m
            return lambda z: torch.addmm(c, z, m)
        return self.__call__

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.affine is not None:
            return torch.addmm(self.affine[0], z, self.affine[1].m)
        return weighted_sum(self.parts, z)

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        if self.affine is not None:  # c + zM: one addmm, Jᵀv = v Mᵀ
            c, mat = self.affine
            return torch.addmm(c, z, mat.m), mat.transpose_map()
        out, jts = None, []
        for c, p in self.parts:
            v, jt = p.linearize(z)
            out = add(out, v if _is_one(c) else c * v)
            if jt is not None:
                cd = c.detach() if isinstance(c, torch.Tensor) else c
                jts.append((cd, jt))
        assert out is not None
        if not jts:
            return out, None
        if len(jts) == 1 and _is_one(jts[0][0]):
            return out, jts[0][1]
        return out, SumT(jts)

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        out: Pairs = []
        for c, p in self.parts:
            if isinstance(c, torch.Tensor) and c.requires_grad:
                return None  # a trained coefficient: autograd
            out = join(out, p.param_vjp(z, g if _is_one(c) else c * g))
            if out is None:
                return None
        return out


class Compose:
    """``z ↦ outer(inner(z))`` (a substitution ``f(g(z))``, e.g. the layers of deep OptEq)."""

    def __init__(self, outer: Plan, inner: Plan):
        self.outer, self.inner = outer, inner

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(z))

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        p, jt_in = self.inner.linearize(z)
        out, jt_out = self.outer.linearize(p, value)
        if jt_in is None or jt_out is None:
            return out, None
        return out, ComposeT(jt_in, jt_out)

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        p, _ = self.inner.linearize(z)
        _, jt_out = self.outer.linearize(p)
        outer = self.outer.param_vjp(p, g)
        if outer is None:
            return None
        if jt_out is None:
            return outer
        return join(outer, self.inner.param_vjp(z, jt_out(g)))


def _const(t: torch.Tensor) -> torch.Tensor:
    """``t`` out of the autograd graph (a transpose Jacobian is applied as a constant): detached
    only when it is in one (a detach is an operation of its own)."""
    return t.detach() if t.requires_grad else t


def _is_one(c: Any) -> bool:
    return isinstance(c, float) and c == 1.0


class Root:
    """The plan of a layer's ``T`` on the flat state ``(B, N)``: a batch-independent value
    ``(1, N)`` is broadcast to the batch (as ``T`` does)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        inner_fn = getattr(plan, "fn", plan)

        def fn(z: torch.Tensor) -> torch.Tensor:
            out = inner_fn(z)
            return out if out.shape == z.shape else out.expand_as(z).contiguous()

        #: the evaluation as one flat function (what the solvers iterate); the plan's own when
        #: its value always has the state's shape (no broadcast to check)
        self.fn = inner_fn if getattr(plan, "batch_shaped", False) else fn

    @staticmethod
    def _shape(out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return out if out.shape == z.shape else out.expand_as(z).contiguous()

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.fn(z)

    def linearize(self, z: torch.Tensor, value: bool = True) -> tuple[Any, Lin]:
        out, jt = self.plan.linearize(z, value)
        return (None if out is None else self._shape(out, z)), jt

    def param_vjp(self, z: torch.Tensor, g: torch.Tensor) -> Pairs:
        return self.plan.param_vjp(z, g)
