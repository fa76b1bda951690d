"""Hessian-vector products through monotone-operator and saddle layers with smooth activations.

Every splitting applies ``prox_{αf_σ}`` with a step ``α ≠ 1``, a numeric root solve; the
second-order backward must see its curvature, also where the implicit backward evaluates the
splitting map inside ``torch.func.vjp`` with the equilibrium captured from the outer graph
(Peaceman–Rachford / Douglas–Rachford: ``prox_{αg}(u)`` of the state alone).  Reference: central
differences of the first-order gradient in float64 (first-order gradients are pinned against
finite differences elsewhere).
"""

from __future__ import annotations

import pytest
import torch

from convex_eq import Dense, Input, Linear, Potential, SqNorm, State, Weight, models
from convex_eq.inclusion import Saddle
from lowering import lower

T64 = torch.float64
# float64, forward and adjoint solves at 1e-13
TIGHT = dict(dtype=T64, solver="anderson", tol=1e-13, max_iter=5000, backward_tol=1e-13)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # a saddle layer returns (z, w)


def _relative_hvp_error(m: torch.nn.Module, x: torch.Tensor, name: str) -> tuple[float, float]:
    """``max|HVP − FD| / max|FD|`` and ``max|FD|`` for ``ℓ = ||c ⊙ z*(x; W)||²`` along a
    random direction ``D`` of weight ``name``: the HVP by second-order autograd, FD by central
    differences (h = 1e-5) of the first-order gradient."""
    w = m.weights[name]
    c = torch.randn(_first(m(x)).shape, dtype=T64, generator=_gen(4))
    d = torch.randn(w.shape, dtype=T64, generator=_gen(3))

    def grad_w() -> torch.Tensor:
        return torch.autograd.grad(((_first(m(x)) * c) ** 2).sum(), w, create_graph=True)[0]

    (hvp,) = torch.autograd.grad((grad_w() * d).sum(), w)
    h = 1e-5
    with torch.no_grad():
        w += h * d
    plus = grad_w().detach()
    with torch.no_grad():
        w -= 2 * h * d
    minus = grad_w().detach()
    with torch.no_grad():
        w += h * d
    fd = (plus - minus) / (2 * h)
    scale = float(fd.abs().max())
    return float((hvp - fd).abs().max()) / scale, scale


# Tolerance 1e-6 relative: the reference carries h² ≈ 1e-10 truncation and 1e-13/h ≈ 1e-8
# solve noise; the exact second order measures ≤ 3e-9 on these layers, a curvature-dropping
# prox 0.15–3 (orders of magnitude apart on any CPU/BLAS).
@pytest.mark.parametrize(("splitting", "activation"), [
    ("forward-backward", "tanh"),
    ("peaceman-rachford", "tanh"),
    ("douglas-rachford", "tanh"),
    ("peaceman-rachford", "sigmoid"),
    ("douglas-rachford", "softplus"),
])
def test_mon_hessian_vector_product_matches_finite_differences(splitting: str,
                                                               activation: str) -> None:
    m = lower(models.mon(n=5, d=3, seed=2, activation=activation,
                         splitting=splitting)).torch_module(**TIGHT)
    x = torch.randn(2, 3, dtype=T64, generator=_gen(0))
    err, scale = _relative_hvp_error(m, x, "B")
    assert scale > 1.0  # not a vacuous comparison of zeros
    assert err <= 1e-6, err


def test_mon_tanh_unrolled_hessian_vector_product_matches_finite_differences() -> None:
    """The same through 800 unrolled Peaceman–Rachford steps (autograd through the
    iterations): PR contracts to rounding well within them; tolerance as above."""
    m = lower(models.mon(n=5, d=3, seed=2, activation="tanh",
                         splitting="peaceman-rachford")).torch_module(
        dtype=T64, backward="unroll", unroll_steps=800)
    x = torch.randn(2, 3, dtype=T64, generator=_gen(0))
    err, scale = _relative_hvp_error(m, x, "B")
    assert scale > 1.0
    assert err <= 1e-6, err


def test_chambolle_pock_smooth_potentials_hessian_vector_product() -> None:
    """Chambolle–Pock with ``prox_{τ f_tanh}`` and ``prox_{σ f_sigmoid}`` (τ = σ = 0.9/||K||₂):
    the HVP in K against differences of the gradient; tolerance as above."""
    g = torch.Generator().manual_seed(0)
    z, w, xi = State("z", 6), State("w", 4), Input("x", 3)
    u = Weight("U", (6, 3), torch.randn(6, 3, dtype=T64, generator=g).numpy())
    k = Weight("K", (4, 6), 2 * torch.randn(4, 6, dtype=T64, generator=g).numpy())
    sad = Saddle([Potential("tanh", z), 0.5 * SqNorm(z), -Linear(u @ xi, z)],
                 [SqNorm(w), Potential("sigmoid", w)], Dense(k), name="smooth-saddle")
    m = lower(sad).torch_module(**TIGHT)
    x = torch.randn(2, 3, dtype=T64, generator=_gen(0))
    err, scale = _relative_hvp_error(m, x, "K")
    assert scale > 0.1  # (0.76 here)
    assert err <= 1e-6, err
