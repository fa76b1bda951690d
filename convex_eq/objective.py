"""Objectives: sums of terms, with value, gradient, prox, LaTeX, certificate and CVXPY export."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._algebra import register
from ._lazy import torch
from .affine import values_from
from .certificate import Certificate, analyze, certify, keep_default_weights_inside
from .errors import ConvexEqError, LoweringError, NotDCPError, ShapeError
from .export import ExportContext, ExportedProblem
from .symbols import Env, Symbol, as_tensor
from .terms.base import Curvature, Term
from .terms.quadratic import Linear, SqNorm


class Objective:
    """``Σ_k term_k``: the hidden objective of an equilibrium layer."""

    def __init__(self, terms: list[Term], name: str = ""):
        flat: list[Term] = []
        for t in terms:
            if isinstance(t, Objective):
                flat.extend(t.terms)
            elif isinstance(t, Term):
                flat.append(t)
            else:
                raise ShapeError(f"cannot add {type(t).__name__} to an objective", term=name or "Σ")
        if not flat:
            raise ShapeError("an objective needs at least one term", term=name or "Σ")
        self.terms = flat
        self.name = name
        self._check_symbols()
        keep_default_weights_inside(self)

    def _check_symbols(self) -> None:
        seen: dict[str, Symbol] = {}
        for s in self.symbols:
            o = seen.get(s.name)
            if o is not None and o is not s:
                raise ShapeError(
                    f"two different symbol objects are named '{s.name}' ({o!r} and {s!r}): "
                    "declaring a symbol again makes a new one, not a reference to the first",
                    term=s.name,
                    hint=f"reuse the object already in the objective (the {o.kind} "
                    f"'{s.name}' you declared first) in the new term instead of declaring "
                    f"{type(s).__name__}({s.name!r}, …) again; rename only a genuinely "
                    "different symbol",
                )
            seen[s.name] = s

    # ------------------------------------------------------------------ symbols
    def _collect(self, kind: str | None) -> list[Symbol]:
        out: list[Symbol] = []
        for t in self.terms:
            for s in t.symbols():
                if (kind is None or s.kind == kind) and all(s is not o for o in out):
                    out.append(s)
        return out

    @property
    def symbols(self) -> list[Symbol]:
        """Every symbol the terms read, in order of appearance."""
        return self._collect(None)

    @property
    def states(self) -> list[Symbol]:
        """The state blocks (what the layer solves for), in order of appearance."""
        return [s for s in self._collect("state")]

    @property
    def inputs(self) -> list[Symbol]:
        """The layer's inputs, in order of appearance."""
        return self._collect("input")

    @property
    def weights(self) -> list[Symbol]:
        """The trainable weights, in order of appearance."""
        return self._collect("weight")

    @property
    def constants(self) -> list[Symbol]:
        """The fixed tensors, in order of appearance."""
        return self._collect("constant")

    @property
    def scalars(self) -> list[Symbol]:
        """The named scalar coefficients, in order of appearance."""
        return self._collect("scalar")

    def symbol(self, name: str) -> Symbol:
        """The symbol called ``name`` (a ``ShapeError`` when there is none)."""
        for s in self.symbols:
            if s.name == name:
                return s
        raise ShapeError(f"no symbol named '{name}' in the objective", term=self.name or str(self))

    # ------------------------------------------------------------------ algebra
    def __add__(self, other: Any) -> Objective:
        if isinstance(other, (int, float)) and other == 0:
            return self
        return Objective([*self.terms, other], self.name)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Objective:
        if isinstance(other, Objective):
            return Objective([*self.terms, *[-t for t in other.terms]], self.name)
        return Objective([*self.terms, -other], self.name)

    def __mul__(self, c: Any) -> Objective:
        return Objective([t * c for t in self.terms], self.name)

    __rmul__ = __mul__

    def __neg__(self) -> Objective:
        return self * -1.0

    # ------------------------------------------------------------------ binding values
    def split_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
        """Separate state/input values (flattened, batched) from weight/scalar overrides."""
        known = {s.name: s for s in self.symbols}
        for k in kwargs:
            if k not in known:
                raise ShapeError(f"unknown symbol '{k}'", term=self.name or "objective",
                                 hint=f"known symbols: {', '.join(sorted(known))}")
        needed = [s for s in self.states + self.inputs]
        values = values_from(needed, kwargs)
        env: dict[str, Any] = {}
        for k, v in kwargs.items():
            s = known[k]
            if s.kind in ("weight", "constant", "scalar"):
                t = as_tensor(v)
                env[k] = s._check_value(t) if s.kind != "scalar" else t
        sizes = {v.shape[0] for v in values.values()}
        if len(sizes) > 1 and 1 in sizes:
            b = max(sizes)
            values = {k: v.expand(b, -1) if v.shape[0] == 1 else v for k, v in values.items()}
            sizes = {b}
        if len(sizes) > 1:
            raise ShapeError(f"batch sizes differ: {sorted(sizes)}", term=self.name or "objective")
        return values, env

    # ------------------------------------------------------------------ numerics
    def value_tensor(self, values: Mapping[str, torch.Tensor], env: Env | None = None
                     ) -> torch.Tensor:
        """Per-sample value ``(B,)`` from flat batched values."""
        out = None
        for t in self.terms:
            v = t.value(values, env)
            out = v if out is None else out + v
        return out

    def value(self, **kwargs: Any) -> Any:
        """``Σ term(z, x)`` per sample; numpy in → numpy out, torch in → torch out."""
        values, env = self.split_kwargs(kwargs)
        v = self.value_tensor(values, env)
        unbatched = all(
            tuple(as_tensor(kwargs[s.name]).shape) == s.shape for s in self.states + self.inputs
        )
        if any(isinstance(kwargs[s.name], torch.Tensor) for s in self.states):
            return v[0] if unbatched else v
        out = v.detach().cpu().numpy()
        return float(out[0]) if unbatched else out

    def grad_tensor(self, values: Mapping[str, torch.Tensor], env: Env | None = None
                    ) -> dict[str, torch.Tensor]:
        """``∇G`` of the smooth terms at ``values`` (state and input tensors by name), per
        state block: the sum of each term's gradient."""
        out: dict[str, torch.Tensor] = {}
        for t in self.terms:
            for k, g in t.grad(values, env).items():
                out[k] = out[k] + g if k in out else g
        return out

    def prox(self, v: torch.Tensor, t: float, values: Mapping[str, torch.Tensor] | None = None,
             env: Env | None = None) -> torch.Tensor:
        """``prox_{t·obj}(v)`` for one prox-able term plus ``a/2||z||²`` and linear terms.

        ``prox_{t(g + a/2||·||² + <w,·>)}(v) = prox_{t/(1+ta) g}((v - t w)/(1+ta))``."""
        if len(self.states) != 1:
            raise LoweringError("prox of a multi-block objective", term=str(self))
        s = self.states[0]
        a, shift, g = 0.0, None, []
        for term in self.terms:
            if isinstance(term, SqNorm) and term.prox_state is s:
                a = a + term.coef_t(env)
            elif isinstance(term, Linear) and term.args[1].is_state(s):
                w = term.coef_t(env) * term.args[0].evaluate(values or {}, env)
                shift = w if shift is None else shift + w
            else:
                g.append(term)
        if not 1 + t * float(a) > 0:
            raise LoweringError("prox undefined: quadratic coefficient ≤ -1/t", term=str(self))
        v2 = v if shift is None else v - t * shift
        v2 = v2 / (1 + t * a)
        tt = t / (1 + t * a)
        if not g:
            return v2
        if len(g) == 1 and g[0].has_prox:
            return g[0].prox(v2, tt, env)
        raise LoweringError(
            f"no closed-form prox for {self}", term=str(self),
            hint="a prox is known for one prox-able term plus squared-norm and linear terms",
        )

    # ------------------------------------------------------------------ analysis
    def certificate_structure(self) -> Curvature:
        """The structural convexity analysis: the conditions on the weights under which the
        objective is convex, before they are evaluated (:meth:`certificate` evaluates them)."""
        return analyze(self)

    def certificate(self, **weights: Any) -> Certificate:
        """Convexity certificate evaluated at the current (or given) weights."""
        _, env = self._env_only(weights)
        return certify(self, env)

    def _env_only(self, kwargs: Mapping[str, Any]) -> tuple[None, dict]:
        known = {s.name: s for s in self.symbols}
        env = {}
        for k, v in kwargs.items():
            if k not in known or known[k].kind not in ("weight", "constant", "scalar"):
                raise ShapeError(f"'{k}' is not a weight/constant/scalar of the objective",
                                 term=self.name or "objective")
            env[k] = as_tensor(v)
        return None, env

    # ------------------------------------------------------------------ export
    def to_cvxpy(self, parameters: tuple[str, ...] = (), **kwargs: Any) -> ExportedProblem:
        """Export one instance to CVXPY; returns the problem and the map back to the state.

        Inputs are given by name (one sample); names in ``parameters`` become ``cp.Parameter``s
        (DPP form, for cvxpylayers)."""
        known = {s.name: s for s in self.symbols}
        inputs, env = {}, {}
        for k, v in kwargs.items():
            if k not in known:
                raise ShapeError(f"unknown symbol '{k}'", term="to_cvxpy")
            s = known[k]
            if s.kind == "state":
                raise ShapeError("states are the variables of the exported problem",
                                 term="to_cvxpy", hint=f"do not pass {k}")
            if s.kind == "input":
                t = as_tensor(v)
                if t.numel() != s.size:
                    raise ShapeError(f"export takes one sample: {k} has shape {tuple(t.shape)}, "
                                     f"expected {s.shape}", term="to_cvxpy")
                inputs[k] = t
            else:
                env[k] = as_tensor(v)
        for s in self.inputs:
            if s.name not in inputs:
                raise ShapeError(f"missing input '{s.name}'", term="to_cvxpy",
                                 hint=f"pass {s.name}=array of shape {s.shape}")
        ctx = ExportContext(self.states, inputs, env, tuple(parameters))
        try:
            for t in self.terms:
                if hasattr(t, "declare"):
                    t.declare(ctx)
            ctx.finalize_variables()
            for t in self.terms:
                for qp in t.quad_parts(env):
                    ctx.add_quadratic(qp.coef, qp.u1, qp.u2, qp.source)
                t.export(ctx)
            return ctx.build()
        except NotDCPError as err:
            cert = certify(self, env)
            if cert.convex:
                raise NotDCPError(
                    f"objective is certified convex ({cert.text}) but not DCP: {err.reason}",
                    term=err.term,
                    hint="convexity comes from curvature bounds DCP cannot see; verify with the "
                    "certified-convex numeric reference (verify.check)",
                ) from err
            raise

    # ------------------------------------------------------------------ printing
    def latex(self) -> str:
        """LaTeX of the whole objective."""
        parts = [t.latex() for t in self.terms]
        s = " + ".join(parts).replace("+ -", "- ")
        return s

    def __str__(self) -> str:
        s = " + ".join(str(t) for t in self.terms).replace("+ -", "- ")
        return s

    def __repr__(self) -> str:
        return f"Objective({self})"

    def describe(self) -> str:
        """Multi-line table: each term with its curvature and smoothness."""
        lines = []
        for t in self.terms:
            cur = t.curvature()
            cond = "; ".join(c.text for c in cur.conditions)
            lip = t.grad_lipschitz(None) if t.smooth else np.inf
            lines.append(f"  {t!s:<48} {t.label:<26} {cur.kind:<8}"
                         f"{(' if ' + cond) if cond else ''}  smooth={t.smooth}"
                         + (f" (L≤{lip:.3g})" if t.smooth and np.isfinite(lip) else ""))
        return "\n".join(lines)


def objective(*terms: Term, name: str = "") -> Objective:
    """Build an objective from terms."""
    return Objective(list(terms), name)


register("sum", Objective)

__all__ = ["ConvexEqError", "Objective", "objective"]
