"""Cyclic block permutation ``P`` of deep OptEq (docs/theory.md §5, Lemma 3)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._lazy import torch
from ..errors import ShapeError
from ..symbols import Env
from .base import LinOp, as_shape


class CyclicPermutation(LinOp):
    """``P (b_1, ..., b_L) = (b_L, b_1, ..., b_{L-1})``: block ``i`` moves to slot ``i+1``
    (1-based, mod L), i.e. output block 1 is the LAST input block; ``Pᵀ = P⁻¹`` rotates back,
    ``Pᵀ (c_1, ..., c_L) = (c_2, ..., c_L, c_1)``.

    ``block_sizes``: per-block sizes (ints) or layout shapes; blocks may differ in size.
    ``in_shape`` is the tuple of block shapes, ``out_shape`` the same tuple rotated.
    """

    def __init__(
        self, block_sizes: Sequence[int | tuple[int, ...]], *, name: str | None = None
    ) -> None:
        shapes = [as_shape(b) for b in block_sizes]
        if not shapes:
            raise ShapeError("CyclicPermutation needs at least one block", term="P_cyc")
        self.block_sizes = [int(np.prod(s)) for s in shapes]
        self.in_shape = tuple(shapes)
        self.out_shape = (shapes[-1], *shapes[:-1])
        self.in_size = self.out_size = sum(self.block_sizes)
        super().__init__("P_cyc", name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``(b_L, b_1, ..., b_{L-1})``."""
        b = torch.split(self.check_input(v), self.block_sizes, dim=-1)
        return torch.cat([b[-1], *b[:-1]], dim=-1)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``(c_2, ..., c_L, c_1)`` for ``w = (c_1, ..., c_L)`` with ``c_1`` of size ``|b_L|``."""
        c = torch.split(self.check_input(w, adjoint=True), self.out_sizes, dim=-1)
        return torch.cat([*c[1:], c[0]], dim=-1)

    @property
    def out_sizes(self) -> list[int]:
        """Block sizes of the output, ``(|b_L|, |b_1|, ..., |b_{L-1}|)``."""
        return [self.block_sizes[-1], *self.block_sizes[:-1]]

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """``||P||₂ = 1`` (a permutation is orthogonal)."""
        return 1.0

    def _latex(self) -> str:
        return "P_{\\mathrm{cyc}}"
