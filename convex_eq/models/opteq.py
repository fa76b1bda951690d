"""OptEq (TPAMI Theorem 1 and its reformulation, docs/theory.md §2-3) and deep OptEq (TPAMI §5)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..activations import get_activation
from ..composition import DeepComposition
from ..errors import ShapeError
from ..objective import Objective
from ..symbols import Input, Scalar, State, Weight
from ..terms import Antiderivative, Linear, Potential, SqNorm
from .weights import conv_spec, conv_weight, injection, spectral_weight


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
        ch, k, groups = conv_spec(conv)
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
        x, q = injection("", n, d, seed)
        w = spectral_weight("W", (m, n), weight_norm, seed)
        obj = Objective([Potential(act, z), SqNorm(z), -Linear(q, z), -SqNorm(w @ z)],
                        name="opteq")
        obj.reference = "reformulated OptEq, docs/theory.md §3 row 1 (TPAMI Eq. 7)"
        return obj
    if form == "conjugate":
        z = State("z", n)
        x, q = injection("", m, d, seed)
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
        ch, k, groups = conv_spec(conv)
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
