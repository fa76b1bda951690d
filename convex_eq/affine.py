"""Affine expressions ``u = Σ_k c_k A_k v_k`` over symbols (states, inputs, weights, constants).

A state or input entry contributes ``c·A(v)`` with ``v`` batched ``(B, n)``; a weight/constant
entry is a bias vector (unbatched, broadcast over the batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._algebra import register
from ._lazy import torch
from .errors import ShapeError
from .operators.compose import Compose
from .symbols import Env, Symbol, as_tensor


@dataclass(frozen=True)
class Entry:
    """One summand ``coef · op(symbol)`` (``op`` None means identity)."""

    coef: float
    op: Any
    symbol: Symbol

    @property
    def out_size(self) -> int:
        return self.symbol.size if self.op is None else self.op.out_size

    def latex(self) -> str:
        sym = self.symbol.latex()
        body = sym if self.op is None else f"{self.op.latex()} {sym}"
        return _coef_latex(self.coef, body)

    def __str__(self) -> str:
        body = self.symbol.name if self.op is None else f"{self.op} {self.symbol.name}"
        return _coef_latex(self.coef, body)


def _coef_latex(c: float, body: str) -> str:
    if c == 1.0:
        return body
    if c == -1.0:
        return f"-{body}"
    return f"{c:g} {body}"


class Affine:
    """``u = Σ c_k A_k v_k``: an affine map of states with input/bias offsets."""

    def __init__(self, entries: list[Entry]):
        if not entries:
            raise ShapeError("empty affine expression", term="Affine")
        sizes = {e.out_size for e in entries}
        if len(sizes) != 1:
            detail = ", ".join(f"{e} -> {e.out_size}" for e in entries)
            raise ShapeError(
                f"summands have different sizes ({detail})",
                term=str(self._str(entries)),
                hint="apply operators so that every summand has the same output size",
            )
        for e in entries:
            if e.op is not None and e.op.in_size != e.symbol.size:
                raise ShapeError(
                    f"operator {e.op} expects size {e.op.in_size}, {e.symbol.name} has size "
                    f"{e.symbol.size} (shape {e.symbol.shape})",
                    term=str(e),
                )
        self.entries = list(entries)
        self.size = sizes.pop()

    # ------------------------------------------------------------------ structure
    @staticmethod
    def _str(entries: list[Entry]) -> str:
        return " + ".join(str(e) for e in entries).replace("+ -", "- ")

    def symbols(self, kind: str | None = None) -> list[Symbol]:
        """Distinct symbols (optionally of one kind), in order of appearance."""
        out: list[Symbol] = []
        for e in self.entries:
            if (kind is None or e.symbol.kind == kind) and all(e.symbol is not s for s in out):
                out.append(e.symbol)
        return out

    def states(self) -> list[Symbol]:
        """The state symbols the expression reads, in order of appearance."""
        return self.symbols("state")

    def part(self, kinds: tuple[str, ...]) -> Affine | None:
        """The sub-expression made of entries whose symbol kind is in ``kinds``."""
        es = [e for e in self.entries if e.symbol.kind in kinds]
        return Affine(es) if es else None

    @property
    def state_part(self) -> Affine | None:
        """The entries on states (``Wz`` of ``Wz + Ux + b``), or None."""
        return self.part(("state",))

    @property
    def offset_part(self) -> Affine | None:
        """The state-free entries (the injection ``Ux + b`` of ``Wz + Ux + b``), or None."""
        return self.part(("input", "weight", "constant"))

    def is_state(self, state: Symbol) -> bool:
        """True if the expression is exactly ``state`` (identity, coefficient 1)."""
        return (
            len(self.entries) == 1
            and self.entries[0].symbol is state
            and self.entries[0].op is None
            and self.entries[0].coef == 1.0
        )

    # ------------------------------------------------------------------ numerics
    def evaluate(self, values: Mapping[str, torch.Tensor], env: Env | None = None) -> torch.Tensor:
        """``u`` as a batched ``(B, size)`` tensor; states/inputs from ``values``."""
        out = None
        for e in self.entries:
            if e.symbol.kind in ("state", "input"):
                if e.symbol.name not in values:
                    raise ShapeError(f"no value given for {e.symbol.kind} '{e.symbol.name}'",
                                     term=str(self))
                v = values[e.symbol.name]
            else:
                v = e.symbol.resolve(env).reshape(1, -1)
            if out is not None:
                v = v.to(out) if v.dtype != out.dtype or v.device != out.device else v
            r = v if e.op is None else e.op.apply(v, env)
            r = r if e.coef == 1.0 else e.coef * r
            out = r if out is None else out + r
        return out

    def adjoint(self, w: torch.Tensor, symbol: Symbol, env: Env | None = None) -> torch.Tensor:
        """``∂<w, u>/∂symbol = Σ c_k A_kᵀ w`` over the entries of ``symbol``."""
        out = None
        for e in self.entries:
            if e.symbol is not symbol:
                continue
            r = w if e.op is None else e.op.adjoint(w, env)
            r = r if e.coef == 1.0 else e.coef * r
            out = r if out is None else out + r
        if out is None:
            return torch.zeros(w.shape[0], symbol.size, dtype=w.dtype, device=w.device)
        return out

    def matrix(self, symbol: Symbol, env: Env | None = None) -> np.ndarray:
        """Dense matrix of ``symbol ↦ u`` (float64)."""
        m = np.zeros((self.size, symbol.size))
        for e in self.entries:
            if e.symbol is symbol:
                a = np.eye(symbol.size) if e.op is None else e.op.matrix(env)
                m = m + e.coef * a
        return m

    def operator_norm(self, symbol: Symbol, env: Env | None = None) -> float:
        """Upper bound on ``||∂u/∂symbol||₂`` (sum of the entries' estimated norms)."""
        tot = 0.0
        for e in self.entries:
            if e.symbol is symbol:
                tot += abs(e.coef) * (1.0 if e.op is None else e.op.norm(env))
        return tot

    # ------------------------------------------------------------------ algebra
    def map(self, op: Any) -> Affine:
        """``op ∘ u`` (linear operators distribute over the sum)."""
        if op.in_size != self.size:
            raise ShapeError(
                f"operator {op} expects size {op.in_size}, expression {self} has size {self.size}",
                term=str(op),
            )
        return Affine(
            [Entry(e.coef, op if e.op is None else Compose(op, e.op), e.symbol)
             for e in self.entries]
        )

    def __add__(self, other: Any) -> Affine:
        return Affine(self.entries + as_affine(other).entries)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Affine:
        return self + (-1.0) * as_affine(other)

    def __rsub__(self, other: Any) -> Affine:
        return as_affine(other) + (-1.0) * self

    def __mul__(self, c: float) -> Affine:
        if not isinstance(c, (int, float)):
            raise ShapeError(f"can only scale by a number, got {type(c).__name__}", term=str(self))
        return Affine([Entry(float(c) * e.coef, e.op, e.symbol) for e in self.entries])

    __rmul__ = __mul__

    def __neg__(self) -> Affine:
        return (-1.0) * self

    def latex(self) -> str:
        """The expression as LaTeX."""
        s = " + ".join(e.latex() for e in self.entries)
        return s.replace("+ -", "- ")

    def __str__(self) -> str:
        return self._str(self.entries)

    def __repr__(self) -> str:
        return f"Affine({self})"


def as_affine(x: Any) -> Affine:
    """Coerce a Symbol or Affine into an Affine expression."""
    if isinstance(x, Affine):
        return x
    if isinstance(x, Symbol):
        if x.kind == "scalar":
            raise ShapeError("a scalar hyper-parameter cannot be used as a vector", term=x.name)
        return Affine([Entry(1.0, None, x)])
    raise ShapeError(
        f"cannot use {type(x).__name__} as a vector expression",
        term=repr(x),
        hint="use State/Input/Weight/Constant symbols and operators",
    )


def values_from(symbols: list[Symbol], given: Mapping[str, Any], batch_shape_ok: bool = True
                ) -> dict[str, torch.Tensor]:
    """Flatten user-given state/input values to ``(B, size)`` tensors, checking shapes."""
    out: dict[str, torch.Tensor] = {}
    for s in symbols:
        if s.name not in given:
            raise ShapeError(f"missing value for {s.kind} '{s.name}'", term=s.name,
                             hint=f"pass {s.name}=array of shape {s.shape} or (B, *{s.shape})")
        t = as_tensor(given[s.name])
        if tuple(t.shape) == s.shape or (s.shape == () and t.ndim == 0):
            t = t.reshape(1, s.size)
        elif tuple(t.shape[1:]) == s.shape or (t.ndim == 2 and t.shape[1] == s.size):
            t = t.reshape(t.shape[0], s.size)
        else:
            raise ShapeError(
                f"value has shape {tuple(t.shape)}, expected {s.shape} or (B, *{s.shape})",
                term=s.name,
            )
        out[s.name] = t
    return out


register("affine", as_affine)
