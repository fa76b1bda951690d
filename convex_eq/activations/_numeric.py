"""Private numeric helpers: tensor coercion, safeguarded monotone solves and quadrature.

Everything here works elementwise on torch tensors; solves run in float64 under ``no_grad`` and
the callers re-attach exact first-order gradients (implicit-function trick).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._lazy import scipy_integrate as integrate
from .._lazy import torch

TensorFn = Callable[["torch.Tensor"], "torch.Tensor"]
ScalarFn = Callable[[float], float]

#: quadrature tolerances used by every numeric antiderivative (scipy.integrate.quad)
QUAD_EPSABS = 1e-13
QUAD_EPSREL = 1e-12
QUAD_LIMIT = 200


def as_tensor(x: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``x`` as a tensor (torch tensors pass through; other data becomes float64)."""
    if isinstance(x, torch.Tensor):
        return x
    if like is not None:
        return torch.as_tensor(x, dtype=like.dtype, device=like.device)
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def finfo_eps(x: torch.Tensor) -> float:
    """Machine epsilon of a floating tensor's dtype (float64 for non-floating dtypes)."""
    return torch.finfo(x.dtype).eps if x.is_floating_point() else torch.finfo(torch.float64).eps


def bracket_increasing(
    fun: TensorFn, target: torch.Tensor, x0: torch.Tensor, max_doublings: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo <= hi`` with ``fun(lo) <= target <= fun(hi)`` for nondecreasing ``fun``, by doubling.

    Entries that cannot be bracketed within ``(1 + |x0|) * 2**max_doublings`` keep the last try.
    """
    step = 1.0 + x0.abs()
    lo, hi = x0 - step, x0 + step
    flo, fhi = fun(lo), fun(hi)
    for _ in range(max_doublings):
        need_lo = flo > target
        need_hi = fhi < target
        if not bool((need_lo | need_hi).any()):
            break
        step = step * 2.0
        lo = torch.where(need_lo, x0 - step, lo)
        hi = torch.where(need_hi, x0 + step, hi)
        flo = torch.where(need_lo, fun(lo), flo)
        fhi = torch.where(need_hi, fun(hi), fhi)
    return lo, hi


def solve_increasing(
    fun: TensorFn,
    dfun: TensorFn,
    target: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    x0: torch.Tensor | None = None,
    maxiter: int = 300,
) -> torch.Tensor:
    """Root of ``fun(x) = target`` in ``[lo, hi]`` (``fun`` nondecreasing, bracketed), elementwise.

    Safeguarded Newton: a Newton step is taken when it stays strictly inside the current bracket,
    otherwise the bracket is bisected.  Stops per entry when the residual is exactly zero, the
    Newton step or the bracket is below ``4 eps (1 + |x|)``.  Runs without autograd.
    """
    with torch.no_grad():
        eps = finfo_eps(target)
        lo, hi = torch.broadcast_tensors(lo, hi)
        lo, hi = lo.clone(), hi.clone()
        x = (lo + hi) / 2 if x0 is None else torch.minimum(torch.maximum(x0, lo), hi)
        done = torch.zeros_like(x, dtype=torch.bool)
        for _ in range(maxiter):
            r = fun(x) - target
            lo = torch.where(r <= 0, x, lo)
            hi = torch.where(r >= 0, x, hi)
            d = dfun(x)
            newton = x - r / d
            ok = torch.isfinite(newton) & (newton > lo) & (newton < hi)
            xn = torch.where(ok, newton, (lo + hi) / 2)
            tol = 4 * eps * (1 + x.abs())
            conv = (r == 0) | ((xn - x).abs() <= tol) | ((hi - lo) <= tol) | torch.isnan(r)
            x = torch.where(done | (r == 0), x, xn)
            done = done | conv
            if bool(done.all()):
                break
        return x


def quad_antiderivative(f: ScalarFn, a: np.ndarray) -> np.ndarray:
    """``∫_0^a f`` for every entry of ``a`` by scipy ``quad`` on consecutive sorted segments.

    Values are accumulated outward from 0 (``a = ±inf`` allowed, NaN stays NaN); each segment
    is integrated to ``epsabs = 1e-13``, ``epsrel = 1e-12``.
    """
    arr = np.asarray(a, dtype=np.float64)
    flat = arr.ravel()
    out = np.full(flat.shape, np.nan)
    out[flat == 0] = 0.0
    for sign in (1.0, -1.0):
        idx = np.nonzero(sign * flat > 0)[0]
        order = idx[np.argsort(sign * flat[idx], kind="stable")]
        prev, acc = 0.0, 0.0
        for i in order:
            x = float(flat[i])
            if x != prev:
                val, _ = integrate.quad(
                    f, prev, x, epsabs=QUAD_EPSABS, epsrel=QUAD_EPSREL, limit=QUAD_LIMIT
                )
                acc += val
                prev = x
            out[i] = acc
    return out.reshape(arr.shape)


def quad_improper(f: ScalarFn, a: float, b: float) -> float:
    """``∫_a^b f`` for an integral known to be finite or ``+inf`` (a limit of a convex function).

    Divergence detection is heuristic: quad's warning flag (``ier > 0``) or an infinite result
    is read as ``+inf``; a NaN result (the integrand overflowed) is returned as NaN.
    """
    res = integrate.quad(
        f, a, b, epsabs=QUAD_EPSABS, epsrel=QUAD_EPSREL, limit=QUAD_LIMIT, full_output=1
    )
    val = float(res[0])
    if math.isnan(val):
        return math.nan
    if len(res) > 3 or not math.isfinite(val):
        return math.inf
    return val


def numpy_antiderivative(a: torch.Tensor, numpy_fn: Any, sigma_fn: Any) -> torch.Tensor:
    """``numpy_fn(a)`` with the gradient ``grad · sigma_fn(a)``: ``d/da ∫σ = σ(a)`` (autograd)."""
    return _numpy_antiderivative().apply(a, numpy_fn, sigma_fn)


@functools.cache
def _numpy_antiderivative() -> type:
    """The autograd Function of ``numpy_antiderivative``, defined on first use (a subclass of
    ``torch.autograd.Function`` would import torch with this module)."""

    class NumpyAntiderivative(torch.autograd.Function):
        """Forward by a numpy routine, backward ``grad * sigma(a)`` (torch)."""

        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, numpy_fn: Any, sigma_fn: Any) -> torch.Tensor:
            ctx.sigma_fn = sigma_fn
            ctx.save_for_backward(a)
            vals = numpy_fn(a.detach().to("cpu", torch.float64).numpy())
            return torch.as_tensor(vals, dtype=a.dtype, device=a.device)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            (a,) = ctx.saved_tensors
            return grad * ctx.sigma_fn(a), None, None

    return NumpyAntiderivative


def xlogx(x: torch.Tensor) -> torch.Tensor:
    """``x log x`` with ``0 log 0 = 0`` (NaN-free gradient for ``x > 0``; 0 at ``x = 0``)."""
    pos = x > 0
    xs = torch.where(pos, x, torch.ones_like(x))
    return torch.where(pos, xs * torch.log(xs), torch.zeros_like(x))


def xlog1p(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x log(1 + y)`` with the value 0 wherever ``x = 0`` (double-where guarded)."""
    zero = x == 0
    ys = torch.where(zero, torch.zeros_like(y), y)
    return torch.where(zero, torch.zeros_like(x), x * torch.log1p(ys))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^x)`` computed stably for all ``x`` (exact gradient ``sigmoid(x)``)."""
    return torch.logaddexp(x, torch.zeros_like(x))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^{-x})`` for ``x > 0`` (Mächler's stable split at ``log 2``)."""
    small = x <= math.log(2.0)
    xs = torch.where(small, x, torch.ones_like(x))
    xl = torch.where(small, torch.ones_like(x), x)
    return torch.where(small, torch.log(-torch.expm1(-xs)), torch.log1p(-torch.exp(-xl)))
