"""The claim's objective down to the function whose stationary points are checked, written once.

``unwind(G, env)`` peels, outermost first,

* a precomposition ``φ∘A``, ``A(z) = Mz + c`` (``M`` invertible, as the precomposition rule
  requires): ``z`` is stationary/minimal for ``φ∘A`` exactly when ``u = A(z)`` is for ``φ``
  (``∂(φ∘A)(z) = Mᵀ∂φ(Az + c)`` with ``M`` invertible).  Measured in ``z`` the projected
  gradient of ``φ∘A`` is no stationarity measure where a non-smooth term of ``φ`` is active
  (a ReLU potential at 0, ℓ1, an ℓ∞ ball): its constraint ``A z ∈ dom`` is not a box in ``z``;
* a single Moreau envelope ``λ·M^μ[φ]`` with ``λ > 0`` (the skip claim): ``argmin λM^μ_φ =
  argmin φ`` and the fixed points of ``prox_{μφ}`` are the stationary points of ``φ``.

``forward``/``backward`` map states through the recorded affine maps (``u = A(z)`` and back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convex_eq.objective import Objective
from convex_eq.terms.moreau import MoreauEnvelope

T64 = torch.float64


@dataclass
class AffineLevel:
    """One peeled ``φ∘A``: state ``new`` (outer) ↦ ``old = M new + c`` (inner)."""

    new: str
    old: str
    M: np.ndarray
    c: np.ndarray


@dataclass
class Unwound:
    """The innermost objective and the affine levels peeled on the way (outermost first)."""

    inner: Any
    levels: list[AffineLevel]
    skipped_envelope: bool = False

    def forward(self, z: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outer states (``(size,)`` or ``(B, size)``) → the innermost objective's states."""
        out = {k: np.asarray(v, dtype=np.float64) for k, v in z.items()}
        for lv in self.levels:
            out = {lv.old: out[lv.new] @ lv.M.T + lv.c}
        return out

    def backward(self, u: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Innermost states → outer states, ``z = M⁻¹(u − c)`` level by level."""
        out = {k: np.asarray(v, dtype=np.float64) for k, v in u.items()}
        for lv in reversed(self.levels):
            w = out[lv.old] - lv.c
            out = {lv.new: np.linalg.solve(lv.M, w.T).T}
        return out


def unwind(obj: Any, env: Mapping[str, torch.Tensor], envelopes: bool = True) -> Unwound:
    """Peel precompositions and (``envelopes``) a single positive Moreau envelope (module
    docstring); ``envelopes=False`` keeps values: ``(φ∘A)(z) = φ(u)``."""
    levels: list[AffineLevel] = []
    skipped = False
    while isinstance(obj, Objective):
        pc = getattr(obj, "precomposition", None)
        if pc is not None:
            m = pc.M.resolve(env).detach().to(T64).numpy()
            c = (pc.c.resolve(env).detach().to(T64).numpy().reshape(-1)
                 if pc.c is not None else np.zeros(m.shape[0]))
            levels.append(AffineLevel(pc.new.name, pc.old.name, m, c))
            obj = pc.inner
            continue
        if envelopes and len(obj.terms) == 1 and isinstance(obj.terms[0], MoreauEnvelope) and \
                obj.terms[0].coef(env) > 0:
            obj, skipped = obj.terms[0].inner, True
            continue
        break
    return Unwound(obj, levels, skipped)
