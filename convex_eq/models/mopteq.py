"""MOptEq: multi-branch OptEq with hierarchical-heritage and diversity (HH&D) fusion, and its
parallel baseline POptEq (docs/theory.md §3 row 4).

The paper writes the branches' signed states ``z̃_i`` and the layer ``z̃_i = W_iᵀσ(W_i h_i(z̃) +
U_i g(x) + b_i)`` (MOptEq Eq. 6, ``h_i`` of Proposition 1).  The seed models declare the same
objective (Eq. 5) in the canonical variable ``y_i = W_i^{-ᵀ}z̃_i`` — the state of Algorithm 2 — so
that no inverse appears: ``z̃_i = W_iᵀy_i`` is an affine argument of the fusion terms and

    G(y) = Σ_i [Σf_σ(y_i) + ½||y_i||² − <U_i x + b_i, y_i>] − ½Σ_i H(W_iᵀy_i, W_{i+1}ᵀy_{i+1})
           + (λ/2)Σ_i D(W_iᵀy_i, W_{i+1}ᵀy_{i+1})            (cyclic: branch L+1 is branch 1)

whose stationarity is ``y_i = σ(W_i h_i(z̃) + U_i x + b_i)``, i.e. the paper's iteration with
``z̃ = Wᵀy``.  ``x`` is the feature ``g(x)`` the layer reads (a stem in front of the layer
computes it).  POptEq (paper Eq. 10–11) keeps each branch's own feedback ``−½||W_iᵀy_i||²``
instead of the fusion terms.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..activations import get_activation
from ..errors import ShapeError
from ..objective import Objective
from ..operators import Adjoint, Conv1d, Conv2d, as_operator, downsample_or_identity
from ..symbols import Input, Scalar, State, Weight
from ..terms import (
    ChannelDecorrelation,
    Coupling,
    Linear,
    Potential,
    SmoothChannelDecorrelation,
    SqNorm,
)
from .weights import conv_weight, resample, spectral_weight

#: ``fusion=``: both HH&D terms, hierarchical heritage only, or none (POptEq)
FUSIONS = ("HD", "H", "none")
#: ``decorrelation=``: the Huber-smoothed D (continuous layer) or the paper's |·| (sign)
DECORRELATIONS = ("smooth", "sign")


def _check_fusion(fusion: str, decorrelation: str, width: float, term: str) -> None:
    if fusion not in FUSIONS:
        raise ShapeError(f"unknown fusion {fusion!r}", term=term,
                         hint="use 'HD' (MOptEq), 'H' (no decorrelation) or 'none' (POptEq)")
    if decorrelation not in DECORRELATIONS:
        raise ShapeError(f"unknown decorrelation {decorrelation!r}", term=term,
                         hint="use 'smooth' (Huber-smoothed |·|, a continuous layer) or 'sign' "
                         "(the paper's |·|: no fixed point guaranteed)")
    if not (width > 0 and math.isfinite(width)):
        raise ShapeError(f"width = {width} must be a finite number > 0", term=term,
                         hint="the Huber width ε of the smoothed decorrelation")


def _assemble(name: str, branches: list[tuple[State, Any, Any]], p_of: Any, act: Any, *,
              lam: float, fusion: str, decorrelation: str, width: float,
              channels: int | None) -> Objective:
    """The objective of branches ``(y_i, W_i as an operator, q_i = U_i x + b_i)``; ``p_of(j, i)``
    is the resampling ``P`` from branch ``j``'s size to branch ``i``'s."""
    terms: list[Any] = []
    signed = [Adjoint(w) @ y for y, w, _ in branches]
    for (y, _, q), zt in zip(branches, signed):
        terms += [Potential(act, y), SqNorm(y), -Linear(q, y)]
        if fusion == "none":
            terms.append(-SqNorm(zt))
    k = len(branches)
    lam_s = Scalar("lam", lam, low=0.0)
    for i in range(k if fusion != "none" else 0):
        j = (i + 1) % k
        p = p_of(j, i)
        terms.append(Coupling(signed[i], signed[j], p) * -0.5)
        if fusion == "HD":
            if decorrelation == "smooth":
                d = SmoothChannelDecorrelation(signed[i], signed[j], p, channels=channels,
                                               width=width)
            else:
                d = ChannelDecorrelation(signed[i], signed[j], p, channels=channels)
            terms.append(d * lam_s * 0.5)
    kind = ("POptEq: parallel OptEq branches without fusion (paper Eq. 10-11)" if fusion == "none"
            else f"MOptEq Eq. 5 in y = W^-T z̃, fusion {fusion}"
            + (f", D {decorrelation}" if fusion == "HD" else ""))
    obj = Objective(terms, name=name)
    obj.reference = kind + ", docs/theory.md §3 row 4"
    return obj


def mopteq(shapes: tuple[tuple[int, int, int], ...] = ((2, 4, 4), (2, 2, 2)), d: int = 8,
           activation: Any = "relu", *, lam: float = 0.1, weight_norm: float = 0.5,
           seed: int = 0, fusion: str = "HD", decorrelation: str = "smooth",
           width: float = 1.0, branch_inputs: bool = False) -> Objective:
    """Dense MOptEq on ``(C, H, W)`` branch states ``y_i`` (module docstring): ``W_i`` square
    dense of spectral norm ``weight_norm`` (ζ), ``q_i = U_i x + b_i``; HH&D on ``z̃_i = W_iᵀy_i``
    with ``P`` average down-sampling (or its transpose) between branch sizes.

    ``fusion``: ``"HD"`` (H and D), ``"H"`` or ``"none"`` (POptEq); ``decorrelation``:
    ``"smooth"`` (Huber width ``width``: the layer is continuous) or ``"sign"`` (the paper's D,
    discontinuous: no fixed point guaranteed); ``branch_inputs``: one input ``x_i`` per branch
    (the perturbation-enhanced layer, :func:`lowering.perturbation_enhanced`, perturbs each
    branch's copy of the feature), else one shared ``x``."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    if len(shapes) < 2:
        raise ShapeError("MOptEq needs at least two branches", term="mopteq")
    _check_fusion(fusion, decorrelation, width, "mopteq")
    shared = Input("x", d)
    branches = []
    for i, s in enumerate(shapes):
        x = Input(f"x{i + 1}", d) if branch_inputs else shared
        y = State(f"y{i + 1}", s)
        g = np.random.default_rng(seed + 7 * i)
        w = spectral_weight(f"W{i + 1}", (y.size, y.size), weight_norm, seed + 7 * i)
        u = Weight(f"U{i + 1}", (y.size, d), g.standard_normal((y.size, d)) / math.sqrt(d))
        b = Weight(f"b{i + 1}", (y.size,), 0.1 * g.standard_normal(y.size))
        branches.append((y, as_operator(w), u @ x + b))
    return _assemble("popteq" if fusion == "none" else "mopteq", branches,
                     lambda j, i: downsample_or_identity(shapes[j], shapes[i]), act, lam=lam,
                     fusion=fusion, decorrelation=decorrelation, width=width, channels=None)


def conv_mopteq(image: tuple[int, ...] = (1, 40), channels: int = 8,
                kernels: tuple[int, ...] = (3, 5), scales: tuple[int, ...] = (1, 2),
                activation: Any = "relu", *, lam: float = 0.01, weight_norm: float = 0.9,
                seed: int = 0, fusion: str = "HD", decorrelation: str = "smooth",
                width: float = 1.0, branch_inputs: bool = False) -> Objective:
    """Multi-branch, multi-scale convolutional MOptEq on features ``(C, L)`` or ``(C, H, W)``:
    branch ``i`` has state ``y_i`` of shape ``channels × spatial/scales[i]``, injection
    ``q_i = U_i x + b_i`` (``U_i`` a ``kernels[i]`` convolution of stride ``scales[i]``) and
    ``W_i`` a ``kernels[i]`` convolution on ``y_i`` of operator norm ``weight_norm`` (ζ, the
    same for MOptEq and POptEq); HH&D on ``z̃_i = W_iᵀy_i`` (module docstring), ``P`` average
    down-sampling or its transpose.  The paper's λ is ≈ 1/C or below (λ = 0.01 at C = 32).

    ``fusion``, ``decorrelation``, ``width``, ``branch_inputs``: as :func:`mopteq`."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    k = len(kernels)
    if k < 2 or len(scales) != k:
        raise ShapeError(f"{k} kernels and {len(scales)} scales: MOptEq needs at least two "
                         "branches and one scale per branch", term="conv_mopteq")
    _check_fusion(fusion, decorrelation, width, "conv_mopteq")
    c0, *spatial = image
    if len(spatial) not in (1, 2):
        raise ShapeError(f"image {image} must be (C, L) or (C, H, W)", term="conv_mopteq")
    shared = Input("x", image)
    branches, shapes = [], []
    for i, (kk, sc) in enumerate(zip(kernels, scales)):
        x = Input(f"x{i + 1}", image) if branch_inputs else shared
        if kk % 2 == 0 or any(n % sc for n in spatial):
            raise ShapeError(f"branch {i + 1}: kernel {kk} must be odd and scale {sc} must "
                             f"divide the spatial size {tuple(spatial)}", term="conv_mopteq")
        shape = (channels, *(n // sc for n in spatial))
        y = State(f"y{i + 1}", shape)
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
        b = Weight(f"b{i + 1}", (y.size,), np.zeros(y.size))
        branches.append((y, w_op, u_op @ x + b))
        shapes.append(shape)
    return _assemble("popteq-conv" if fusion == "none" else "mopteq-conv", branches,
                     lambda j, i: resample(shapes[j], shapes[i], f"P{i + 1}"), act, lam=lam,
                     fusion=fusion, decorrelation=decorrelation, width=width, channels=channels)
