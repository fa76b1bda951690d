"""Inverse of a square invertible operator: ``v ↦ A⁻¹ v`` (a linear solve)."""

from __future__ import annotations

from typing import Any

from .._lazy import torch
from ..errors import ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, op_latex, op_symbols


class Inverse(LinOp):
    """``A⁻¹`` of a square operator: ``apply`` solves ``A u = v``, ``adjoint`` solves
    ``Aᵀ u = w`` (``(A⁻¹)ᵀ = (Aᵀ)⁻¹``); ``A`` is assembled densely (torch, differentiable)."""

    def __init__(self, A: Any, *, name: str | None = None) -> None:
        if A.in_size != A.out_size:
            raise ShapeError(f"{A} maps {A.in_size} → {A.out_size}: not square, no inverse",
                             term=str(A), hint="only a square invertible operator has one")
        self.A = A
        self.in_size = self.out_size = A.in_size
        self.in_shape = getattr(A, "out_shape", (A.out_size,))
        self.out_shape = getattr(A, "in_shape", (A.in_size,))
        base = str(A) if getattr(A, "atomic", True) else f"({A})"
        super().__init__(f"{base}⁻¹", name)

    def _dense(self, like: torch.Tensor, env: Env | None) -> torch.Tensor:
        eye = torch.eye(self.in_size, dtype=like.dtype, device=like.device)
        return self.A.apply(eye, env).T  # columns A e_i

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``A⁻¹ v`` (batched)."""
        v = self.check_input(v)
        return torch.linalg.solve(self._dense(v, env), v.reshape(-1, self.in_size).T).T.reshape(
            v.shape)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``A⁻ᵀ w`` (batched)."""
        w = self.check_input(w, adjoint=True)
        return torch.linalg.solve(self._dense(w, env).T, w.reshape(-1, self.in_size).T).T.reshape(
            w.shape)

    def symbols(self) -> list[Symbol]:
        """The symbols of the inverted operator ``A``."""
        return op_symbols(self.A)

    def _latex(self) -> str:
        return f"{op_latex(self.A)}^{{-1}}"
