"""Identity operator ``v ↦ v``."""

from __future__ import annotations

import numpy as np

from .._lazy import torch
from ..symbols import Env
from .base import LinOp, as_shape


class Identity(LinOp):
    """``I v = v`` on ``R^n`` (``size_or_shape``: ``n`` or a layout shape with ``prod = n``)."""

    def __init__(self, size_or_shape: int | tuple[int, ...], *, name: str | None = None) -> None:
        self.in_shape = self.out_shape = as_shape(size_or_shape)
        self.in_size = self.out_size = int(np.prod(self.in_shape))
        super().__init__("I", name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``v``."""
        return self.check_input(v)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``w`` (``Iᵀ = I``)."""
        return self.check_input(w, adjoint=True)

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """``I_n``."""
        return np.eye(self.in_size)

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """``||I||₂ = 1`` (exact)."""
        return 1.0
