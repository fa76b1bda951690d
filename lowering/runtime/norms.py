"""Spectral norms ``||A||₂`` of the operators weight control keeps (docs/guide.md, weight
control): exact where it is cheap (a dense SVD up to :data:`DENSE_SVD_ENTRIES` entries),
otherwise by power iteration to a relative change of :data:`POWER_TOL` on the actual operator
(zero padding, stride and groups as ``T`` applies them), warm-started from the last weight
version's singular vector.  An operator type can register a cheap guaranteed upper bound,
differentiable in its weight (the Fourier bound of a convolution): training rescales such a
weight by that bound instead of measuring the exact norm of every new version (a dense SVD of
the demo's 480 × 480 convolution costs more than the rest of its training step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import NonFiniteError

#: largest operator (rows × columns) whose norm is taken from a dense SVD
DENSE_SVD_ENTRIES = 512 * 512
#: power iteration: stop when ``σ`` changes by at most this relative amount in an iteration
#: (far below weight control's margin, 0.01 by default, which absorbs the estimate's error)
POWER_TOL = 1e-7
POWER_MAX_ITER = 2000


@dataclass
class TopPair:
    """``σ = ||A||₂`` with its singular vectors (``A v = σ u``; float64, unit norm) and whether
    ``σ`` is exact to the power iteration's tolerance (False: the iteration hit its cap)."""

    sigma: float
    u: torch.Tensor
    v: torch.Tensor
    exact: bool = True


UpperBound = Callable[[Any, str, dict], torch.Tensor]
#: ``bound(op, delta) ≥ ||A(Δ)||₂`` for an operator ``A(W)`` linear in its weight: with Weyl's
#: inequality ``||A(W)||₂ ≤ ||A(W₀)||₂ + ||A(W − W₀)||₂`` a weight close to one measured exactly
#: is proved within its target without a new measurement
DifferenceBound = Callable[[Any, torch.Tensor], float]
DIFFERENCE_BOUNDS: dict[str, DifferenceBound] = {}
#: operator class name → ``bound(op, weight_name, env) ≥ ||op||₂``: a guaranteed upper bound, a
#: float64 scalar tensor differentiable in ``env[weight_name]``
UPPER_BOUNDS: dict[str, UpperBound] = {}


def register_upper_bound(op_type: str) -> Callable[[UpperBound], UpperBound]:
    """Register a cheap guaranteed upper bound of ``||op||₂`` for operators named ``op_type``."""

    def deco(fn: UpperBound) -> UpperBound:
        UPPER_BOUNDS[op_type] = fn
        return fn

    return deco


def register_difference_bound(op_type: str) -> Callable[[DifferenceBound], DifferenceBound]:
    """Register ``bound(op, delta) ≥ ||A(Δ)||₂`` for operators named ``op_type``."""

    def deco(fn: DifferenceBound) -> DifferenceBound:
        DIFFERENCE_BOUNDS[op_type] = fn
        return fn

    return deco


def difference_bound(op: Any, delta: torch.Tensor) -> float | None:
    """The registered bound of ``||A(Δ)||₂`` for ``op`` (None: none registered)."""
    for cls in type(op).__mro__:
        fn = DIFFERENCE_BOUNDS.get(cls.__name__)
        if fn is not None:
            return fn(op, delta)
    return None


@register_difference_bound("Dense")
def dense_difference(op: Any, delta: torch.Tensor) -> float:
    """``||Δ||₂ ≤ ||Δ||_F``."""
    return float(torch.linalg.vector_norm(delta.detach(), dtype=torch.float64))


@register_difference_bound("_ConvNd")
def conv_difference(op: Any, delta: torch.Tensor) -> float:
    """``||A(ΔK)||₂ ≤ ||N||_F`` with ``N_oi = ||ΔK_oi||₁`` (Young's inequality per channel pair,
    ``||k ∗ x||₂ ≤ ||k||₁ ||x||₂``, which zero padding, stride and grouping only shrink)."""
    n1 = delta.detach().to(torch.float64).abs().flatten(2).sum(-1)
    return float(torch.linalg.vector_norm(n1))


def upper_bound_tensor(op: Any, name: str, env: dict) -> torch.Tensor | None:
    """The registered upper bound for ``op`` (by class, most specific first) as a tensor
    differentiable in ``env[name]``, or None where none is registered (or it cannot bound this
    operator)."""
    for cls in type(op).__mro__:
        fn = UPPER_BOUNDS.get(cls.__name__)
        if fn is not None:
            return fn(op, name, env)
    return None


def upper_bound(op: Any, name: str, env: dict) -> float | None:
    """:func:`upper_bound_tensor` as a number (no autograd)."""
    with torch.no_grad():
        ub = upper_bound_tensor(op, name, env)
    return None if ub is None else float(ub)


def _env64(env: dict) -> dict:
    return {k: (v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in env.items()}


def top_pair(op: Any, name: str, env: dict, start: torch.Tensor | None = None) -> TopPair:
    """``||op||₂`` and its singular pair at ``env`` (float64): a dense SVD for operators up to
    :data:`DENSE_SVD_ENTRIES` entries, else power iteration on ``AᵀA`` from ``start`` (the last
    version's ``v``) or a seeded Gaussian."""
    e64 = _env64(env)
    dev = env[name].device
    with torch.no_grad(), torch.inference_mode(False):
        if op.in_size * op.out_size <= DENSE_SVD_ENTRIES:
            eye = torch.eye(op.in_size, dtype=torch.float64, device=dev)
            M = op.apply(eye, e64).T  # (out, in)
            _finite(M, name)
            U, S, Vh = torch.linalg.svd(M, full_matrices=False)
            return TopPair(float(S[0]), U[:, 0].contiguous(), Vh[0].contiguous())
        return _power(op, name, e64, dev, start)


def _power(op: Any, name: str, e64: dict, dev: torch.device, start: torch.Tensor | None
           ) -> TopPair:
    if start is None or start.shape != (op.in_size,):
        g = torch.Generator().manual_seed(0)
        start = torch.randn(op.in_size, generator=g, dtype=torch.float64)
    v = (start / start.norm()).to(dev)[None]
    sigma, exact = 0.0, False
    for _ in range(POWER_MAX_ITER):
        w = op.adjoint(op.apply(v, e64), e64)
        wn = float(w.norm())
        if wn == 0.0:
            return TopPair(0.0, torch.zeros(op.out_size, dtype=torch.float64, device=dev),
                           v[0], True)
        _finite(w, name)
        new = wn ** 0.5  # ||AᵀA v|| → σ² for the top singular vector
        v = w / wn
        done = abs(new - sigma) <= POWER_TOL * new
        sigma = new
        if done:
            exact = True
            break
    av = op.apply(v, e64)[0]
    sigma = float(av.norm())  # σ = ||A v|| at the unit iterate (a lower bound of ||A||₂)
    return TopPair(sigma, av / sigma if sigma else av, v[0], exact)


def _finite(t: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(t).all()):  # (a write through .data passed env's check)
        raise NonFiniteError(f"parameter '{name}' contains NaN or Inf", term=name,
                             hint="check the optimizer step / the loaded state_dict")


def sigma_through(op: Any, env: dict, pair: TopPair, dtype: torch.dtype) -> torch.Tensor:
    """``uᵀ A(w) v`` at the weights of ``env``, differentiable in them: the value is ``σ`` and
    the gradient ``u vᵀ`` (through the operator), exact to first order."""
    half = (torch.float16, torch.bfloat16)
    if dtype in half:  # uᵀAv in float32 (a half product would round σ by up to 2⁻⁸)
        env = {k: (t.float() if torch.is_tensor(t) and t.dtype in half else t)
               for k, t in env.items()}
        av = op.apply(pair.v.float()[None], env)[0]
    else:
        av = op.apply(pair.v.to(dtype)[None], env)[0]
    return (pair.u.to(av.dtype) * av).sum().to(torch.float64)


@register_upper_bound("_ConvNd")
@register_upper_bound("Conv2d")
def conv_fourier_bound(op: Any, name: str, env: dict) -> torch.Tensor | None:
    """``max_ω σ_max(K̂_g(ω))`` over the DFT grid of size ``n + k + p`` per spatial axis and over
    the groups ``g``: the zero-padded (and strided: a row subset) convolution is a compression of
    that circulant operator, whose singular values are those of the per-frequency
    ``C_out/g × C_in/g`` matrices (an upper bound of ``||A||₂``; 0.6 % above the exact norm on
    the demo's trained 12-channel convolution of length 40).  None for a dilated kernel.

    A real kernel has ``K̂(−ω) = conj K̂(ω)``, whose singular values are the same, so the half
    grid of ``rfftn`` holds every value; the largest is found without a graph (singular values
    only) and the returned value is the norm of that one frequency's matrix, differentiable in
    the weight (the max's gradient is its argmax's: a third of the full grid's cost)."""
    if getattr(op, "dilation", 1) not in (1, (1,), (1, 1)):
        return None
    K = env[name].to(torch.float64)
    nd = K.ndim - 2
    spatial = op.in_shape[1:]
    pads = tuple(op.padding) if isinstance(op.padding, (tuple, list)) else (op.padding,) * nd
    sizes = [n + k + p for n, k, p in zip(spatial, K.shape[2:], pads)]
    Kh = torch.fft.rfftn(K, s=sizes, dim=tuple(range(2, 2 + nd)))
    groups = int(getattr(op, "groups", 1))
    per = K.shape[0] // groups
    # (C_out, C_in/g, ω...) → (g, ω, C_out/g, C_in/g): one stack of per-frequency matrices
    mats = (Kh.reshape(groups, per, *Kh.shape[1:]).permute(0, *range(3, 3 + nd), 1, 2)
            .reshape(-1, per, K.shape[1]))
    with torch.no_grad():
        try:
            top = torch.linalg.svdvals(mats)[:, 0]
        except torch.linalg.LinAlgError:  # checked only then: no extra host sync per call
            _finite(K, name)
            raise
        best = int(top.argmax())
        if not math.isfinite(float(top[best])):
            _finite(K, name)
    return torch.linalg.matrix_norm(mats[best], ord=2)
