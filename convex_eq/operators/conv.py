"""2-D convolution operator (no bias) on flattened ``(C, H, W)`` feature maps."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ScaleError, ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, as_shape, as_symbol, resolve_weight


def _pair(x: int | tuple[int, int], what: str, low: int) -> tuple[int, int]:
    p = (x, x) if isinstance(x, int) else tuple(x)
    if len(p) != 2 or any(int(a) != a or a < low for a in p):
        raise ScaleError(f"{what} = {x} must be an int (or pair of ints) >= {low}", term="Conv2d")
    return int(p[0]), int(p[1])


class Conv2d(LinOp):
    """``A v = conv2d(v, K)`` (cross-correlation, as torch); ``Aᵀ`` = ``conv_transpose2d``.

    ``weight`` has shape ``(C_out, C_in, kh, kw)``; ``in_shape = (C_in, H, W)``;
    ``out_shape = (C_out, H_out, W_out)`` with ``H_out = (H + 2 p - kh) // s + 1`` (as torch).
    """

    def __init__(
        self,
        weight: Any,
        in_shape: tuple[int, int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        *,
        name: str | None = None,
    ) -> None:
        self.weight = as_symbol(weight, prefix="K_c")
        wname = self.weight.name
        if len(self.weight.shape) != 4:
            raise ShapeError(
                f"conv weight '{wname}' must have shape (C_out, C_in, kh, kw), got "
                f"{self.weight.shape}",
                term=f"conv({wname})",
            )
        self.in_shape = as_shape(in_shape)
        if len(self.in_shape) != 3:
            raise ShapeError(
                f"in_shape must be (C, H, W), got {self.in_shape}", term=f"conv({wname})"
            )
        self.stride = _pair(stride, "stride", 1)
        self.padding = _pair(padding, "padding", 0)
        c_out, c_in, kh, kw = self.weight.shape
        c, h, w = self.in_shape
        if c_in != c:
            raise ShapeError(
                f"weight '{wname}' expects {c_in} input channels, in_shape {self.in_shape} has {c}",
                term=f"conv({wname})",
            )
        (sh, sw), (ph, pw) = self.stride, self.padding
        if h + 2 * ph < kh or w + 2 * pw < kw:
            raise ShapeError(
                f"kernel {kh}x{kw} is larger than the padded input {h + 2 * ph}x{w + 2 * pw}",
                term=f"conv({wname})",
            )
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        self.out_shape = (c_out, ho, wo)
        # conv_transpose2d output is (ho-1)s - 2p + k + output_padding; pick it to land on (h, w).
        self.output_padding = (h - ((ho - 1) * sh - 2 * ph + kh), w - ((wo - 1) * sw - 2 * pw + kw))
        self.in_size, self.out_size = c * h * w, c_out * ho * wo
        super().__init__(f"conv({wname})", name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``conv2d(v, K, stride, padding)`` on ``v`` reshaped to ``(B, C, H, W)``, flattened."""
        v = self.check_input(v)
        k = resolve_weight(self.weight, env, v, self)
        x = v.reshape(-1, *self.in_shape)
        y = F.conv2d(x, k, stride=self.stride, padding=self.padding)
        return y.reshape(*v.shape[:-1], self.out_size)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``conv_transpose2d(w, K, stride, padding, output_padding)``: the exact adjoint."""
        w = self.check_input(w, adjoint=True)
        k = resolve_weight(self.weight, env, w, self)
        y = w.reshape(-1, *self.out_shape)
        x = F.conv_transpose2d(
            y, k, stride=self.stride, padding=self.padding, output_padding=self.output_padding
        )
        return x.reshape(*w.shape[:-1], self.in_size)

    def symbols(self) -> list[Symbol]:
        """``[K]``."""
        return [self.weight]

    def _latex(self) -> str:
        return f"\\operatorname{{conv}}({self.weight.latex()})"
