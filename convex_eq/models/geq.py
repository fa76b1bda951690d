"""GEQ / KerDEQ: Gaussian-kernel equilibrium models (docs/theory.md §3 rows 2-3, §3.2).

* ``geq``: one equilibrium, whole or patch-split kernel, dense or convolutional;
* ``conv_geq``: GEQ as the GEQ paper builds it: parallel, independent branches at several input
  scales (strided injections), each a patch- and channel-split GEQ with its own ``W_h``, on
  signals ``(C, L)`` or images ``(C, H, W)``; the branches are fused by the classifier's
  ``fusion="average"`` readout, not in the objective.

``gamma`` is a number (a fixed ``γ``), ``"input"`` (``γ(x) = 0.2/min_i ||q̃_i W_h||²``, GEQ's
rule at ``z = 0``: the equilibrium is a stationary point of ``G(·; x, γ(x))``), ``"paper"``
(``γ(x, z) = 0.2/min_i ||(x̃_i − z̃_i)W_h||²`` recomputed in every iteration: the equilibrium is a
fixed point of GEQ's iteration, not a stationary point of one objective), or an
``InputBandwidth`` / ``ResidualBandwidth`` with other constants.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..activations import get_activation
from ..errors import OptionError, ShapeError
from ..objective import Objective
from ..operators import Conv1d, Conv2d
from ..symbols import Input, Scalar, State, Weight
from ..terms import GaussianKernel, PatchGaussianKernel, Potential, SqNorm
from ..terms.gaussian_kernel import BANDWIDTH_RULES, InputBandwidth, ResidualBandwidth
from .weights import conv_spec, conv_weight, injection, spectral_weight

#: ``gamma=`` names of the bandwidth rules with GEQ's constant 0.2 (docs/theory.md §3.1–3.2)
GAMMA_RULES: dict[str, Any] = {"paper": ResidualBandwidth(0.2, "min"),
                               "input": InputBandwidth(0.2, "min")}


def bandwidth(gamma: Any, term: str) -> Any:
    """The kernel's ``γ``: a rule for ``"paper"``/``"input"`` or a rule object, else a positive
    ``Scalar("gamma")`` (a typed error names what is wrong)."""
    if isinstance(gamma, str):
        if gamma not in GAMMA_RULES:
            raise OptionError(f"gamma={gamma!r} is not a bandwidth rule", term=term,
                              hint=f"use a number, one of {sorted(GAMMA_RULES)}, an "
                              "InputBandwidth or a ResidualBandwidth")
        return GAMMA_RULES[gamma]
    if isinstance(gamma, BANDWIDTH_RULES):
        return gamma
    if isinstance(gamma, bool) or not isinstance(gamma, int | float):
        raise OptionError(f"gamma={gamma!r} is not a number or a bandwidth rule", term=term,
                          hint=f"use a number, one of {sorted(GAMMA_RULES)}, an InputBandwidth "
                          "or a ResidualBandwidth")
    return Scalar("gamma", float(gamma), low=0.0, low_open=True)


def geq(n: int = 16, p: int = 16, d: int = 8, activation: Any = "relu", *,
        gamma: Any = 0.5, weight_norm: float = 0.9, seed: int = 0,
        patch: int | tuple[int, int] | None = None, image: tuple[int, int, int] | None = None,
        h: int | None = None, conv: tuple[Any, ...] | None = None,
        channel_split: int | None = None) -> Objective:
    """GEQ: ``Σf_σ(z) + ½||z||² - (1/2γ)exp(-γ||q - Wz||²)``, ``q = Ux + b``
    (docs/theory.md §3 row 2);
    with ``patch`` (``p`` or ``(p_h, p_w)``) and ``image=(C,H,W)`` (the layout of q and Wz) the
    patch-split kernel ``(1/2γ)Σ_i exp(-γ||(x̃_i - z̃_i)W_h||²)`` (row 3), patches of
    ``channel_split`` = ``c_s`` channels (default all) and ``W_h`` of ``h`` columns (default
    ``c_s·p_h·p_w``: full size); ``gamma``: module docstring."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    gam = bandwidth(gamma, "geq")
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


def patch_weight(patch: int | tuple[int, int], cs: int, h: int | None, seed: int) -> Weight:
    """``W_h``: ``(c_s·p_h·p_w) × h`` (``h`` None: square, full size), entries
    ``N(0, 1/(c_s·p_h·p_w))``."""
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    dim = cs * ph * pw
    h = dim if h is None else h
    g = np.random.default_rng(seed + 3)
    return Weight("W_h", (dim, h), g.standard_normal((dim, h)) / math.sqrt(dim))


def conv_geq(image: tuple[int, ...] = (3, 32, 32), channels: int = 32, *,
             scales: tuple[int, ...] = (1, 2, 4, 4, 8, 8), kernel: int = 3,
             patch: int | tuple[int, ...] = 2, channel_split: int = 8,
             hidden: int | None = None,
             gamma: Any = "paper", activation: Any = "relu", weight_norm: float = 0.9,
             seed: int = 0) -> Objective:
    """Multi-branch GEQ (docs/theory.md §3.2): ``G = Σ_i [Σf_σ(z_i) + ½||z_i||² − S_i(z_i)]``,
    ``S_i = (1/2γ_i)Σ_j exp(−γ_i||(x̃_{ij} − z̃_{ij})W_{h,i}||²)``, ``x̃_{ij}``/``z̃_{ij}`` the
    ``c_s × p`` (signals) or ``c_s × p × p`` (images) patches of ``q_i = U_i x + b_i`` and
    ``W_i z_i``; no term couples the branches, so each is an independent GEQ equilibrium.

    Branch ``i`` has state ``z_i``: ``channels × spatial/scales[i]``, ``U_i`` a ``kernel``
    convolution with stride ``scales[i]``, ``W_i`` a ``kernel`` convolution of operator norm
    ``weight_norm`` and ``W_{h,i}``: ``(c_s·p^d) × hidden`` with orthonormal columns (or rows),
    ``||W_{h,i}||₂ = 1`` (``hidden`` None: ``c_s·p^d``, full size).  Defaults are the paper's
    CIFAR setting (scales 32/16/8/8/4/4 of a 32×32 image, ``p = 2``, ``c_s = 8``,
    ``c_hid = 32 = c_s·p²``); on a signal ``(C, L)`` a patch is ``p`` consecutive positions of
    ``c_s`` channels and the full-size ``W_h`` is ``c_s·p × c_s·p``.  ``gamma``: module
    docstring (default GEQ's rule, ``"paper"``)."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    gam = bandwidth(gamma, "conv_geq")
    spatial = list(image[1:])
    if len(spatial) not in (1, 2) or min(image) < 1:
        raise ShapeError(f"image {image} must be (C, L) or (C, H, W) with positive sizes",
                         term="conv_geq")
    if not scales:
        raise ShapeError("conv_geq needs at least one branch scale", term="conv_geq")
    if channels < 1 or channel_split < 1 or channels % channel_split:
        raise ShapeError(f"channel split {channel_split} does not divide the {channels} "
                         "channels", term="conv_geq", hint="choose channel_split c_s that "
                         "divides channels")
    if kernel % 2 == 0:
        raise ShapeError(f"kernel {kernel} must be odd ('same' padding)", term="conv_geq")
    if hidden is not None and hidden < 1:
        raise ShapeError(f"hidden = {hidden} columns of W_h must be ≥ 1", term="conv_geq",
                         hint="or None: full size c_s·p^d")
    ps = _patch_sizes(patch, len(spatial))
    x = Input("x", image)
    terms: list[Any] = []
    for i, sc in enumerate(scales):
        shape = (channels, *_branch_spatial(spatial, sc, ps, i))
        z = State(f"z{i + 1}", shape)
        rng = np.random.default_rng(seed + 7 * i + 1)
        q = _injection(f"{i + 1}", x, shape, kernel, sc, rng)
        w_op = conv_weight(f"W{i + 1}", channels, channels, kernel, shape, norm=weight_norm,
                           seed=seed + 7 * i)
        dim = channel_split * math.prod(ps)
        hid = dim if hidden is None else hidden
        wh = Weight(f"W_h{i + 1}", (dim, hid), _orthonormal(dim, hid, rng))
        layout = shape if len(spatial) == 2 else (channels, 1, shape[1])
        s = PatchGaussianKernel(q, w_op @ z, gam, ps if len(ps) == 2 else (1, ps[0]), wh,
                                layout, channel_split=channel_split)
        terms += [Potential(act, z), SqNorm(z), -s]
    obj = Objective(terms, name="geq-branches")
    obj.reference = (f"GEQ, {len(scales)} independent branches at scales {tuple(scales)} "
                     "(patch- and channel-split kernel each), docs/theory.md §3.2")
    return obj


def _patch_sizes(patch: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """One patch size per spatial axis (an int: the same on every axis)."""
    ps = (patch,) * ndim if isinstance(patch, int) else tuple(int(p) for p in patch)
    if len(ps) != ndim or min(ps) < 1:
        raise ShapeError(f"patch {patch} must be a positive int or one size per spatial axis "
                         f"({ndim})", term="conv_geq")
    return ps


def _branch_spatial(spatial: list[int], scale: int, ps: tuple[int, ...], i: int
                    ) -> tuple[int, ...]:
    """The spatial size of branch ``i`` (``spatial/scale``), which the patches must tile."""
    if scale < 1 or any(n % scale for n in spatial):
        raise ShapeError(f"branch {i + 1}: scale {scale} must divide the spatial size "
                         f"{tuple(spatial)}", term="conv_geq")
    out = tuple(n // scale for n in spatial)
    if any(n % p for n, p in zip(out, ps)):
        raise ShapeError(f"branch {i + 1}: patch {ps} does not tile its size {out} (scale "
                         f"{scale})", term="conv_geq", hint="choose scales whose sizes the "
                         "patch divides, e.g. scales=(1, 2, 4, 4) for a length-40 signal and "
                         "patch 2")
    return out


def _injection(name: str, x: Input, shape: tuple[int, ...], kernel: int, stride: int,
               rng: np.random.Generator) -> Any:
    """``q_i = U_i x + b_i``: a stride-``stride`` ``kernel`` convolution of operator norm 1 and
    a zero bias of the branch's size."""
    image = x.shape
    c0, *spatial = image
    ks = (kernel,) * len(spatial)
    uw = Weight(f"U{name}", (shape[0], c0, *ks), rng.standard_normal((shape[0], c0, *ks)))
    cls = Conv1d if len(spatial) == 1 else Conv2d
    u_op = cls(uw, in_shape=image, stride=stride, padding=kernel // 2)
    if tuple(u_op.out_shape) != shape:
        raise ShapeError(f"branch {name}: the stride-{stride} kernel-{kernel} injection gives "
                         f"{u_op.out_shape}, not {shape}", term="conv_geq")
    uw.value = uw.value / u_op.norm()
    size = math.prod(shape)
    return u_op @ x + Weight(f"b{name}", (size,), np.zeros(size))


def _orthonormal(dim: int, hidden: int, rng: np.random.Generator) -> np.ndarray:
    """A ``dim × hidden`` matrix with orthonormal columns (``hidden ≤ dim``) or rows: spectral
    norm 1, so that the contraction bound ``||W_i||₂²·||W_{h,i}||₂²`` starts at
    ``weight_norm²``."""
    a = rng.standard_normal((max(dim, hidden), min(dim, hidden)))
    qm, r = np.linalg.qr(a)
    qm = qm * np.sign(np.diag(r))  # a uniform (Haar) orthonormal frame
    return qm if dim >= hidden else qm.T
