"""Convolution operators (no bias) on flattened feature maps: ``Conv2d`` on ``(C, H, W)`` and
``Conv1d`` on ``(C, L)``, rectangular kernels, any padding/stride, grouped and depthwise
(``groups = C_in``) convolutions; the adjoint is the matching transposed convolution."""

from __future__ import annotations

from typing import Any

from .._lazy import torch
from .._lazy import torch_functional as F
from ..errors import ScaleError, ShapeError
from ..symbols import Env, Symbol
from .base import LinOp, as_shape, as_symbol, resolve_weight


def _tuple(x: int | tuple[int, ...], n: int, what: str, low: int, cls: str) -> tuple[int, ...]:
    p = (x,) * n if isinstance(x, int) else tuple(x)
    if len(p) != n or any(int(a) != a or a < low for a in p):
        raise ScaleError(f"{what} = {x} must be an int (or {n} ints) >= {low}", term=cls)
    return tuple(int(a) for a in p)


class _ConvNd(LinOp):
    """``A v = convNd(v, K)`` (cross-correlation, as torch) with ``groups``; ``Aᵀ`` =
    ``conv_transposeNd`` with the same weight, stride, padding and groups (its exact adjoint)."""

    #: number of spatial axes: 1 for signals ``(C, L)``, 2 for images ``(C, H, W)``
    dims: int = 2
    _fwd: str  # torch.nn.functional's convolution and its adjoint, by name
    _bwd: str

    def __init__(self, weight: Any, in_shape: tuple[int, ...], stride: int | tuple[int, ...] = 1,
                 padding: int | tuple[int, ...] = 0, *, groups: int = 1,
                 name: str | None = None) -> None:
        cls, nd = type(self).__name__, self.dims
        self.weight = as_symbol(weight, prefix="K_c")
        wname = self.weight.name
        lay = "(C, H, W)" if nd == 2 else "(C, L)"
        kdims = "kh, kw" if nd == 2 else "k"
        if len(self.weight.shape) != nd + 2:
            raise ShapeError(
                f"conv weight '{wname}' must have shape (C_out, C_in/groups, {kdims}), got "
                f"{self.weight.shape}", term=f"conv({wname})")
        self.in_shape = as_shape(in_shape)
        if len(self.in_shape) != nd + 1:
            raise ShapeError(f"in_shape must be {lay}, got {self.in_shape}", term=f"conv({wname})")
        if int(groups) != groups or groups < 1:
            raise ScaleError(f"groups = {groups} must be a positive int", term=cls)
        self.groups = int(groups)
        self.stride = _tuple(stride, nd, "stride", 1, cls)
        self.padding = _tuple(padding, nd, "padding", 0, cls)
        c_out, c_in_g, *ks = self.weight.shape
        c, *sp = self.in_shape
        g = self.groups
        if c % g or c_out % g:
            raise ShapeError(f"groups = {g} must divide the input channels ({c}) and the output "
                             f"channels ({c_out})", term=f"conv({wname})")
        if c_in_g * g != c:
            raise ShapeError(
                f"weight '{wname}' expects {c_in_g * g} input channels ({c_in_g} per group × "
                f"{g} groups), in_shape {self.in_shape} has {c}", term=f"conv({wname})")
        padded = [n + 2 * p for n, p in zip(sp, self.padding)]
        if any(k > n for k, n in zip(ks, padded)):
            raise ShapeError(
                f"kernel {'x'.join(map(str, ks))} is larger than the padded input "
                f"{'x'.join(map(str, padded))}", term=f"conv({wname})")
        out_sp = [(n - k) // s + 1 for n, k, s in zip(padded, ks, self.stride)]
        self.out_shape = (c_out, *out_sp)
        # conv_transpose output is (o-1)s - 2p + k + output_padding; pick it to land on the input
        self.output_padding = tuple(n - ((o - 1) * s - 2 * p + k) for n, o, s, p, k
                                    in zip(sp, out_sp, self.stride, self.padding, ks))
        self.in_size = c * _prod(sp)
        self.out_size = c_out * _prod(out_sp)
        #: the adjoint as a forward convolution of the flipped kernel (stride 1, padding at
        #: most k − 1: then ``conv_transposeNd(w, K, p) = convNd(w, flip(Kᵀ), k − 1 − p)``
        #: exactly; faster than the transposed convolution on most geometries, see
        #: docs/performance.md); None: the transposed convolution
        self._flip_padding = (tuple(k - 1 - p for k, p in zip(ks, self.padding))
                              if all(s == 1 for s in self.stride)
                              and all(p <= k - 1 for k, p in zip(ks, self.padding)) else None)
        super().__init__(f"conv({wname})", name)

    @property
    def apply_cost(self) -> int:
        """``C_out · (C_in/groups) · Π kernel · Π output positions`` multiply–adds."""
        c_out, c_in_g, *ks = self.weight.shape
        return c_out * c_in_g * _prod(ks) * _prod(self.out_shape[1:])

    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``convNd(v, K, stride, padding, groups)`` on ``v`` reshaped to ``(B, *in_shape)``."""
        v = self.check_input(v)
        k = resolve_weight(self.weight, env, v, self)
        y = getattr(F, self._fwd)(v.reshape(-1, *self.in_shape), k, stride=self.stride,
                            padding=self.padding, groups=self.groups)
        return y.reshape(*v.shape[:-1], self.out_size)

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``conv_transposeNd(w, K, stride, padding, output_padding, groups)``: the exact
        adjoint."""
        w = self.check_input(w, adjoint=True)
        k = resolve_weight(self.weight, env, w, self)
        flip = self.__dict__.get("_flip_padding")  # (absent in an operator pickled before it)
        if flip is not None:
            x = getattr(F, self._fwd)(w.reshape(-1, *self.out_shape), self._flipped(k),
                                      padding=flip, groups=self.groups)
        else:
            x = getattr(F, self._bwd)(w.reshape(-1, *self.out_shape), k, stride=self.stride,
                                      padding=self.padding, output_padding=self.output_padding,
                                      groups=self.groups)
        return x.reshape(*w.shape[:-1], self.in_size)

    def _flipped(self, k: torch.Tensor) -> torch.Tensor:
        """The kernel of the adjoint as a forward convolution: per group, input and output
        channels swapped, every spatial axis reversed, ``(C_in, C_out/groups, *kernel)``."""
        g = self.groups
        c_out, c_in_g, *ks = k.shape
        if g > 1:
            k = k.reshape(g, c_out // g, c_in_g, *ks).transpose(1, 2).reshape(
                g * c_in_g, c_out // g, *ks)
        else:
            k = k.transpose(0, 1)
        return k.flip(tuple(range(2, k.ndim)))

    def symbols(self) -> list[Symbol]:
        """``[K]``."""
        return [self.weight]

    def _latex(self) -> str:
        return f"\\operatorname{{conv}}({self.weight.latex()})"


class Conv2d(_ConvNd):
    """``A v = conv2d(v, K)`` on ``(C, H, W)``; ``weight`` ``(C_out, C_in/groups, kh, kw)``;
    ``out_shape = (C_out, H_out, W_out)`` with ``H_out = (H + 2 p - kh) // s + 1`` (as torch)."""

    dims = 2
    _fwd = "conv2d"
    _bwd = "conv_transpose2d"


class Conv1d(_ConvNd):
    """``A v = conv1d(v, K)`` on ``(C, L)`` signals; ``weight`` ``(C_out, C_in/groups, k)``;
    ``out_shape = (C_out, (L + 2p - k) // s + 1)``."""

    dims = 1
    _fwd = "conv1d"
    _bwd = "conv_transpose1d"


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
