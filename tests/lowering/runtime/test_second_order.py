"""Second- and higher-order gradients through the emitted module (lowering/backward.py): the
implicit backward's second order (``create_graph=True``) against gradgradcheck, central
differences and the unrolled iteration, for dense, monotone-operator (splitting), convolutional
and saddle layers; third order refused on the implicit path and exact through ``unroll``; second
order through weight control exact where it can be, refused where it cannot; masked adjoint rows
stay constants."""

from __future__ import annotations

import warnings

import pytest
import torch

from convex_eq import L1, Dense, Input, Linear, Potential, SqNorm, State, Weight, models
from convex_eq.errors import OptionError
from convex_eq.inclusion import Saddle
from lowering import lower
from lowering.runtime.backward import AdjointConfig, FixedPointProblem
from lowering.runtime.backward.second_order import AdjointSolve as _AdjointSolve
from tests.lowering.runtime.helpers import controlled_layer, gen, qp_module, small_dense

T64 = F64 = torch.float64
SPLITTINGS = ("forward-backward", "peaceman-rachford", "douglas-rachford")
# float64, forward and adjoint solves at 1e-13 (Anderson converges in tens of iterations on
# these margin-0.5 layers)
TIGHT = dict(dtype=T64, solver="anderson", tol=1e-13, max_iter=5000, backward_tol=1e-13)


@pytest.mark.parametrize("backward", ["implicit", "unroll"])
def test_gradgradcheck(backward):
    """Second-order autograd through the layer (inputs and W), float64, tight solves."""
    d = small_dense()
    kw = {"unroll_steps": 30} if backward == "unroll" else {"backward_tol": 1e-13}
    m = d.torch_module(dtype=T64, tol=1e-13, max_iter=500, backward=backward,
                       weight_control=None, **kw)
    x = torch.randn(2, 2, dtype=T64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    W = m.weights["W"]

    def fn(x, W):
        return _call_with_w(m, x, W)

    assert torch.autograd.gradcheck(fn, (x, W), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradgradcheck(fn, (x, W), eps=1e-6, atol=1e-6)


def _call_with_w(m, x, W):
    """The module with W replaced by a (differentiable) tensor, weight control off."""
    orig = m.env

    def env():
        e = orig()
        e["W"] = W
        return e

    m.env = env
    try:
        return m(x)
    finally:
        del m.env


def test_double_backward_is_not_zero_and_matches_unrolled():
    """A gradient penalty's gradient through the implicit backward equals the one of a long
    unrolled (contractive) iteration, and is not zero.

    Pins: grad(grad(...)) through the implicit backward was silently 0."""
    d = small_dense(seed=3)
    outs = {}
    for mode, kw in (("implicit", {"backward_tol": 1e-13}), ("unroll", {"unroll_steps": 200})):
        m = d.torch_module(dtype=T64, tol=1e-13, max_iter=500, backward=mode,
                           weight_control=None, **kw)
        x = torch.randn(3, 2, dtype=T64, generator=torch.Generator().manual_seed(5),
                        requires_grad=True)
        z = m(x)
        (gx,) = torch.autograd.grad(z.pow(2).sum(), x, create_graph=True)
        penalty = gx.pow(2).sum()
        (gw,) = torch.autograd.grad(penalty, m.weights["W"])
        outs[mode] = gw
    assert float(outs["implicit"].abs().max()) > 1e-3
    assert torch.allclose(outs["implicit"], outs["unroll"], rtol=1e-8, atol=1e-10)


def test_second_order_differentiates_the_adjoint() -> None:
    """``create_graph=True`` takes the second-order path (not the plan's linearisation):
    the gradient of a gradient penalty is not zero and matches central differences of the
    first-order gradient (float64, tol 1e-13, so the solves' own error, ~1e-13, is far below
    the differences' truncation error h² = 1e-10 and round-off 1e-16/h = 1e-11)."""
    mod = qp_module(m=16, tol=1e-13, backward_tol=1e-13, max_iter=2000, backward_max_iter=2000)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=g, dtype=torch.float64, requires_grad=True)

    def penalty(xx: torch.Tensor) -> torch.Tensor:
        (gx,) = torch.autograd.grad((mod(xx) ** 2).sum(), xx, create_graph=True)
        return (gx ** 2).sum()

    (hx,) = torch.autograd.grad(penalty(x), x)
    assert float(hx.abs().max()) > 0
    h = 1e-5
    e = torch.zeros_like(x)
    e[1, 5] = h
    fd = (penalty((x + e).detach().requires_grad_()) -
          penalty((x - e).detach().requires_grad_())) / (2 * h)
    assert abs(float(fd) - float(hx[1, 5])) <= 1e-6 * max(1.0, abs(float(fd)))


# ------------------------------------------------------------------ monotone-operator layers
def _with_weight(m: torch.nn.Module, x: torch.Tensor, name: str, w: torch.Tensor) -> torch.Tensor:
    """The module with weight ``name`` replaced by the (differentiable) tensor ``w``."""
    return torch.func.functional_call(m, {f"weights.{name}": w}, (x,))


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # a saddle layer returns (z, w)


def _hvp_and_fd(m: torch.nn.Module, x: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
    """``d/dW ⟨∂ℓ/∂W, D⟩`` by second-order autograd and by central differences (h = 1e-5) of
    the first-order gradient, ``ℓ = ||c ⊙ z*(x; W)||²``."""
    w = m.weights[name]
    c = torch.randn(_first(m(x)).shape, dtype=T64, generator=gen(4))
    d = torch.randn(w.shape, dtype=T64, generator=gen(3))

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
    """gradgradcheck through a MON layer (inputs and A), every splitting.  float64 with solves
    at 1e-13: eps = 1e-6 differences carry O(eps²) truncation and ~1e-13/eps = 1e-7 solve noise
    on O(1)–O(10) entries, far inside atol 1e-6 + rtol 1e-3 (the settings of the dense-layer
    gradgradcheck above), on any BLAS.

    Pins: the second-order path takes ``(∂T/∂θ)ᵀg`` by ``torch.func.vjp`` over the weights, and
    the splitting's step sizes were computed there with ``.numpy()`` from functorch wrappers:
    an untyped "Cannot access data pointer of Tensor that doesn't have storage"."""
    m = lower(models.mon(n=4, d=2, seed=1, splitting=splitting)).torch_module(**TIGHT)
    x = torch.randn(2, 2, dtype=T64, generator=gen(0), requires_grad=True)
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
    x = torch.randn(2, 3, dtype=T64, generator=gen(0))
    hvp, fd = _hvp_and_fd(m, x, "B")
    assert float(fd.abs().max()) > 1.0  # not a vacuous comparison of zeros
    assert float((hvp - fd).abs().max()) <= 1e-6 * float(fd.abs().max())


def test_conv_mon_and_saddle_second_order() -> None:
    """The conv MON layer (Peaceman–Rachford's cached LU of I + αM is re-factorised under
    autograd) and the Chambolle–Pock saddle layer (τ, σ from ||K||₂): Hessian-vector products
    against central differences.  Tolerance as above: measured ~5e-9 relative against a bound
    of 1e-6."""
    m = lower(models.mon(conv=(2, 3), image=(1, 6))).torch_module(**TIGHT)
    x = torch.randn(2, 1, 6, dtype=T64, generator=gen(0))
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
    x = torch.randn(2, 3, dtype=T64, generator=gen(0))
    hvp, fd = _hvp_and_fd(m, x, "K")
    assert float(fd.abs().max()) > 0.1  # (0.78 here)
    assert float((hvp - fd).abs().max()) <= 1e-6 * float(fd.abs().max())


def test_step_cache_unaffected_by_second_order() -> None:
    """A second-order backward leaves no stale steps behind: the no-grad forward after it
    equals the one before (same weights, same solve: bitwise equal)."""
    m = lower(models.mon(n=4, d=2, seed=1)).torch_module(**TIGHT)
    x = torch.randn(2, 2, dtype=T64, generator=gen(0), requires_grad=True)
    with torch.no_grad():
        before = m(x)
    (gx,) = torch.autograd.grad((m(x) ** 2).sum(), x, create_graph=True)
    torch.autograd.grad((gx ** 2).sum(), m.weights["A"])
    with torch.no_grad():
        after = m(x)
    assert torch.equal(before, after)


# ------------------------------------------------------------------ third order
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
    """The implicit backward's tangent solve ties its outputs to the incoming gradient only, so
    a third backward is refused with a typed error pointing to ``backward='unroll'``; asking
    ``create_graph=True`` without a third backward still gives the exact second order.

    Pins: a third derivative came out silently wrong (this MON layer: 1558.5 against 4657.6
    by central differences)."""
    m = lower(models.mon(n=4, d=2, seed=1)).torch_module(**TIGHT)
    x0 = torch.randn(2, 2, dtype=T64, generator=gen(0))
    with pytest.raises(OptionError, match="third- and higher-order") as err:
        _third(m, x0, torch.randn(2, 2, dtype=T64, generator=gen(1)))
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
    x0 = torch.randn(2, 2, dtype=T64, generator=gen(0))
    ad, fd = _third(m, x0, torch.randn(2, 2, dtype=T64, generator=gen(1)))
    assert abs(fd) > 1.0
    assert abs(ad - fd) <= 1e-6 * abs(fd)


# ------------------------------------------------------------------ through weight control
def _directional_fd(fn, p: torch.Tensor, d: torch.Tensor, h: float = 1e-5) -> torch.Tensor:
    with torch.no_grad():
        p += h * d
    plus = fn().detach()
    with torch.no_grad():
        p -= 2 * h * d
    minus = fn().detach()
    with torch.no_grad():
        p += h * d
    return (plus - minus) / (2 * h)


def test_hessian_through_active_weight_control_is_refused() -> None:
    """Weight control's norm ``σ = uᵀAv`` holds the singular pair fixed: exact in value and
    first derivative, not in a second derivative w.r.t. a rescaled weight, which is refused
    while the rescaling is active; first order is unaffected.

    Pins: a Hessian-vector product w.r.t. W came out 4 % off, silently."""
    m, x, c = controlled_layer(1.3)  # ||W||₂ = 1.3 > 1: the layer uses W·0.99/1.3
    w = m.weights["W"]
    with pytest.raises(OptionError, match="second-order gradients through the weight control"):
        (g,) = torch.autograd.grad((m(x) * c).sum(), w, create_graph=True)
        torch.autograd.grad(g.sum(), w)
    (g1,) = torch.autograd.grad((m(x) * c).sum(), w)  # first order: unaffected
    assert torch.isfinite(g1).all()


@pytest.mark.parametrize("norm", [0.8, 1.3])
def test_second_order_that_is_exact_still_runs(norm: float) -> None:
    """Exact second-order paths against central differences of first-order gradients
    (float64, solves at 1e-13; h = 1e-5 gives O(h²) ≈ 1e-10 plus 1e-13/h ≈ 1e-8 relative:
    1e-6 is a hundred times that): a gradient penalty ``||∂ℓ/∂x||²`` differentiated w.r.t. the
    rescaled W (only the scale's first derivative enters), and, with the rescaling inactive
    (``||W||₂ = 0.8``), the Hessian-vector product w.r.t. W itself."""
    m, x, c = controlled_layer(norm)
    w = m.weights["W"]
    d = torch.randn(6, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    xs = x.clone().requires_grad_()

    def penalty() -> torch.Tensor:
        (gx,) = torch.autograd.grad((m(xs) * c).sum(), xs, create_graph=True)
        return (gx ** 2).sum()

    (gw,) = torch.autograd.grad(penalty(), w)
    fd = _directional_fd(penalty, w, d)
    assert abs(float((gw * d).sum()) - float(fd)) <= 1e-6 * abs(float(fd))
    if norm > 1:
        return

    def grad_w() -> torch.Tensor:
        return torch.autograd.grad((m(x) * c).sum(), w, create_graph=True)[0]

    (hvp,) = torch.autograd.grad((grad_w() * d).sum(), w)
    fd = _directional_fd(grad_w, w, d)
    assert float((hvp - fd).abs().max()) <= 1e-6 * float(fd.abs().max())


def test_second_order_of_a_masked_adjoint_row_is_zero() -> None:
    """Under on_nonconvergence='mask' the adjoint solve ``g = Jᵀg + v`` returns zero rows for
    the samples whose solve failed: those rows are constants, so the second-order backward
    gives them a zero derivative, and the converged sample its tangent solution.

    ``T(z) = Wz`` with ``W = [[0.1, 0], [1, 0.95]]``: sample 0's ``v`` is the eigenvector of
    ``Wᵀ`` for 0.95 (the 20 plain iterations leave a relative residual ~1e-2 ≫ 1e-10: it
    fails), sample 1's is that for 0.1 (converges); both tangents ``u`` are the eigenvector of
    ``W`` for 0.1 (converge).

    Pins: the failed rows got the tangent solution ``(I − J)⁻¹u`` (the tangent solve masked
    only its own failures): a gradient penalty received a gradient through rows that had left
    the gradient."""
    w = torch.tensor([[0.1, 0.0], [1.0, 0.95]], dtype=F64, requires_grad=True)
    cfg = AdjointConfig("plain", 1e-10, 20, "mask", "iterative", True)
    problem = FixedPointProblem(lambda z, ts: z @ ts[0].T, [w], cfg, lambda st: None)
    z = torch.zeros(2, 2, dtype=F64)
    v = torch.tensor([[1.0, 0.85], [1.0, 0.0]], dtype=F64, requires_grad=True)
    u = torch.tensor([[0.85, -1.0], [0.85, -1.0]], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the mask mode's warning naming sample 0)
        g = _AdjointSolve.apply(v, z, problem, w)
        gv, = torch.autograd.grad(g, v, u)
    assert float(g[0].abs().max()) == 0.0
    assert float(gv[0].abs().max()) == 0.0  # a constant row: exactly zero
    # the converged sample: h = (I − W)⁻¹u = u / 0.9; its plain tangent iteration contracts by
    # 0.1 per step to relative residual 1e-10, so h is within ~1e-11 relative of that on any
    # BLAS (2×2 products, float64); 1e-9 leaves a wide margin
    assert float((gv[1] - u[1] / 0.9).abs().max()) <= 1e-9
