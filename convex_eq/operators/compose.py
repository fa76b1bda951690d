"""Composition of operators: ``v ↦ A(B v)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._algebra import register
from .._lazy import torch
from ..errors import ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, op_latex, op_symbols, unique_symbols


class Compose(LinOp):
    """``A ∘ B``: ``apply = A(B v)``, ``adjoint = Bᵀ(Aᵀ w)``; needs ``B.out_size == A.in_size``."""

    atomic = False

    def __init__(self, A: Any, B: Any, *, name: str | None = None) -> None:
        if B.out_size != A.in_size:
            raise ShapeError(
                f"cannot compose {A} (input size {A.in_size}) with {B} (output size {B.out_size})",
                term=f"{A} ∘ {B}",
                hint=f"{B} must produce a vector of the size {A} accepts",
            )
        self.A, self.B = A, B
        self.in_size, self.out_size = B.in_size, A.out_size
        self.in_shape = getattr(B, "in_shape", (B.in_size,))
        self.out_shape = getattr(A, "out_shape", (A.out_size,))
        super().__init__(f"{A} {B}", name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``A(B v)``."""
        return self.A.apply(self.B.apply(self.check_input(v), env), env)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``Bᵀ(Aᵀ w)``."""
        return self.B.adjoint(self.A.adjoint(self.check_input(w, adjoint=True), env), env)

    @property
    def apply_cost(self) -> int:
        """The two factors' costs."""
        return self.A.apply_cost + self.B.apply_cost

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """``matrix(A) @ matrix(B)``."""
        return self.A.matrix(env) @ self.B.matrix(env)

    def symbols(self) -> list[Symbol]:
        """Symbols of ``A`` then of ``B`` (distinct)."""
        return unique_symbols([op_symbols(self.A), op_symbols(self.B)])

    def _latex(self) -> str:
        return f"{op_latex(self.A)} {op_latex(self.B)}"


register("compose", Compose)
