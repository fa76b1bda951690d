"""Monotone operator equilibrium network (docs/monotone.md §5)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..activations import get_activation
from ..errors import ShapeError
from ..symbols import Input, State, Weight
from ..terms import Linear, Potential
from .weights import conv_spec, conv_weight, injection, spectral_weight


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
    from ..inclusion import Inclusion
    from ..operators.monotone import MonotoneMatrix

    act = get_activation(activation) if isinstance(activation, str) else activation
    if conv is not None:
        if image is None:
            raise ShapeError("conv MON needs image=(C, H, W) or (C, L) of the input", term="mon")
        ch, k, groups = conv_spec(conv)
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
    x, q = injection("", n, d, seed)
    a = spectral_weight("A", (n, n), weight_scale, seed)
    b = spectral_weight("B", (n, n), weight_scale, seed + 2)
    inc = Inclusion(Potential(act, z), grad=[-Linear(q, z)],
                    linear=[MonotoneMatrix(a, b, margin)], name="mon", splitting=splitting)
    inc.reference = "MON, docs/monotone.md §5"
    return inc
