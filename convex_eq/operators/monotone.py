"""Monotone linear operators on a state (docs/monotone.md §1): the skew part ``B − Bᵀ`` and the
monotone parametrisation ``I − W = mI + AᵀA − (B − Bᵀ)`` of ``W = (1 − m)I − AᵀA + B − Bᵀ``.

``monotone_margin(op, env)`` returns a lower bound ``m`` of ``λ_min(½(L + Lᵀ))`` and whether it
holds for *every* value of the operator's weights (a structural fact) or only at ``env`` (a
number computed from the dense matrix).  The bounds are units of :data:`MARGINS`, found by the
operator's class name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._lazy import torch
from ..errors import ScaleError, ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, as_symbol, finite_matrix, resolve_weight, unique_symbols


def _square(W: Symbol, what: str) -> int:
    if len(W.shape) != 2 or W.shape[0] != W.shape[1]:
        raise ShapeError(f"{what} needs a square matrix, '{W.name}' has shape {W.shape}",
                         term=W.name, hint="declare the weight with shape (n, n)")
    return W.shape[0]


class Skew(LinOp):
    """``S v = (B − Bᵀ) v``: skew, ``⟨Sv, v⟩ = 0`` for every ``B`` (monotone, margin 0)."""

    def __init__(self, B: Any, *, name: str | None = None) -> None:
        self.B = as_symbol(B)
        n = _square(self.B, "Skew")
        self.in_size = self.out_size = n
        self.in_shape = self.out_shape = (n,)
        super().__init__(f"({self.B.name} − {self.B.name}ᵀ)", name)

    def _mat(self, like: torch.Tensor, env: Env | None) -> torch.Tensor:
        b = resolve_weight(self.B, env, like, self)
        return b - b.T

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``(B − Bᵀ) v`` (batched ``v (B − Bᵀ)ᵀ``)."""
        v = self.check_input(v)
        return v @ self._mat(v, env).T

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``(B − Bᵀ)ᵀ w = −(B − Bᵀ) w``."""
        w = self.check_input(w, adjoint=True)
        return w @ self._mat(w, env)

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """``B − Bᵀ`` as a float64 array."""
        t = self._mat(torch.empty((), dtype=torch.float64), env)
        return finite_matrix(t.detach().cpu().numpy().copy(), str(self))

    def norm(self, env: Env | None = None, iters: int = 200, tol: float = 1e-10,
             seed: int = 0) -> float:
        """``||B − Bᵀ||₂`` (exact, dense SVD)."""
        return float(np.linalg.norm(self.matrix(env), 2))

    def symbols(self) -> list[Symbol]:
        """``[B]``."""
        return [self.B]

    def _latex(self) -> str:
        b = self.B.latex()
        return f"({b} - {b}^\\top)"


class MonotoneMatrix(LinOp):
    """``I − W = mI + AᵀA − (B − Bᵀ)`` with ``W = (1 − m)I − AᵀA + B − Bᵀ`` (MON's
    parametrisation): ``½((I − W) + (I − W)ᵀ) = mI + AᵀA ⪰ mI`` for every ``A, B``.

    ``A`` (``k×n``) and ``B`` (``n×n``) are weights/arrays (dense) or linear operators of the
    state (e.g. convolutions ``Conv2d``/``Conv1d`` mapping the feature map to itself)."""

    def __init__(self, A: Any, B: Any, margin: float, *, name: str | None = None) -> None:
        from .dense import Dense

        self.A = A if isinstance(A, LinOp) else Dense(A)
        self.B = B if isinstance(B, LinOp) else Dense(B)
        n = self.B.in_size
        if self.B.out_size != n:
            raise ShapeError(f"B must map the state to itself, {self.B} maps {n} → "
                             f"{self.B.out_size}", term=str(self.B),
                             hint="declare B with shape (n, n)")
        if self.A.in_size != n:
            raise ShapeError(f"A must act on the state ({n} entries), {self.A} takes "
                             f"{self.A.in_size}", term=str(self.A),
                             hint=f"declare A with shape (k, {n})")
        margin = float(margin)
        if not np.isfinite(margin) or margin <= 0:
            raise ScaleError(f"margin m = {margin} must be a positive number",
                             term="MonotoneMatrix",
                             hint="m > 0 makes the inclusion strongly monotone (e.g. m = 0.5)")
        self.margin = margin
        self.in_size = self.out_size = n
        self.in_shape = self.out_shape = getattr(self.B, "in_shape", (n,))
        a, b = self.A, self.B
        super().__init__(f"({margin:g}I + {a}ᵀ{a} − ({b} − {b}ᵀ))", name)

    def W(self, env: Env | None = None) -> torch.Tensor:
        """``W = (1 − m)I − AᵀA + B − Bᵀ`` (float64, dense), the weight of
        ``z = σ(Wz + Ux + b)``."""
        return torch.eye(self.in_size, dtype=torch.float64) - torch.as_tensor(self.matrix(env))

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``m v + Aᵀ(A v) − (B v − Bᵀ v)``."""
        v = self.check_input(v)
        return (self.margin * v + self.A.adjoint(self.A.apply(v, env), env)
                - (self.B.apply(v, env) - self.B.adjoint(v, env)))

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``m w + Aᵀ(A w) + (B w − Bᵀ w)``."""
        w = self.check_input(w, adjoint=True)
        return (self.margin * w + self.A.adjoint(self.A.apply(w, env), env)
                + (self.B.apply(w, env) - self.B.adjoint(w, env)))

    def symbols(self) -> list[Symbol]:
        """The symbols of ``A`` then ``B``."""
        return unique_symbols([self.A.symbols(), self.B.symbols()])

    def _latex(self) -> str:
        a, b = self.A.latex(), self.B.latex()
        return f"\\left({self.margin:g}I + {a}^\\top {a} - ({b} - {b}^\\top)\\right)"


# ----------------------------------------------------------------------------- margins
@dataclass(frozen=True)
class Margin:
    """``λ_min(½(L + Lᵀ)) ≥ value``; ``for_every_weight``: a structural fact, else measured at
    the given weights; ``why`` says which."""

    value: float
    for_every_weight: bool
    why: str


MarginFn = Callable[[Any, Env | None], Margin]
#: operator class name → margin bound (see :func:`monotone_margin`)
MARGINS: dict[str, MarginFn] = {}


def register_margin(op_type: str) -> Callable[[MarginFn], MarginFn]:
    """Register ``fn(op, env) → Margin`` for operators whose class is named ``op_type``."""

    def deco(fn: MarginFn) -> MarginFn:
        MARGINS[op_type] = fn
        return fn

    return deco


@register_margin("Skew")
def _skew_margin(op: Any, env: Env | None) -> Margin:
    return Margin(0.0, True, f"{op} is skew-symmetric: ⟨Sv, v⟩ = 0 for every {op.B.name}")


@register_margin("MonotoneMatrix")
def _mon_margin(op: Any, env: Env | None) -> Margin:
    return Margin(op.margin, True, f"symmetric part mI + AᵀA ⪰ mI with m = {op.margin:g} for "
                  f"every {op.A}, {op.B}")


@register_margin("Identity")
def _identity_margin(op: Any, env: Env | None) -> Margin:
    return Margin(1.0, True, "identity")


def _measured_margin(op: Any, env: Env | None) -> Margin:
    m = op.matrix(env)
    lam = float(np.linalg.eigvalsh(0.5 * (m + m.T)).min())
    return Margin(lam, False, f"λ_min(½({op} + {op}ᵀ)) = {lam:.4g} at the current weights")


def monotone_margin(op: Any, env: Env | None = None) -> Margin:
    """The registered margin of ``op`` (by class name), else ``λ_min`` of its symmetric part
    measured from the dense matrix at ``env``."""
    if getattr(op, "in_size", None) != getattr(op, "out_size", None):
        raise ShapeError(f"a monotone operator maps the state to itself; {op} maps "
                         f"{op.in_size} → {op.out_size}", term=str(op))
    fn = MARGINS.get(type(op).__name__, _measured_margin)
    return fn(op, env)
