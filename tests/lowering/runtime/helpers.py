"""Layers, modules and maps shared by the runtime tests (the emitted module, its solvers and its
backward passes)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import (
    Antiderivative,
    Input,
    Linear,
    Objective,
    Potential,
    SqNorm,
    State,
    Weight,
    models,
)
from convex_eq.models import opteq
from lowering.runtime.solvers import SolverStats, exact_rel_residual

F64 = torch.float64


# ------------------------------------------------------------------ derived layers
def relu_layer(m: int = 12, n: int = 8, norm: float = 0.8, seed: int = 0) -> lowering.DerivedLayer:
    """The canonical ReLU layer ``relu(WᵀWz + q)`` with ``q`` the input, ``W`` (m × n)
    of spectral norm ``norm``."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, n))
    w *= norm / np.linalg.norm(w, 2)
    z, q = State("z", n), Input("q", n)
    return lowering.lower(Objective([Potential("relu", z), SqNorm(z), -Linear(q, z),
                                     -SqNorm(Weight("W", (m, n), w) @ z)], name="entry"))


def uneven_relu_layer() -> lowering.DerivedLayer:
    """OptEq ``z = Wᵀrelu(Wz + Ux + b)`` with ``||W||₂ = 0.97`` and a non-orthogonal ``W``:
    the samples' contraction rates differ (their active sets do)."""
    z, x = State("z", 6), Input("x", 4)
    w0 = np.random.default_rng(0).normal(size=(6, 6))
    w = Weight("W", (6, 6), w0 / np.linalg.norm(w0, 2) * 0.97)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) - 0.5)
    return lowering.lower(Antiderivative("relu", w @ z + u @ x + b).conjugate() - SqNorm(z))


def uneven_inputs() -> torch.Tensor:
    """Eight seeded inputs of :func:`uneven_relu_layer` (float64, scale 2)."""
    return torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(0)) * 2


def conv_layer(channels: int = 4, image: tuple[int, int, int] = (1, 6, 6), seed: int = 0):
    """Convolutional OptEq (3×3 kernels) on a small image."""
    return lowering.lower(models.opteq(conv=(channels, 3), image=image, seed=seed))


def small_dense(seed: int = 0):
    """A 4-unit canonical tanh OptEq with ``||W||₂ = 0.6`` (cheap tight second-order solves)."""
    return lowering.lower(models.opteq(n=4, m=4, d=2, activation="tanh", form="canonical",
                                       weight_norm=0.6, seed=seed))


def nan_batch():
    """A small OptEq layer, five inputs, and the same inputs with a NaN in sample 3."""
    d = lowering.lower(models.opteq(n=6, m=6, d=3, seed=0))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    bad = x.clone()
    bad[3, 1] = float("nan")
    return d, x, bad


# ------------------------------------------------------------------ emitted modules
def controlled_layer(norm: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """OptEq with ``||W||₂ = norm`` under the default weight control (rescaling active when
    ``norm > 1``), solves at 1e-13, and seeded inputs ``x`` and loss weights ``c``."""
    z, x = State("z", 6), Input("x", 4)
    w0 = np.random.default_rng(0).normal(size=(6, 6))
    w = Weight("W", (6, 6), w0 / np.linalg.norm(w0, 2) * norm)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "weight control rescales 'W'" (norm > 1)
        m = lowering.lower(Antiderivative("relu", w @ z + u @ x + b).conjugate() - SqNorm(z)
                           ).torch_module(dtype=F64, tol=1e-13, max_iter=3000,
                                          backward_tol=1e-13, backward_max_iter=3000)
    g = torch.Generator().manual_seed(0)
    return m, torch.randn(3, 4, dtype=F64, generator=g), torch.randn(3, 6, dtype=F64, generator=g)


def small_module(**kw):
    """A small conjugate-form OptEq module in float64."""
    d = lowering.lower(models.opteq(n=8, m=10, d=3, form="conjugate", seed=3))
    return d.torch_module(dtype=F64, **kw)


def qp_module(m: int = 16, dtype: torch.dtype = torch.float64, **kw):
    """The benchmarks' QP layer (``W``: m × 64, ``||W||₂ = 0.9``) without weight control,
    forward and adjoint solves at 1e-10."""
    layer = lowering.lower(qp_objective(qp_weight(m, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-10, max_iter=500, backward_tol=1e-10,
                backward_max_iter=500, dtype=dtype)
    opts.update(kw)
    return layer.torch_module(**opts)


def qp_module_64(**kw: object) -> lowering.EquilibriumModule:
    """The QP layer with a 64 × 64 ``W``, solves at 1e-6 (the module's ordinary call path)."""
    layer = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-6, max_iter=200, backward_tol=1e-6,
                backward_max_iter=200, dtype=torch.float64)
    opts.update(kw)
    return layer.torch_module(**opts)


def qp_module_16(**kw: object) -> lowering.EquilibriumModule:
    """The QP layer on a 16-dimensional state (``W``: 16 × 16), solves at 1e-8."""
    layer = lowering.lower(qp_objective(qp_weight(16, 16, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-8, max_iter=300, backward_tol=1e-8,
                backward_max_iter=300, dtype=torch.float64)
    opts.update(kw)
    return layer.torch_module(**opts)


def compiled_relu_module(**kw):  # type: ignore[no-untyped-def]
    """A small ReLU OptEq module with tight solves and the iterative adjoint (the solves that
    run in compiled chunks under ``torch.compile``)."""
    d = lowering.lower(opteq(n=6, m=6, d=3, activation="relu", weight_norm=0.9, seed=2))
    return d.torch_module(dtype=F64, tol=1e-11, max_iter=300, backward_tol=1e-11,
                          backward_adjoint="iterative", **kw)


class Half(torch.nn.Module):
    """A parametrisation ``W ↦ W/2``."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 0.5 * w


def output_and_grads(mod, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The output, the input gradient and every parameter gradient of ``Σ c ⊙ mod(x)``."""
    xx = x.detach().clone().requires_grad_()
    z = mod(xx)
    (z * c).sum().backward()
    return (z.detach(), xx.grad, *[p.grad.clone() for p in mod.parameters()])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ fixed-point maps
def linear_map(seed: int, rho: float, dt: torch.dtype, nonnormal: bool):
    """``z ↦ Wz + b`` on a batch of 4, ``N = 24``: ``W`` of spectral norm ``rho``, or (non-normal)
    ``rho·I`` plus a strictly upper triangular part."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(24, 24, generator=g, dtype=torch.float64)
    W = (torch.triu(W, 1) * 0.5 + rho * torch.eye(24, dtype=torch.float64)) if nonnormal \
        else W / torch.linalg.matrix_norm(W, 2) * rho
    b = torch.randn(4, 24, generator=g, dtype=torch.float64)
    W, b = W.to(dt), b.to(dt)
    return lambda z: z @ W.T + b


def shrinking(z: torch.Tensor) -> torch.Tensor:
    """``z/2 + 1e-19``: from ``z0 = 1`` the iterates shrink towards the tiny fixed point 2e-19."""
    return 0.5 * z + 1e-19


def one_diverging(z: torch.Tensor) -> torch.Tensor:
    """Sample 0 contracts (``z/2 + 1``), the others diverge (``2z + 1``)."""
    return torch.cat([0.5 * z[:1] + 1.0, 2.0 * z[1:] + 1.0])


def false_passes(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, st: SolverStats,
                 tol: float) -> torch.Tensor:
    """``(B, K)``: recorded residuals at or below ``tol`` whose iterate's exact residual is not
    (the plain iterates recomputed from ``z0``; ``1.001·tol`` absorbs float64 rounding)."""
    z, exact = z0, []
    for _ in range(st.residuals.shape[1]):
        fz = f(z)
        exact.append(exact_rel_residual(fz - z, fz))
        z = fz
    true = torch.stack(exact, 1)
    return (st.residuals <= tol) & (true > 1.001 * tol)
