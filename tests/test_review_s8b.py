"""Review s8b: second-order gradients through monotone-operator (splitting) layers.

``torch.autograd.grad(..., create_graph=True)`` then a second backward through a MON layer
with ``backward="implicit"`` failed for every splitting (forward–backward, Peaceman–Rachford,
Douglas–Rachford) and for the Chambolle–Pock saddle layer with an untyped ``RuntimeError:
Cannot access data pointer of Tensor that doesn't have storage``: the second-order path takes
``(∂T/∂θ)ᵀg`` by ``torch.func.vjp`` over the weights, and inside it the splitting's step sizes
(``(m, L)`` of ``F``, ``τ, σ`` from ``||K||₂``) were computed with ``.numpy()`` from tensors that
are functorch wrappers without storage.  The steps are numbers of the current weights, never
differentiated (the equilibrium does not depend on them), so they are now computed from the
plain values with ``torch.func`` off.  ``phantom`` still refuses second order with a typed
error; ``unroll`` with ``torch.autograd`` worked before and still does.  The same cause broke
``torch.func.grad`` over the inputs of a MON layer with ``backward="unroll"`` (a combination the
module accepts), fixed with it.
"""

from __future__ import annotations

import pytest
import torch

from convex_eq import L1, Dense, Input, Linear, Potential, SqNorm, State, Weight, models
from convex_eq.errors import OptionError
from convex_eq.inclusion import Saddle
from lowering import lower

T64 = torch.float64
SPLITTINGS = ("forward-backward", "peaceman-rachford", "douglas-rachford")
# float64, forward and adjoint solves at 1e-13 (Anderson converges in tens of iterations on
# these margin-0.5 layers)
TIGHT = dict(dtype=T64, solver="anderson", tol=1e-13, max_iter=5000, backward_tol=1e-13)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _with_weight(m: torch.nn.Module, x: torch.Tensor, name: str, w: torch.Tensor) -> torch.Tensor:
    """The module with weight ``name`` replaced by the (differentiable) tensor ``w``."""
    return torch.func.functional_call(m, {f"weights.{name}": w}, (x,))


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # a saddle layer returns (z, w)


def _hvp_and_fd(m: torch.nn.Module, x: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
    """``d/dW ⟨∂ℓ/∂W, D⟩`` by second-order autograd and by central differences (h = 1e-5) of
    the first-order gradient, ``ℓ = ||c ⊙ z*(x; W)||²``."""
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
    return hvp, (plus - minus) / (2 * h)


@pytest.mark.parametrize("splitting", SPLITTINGS)
def test_mon_implicit_gradgradcheck(splitting: str) -> None:
    """The reported failure: gradgradcheck through a MON layer (inputs and A), every splitting.
    float64 with solves at 1e-13: eps = 1e-6 differences carry O(eps²) truncation and
    ~1e-13/eps = 1e-7 solve noise on O(1)–O(10) entries, far inside atol 1e-6 + rtol 1e-3 (the
    settings of the dense-layer gradgradcheck in test_training), on any BLAS."""
    m = lower(models.mon(n=4, d=2, seed=1, splitting=splitting)).torch_module(**TIGHT)
    x = torch.randn(2, 2, dtype=T64, generator=_gen(0), requires_grad=True)
    a = m.weights["A"]

    def fn(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return _with_weight(m, x, "A", a)

    assert torch.autograd.gradgradcheck(fn, (x, a), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("splitting", SPLITTINGS)
def test_mon_hessian_vector_product_matches_finite_differences(splitting: str) -> None:
    """The Hessian-vector product in B against central differences of the first-order gradient
    (measured ~2e-9 relative: h² ≈ 1e-10 truncation plus 1e-13/h ≈ 1e-8 solve noise); 1e-6 is
    orders of magnitude above both on any CPU/BLAS.  The three splittings share the
    equilibrium, so their Hessians agree to the same accuracy."""
    m = lower(models.mon(n=5, d=3, seed=2, splitting=splitting)).torch_module(**TIGHT)
    x = torch.randn(2, 3, dtype=T64, generator=_gen(0))
    hvp, fd = _hvp_and_fd(m, x, "B")
    assert float(fd.abs().max()) > 1.0  # not a vacuous comparison of zeros
    assert float((hvp - fd).abs().max()) <= 1e-6 * float(fd.abs().max())


def test_conv_mon_and_saddle_second_order() -> None:
    """Same root cause in the conv MON layer (Peaceman–Rachford's cached LU of I + αM is
    re-factorised under autograd) and in the Chambolle–Pock saddle layer (τ, σ from ||K||₂).
    Tolerance as above: measured ~5e-9 relative against a bound of 1e-6."""
    m = lower(models.mon(conv=(2, 3), image=(1, 6))).torch_module(**TIGHT)
    x = torch.randn(2, 1, 6, dtype=T64, generator=_gen(0))
    hvp, fd = _hvp_and_fd(m, x, "A")
    assert float(fd.abs().max()) > 1.0
    assert float((hvp - fd).abs().max()) <= 1e-6 * float(fd.abs().max())

    g = torch.Generator().manual_seed(0)
    z, w, xi = State("z", 6), State("w", 4), Input("x", 3)
    u = Weight("U", (6, 3), torch.randn(6, 3, dtype=T64, generator=g).numpy())
    k = Weight("K", (4, 6), 2 * torch.randn(4, 6, dtype=T64, generator=g).numpy())
    sad = Saddle([Potential("relu", z), 0.5 * SqNorm(z), -Linear(u @ xi, z)],
                 [SqNorm(w), 0.1 * L1(w)], Dense(k), name="robust")
    m = lower(sad).torch_module(**TIGHT)
    x = torch.randn(2, 3, dtype=T64, generator=_gen(0))
    hvp, fd = _hvp_and_fd(m, x, "K")
    assert float(fd.abs().max()) > 0.1  # (0.78 here)
    assert float((hvp - fd).abs().max()) <= 1e-6 * float(fd.abs().max())


def test_step_cache_unaffected_by_second_order() -> None:
    """A second-order backward leaves no stale steps behind: the no-grad forward after it
    equals the one before (same weights, same solve: bitwise equal)."""
    m = lower(models.mon(n=4, d=2, seed=1)).torch_module(**TIGHT)
    x = torch.randn(2, 2, dtype=T64, generator=_gen(0), requires_grad=True)
    with torch.no_grad():
        before = m(x)
    (gx,) = torch.autograd.grad((m(x) ** 2).sum(), x, create_graph=True)
    torch.autograd.grad((gx ** 2).sum(), m.weights["A"])
    with torch.no_grad():
        after = m(x)
    assert torch.equal(before, after)


def test_mon_phantom_second_order_is_a_typed_refusal() -> None:
    m = lower(models.mon(n=4, d=2, seed=1)).torch_module(dtype=T64, backward="phantom")
    x = torch.randn(2, 2, dtype=T64, generator=_gen(0), requires_grad=True)
    with pytest.raises(OptionError, match="first-order gradients only") as err:
        torch.autograd.grad(m(x).sum(), x, create_graph=True)
    assert "backward='phantom'" not in (err.value.hint or "")  # no hint to what is set


@pytest.mark.parametrize("splitting", ["forward-backward", "peaceman-rachford"])
def test_mon_unroll_under_torch_func_grad(splitting: str) -> None:
    """``torch.func.grad`` over the inputs (accepted for ``backward="unroll"``) failed with the
    same RuntimeError; it now equals ``torch.autograd.grad`` of the same unrolled loop.  The
    same float64 operations in the same order on one machine: 1e-12 relative is only slack."""
    m = lower(models.mon(n=4, d=2, seed=1, splitting=splitting)).torch_module(
        dtype=T64, backward="unroll", unroll_steps=50)
    x = torch.randn(2, 2, dtype=T64, generator=_gen(0))
    g = torch.func.grad(lambda x: (m(x) ** 2).sum())(x)
    xs = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad((m(xs) ** 2).sum(), xs)
    assert float(ref.abs().max()) > 1e-3
    assert torch.allclose(g, ref, rtol=1e-12, atol=0.0)


# ---------------------------------------------------------------------------- third order
# The implicit backward's second-order (tangent) solve was ``@once_differentiable``, which ties
# its outputs only to the incoming gradient: their dependence on (z*, g, θ) was dropped and a
# third derivative came out silently wrong (this MON layer: 1558.5 against 4657.6 by central
# differences; the dense OptEq layer of test_training: -0.281 against -0.504).  It is now a
# typed refusal at the third backward; backward="unroll" gives third derivatives.
def _third(m: torch.nn.Module, x0: torch.Tensor, d: torch.Tensor) -> tuple[float, float]:
    """``∇³ℓ[d, d, ·]·d`` by autograd and by central differences of the second-order autograd
    ``∇_x ||∇_x ℓ||²`` (h = 1e-5), ``ℓ = Σ z*(x)³``."""

    def second(x0: torch.Tensor, create_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        (g,) = torch.autograd.grad((m(x) ** 3).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad((g ** 2).sum(), x, create_graph=create_graph)
        return x, h

    x, h = second(x0, True)
    (t,) = torch.autograd.grad((h * d).sum(), x)
    e = 1e-5
    fd = ((second(x0 + e * d, False)[1] - second(x0 - e * d, False)[1]) * d).sum() / (2 * e)
    return float((t * d).sum()), float(fd)


def test_third_order_through_implicit_is_a_typed_refusal() -> None:
    m = lower(models.mon(n=4, d=2, seed=1)).torch_module(**TIGHT)
    x0 = torch.randn(2, 2, dtype=T64, generator=_gen(0))
    with pytest.raises(OptionError, match="third- and higher-order") as err:
        _third(m, x0, torch.randn(2, 2, dtype=T64, generator=_gen(1)))
    assert "backward='unroll'" in err.value.hint and "'implicit'" not in err.value.hint
    # create_graph=True in the second backward without a third one still gives the exact
    # second order (the refusal is lazy): the second derivative without it, up to the order of
    # floating-point accumulation in the recorded backward (measured 9e-14 relative; float64
    # solves at 1e-13 bound any solver-path difference to ~1e-12, so 1e-9 holds on any BLAS)
    outs = []
    for cg in (False, True):
        x = x0.clone().requires_grad_()
        (g,) = torch.autograd.grad((m(x) ** 3).sum(), x, create_graph=True)
        outs.append(torch.autograd.grad((g ** 2).sum(), x, create_graph=cg)[0].detach())
    assert float(outs[0].abs().max()) > 1.0
    assert float((outs[0] - outs[1]).abs().max()) <= 1e-9 * float(outs[0].abs().max())


def test_third_order_through_unroll_matches_finite_differences() -> None:
    """What the refusal points to.  PR contracts fast on this layer: 300 unrolled steps reach
    the equilibrium to rounding; measured agreement 3e-11 relative (h² truncation plus
    1e-16/h² rounding of the second-order values), 1e-6 leaves four orders on any BLAS."""
    m = lower(models.mon(n=4, d=2, seed=1, splitting="peaceman-rachford")).torch_module(
        dtype=T64, backward="unroll", unroll_steps=300)
    x0 = torch.randn(2, 2, dtype=T64, generator=_gen(0))
    ad, fd = _third(m, x0, torch.randn(2, 2, dtype=T64, generator=_gen(1)))
    assert abs(fd) > 1.0
    assert abs(ad - fd) <= 1e-6 * abs(fd)
