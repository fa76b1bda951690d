"""Initial weights of the seed models: dense and convolutional weights scaled to a given operator
norm, affine injections, and the resampling operators between branches of different sizes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lazy import torch
from ..errors import ShapeError
from ..operators import Adjoint, Conv1d, Conv2d, downsample_or_identity
from ..symbols import Constant, Input, Weight


def spectral_weight(name: str, shape: tuple[int, ...], norm: float = 0.9, seed: int = 0
                    ) -> Weight:
    """A random dense weight scaled to spectral norm ``norm``."""
    g = np.random.default_rng(seed)
    w = g.standard_normal(shape)
    w = w / np.linalg.norm(w.reshape(shape[0], -1), 2) * norm
    return Weight(name, shape, w)

def conv_weight(name: str, c_out: int, c_in: int, k: int | tuple[int, ...],
                in_shape: tuple[int, ...], norm: float = 0.9, seed: int = 0,
                padding: int | tuple[int, ...] | None = None, groups: int = 1) -> Conv2d | Conv1d:
    """A random convolution scaled to operator norm ``norm`` (power iteration): ``Conv2d`` on
    ``in_shape = (C, H, W)``, ``Conv1d`` on ``(C, L)``; ``k`` an int or one size per spatial
    dimension; ``groups = c_in`` is depthwise.  With the default "same" padding ``k_d // 2`` a
    kernel size is capped at ``2n_d − 1`` (taps beyond it only ever see padding: their weights
    would never train), e.g. ``k = 3`` on a ``(C, 1, 40)`` signal is a ``1×3`` kernel."""
    spatial = tuple(in_shape[1:])
    if len(spatial) not in (1, 2):
        raise ShapeError(f"in_shape {in_shape} must be (C, L) or (C, H, W)", term=name)
    ks = (k,) * len(spatial) if isinstance(k, int) else tuple(k)
    if len(ks) != len(spatial):
        raise ShapeError(f"kernel {k} has {len(ks)} sizes for {len(spatial)} spatial dims",
                         term=name, hint=f"give one size per dimension of {spatial}")
    if padding is None:
        ks = tuple(min(kd, 2 * n - 1) for kd, n in zip(ks, spatial))
        if any(kd % 2 == 0 for kd in ks):
            raise ShapeError(f"kernel {ks} has an even size: 'same' padding k // 2 would change "
                             "the feature map's size", term=name, hint="use odd kernel sizes")
        padding = tuple(kd // 2 for kd in ks)
    if c_in % groups or c_out % groups:
        raise ShapeError(f"groups = {groups} must divide {c_in} input and {c_out} output "
                         "channels", term=name)
    g = np.random.default_rng(seed)
    shape = (c_out, c_in // groups, *ks)
    w = Weight(name, shape, g.standard_normal(shape) / math.prod(ks))
    cls = Conv2d if len(spatial) == 2 else Conv1d
    op = cls(w, in_shape=in_shape, padding=padding, groups=groups)
    w.value = w.value * (norm / op.norm())
    return op

def conv_spec(conv: tuple[Any, ...]) -> tuple[int, Any, int]:
    """``(channels, kernel[, groups])`` of ``opteq(conv=…)`` / ``geq(conv=…)``."""
    if len(conv) not in (2, 3):
        raise ShapeError(f"conv={conv} must be (channels, kernel) or (channels, kernel, groups)",
                         term="conv", hint="kernel: an int or one size per spatial dimension")
    return conv[0], conv[1], (conv[2] if len(conv) == 3 else 1)

def injection(name: str, out_size: int, d: int, seed: int) -> tuple[Input, Any]:
    x = Input("x", d)
    g = np.random.default_rng(seed + 1)
    u = Weight(f"U{name}", (out_size, d), g.standard_normal((out_size, d)) / math.sqrt(d))
    b = Weight(f"b{name}", (out_size,), 0.1 * g.standard_normal(out_size))
    return x, u @ x + b

def resample(from_shape: tuple[int, ...], to_shape: tuple[int, ...], name: str) -> Any:
    """``P``: ``from_shape → to_shape`` between two branches' states.  ``(C, H, W)`` maps:
    :func:`~convex_eq.operators.downsample_or_identity`; ``(C, L)`` signals: ``I`` if equal, else
    average down-sampling by ``f = L_big / L_small`` as a depthwise ``Conv1d`` with the constant
    kernel ``1/f`` and stride ``f`` (an exact linear map with an exact adjoint), or that map's
    transpose (up-sampling)."""
    if len(from_shape) == 3 or from_shape == to_shape:
        return downsample_or_identity(from_shape, to_shape)
    (c1, l1), (c2, l2) = from_shape, to_shape
    big, small = (l1, l2) if l1 >= l2 else (l2, l1)
    if c1 != c2 or big % small:
        raise ShapeError(f"cannot resample {from_shape} to {to_shape}", term=name,
                         hint="give the branches equal channels and lengths that divide")
    f = big // small
    k = Constant(name, np.full((c1, 1, f), 1.0 / f))
    down = Conv1d(k, in_shape=(c1, big), stride=f, groups=c1)
    return down if l1 >= l2 else Adjoint(down)

def torch_seed(seed: int) -> torch.Generator:
    """A seeded torch generator (for reproducible examples)."""
    return torch.Generator().manual_seed(seed)
