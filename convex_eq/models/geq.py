"""GEQ / KerDEQ: Gaussian-kernel equilibrium models (docs/theory.md §3 rows 2-3)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..activations import get_activation
from ..errors import ShapeError
from ..objective import Objective
from ..symbols import Input, Scalar, State, Weight
from ..terms import GaussianKernel, PatchGaussianKernel, Potential, SqNorm
from .weights import conv_spec, conv_weight, injection, spectral_weight


def geq(n: int = 16, p: int = 16, d: int = 8, activation: Any = "relu", *,
        gamma: float = 0.5, weight_norm: float = 0.9, seed: int = 0,
        patch: int | tuple[int, int] | None = None, image: tuple[int, int, int] | None = None,
        h: int = 4, conv: tuple[Any, ...] | None = None, channel_split: int | None = None
        ) -> Objective:
    """GEQ: ``Σf_σ(z) + ½||z||² - (1/2γ)exp(-γ||q - Wz||²)``, ``q = Ux + b``
    (docs/theory.md §3 row 2);
    with ``patch`` (``p`` or ``(p_h, p_w)``) and ``image=(C,H,W)`` (the layout of q and Wz) the
    patch-split kernel ``(1/2γ)Σ_i exp(-γ||(x̃_i - z̃_i)W_h||²)`` (row 3), patches of
    ``channel_split`` = ``c_s`` channels (default all)."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    gam = Scalar("gamma", gamma, low=0.0, low_open=True)
    if conv is not None:
        if image is None or patch is None:
            raise ShapeError("conv GEQ needs image=(C, H, W) of the input and a patch size",
                             term="geq")
        ch, k, groups = conv_spec(conv)
        c0, hh, ww = image
        z = State("z", (ch, hh, ww))
        x = Input("x", image)
        u_op = conv_weight("U", ch, c0, k, image, norm=1.0, seed=seed + 1)
        b = Weight("b", (ch * hh * ww,), np.zeros(ch * hh * ww))
        w_op = conv_weight("W", ch, ch, k, (ch, hh, ww), norm=weight_norm, seed=seed,
                           groups=groups)
        wh = patch_weight(patch, channel_split or ch, h, seed)
        s = PatchGaussianKernel(u_op @ x + b, w_op @ z, gam, patch, wh, (ch, hh, ww),
                                channel_split=channel_split)
        obj = Objective([Potential(act, z), SqNorm(z), -s], name="geq-conv")
        obj.reference = "GEQ (conv, patch-split Gaussian kernel), docs/theory.md §3 row 3"
        return obj
    z = State("z", n)
    x, q = injection("", p, d, seed)
    w = spectral_weight("W", (p, n), weight_norm, seed)
    if patch is None:
        s = GaussianKernel(q - w @ z, gam)
        name, ref = "geq", "GEQ/KerDEQ Gaussian kernel, docs/theory.md §3 row 2"
    else:
        if image is None or math.prod(image) != p:
            raise ShapeError(f"image layout {image} must have p = {p} entries", term="geq")
        wh = patch_weight(patch, channel_split or image[0], h, seed)
        s = PatchGaussianKernel(q, w @ z, gam, patch, wh, image, channel_split=channel_split)
        name, ref = "geq-patch", "GEQ with patch splitting, docs/theory.md §3 row 3"
    obj = Objective([Potential(act, z), SqNorm(z), -s], name=name)
    obj.reference = ref
    return obj

def patch_weight(patch: int | tuple[int, int], cs: int, h: int, seed: int) -> Weight:
    """``W_h``: ``(c_s·p_h·p_w) × h``, entries ``N(0, 1/dim)``."""
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    dim = cs * ph * pw
    g = np.random.default_rng(seed + 3)
    return Weight("W_h", (dim, h), g.standard_normal((dim, h)) / math.sqrt(dim))
