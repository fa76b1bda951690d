"""Term base class: every term declares shape rule, curvature (with condition), smoothness,
gradient, prox, value, LaTeX and CVXPY export — in the style of CVXPY's atoms."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._algebra import build
from .._lazy import torch
from ..affine import Affine, as_affine
from ..errors import LoweringError, NotDCPError, ScaleError, ShapeError
from ..symbols import Env, Scalar, ScaledScalar, Symbol

if TYPE_CHECKING:
    from ..export import ExportContext

Values = Mapping[str, "torch.Tensor"]


# --------------------------------------------------------------------------- curvature
@dataclass
class Condition:
    """A checkable condition ``measure(env) <sense> bound`` (e.g. ``||W||₂ ≤ 1``)."""

    text: str
    latex: str
    measure: Callable[[Env | None], float]
    bound: float
    sense: str = "<="
    tol: float = 1e-9
    op: Any = None  # the operator whose norm is measured, if any (used by weight control)
    #: names of the symbols ``measure`` reads when ``op`` is None (None: not known)
    reads: tuple[str, ...] | None = None

    def value(self, env: Env | None = None) -> float:
        """The measured quantity ``measure(env)`` that the condition compares with ``bound``."""
        return float(self.measure(env))

    def holds(self, env: Env | None = None) -> bool:
        """``measure(env) ≤ bound + tol`` (``≥ bound − tol``; ``>``: strictly above ``bound``)
        at the current values."""
        v = self.value(env)
        if self.sense == "<=":
            return v <= self.bound + self.tol
        if self.sense == ">":
            return v > self.bound
        return v >= self.bound - self.tol

    def describe(self, env: Env | None = None) -> str:
        """``||W||₂ ≤ 1 (now 1.37)``."""
        return f"{self.text} (now {self.value(env):.4g})"


@dataclass
class Curvature:
    """Declared curvature of a term: convex/concave/affine/unknown, holding under ``conditions``."""

    kind: str
    conditions: list[Condition] = field(default_factory=list)
    reason: str = ""

    def flipped(self) -> Curvature:
        """The curvature of ``−f``: convex ↔ concave, same conditions."""
        k = {"convex": "concave", "concave": "convex"}.get(self.kind, self.kind)
        return Curvature(k, list(self.conditions), self.reason)


@dataclass
class QuadPart:
    """``coef · <u1, u2>`` (``u2 is None`` means ``½ coef ||u1||²``): a quadratic summand.

    Quadratic summands of all terms are collected into one symmetric form for certificates and
    for CVXPY export (so ``½||z||² - ½||Wz||²`` becomes ``½ zᵀ(I - WᵀW) z``)."""

    coef: float
    u1: Affine
    u2: Affine | None
    source: str


@dataclass
class StrongConvexity:
    """``coef·f`` is ``m``-strongly convex in ``state``, with ``m = factor / ||op||₂²``
    (``op`` None means ``m = factor``); with ``arg`` (an affine ``u = Az + c``) instead:
    ``coef·f − (factor/2)||u||²`` is convex, i.e. ``factor·AᵀA`` joins the quadratic form."""

    state: Symbol
    factor: float
    op: Any = None
    op_text: str = ""
    arg: Any = None

    def modulus(self, env: Env | None = None) -> float:
        """The modulus ``m = factor/||op||₂²`` (``factor`` without an operator)."""
        if self.op is None:
            return self.factor
        n = self.op.norm(env)
        return math.inf if n == 0 else self.factor / n**2


#: conjugate rules by term type, ``rule(term) → (term)*``, or None where the rule does not apply
#: (see ``Term.conjugate``); registered by the module defining the conjugate, which imports the
#: term's module (so the term's module need not import it back)
CONJUGATE_RULES: dict[type, Callable[[Term], Term | None]] = {}


# --------------------------------------------------------------------------- base term
class Term:
    """A summand of a hidden objective, ``scale · Π scalars · f(args)``."""

    #: short human-readable kind, e.g. "Gaussian kernel"
    label: str = "term"
    #: curvature of f itself (before the coefficient), unconditional
    base_curvature: str = "unknown"
    #: True if ``f`` is differentiable (the lowering may take a gradient step on it); False if
    #: it is used through its prox or not at all
    smooth: bool = False
    #: True if the term couples samples of a batch (batch decorrelation)
    batch_coupled: bool = False
    #: how ``∇_u f`` depends on the arguments, for evaluation plans (docs/theory.md §8):
    #: ``"identity"`` (``∇f(u) = u``), ``"elementwise"`` (one argument, ``∇f(u)_i`` depends on
    #: ``u_i`` only), ``"bilinear"`` (``∇_{u_k} f`` depends only on the other arguments), or
    #: None (not declared: the layer is evaluated by its node tree, differentiated by autograd)
    grad_structure: str | None = None
    #: for a ``"bilinear"`` term: ``grad_sources[k] = j`` when ``∇_{u_k} f`` is the argument
    #: ``u_j`` itself (``<w, u>``: ``(1, 0)``), which lets an evaluation plan take the value
    #: ``u_j`` with no gradient call (lowering/nodes.py, docs/theory.md §8); None: not declared
    grad_sources: tuple[int, ...] | None = None
    #: True if ``prox_{t·coef·f}`` acts coordinatewise (its Jacobian is diagonal)
    prox_elementwise: bool = False
    #: how verify's lifted problem takes the term (docs/theory.md §9.2): "value" (its value is
    #: one contribution), "dual" (a conjugate of an affine map: an auxiliary dual block y with
    #: z = s·Mᵀy), "envelope" (a Moreau envelope: an auxiliary copy of its state)
    lift_role: str = "value"
    #: the lifted problem may polish with this term's 1-D prox (a separable non-smooth term);
    #: None: the term's ``separable`` flag decides
    lift_prox: bool | None = None

    def domain_box(self, size: int, env: Env | None = None) -> tuple[Any, Any] | None:
        """``dom`` of the term in its prox state as a box ``(lo, hi)`` of length ``size`` (float64
        numpy arrays; open ends moved inside by 1e-12), or None when it constrains nothing."""
        return None

    def input_parameters(self) -> tuple[tuple[str, str], ...]:
        """``(text, LaTeX)`` definitions of parameters the term computes per sample from the
        inputs only (never a state), e.g. a bandwidth ``γ(x)``; the objective is then fixed per
        sample and lowering states them as a derivation step.  ``()`` by default."""
        return ()

    def state_parameters(self) -> tuple[tuple[str, str], ...]:
        """``(text, LaTeX)`` definitions of parameters the term recomputes from the state at
        every evaluation while its gradient rule holds them fixed (GEQ's bandwidth
        ``γ(x, z)``): the layer is then an iteration whose fixed points are not stationary
        points of the objective, and lowering claims exactly that.  ``()`` by default."""
        return ()

    def frozen_at(self, values: Values, env: Env | None = None) -> list[Term]:
        """One copy of the term per sample of ``values`` with its state-dependent parameters
        (``state_parameters``) fixed at their values there: at a fixed point of the layer's
        iteration, the terms of the objective that is stationary there.  Only for terms with
        state parameters (a ``LoweringError`` otherwise)."""
        raise LoweringError("the term has no state-dependent parameter to freeze",
                            term=str(self), hint="only terms with state_parameters() have one")

    def derivation_notes(self) -> tuple[str, ...]:
        """Remarks on the layer this term's gradient rule gives, printed with the derivation's
        stationarity step (e.g. a limit of a parameter).  ``()`` by default."""
        return ()

    def __init__(self, *args: Any):
        self.args: list[Affine] = [as_affine(a) for a in args]
        self.scale: float = 1.0
        self.scalars: tuple[Scalar, ...] = ()
        self.check_shapes()

    # ----------------------------------------------------------- structure & shapes
    def check_shapes(self) -> None:
        """Shape rule; default: nothing beyond the affine args' own consistency."""

    def states(self) -> list[Symbol]:
        """The ``State`` symbols the term depends on, in order of first appearance."""
        out: list[Symbol] = []
        for a in self.args:
            for s in a.states():
                if all(s is not o for o in out):
                    out.append(s)
        return out

    def symbols(self) -> list[Symbol]:
        """Every symbol the term reads: its arguments' symbols and their operators' weights."""
        out: list[Symbol] = []
        for a in self.args:
            for e in a.entries:
                syms = [e.symbol, *([] if e.op is None else e.op.symbols())]
                for s in syms:
                    if all(s is not o for o in out):
                        out.append(s)
        for s in self.scalars:
            if all(s is not o for o in out):
                out.append(s)
        return out

    @property
    def name(self) -> str:
        """The term as text (its ``str``)."""
        return str(self)

    # ----------------------------------------------------------- coefficient
    def coef(self, env: Env | None = None) -> float:
        """The coefficient ``scale · Π scalars`` at the current scalar values."""
        c = self.scale
        for s in self.scalars:
            c *= s.float(env)
        return c

    def coef_t(self, env: Env | None = None) -> Any:
        """The coefficient for evaluation: ``coef(env)``, but a tensor that carries the gradient
        when one of the scalars is learnable (``Scalar.coef_value``)."""
        c: Any = self.scale
        for s in self.scalars:
            c = c * s.coef_value(env)
        return c

    def coef_sign(self) -> int:
        """Sign of the coefficient (scalars are declared positive)."""
        return 1 if self.scale >= 0 else -1

    def __mul__(self, c: Any) -> Term:
        if isinstance(c, ScaledScalar):  # (0.5·λ)·t = 0.5·(λ·t)
            return (self * c.scalar) * c.factor
        t = copy.copy(self)
        if isinstance(c, Scalar):
            if c.low is None or c.low < 0:
                raise ScaleError(
                    f"scaling by scalar {c.name} needs a declared lower bound ≥ 0",
                    term=str(self),
                    hint=f"declare Scalar('{c.name}', v, low=0)",
                )
            t.scalars = (*self.scalars, c)
        elif isinstance(c, (int, float)):
            if not math.isfinite(c):
                raise ScaleError(f"scale {c} is not finite", term=str(self))
            t.scale = self.scale * float(c)
        else:
            raise ScaleError(f"cannot scale a term by {type(c).__name__}", term=str(self))
        return t

    __rmul__ = __mul__

    def __neg__(self) -> Term:
        return self * -1.0

    def with_args(self, args: list[Affine]) -> Term:
        """The same term (kind, scale, scalars) on new arguments."""
        t = copy.copy(self)
        t.args = list(args)
        return t

    def __add__(self, other: Any) -> Any:
        return build("sum", [self]) + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        return build("sum", [self]) - other

    # ----------------------------------------------------------- curvature
    def curvature(self) -> Curvature:
        """Curvature of ``coef·f`` with the conditions under which it holds."""
        c = self.raw_curvature()
        return c if self.coef_sign() > 0 else c.flipped()

    def raw_curvature(self) -> Curvature:
        """Curvature of ``f`` itself (before the coefficient) with its conditions
        (docs/theory.md §3)."""
        return Curvature(self.base_curvature)

    def quad_parts(self, env: Env | None = None) -> list[QuadPart]:
        """Quadratic summands of this term (collected objective-wide); default none."""
        return []

    def strong_convexity(self) -> StrongConvexity | None:
        """Strong-convexity modulus of ``coef·f`` in one state block (for certificates)."""
        return None

    # ----------------------------------------------------------- numerics
    def value(self, values: Values, env: Env | None = None) -> torch.Tensor:
        """Per-sample value, shape ``(B,)``."""
        us = [a.evaluate(values, env) for a in self.args]
        c = self.coef_t(env)
        raw = self.raw_value(us, env)
        return torch.zeros_like(raw) if isinstance(c, float) and c == 0 else c * raw

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``f(u_1, …, u_k)`` per sample, shape ``(B,)``, at the evaluated arguments ``us``."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw_value")

    def grad(self, values: Values, env: Env | None = None, wrt: str = "state"
             ) -> dict[str, torch.Tensor]:
        """Gradient with respect to each state block (``wrt="input"``: each input), by the chain
        rule through the affine arguments."""
        if not self.smooth:
            raise LoweringError(
                "term is not differentiable", term=str(self),
                hint="use its prox (if any) or a smooth surrogate (e.g. a Moreau envelope)",
            )
        us = [a.evaluate(values, env) for a in self.args]
        gs = self.raw_grad(us, env)
        c = self.coef_t(env)
        out: dict[str, torch.Tensor] = {}
        for a, g in zip(self.args, gs):
            if g is None:
                continue
            for s in a.symbols(wrt):
                contrib = c * a.adjoint(g, s, env)
                out[s.name] = out[s.name] + contrib if s.name in out else contrib
        return out

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇_{u_i} f(u_1, …, u_k)`` per argument (``None`` where ``f`` does not depend on it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw_grad")

    def grad_lipschitz(self, env: Env | None = None) -> float:
        """Upper bound on the Lipschitz constant of ``∇(coef·f)`` w.r.t. the stacked state."""
        if not self.smooth:
            return math.inf
        tot = 0.0
        lips = self.raw_grad_lipschitz(env)
        for a, lip in zip(self.args, lips):
            n = sum(a.operator_norm(s, env) ** 2 for s in a.states())
            tot += lip * n
        return abs(self.coef(env)) * tot

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """Per argument, a bound on ``Lip(∇_{u_i} f)`` (``inf`` when none is known)."""
        return [math.inf] * len(self.args)

    def grad_text(self, latex: bool = False) -> list[str | None] | None:
        """Printable gradient rule per argument (``f'(u)``), used in derivations."""
        return None

    # ----------------------------------------------------------- prox
    @property
    def prox_state(self) -> Symbol | None:
        """The state this term's prox acts on (single arg that is exactly a state)."""
        if len(self.args) == 1 and len(self.args[0].entries) == 1:
            e = self.args[0].entries[0]
            if e.symbol.kind == "state" and e.op is None and e.coef == 1.0:
                return e.symbol
        return None

    @property
    def has_prox(self) -> bool:
        """``True`` iff ``prox_{t·coef·f}`` has a closed form on a bare state argument."""
        return self.prox_state is not None and type(self).raw_prox is not Term.raw_prox

    def prox(self, v: torch.Tensor, t: float = 1.0, env: Env | None = None) -> torch.Tensor:
        """``prox_{t·coef·f}(v)`` (closed form)."""
        if not self.has_prox:
            raise LoweringError(
                "no closed-form prox", term=str(self),
                hint="use a gradient step (if smooth) or the forward-backward fallback",
            )
        if not t * self.coef(env) > 0:
            raise ScaleError(f"prox needs a positive step·coefficient, got "
                             f"{t * self.coef(env):g}", term=str(self))
        return self.raw_prox(v, t * self.coef_t(env), env)

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        """``prox_{t f}(v) = argmin_u f(u) + ||u − v||²/(2t)`` in closed form (docs/theory.md,
        notation)."""
        raise LoweringError("no closed-form prox", term=str(self))

    # ----------------------------------------------------------- conjugate
    def conjugate(self) -> Term:
        """Closed-form convex conjugate ``(coef·f)*`` (a method per term, or a rule in
        ``CONJUGATE_RULES`` registered by a module that may not be imported by the term's)."""
        rule = CONJUGATE_RULES.get(type(self))
        out = None if rule is None else rule(self)
        if out is not None:
            return out
        raise NotDCPError(
            "no closed-form conjugate rule", term=str(self),
            hint="conjugates are known for potentials, σ̃, ½||·||², ||·||₁, indicators, σ̃∘affine "
                 "and ½uᵀSu (S ⪰ 0 a Constant)",
        )

    # ----------------------------------------------------------- export
    def export(self, ctx: ExportContext) -> None:
        """Add this term's CVXPY form (quadratic parts go through ``quad_parts``)."""
        raise NotDCPError(
            f"{self.label} term is not DCP-representable", term=str(self),
            hint="verify this objective with the numeric/local references (verify.check)",
        )

    # ----------------------------------------------------------- printing
    def coef_latex(self) -> str:
        """LaTeX of the coefficient ``scale · Π scalars`` (empty for 1)."""
        parts = [] if self.scale == 1.0 else (["-"] if self.scale == -1.0 else [f"{self.scale:g}"])
        parts += [s.latex() for s in self.scalars]
        return " ".join(parts)

    def coef_str(self) -> str:
        """Text of the coefficient ``scale · Π scalars`` (empty for 1)."""
        if self.scale == 1.0 and not self.scalars:
            return ""
        parts = [] if self.scale == 1.0 else (["-"] if self.scale == -1.0 else [f"{self.scale:g}"])
        parts += [s.name for s in self.scalars]
        sep = "" if parts == ["-"] else "·"
        return "".join(parts[:1]) + "".join("·" + p for p in parts[1:]) + sep

    def latex(self) -> str:
        """LaTeX of ``coef · f(args)``."""
        c = self.coef_latex()
        return f"{c} {self.raw_latex()}".strip()

    def raw_latex(self) -> str:
        """LaTeX of ``f(args)`` without the coefficient (each term gives its formula)."""
        return type(self).__name__

    def __str__(self) -> str:
        return f"{self.coef_str()}{self.raw_str()}"

    def raw_str(self) -> str:
        """Text of ``f(args)`` without the coefficient (each term gives its formula)."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self}>"


def single_arg(term: Term) -> Affine:
    """The term's only affine argument (a ``ShapeError`` when it has several)."""
    if len(term.args) != 1:
        raise ShapeError(f"expected one argument, got {len(term.args)}", term=str(term))
    return term.args[0]


def batch_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample inner product ``<a_b, b_b>``."""
    return (a * b).sum(dim=-1)


def require_states(args: Sequence[Affine], term: str) -> None:
    """Refuse a term none of whose arguments involves a state (it would be a constant)."""
    if not any(a.states() for a in args):
        raise ShapeError("term does not depend on any state", term=term,
                         hint="terms of the hidden objective must involve the equilibrium state")
