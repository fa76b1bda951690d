"""MOptEq: multi-branch OptEq with hierarchical-heritage and diversity fusion, and its parallel
baseline POptEq (docs/theory.md §3 row 4)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..activations import get_activation
from ..errors import ShapeError
from ..objective import Objective
from ..operators import Conv1d, Conv2d, downsample_or_identity
from ..symbols import Input, Scalar, State, Weight
from ..terms import ChannelDecorrelation, Coupling, Linear, Potential, SqNorm
from .weights import conv_weight, resample, spectral_weight


def mopteq(shapes: tuple[tuple[int, int, int], ...] = ((2, 4, 4), (2, 2, 2)), d: int = 8,
           activation: Any = "relu", *, lam: float = 0.1, weight_norm: float = 0.5,
           seed: int = 0, decorrelation: bool = True, fusion: str | None = None
           ) -> Objective:
    """MOptEq (HH&D fusion): ``Σ_i [Σf_σ(z_i) + ½||z_i||² - <q_i, z_i> - ½||W_i z_i||²]
    - ½Σ_i H(z_i, z_{i+1}) + (λ/2)Σ_i D(z_i, z_{i+1})`` (cyclic; docs/theory.md §3 row 4).

    ``fusion``: ``"HD"`` (both terms, the default), ``"H"`` (no decorrelation; the same as
    ``decorrelation=False``) or ``"none"``: the parallel baseline POptEq, independent branches
    ``z_i = σ(W_iᵀW_i z_i + U_i x + b_i)`` with neither term."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    k = len(shapes)
    if k < 2:
        raise ShapeError("MOptEq needs at least two branches", term="mopteq")
    if fusion is None:
        fusion = "HD" if decorrelation else "H"
    elif fusion not in ("HD", "H", "none"):
        raise ShapeError(f"unknown fusion {fusion!r}", term="mopteq",
                         hint="use 'HD' (MOptEq), 'H' (no decorrelation) or 'none' (POptEq)")
    elif fusion == "HD" and not decorrelation:
        raise ShapeError("fusion='HD' contradicts decorrelation=False", term="mopteq",
                         hint="pass only fusion=")
    lam_s = Scalar("lam", lam, low=0.0)
    x = Input("x", d)
    zs = [State(f"z{i + 1}", s) for i, s in enumerate(shapes)]
    terms: list[Any] = []
    for i, zi in enumerate(zs):
        g = np.random.default_rng(seed + 7 * i)
        w = spectral_weight(f"W{i + 1}", (zi.size, zi.size), weight_norm, seed + 7 * i)
        u = Weight(f"U{i + 1}", (zi.size, d), g.standard_normal((zi.size, d)) / math.sqrt(d))
        b = Weight(f"b{i + 1}", (zi.size,), 0.1 * g.standard_normal(zi.size))
        terms += [Potential(act, zi), SqNorm(zi), -Linear(u @ x + b, zi), -SqNorm(w @ zi)]
    for i in range(k if fusion != "none" else 0):
        zi, zj = zs[i], zs[(i + 1) % k]
        p = downsample_or_identity(zj.shape, zi.shape)
        terms.append(Coupling(zi, zj, p) * -0.5)
        if fusion == "HD":
            terms.append(ChannelDecorrelation(zi, zj, p) * lam_s * 0.5)
    if fusion == "none":
        obj = Objective(terms, name="popteq")
        obj.reference = "POptEq: parallel OptEq branches without fusion, docs/theory.md §3 row 4"
        return obj
    obj = Objective(terms, name="mopteq")
    obj.reference = "MOptEq HH&D fusion, docs/theory.md §3 row 4"
    return obj

def conv_mopteq(image: tuple[int, ...] = (1, 40), channels: int = 8,
                kernels: tuple[int, ...] = (3, 5), scales: tuple[int, ...] = (1, 2),
                activation: Any = "relu", *, lam: float = 0.1, weight_norm: float = 0.5,
                seed: int = 0, fusion: str = "HD", branch_inputs: bool = False) -> Objective:
    """Multi-branch, multi-scale convolutional MOptEq on signals ``(C, L)`` or images
    ``(C, H, W)``: branch ``i`` has state ``z_i`` of shape ``channels × spatial/scales[i]``,
    injection ``q_i = U_i x + b_i`` (``U_i`` a ``kernels[i]`` convolution with stride
    ``scales[i]``) and ``W_i`` a ``kernels[i]`` convolution on ``z_i``;
    ``G = Σ_i [Σf_σ(z_i) + ½||z_i||² - <q_i, z_i> - ½||W_i z_i||²] - ½Σ_i H(z_i, z_{i+1})
    + (λ/2)Σ_i D(z_i, z_{i+1})`` (cyclic, ``H(z_i, z_j) = z_iᵀP z_j`` with ``P`` resampling
    ``z_j`` to ``z_i``'s size; docs/theory.md §3 row 4).

    ``fusion``: ``"HD"`` (H and D), ``"H"`` or ``"none"`` (POptEq: independent branches).
    ``branch_inputs``: one input ``x_i`` per branch instead of one shared ``x`` (the branches'
    inputs of the perturbation-enhanced cascade, :func:`lowering.perturbation.cascade`)."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    k = len(kernels)
    if k < 2 or len(scales) != k:
        raise ShapeError(f"{k} kernels and {len(scales)} scales: MOptEq needs at least two "
                         "branches and one scale per branch", term="conv_mopteq")
    if fusion not in ("HD", "H", "none"):
        raise ShapeError(f"unknown fusion {fusion!r}", term="conv_mopteq",
                         hint="use 'HD' (MOptEq), 'H' (no decorrelation) or 'none' (POptEq)")
    c0, *spatial = image
    if len(spatial) not in (1, 2):
        raise ShapeError(f"image {image} must be (C, L) or (C, H, W)", term="conv_mopteq")
    shared = Input("x", image)
    lam_s = Scalar("lam", lam, low=0.0)
    zs, terms = [], []
    for i, (kk, sc) in enumerate(zip(kernels, scales)):
        if kk % 2 == 0 or any(n % sc for n in spatial):
            raise ShapeError(f"branch {i + 1}: kernel {kk} must be odd and scale {sc} must "
                             f"divide the spatial size {tuple(spatial)}", term="conv_mopteq")
        shape = (channels, *(n // sc for n in spatial))
        z = State(f"z{i + 1}", shape)
        zs.append(z)
        x = Input(f"x{i + 1}", image) if branch_inputs else shared
        cls = Conv1d if len(spatial) == 1 else Conv2d
        g = np.random.default_rng(seed + 7 * i + 1)
        ks = (kk,) * len(spatial)
        uw = Weight(f"U{i + 1}", (channels, c0, *ks), g.standard_normal((channels, c0, *ks)))
        u_op = cls(uw, in_shape=image, stride=sc, padding=kk // 2)
        if tuple(u_op.out_shape) != shape:
            raise ShapeError(f"branch {i + 1}: the stride-{sc} kernel-{kk} injection gives "
                             f"{u_op.out_shape}, not {shape}", term="conv_mopteq")
        uw.value = uw.value / u_op.norm()
        w_op = conv_weight(f"W{i + 1}", channels, channels, kk, shape, norm=weight_norm,
                           seed=seed + 7 * i)
        b = Weight(f"b{i + 1}", (z.size,), np.zeros(z.size))
        terms += [Potential(act, z), SqNorm(z), -Linear(u_op @ x + b, z), -SqNorm(w_op @ z)]
    for i in range(k if fusion != "none" else 0):
        zi, zj = zs[i], zs[(i + 1) % k]
        p = resample(zj.shape, zi.shape, f"P{i + 1}")
        terms.append(Coupling(zi, zj, p) * -0.5)
        if fusion == "HD":
            terms.append(ChannelDecorrelation(zi, zj, p, channels=channels) * lam_s * 0.5)
    name = "popteq-conv" if fusion == "none" else "mopteq-conv"
    obj = Objective(terms, name=name)
    obj.reference = ("POptEq: parallel conv OptEq branches without fusion" if fusion == "none"
                     else f"MOptEq multi-scale conv, fusion {fusion}") + ", docs/theory.md §3 row 4"
    return obj
