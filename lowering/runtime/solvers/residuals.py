"""Relative residuals ``||f(z) − z|| / max(||f(z)||, 1e-30)`` per sample, in forms that cannot
overflow or underflow into a false 0 ("converged") in any dtype (docs/theory.md §8, solver
bookkeeping).

Per iteration the solvers measure plain norms in the state's dtype; the returned iterate's
residual, and any measurement that came out non-finite, use exact forms: float64 norms of
float32/16 states, or *scaled* norms (both vectors divided by their largest magnitude first).
"""

from __future__ import annotations

import math

import torch

#: dtypes whose reductions (Gram matrices, small linear solves) run in float64
LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
norm = torch.linalg.vector_norm
#: unit round-off of the dtypes whose plain residuals can stand for the exact ones
#: (``Tracker.plain_is_exact``)
EXACT_PLAIN = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
#: per such dtype ``√(tiny/u)``: the smallest ``tol·||fz||`` at which the squares a
#: flush-denormal mode reads as 0 (those below ``tiny``) stay inside the rounding margin
FLUSH_SAFE = {dt: math.sqrt(torch.finfo(dt).tiny / u) for dt, u in EXACT_PLAIN.items()}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype solver bookkeeping (Gram matrices, small solves) runs in: float64 for
    float32/16 states (their round-off, squared in a Gram matrix, stalls Anderson near 1e-4),
    the state's own dtype otherwise."""
    return torch.float64 if dtype in LOW_PRECISION else dtype


def scaled_rel_residual(d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
    """``||d|| / max(||fz||, 1e-30)`` per sample, overflow-safe: both are divided by
    ``s = max(max|d|, max|fz|)`` before the norms (``||d/s||, ||fz/s|| ≤ √N``), so the ratio
    is exact up to rounding for every finite input and NaN for a non-finite one.  Half
    precision is computed in float32."""
    if fz.ndim != 2:
        d, fz = d.flatten(1), fz.flatten(1)
    if fz.dtype in (torch.float16, torch.bfloat16):
        d, fz = d.float(), fz.float()
    s = torch.maximum(d.abs().amax(dim=1), fz.abs().amax(dim=1))
    s = torch.where(s > 0, s, torch.ones_like(s))[:, None]
    norm = torch.linalg.vector_norm
    num = norm(d / s, dim=1)
    den = norm(fz / s, dim=1)
    return num / torch.maximum(den, 1e-30 / s[:, 0])


def extreme_scale(fz: torch.Tensor, tol: float) -> bool:
    """True when plain norms of this state could overflow or underflow: a sample with an entry
    beyond ``sqrt(max)/1e3`` of its dtype (its squared norm can overflow, reading a false 0
    residual), or a nonzero sample whose largest entry is below ``10·sqrt(tiny)/tol`` (the
    squares of a difference at relative size ``tol`` can underflow).  Checked on the first
    iterate's image (one reduction per solve); a solve whose iterates only later reach such
    scales still has every stop confirmed (``Tracker.confirm``)."""
    a = fz.detach().abs().flatten(1).amax(dim=1)
    mm = torch.aminmax(a)
    lo, hi = float(mm.min), float(mm.max)
    if lo == 0.0:  # samples at exactly 0 have no scale (their 0/0 takes the exact form)
        nonzero = a[a > 0]
        lo = float(nonzero.min()) if nonzero.numel() else 1.0
    return not scale_ok(lo, hi, fz.dtype, tol)


def scale_ok(lo: float, hi: float, dtype: torch.dtype, tol: float) -> bool:
    """Plain norms of states whose per-sample largest entries lie in ``[lo, hi]`` can neither
    overflow nor underflow into a false 0 (float16 norms run in float32: judged by its
    range)."""
    low, eps, high = scale_range(dtype)
    return lo >= low / max(tol, eps) and hi <= high


def scale_range(dtype: torch.dtype) -> tuple[float, float, float]:
    """:data:`SCALE_RANGE`'s entry for ``dtype``, made on first use."""
    rng = SCALE_RANGE.get(dtype)
    if rng is None:
        fi = torch.finfo(torch.float32 if dtype == torch.float16 else dtype)
        rng = SCALE_RANGE[dtype] = (10 * fi.tiny ** 0.5, fi.eps, fi.max ** 0.5 / 1e3)
    return rng


#: per dtype ``(10·√tiny, eps, √max / 10³)``: the constants of :func:`scale_ok`
SCALE_RANGE: dict[torch.dtype, tuple[float, float, float]] = {}


def norms_in_range(den: torch.Tensor, n: int, dtype: torch.dtype, tol: float,
                    least: float = 0.0) -> bool:
    """:func:`scale_ok` decided from plain per-sample norms ``den = ||x_b||`` of states with
    ``n`` entries, which bound each sample's largest entry, ``den/√n ≤ max|x_b| ≤ den``
    (``den`` can only fall short of the true norm, by underflow; 2: round-off margin), and
    every norm at least ``least``.  False for a zero or non-finite norm.  One reduction, two
    reads."""
    lo, hi = torch.aminmax(den)
    lo_ = float(lo)
    if not lo_ >= least:
        return False
    # scale_ok(lo_ / (2√n), hi), inline (asked at the first record and at the stop of a solve)
    low, eps, high = SCALE_RANGE.get(dtype) or scale_range(dtype)
    return lo_ / (2.0 * math.sqrt(max(n, 1))) >= low / max(tol, eps) and float(hi) <= high


def plain_norms(d: torch.Tensor, fz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||fz||, ||d|| / ||fz||)`` per sample ``(B, 1)``, plain norms in the state's dtype
    (what a lean record measures; no floor: 0/0 reads NaN and goes the general way)."""
    den = norm(fz, dim=1, keepdim=True)
    return den, norm(d, dim=1, keepdim=True).div_(den)  # in place on the fresh norm


def fast_rel_residual(d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
    """``||d|| / max(||fz||, 1e-30)`` with plain norms accumulated in float64 for float32/16
    states (exact there: ``(3.4e38)² ≪ 1.8e308``); a float64 state whose norm overflows gives a
    non-finite value, which ``Tracker.record`` recomputes with
    :func:`scaled_rel_residual`."""
    if fz.ndim != 2:
        d, fz = d.flatten(1), fz.flatten(1)
    acc = torch.float64 if fz.dtype in LOW_PRECISION else None
    norm = torch.linalg.vector_norm
    den = norm(fz, dim=1, dtype=acc)
    r = norm(d, dim=1, dtype=acc) / den.clamp_min(1e-30)
    # float64: ||fz|| = inf with a finite ||d|| would read 0 ("converged"); inf·0 = NaN sends
    # such a sample to the scaled form instead
    return r if acc is not None else r + den * 0.0


def rel_residual(fz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``||f(z) - z|| / max(||f(z)||, 1e-30)`` per sample (scaled: cannot overflow into 0)."""
    return scaled_rel_residual(fz - z, fz)


def exact_rel_residual(d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
    """``||d|| / max(||fz||, 1e-30)`` per sample, exactly: float64 norms for float32/16 states
    (their squares cannot overflow or underflow in float64), the scaled form otherwise."""
    if fz.ndim != 2:
        d, fz = d.flatten(1), fz.flatten(1)
    if fz.dtype in LOW_PRECISION:
        den = norm(fz, dim=1, dtype=torch.float64).clamp_min(1e-30)
        return norm(d, dim=1, dtype=torch.float64) / den
    return scaled_rel_residual(d, fz)
