"""Dense matrix operator ``v ↦ W v`` (batched: ``v @ Wᵀ``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._algebra import register
from .._lazy import torch
from ..errors import ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, as_symbol, finite_matrix, resolve_weight


class Dense(LinOp):
    """``A v = W v`` with ``W ∈ R^{m×n}`` a Weight/Constant (or array, wrapped as a Constant)."""

    def __init__(self, W: Any, *, name: str | None = None) -> None:
        self.W = as_symbol(W)
        if len(self.W.shape) != 2:
            raise ShapeError(
                f"Dense needs a 2-D matrix, '{self.W.name}' has shape {self.W.shape}",
                term=self.W.name,
                hint="declare the weight with shape (out, in)",
            )
        self.out_size, self.in_size = self.W.shape
        self.in_shape, self.out_shape = (self.in_size,), (self.out_size,)
        super().__init__(self.W.name, name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``W v`` (batched ``v @ Wᵀ``)."""
        v = self.check_input(v)
        return v @ resolve_weight(self.W, env, v, self).T

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``Wᵀ w`` (batched ``w @ W``)."""
        w = self.check_input(w, adjoint=True)
        return w @ resolve_weight(self.W, env, w, self)

    def bound(self, env: Env | None, like: torch.Tensor) -> tuple[Any, Any]:
        """``(v ↦ v Wᵀ, w ↦ w W)`` with ``W`` resolved once."""
        w = resolve_weight(self.W, env, like, self)
        wt = w.T
        return (lambda v: v @ wt), (lambda u: u @ w)

    def gram(self, like: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``WᵀW`` (one product, ``n²m``)."""
        w = resolve_weight(self.W, env, like, self)
        return w.T @ w

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """``W`` itself as a float64 numpy array (a copy)."""
        return finite_matrix(self.W.numpy(env), str(self))

    def symbols(self) -> list[Symbol]:
        """``[W]``."""
        return [self.W]

    def _latex(self) -> str:
        return self.W.latex()

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """``||W||₂`` exactly (SVD) for matrices up to 2000 on a side, else power iteration."""
        if min(self.in_size, self.out_size) <= 2000:
            return float(np.linalg.norm(self.matrix(env), 2))
        return super().norm(env, iters, tol, seed)


register("dense", Dense)
