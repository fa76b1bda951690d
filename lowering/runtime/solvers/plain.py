"""Plain (Picard) iteration ``z ← (1 − λ) z + λ f(z)`` (docs/theory.md §8, solvers)."""

from __future__ import annotations

import torch

from convex_eq.errors import OptionError

from .compiled import compiled_name, plain_phase
from .tracker import F, Tracker


def plain(f: F, z0: torch.Tensor, tr: Tracker, *, max_iter: int = 100,
          damping: float = 1.0) -> None:
    """``z ← (1 − λ) z + λ f(z)`` with ``λ = damping`` from ``z0``, recorded into ``tr``;
    undamped, in compiled chunks when ``tr.compiled`` is set."""
    if not 0 < damping <= 1:
        raise OptionError(f"damping {damping} must lie in (0, 1]", term="solver plain")
    if damping == 1.0:
        tr.name = compiled_name("plain", tr.compiled)
        plain_phase(f, z0, tr, max_iter)
        return
    tr.name = "plain"
    z = z0
    for _ in range(max_iter):
        fz = f(z)
        if tr.record(z, fz):
            break
        z = (1 - damping) * z + damping * fz
