"""Adjoint (transpose) of an operator: ``w ↦ Aᵀ w``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._algebra import register
from .._lazy import torch
from ..symbols import Env, Symbol
from .base import LinOp, op_latex, op_symbols


class Adjoint(LinOp):
    """``Aᵀ``: ``apply`` is ``A.adjoint`` and ``adjoint`` is ``A.apply``; ``(Aᵀ)ᵀ = A``."""

    def __init__(self, A: Any, *, name: str | None = None) -> None:
        self.A = A
        self.in_size, self.out_size = A.out_size, A.in_size
        self.in_shape = getattr(A, "out_shape", (A.out_size,))
        self.out_shape = getattr(A, "in_shape", (A.in_size,))
        base = str(A) if getattr(A, "atomic", True) else f"({A})"
        super().__init__(f"{base}^T", name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``Aᵀ v``."""
        return self.A.adjoint(self.check_input(v), env)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``A w``."""
        return self.A.apply(self.check_input(w, adjoint=True), env)

    @property
    def apply_cost(self) -> int:
        """That of ``A`` (the adjoint costs what the operator does)."""
        return self.A.apply_cost

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """``matrix(A)ᵀ``."""
        return np.ascontiguousarray(self.A.matrix(env).T)

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """``||Aᵀ||₂ = ||A||₂``."""
        return float(self.A.norm(env, iters=iters, tol=tol, seed=seed))

    def symbols(self) -> list[Symbol]:
        """The symbols of ``A``."""
        return op_symbols(self.A)

    def transpose_text(self, latex: bool = False) -> str:
        """``(Aᵀ)ᵀ`` displays as ``A``."""
        return self.A.latex() if latex else str(self.A)

    @property
    def T(self) -> Any:
        """``(Aᵀ)ᵀ = A`` (the wrapped operator itself)."""
        return self.A

    def _latex(self) -> str:
        inner = op_latex(self.A)
        return (
            f"{inner}^\\top" if getattr(self.A, "atomic", True) else f"\\left({inner}\\right)^\\top"
        )


register("transpose", Adjoint)
