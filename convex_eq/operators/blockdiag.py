"""Block-diagonal operator ``diag(A_1, ..., A_k)`` on concatenated blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._lazy import scipy_linalg, torch
from ..errors import ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, op_latex, op_symbols, unique_symbols


class BlockDiag(LinOp):
    """``(v_1, ..., v_k) ↦ (A_1 v_1, ..., A_k v_k)`` on the concatenation of the blocks.

    ``in_shape``/``out_shape`` are tuples of the blocks' layout shapes.
    """

    def __init__(self, ops: Sequence[Any], *, name: str | None = None) -> None:
        self.ops = list(ops)
        if not self.ops:
            raise ShapeError("BlockDiag needs at least one block", term="blkdiag()")
        self.in_sizes = [op.in_size for op in self.ops]
        self.out_sizes = [op.out_size for op in self.ops]
        self.in_size, self.out_size = sum(self.in_sizes), sum(self.out_sizes)
        self.in_shape = tuple(getattr(op, "in_shape", (op.in_size,)) for op in self.ops)
        self.out_shape = tuple(getattr(op, "out_shape", (op.out_size,)) for op in self.ops)
        super().__init__("blkdiag(" + ", ".join(str(op) for op in self.ops) + ")", name)

    @property
    def apply_cost(self) -> int:
        """The blocks' costs."""
        return sum(op.apply_cost for op in self.ops)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``(A_i v_i)_i`` concatenated."""
        parts = torch.split(self.check_input(v), self.in_sizes, dim=-1)
        return torch.cat([op.apply(p, env) for op, p in zip(self.ops, parts)], dim=-1)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``(A_iᵀ w_i)_i`` concatenated."""
        parts = torch.split(self.check_input(w, adjoint=True), self.out_sizes, dim=-1)
        return torch.cat([op.adjoint(p, env) for op, p in zip(self.ops, parts)], dim=-1)

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """``scipy.linalg.block_diag`` of the blocks' matrices."""
        return scipy_linalg.block_diag(*(op.matrix(env) for op in self.ops))

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """``max_i ||A_i||₂`` (exact identity; each block estimated by power iteration)."""
        return max(float(op.norm(env, iters=iters, tol=tol, seed=seed)) for op in self.ops)

    def symbols(self) -> list[Symbol]:
        """Symbols of all blocks (distinct, in order)."""
        return unique_symbols([op_symbols(op) for op in self.ops])

    def _latex(self) -> str:
        return "\\operatorname{blkdiag}(" + ", ".join(op_latex(op) for op in self.ops) + ")"
