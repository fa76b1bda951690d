"""The benchmarks' hand-written loop (benchmarks/hand.py): its stop test decides as the module's
rule does."""

from __future__ import annotations

import torch

from benchmarks.hand import done


def test_hand_stop_test_is_the_module_decision() -> None:
    """``benchmarks.hand.done`` decides as the float64 residual compared with the unrounded
    ``tol`` (the module's rule, :func:`lowering.runtime.solvers.stats.meets`), zero-norm
    samples included (0/0 must never read as done; 0 − 0 over the floor reads 0, done)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        fz = torch.randn(6, 8, generator=g)
        z = fz + torch.randn(6, 8, generator=g) * 10.0 ** float(torch.empty(()).uniform_(
            -8, -4, generator=g)) * fz.norm(dim=1, keepdim=True)
        if trial % 7 == 0:
            fz[2] = 0.0
            z[2] = 0.0 if trial % 2 else 1e-3
        tol = (1e-6, 1e-5, 3e-7)[trial % 3]
        r = (fz.double() - z.double()).norm(dim=1) / fz.double().norm(dim=1).clamp_min(1e-30)
        # the plain float32 norms' rounding (≤ (8 + 3)·2⁻²⁴ relative) can only flip samples
        # within that of tol: such draws are skipped, not judged
        if bool(((r - tol).abs() <= 1e-5 * tol).any()):
            continue
        assert done(fz, z, tol) == bool((r <= tol).all())
