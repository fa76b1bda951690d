"""Average down-sampling, its adjoint, and the size-matching map ``P_{i:j}`` of MOptEq."""

from __future__ import annotations

from .._lazy import torch
from .._lazy import torch_functional as F
from ..errors import ScaleError, ShapeError
from ..symbols import Env
from .adjoint import Adjoint
from .base import LinOp, as_shape
from .identity import Identity


class AvgDownsample(LinOp):
    """``A v = avg_pool2d(v, f)`` (kernel = stride = ``f``); ``Aᵀ w = nearest_upsample(w, f) / f²``.

    ``in_shape = (C, H, W)`` with ``H`` and ``W`` divisible by ``f``; ``out_shape =
    (C, H/f, W/f)``.
    """

    def __init__(self, factor: int, in_shape: tuple[int, int, int], *, name: str | None = None):
        if isinstance(factor, bool) or int(factor) != factor or factor < 1:
            raise ScaleError(f"factor = {factor} must be an integer >= 1", term="AvgDownsample")
        self.factor = f = int(factor)
        self.in_shape = as_shape(in_shape)
        if len(self.in_shape) != 3:
            raise ShapeError(f"in_shape must be (C, H, W), got {self.in_shape}", term=f"avgpool{f}")
        c, h, w = self.in_shape
        if h % f or w % f:
            raise ShapeError(
                f"spatial size {h}x{w} is not divisible by the factor {f}",
                term=f"avgpool{f}",
                hint="choose a factor dividing both H and W",
            )
        self.out_shape = (c, h // f, w // f)
        self.in_size, self.out_size = c * h * w, c * (h // f) * (w // f)
        super().__init__(f"avgpool{f}", name)

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """Mean over each non-overlapping ``f×f`` window."""
        v = self.check_input(v)
        y = F.avg_pool2d(v.reshape(-1, *self.in_shape), self.factor)
        return y.reshape(*v.shape[:-1], self.out_size)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """Copy each pixel to its ``f×f`` window, divided by ``f²``."""
        w = self.check_input(w, adjoint=True)
        f = self.factor
        y = w.reshape(-1, *self.out_shape)
        x = y.repeat_interleave(f, dim=-2).repeat_interleave(f, dim=-1) / (f * f)
        return x.reshape(*w.shape[:-1], self.in_size)

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """``||A||₂ = 1/f`` (exact: ``AAᵀ = I/f²``)."""
        return 1.0 / self.factor

    def _latex(self) -> str:
        return f"\\operatorname{{avgpool}}_{{{self.factor}}}"


class Upsample(Adjoint):
    """``AvgDownsample(f, out_shape)ᵀ``: ``v ↦ nearest_upsample(v, f) / f²`` (NOT plain nearest
    upsampling, which is ``f²`` times this)."""

    def __init__(self, factor: int, out_shape: tuple[int, int, int], *, name: str | None = None):
        super().__init__(AvgDownsample(factor, out_shape), name=name)
        self.factor = self.A.factor


def downsample_or_identity(
    from_shape: int | tuple[int, ...], to_shape: int | tuple[int, ...], *, name: str | None = None
) -> LinOp:
    """``P``: ``from_shape -> to_shape`` — ``I`` if equal, avg-downsample or its transpose.

    This is ``P_{i:j}`` of docs/theory.md §3 with ``from_shape`` = shape of ``z_j`` and ``to_shape``
    = shape
    of ``z_i``.  Spatial sizes must differ by one integer factor in both H and W; channels must
    agree.
    """
    src, dst = as_shape(from_shape), as_shape(to_shape)
    term = name or f"P[{src}->{dst}]"
    if src == dst:
        return Identity(src, name=name)
    if len(src) != 3 or len(dst) != 3:
        raise ShapeError(
            f"cannot match shapes {src} and {dst}",
            term=term,
            hint="only (C, H, W) maps of equal channels can be resampled",
        )
    if src[0] != dst[0]:
        raise ShapeError(
            f"channel counts differ ({src[0]} vs {dst[0]}); P only changes spatial size",
            term=term,
            hint="give both branches the same number of channels",
        )
    small, big = (dst, src) if dst[1] <= src[1] else (src, dst)
    f = big[1] // small[1]
    if big[1] != f * small[1] or big[2] != f * small[2]:
        raise ShapeError(
            f"spatial sizes {src[1:]} and {dst[1:]} do not differ by one integer factor",
            term=term,
        )
    if small is dst:
        return AvgDownsample(f, src, name=name)
    return Upsample(f, dst, name=name)
