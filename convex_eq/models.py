"""Seed objectives of the papers, built from the same terms a user would write.

* ``opteq(form="conjugate")``: OptEq Theorem 1 (TPAMI Eq. 5-6), ``φ = ψ* - ½||·||²``,
  ``ψ = (1/μ)Σσ̃(Wz + Ux + b)``;
* ``opteq(form="canonical")``: reformulated OptEq (docs/theory.md §3 row 1),
  ``Σf_σ(z) + ½||z||² - <Ux+b, z> - ½||Wz||²``;
* ``deep_opteq``: deep OptEq, TPAMI §5 (Lemma 3 / Thm 2 / Cor 1),
  ``f_l = αW_lᵀσ(W_l z + U_l x + b_l) + (1-α)z``;
* ``geq``: GEQ/KerDEQ (docs/theory.md §3 rows 2-3), Gaussian-kernel similarity, whole or
  patch-split;
* ``mopteq``: MOptEq with HH&D fusion (docs/theory.md §3 row 4), per-branch linear kernels
  ``+ ½ΣH - (λ/2)ΣD``; ``conv_mopteq``: its multi-branch, multi-scale convolutional form on
  signals or images (``fusion="none"``: the POptEq baseline; ``branch_inputs=True``: one input
  per branch for the perturbation-enhanced cascade of ``lowering.perturbation``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._lazy import torch
from .activations import get_activation
from .composition import DeepComposition
from .errors import ShapeError
from .objective import Objective
from .operators import Adjoint, Conv1d, Conv2d, downsample_or_identity
from .symbols import Constant, Input, Scalar, State, Weight
from .terms import (
    Antiderivative,
    ChannelDecorrelation,
    Coupling,
    GaussianKernel,
    Linear,
    PatchGaussianKernel,
    Potential,
    SqNorm,
)


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


def _conv_spec(conv: tuple[Any, ...]) -> tuple[int, Any, int]:
    """``(channels, kernel[, groups])`` of ``opteq(conv=…)`` / ``geq(conv=…)``."""
    if len(conv) not in (2, 3):
        raise ShapeError(f"conv={conv} must be (channels, kernel) or (channels, kernel, groups)",
                         term="conv", hint="kernel: an int or one size per spatial dimension")
    return conv[0], conv[1], (conv[2] if len(conv) == 3 else 1)


def _injection(name: str, out_size: int, d: int, seed: int) -> tuple[Input, Any]:
    x = Input("x", d)
    g = np.random.default_rng(seed + 1)
    u = Weight(f"U{name}", (out_size, d), g.standard_normal((out_size, d)) / math.sqrt(d))
    b = Weight(f"b{name}", (out_size,), 0.1 * g.standard_normal(out_size))
    return x, u @ x + b


def opteq(n: int = 16, m: int = 16, d: int = 8, activation: Any = "relu", *,
          form: str = "canonical", mu: float = 1.0, weight_norm: float = 0.9, seed: int = 0,
          conv: tuple[Any, ...] | None = None, image: tuple[int, ...] | None = None
          ) -> Objective:
    """OptEq. ``form="conjugate"``: ``φ(z) = ψ*(z) - ½||z||²``, ``ψ(z) = (1/μ)Σσ̃(Wz+Ux+b)``,
    ``W: m×n`` (layer ``(1/μ)Wᵀσ(Wz+q)``). ``form="canonical"``: ``Σf_σ(z) + ½||z||² - <q,z> -
    ½||Wz||²`` (layer ``σ(WᵀWz + q)``). ``conv=(channels, kernel[, groups])`` with
    ``image=(C,H,W)`` (or ``(C,L)``: 1-D) of the input uses convolutional ``U`` and ``W`` on a
    ``channels×H×W`` state; ``kernel`` an int or one size per dimension; ``groups = channels``
    makes ``W`` depthwise (see ``conv_weight``)."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    if conv is not None:
        if image is None:
            raise ShapeError("conv OptEq needs image=(C, H, W) of the input", term="opteq")
        ch, k, groups = _conv_spec(conv)
        c0, *sp = image
        z = State("z", (ch, *sp))
        x = Input("x", image)
        u_op = conv_weight("U", ch, c0, k, image, norm=1.0, seed=seed + 1)
        b = Weight("b", (z.size,), np.zeros(z.size))
        w_op = conv_weight("W", ch, ch, k, z.shape, norm=weight_norm, seed=seed, groups=groups)
        q = u_op @ x + b
        if form == "conjugate":
            psi = Antiderivative(act, w_op @ z + q) * (1.0 / mu)
            obj = Objective([psi.conjugate(), -SqNorm(z)], name="opteq-conv-conj")
            obj.reference = "OptEq (conv), Theorem 1, docs/theory.md §2"
            return obj
        obj = Objective([Potential(act, z), SqNorm(z), -Linear(q, z), -SqNorm(w_op @ z)],
                        name="opteq-conv")
        obj.reference = "OptEq (conv), docs/theory.md §3 row 1"
        return obj
    if form == "canonical":
        z = State("z", n)
        x, q = _injection("", n, d, seed)
        w = spectral_weight("W", (m, n), weight_norm, seed)
        obj = Objective([Potential(act, z), SqNorm(z), -Linear(q, z), -SqNorm(w @ z)],
                        name="opteq")
        obj.reference = "reformulated OptEq, docs/theory.md §3 row 1 (TPAMI Eq. 7)"
        return obj
    if form == "conjugate":
        z = State("z", n)
        x, q = _injection("", m, d, seed)
        w = spectral_weight("W", (m, n), weight_norm * math.sqrt(mu), seed)
        psi = Antiderivative(act, w @ z + q) * (1.0 / mu)
        obj = Objective([psi.conjugate(), -SqNorm(z)], name="opteq-conj")
        obj.reference = "OptEq Theorem 1, docs/theory.md §2 (TPAMI Eq. 5-6)"
        return obj
    raise ShapeError(f"unknown form {form!r}", term="opteq", hint="use 'canonical' or 'conjugate'")


def deep_opteq(L: int = 2, n: int = 12, m: int = 12, d: int = 6, activation: Any = "relu", *,
               alpha: float | Scalar = 0.5, weight_norm: float = 0.9, seed: int = 0,
               conv: tuple[Any, ...] | None = None, image: tuple[int, ...] | None = None
               ) -> DeepComposition:
    """Deep OptEq: ``f_l(z) = αW_lᵀσ(W_l z + U_l x + b_l) + (1-α)z``, ``T = f_L∘…∘f_1``;
    ``φ_l = ψ_l* - ½||·||²`` declared on block ``z_l`` (last block ``z_0``).

    ``conv=(channels, kernel[, groups])`` with ``image=(C, H, W)`` or ``(C, L)``: convolutional
    ``W_l`` (state ``channels×spatial`` → itself) and ``U_l`` (input → state).  ``alpha``: a
    float, or a :class:`~convex_eq.symbols.Scalar` in ``(0, 1]`` (the hook for a learnable α:
    the composition reads it through ``scalar_value``)."""
    act = get_activation(activation) if isinstance(activation, str) else activation
    if conv is not None:
        if image is None:
            raise ShapeError("conv deep OptEq needs image=(C, H, W) or (C, L) of the input",
                             term="deep_opteq")
        ch, k, groups = _conv_spec(conv)
        x = Input("x", image)
        shape = (ch, *image[1:])
    else:
        x = Input("x", d)
        shape = (n,)
    layers = []
    for i in range(1, L + 1):
        blk = State(f"z{i % L}", shape)
        g = np.random.default_rng(seed + 10 * i)
        if conv is not None:
            w = conv_weight(f"W{i}", ch, ch, k, shape, norm=weight_norm, seed=seed + 10 * i,
                            groups=groups)
            u = conv_weight(f"U{i}", ch, image[0], k, image, norm=1.0, seed=seed + 10 * i + 1)
            b = Weight(f"b{i}", (blk.size,), np.zeros(blk.size))
        else:
            w = spectral_weight(f"W{i}", (m, n), weight_norm, seed + 10 * i)
            u = Weight(f"U{i}", (m, d), g.standard_normal((m, d)) / math.sqrt(d))
            b = Weight(f"b{i}", (m,), 0.1 * g.standard_normal(m))
        psi = Antiderivative(act, w @ blk + (u @ x + b))
        layers.append(Objective([psi.conjugate(), -SqNorm(blk)], name=f"phi{i}"))
    return DeepComposition(layers, alpha, name=f"deep_opteq(L={L})")


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
        ch, k, groups = _conv_spec(conv)
        c0, hh, ww = image
        z = State("z", (ch, hh, ww))
        x = Input("x", image)
        u_op = conv_weight("U", ch, c0, k, image, norm=1.0, seed=seed + 1)
        b = Weight("b", (ch * hh * ww,), np.zeros(ch * hh * ww))
        w_op = conv_weight("W", ch, ch, k, (ch, hh, ww), norm=weight_norm, seed=seed,
                           groups=groups)
        wh = _patch_weight(patch, channel_split or ch, h, seed)
        s = PatchGaussianKernel(u_op @ x + b, w_op @ z, gam, patch, wh, (ch, hh, ww),
                                channel_split=channel_split)
        obj = Objective([Potential(act, z), SqNorm(z), -s], name="geq-conv")
        obj.reference = "GEQ (conv, patch-split Gaussian kernel), docs/theory.md §3 row 3"
        return obj
    z = State("z", n)
    x, q = _injection("", p, d, seed)
    w = spectral_weight("W", (p, n), weight_norm, seed)
    if patch is None:
        s = GaussianKernel(q - w @ z, gam)
        name, ref = "geq", "GEQ/KerDEQ Gaussian kernel, docs/theory.md §3 row 2"
    else:
        if image is None or math.prod(image) != p:
            raise ShapeError(f"image layout {image} must have p = {p} entries", term="geq")
        wh = _patch_weight(patch, channel_split or image[0], h, seed)
        s = PatchGaussianKernel(q, w @ z, gam, patch, wh, image, channel_split=channel_split)
        name, ref = "geq-patch", "GEQ with patch splitting, docs/theory.md §3 row 3"
    obj = Objective([Potential(act, z), SqNorm(z), -s], name=name)
    obj.reference = ref
    return obj


def _patch_weight(patch: int | tuple[int, int], cs: int, h: int, seed: int) -> Weight:
    """``W_h``: ``(c_s·p_h·p_w) × h``, entries ``N(0, 1/dim)``."""
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    dim = cs * ph * pw
    g = np.random.default_rng(seed + 3)
    return Weight("W_h", (dim, h), g.standard_normal((dim, h)) / math.sqrt(dim))


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


def _resample(from_shape: tuple[int, ...], to_shape: tuple[int, ...], name: str) -> Any:
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
        p = _resample(zj.shape, zi.shape, f"P{i + 1}")
        terms.append(Coupling(zi, zj, p) * -0.5)
        if fusion == "HD":
            terms.append(ChannelDecorrelation(zi, zj, p, channels=channels) * lam_s * 0.5)
    name = "popteq-conv" if fusion == "none" else "mopteq-conv"
    obj = Objective(terms, name=name)
    obj.reference = ("POptEq: parallel conv OptEq branches without fusion" if fusion == "none"
                     else f"MOptEq multi-scale conv, fusion {fusion}") + ", docs/theory.md §3 row 4"
    return obj


def torch_seed(seed: int) -> torch.Generator:
    """A seeded torch generator (for reproducible examples)."""
    return torch.Generator().manual_seed(seed)


def mon(n: int = 16, d: int = 8, activation: Any = "relu", *, margin: float = 0.5,
        weight_scale: float = 1.0, seed: int = 0, splitting: str = "auto",
        conv: tuple[Any, ...] | None = None, image: tuple[int, ...] | None = None) -> Any:
    """Monotone operator equilibrium network (docs/monotone.md §5): ``0 ∈ (I − W)z − (Ux + b)
    + ∂f_σ(z)``, ``I − W = mI + AᵀA − (B − Bᵀ)``, i.e. ``z = prox_{f_σ}``-splitting of
    ``z = σ(Wz + Ux + b)``; one equilibrium for every ``A, B`` (margin ``m``), so it trains
    without weight control.  ``weight_scale``: ``||A||₂ = ||B||₂`` at initialisation.
    ``splitting``: "auto" (Peaceman–Rachford), "peaceman-rachford", "douglas-rachford" or
    "forward-backward".  ``conv=(channels, kernel)`` with ``image=(C, H, W)`` or ``(C, L)``
    uses convolutional ``U, A, B`` on a ``channels×…`` state.  Returns an ``Inclusion``:
    ``lowering.lower(mon(...)).torch_module(...)`` as for ``opteq``."""
    from .inclusion import Inclusion
    from .operators.monotone import MonotoneMatrix

    act = get_activation(activation) if isinstance(activation, str) else activation
    if conv is not None:
        if image is None:
            raise ShapeError("conv MON needs image=(C, H, W) or (C, L) of the input", term="mon")
        ch, k, groups = _conv_spec(conv)
        if groups != 1:
            raise ShapeError("conv MON takes conv=(channels, kernel)", term="mon",
                             hint="drop the groups entry")
        c0, *sp = image
        z = State("z", (ch, *sp))
        x = Input("x", image)
        u_op = conv_weight("U", ch, c0, k, image, norm=1.0, seed=seed + 1)
        b = Weight("b", (z.size,), np.zeros(z.size))
        a_op = conv_weight("A", ch, ch, k, z.shape, norm=weight_scale, seed=seed)
        b_op = conv_weight("B", ch, ch, k, z.shape, norm=weight_scale, seed=seed + 2)
        inc = Inclusion(Potential(act, z), grad=[-Linear(u_op @ x + b, z)],
                        linear=[MonotoneMatrix(a_op, b_op, margin)], name="mon-conv",
                        splitting=splitting)
        inc.reference = "MON (conv), docs/monotone.md §5"
        return inc
    z = State("z", n)
    x, q = _injection("", n, d, seed)
    a = spectral_weight("A", (n, n), weight_scale, seed)
    b = spectral_weight("B", (n, n), weight_scale, seed + 2)
    inc = Inclusion(Potential(act, z), grad=[-Linear(q, z)],
                    linear=[MonotoneMatrix(a, b, margin)], name="mon", splitting=splitting)
    inc.reference = "MON, docs/monotone.md §5"
    return inc
