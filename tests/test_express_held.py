"""The express call's held-tensor backward (lowering/backward.py ``_PlannedFixedPoint``,
posed by lowering/module.py ``_express``): the plan's state-free tensors ``(c, M)`` are the
autograd inputs and ``σ'`` at ``z*`` is read from the solver's last image.  It must give the
gradients the leaf-copy path gives (forced by a ``_plan_held`` that finds no plan), at every
order the implicit backward supports, in every failure mode; the derivative read from the image
must be the one read from the pre-activation (a broken rule makes that test fail)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.activations.relu import ReLU
from convex_eq.errors import ConvergenceWarning, OptionError
from lowering import plan as pl

F64 = torch.float64


def _module(m: int = 64, dtype: torch.dtype = F64, **kw):
    layer = lowering.lower(qp_objective(qp_weight(m, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-11, max_iter=500, backward_tol=1e-11,
                backward_max_iter=500, dtype=dtype)
    opts.update(kw)
    return layer.torch_module(**opts)


def _run(mod, x: torch.Tensor, c: torch.Tensor, held: bool) -> tuple[torch.Tensor, ...]:
    """Output and gradients (input, then every parameter) of ``Σ c ⊙ z``; ``held=False``
    forces the leaf-copy path."""
    if held:
        mod.__dict__.pop("_plan_held", None)
    else:  # the leaf-copy path: no plan posed on its held tensors
        mod._plan_held = lambda *a: None
    mod.zero_grad()
    xx = x.detach().clone().requires_grad_()
    z = mod(xx)
    is_held = type(z.grad_fn).__name__ == "_PlannedFixedPointBackward"
    assert is_held is held, z.grad_fn
    (z * c).sum().backward()
    return (z.detach(), xx.grad,
            *[p.grad.clone() for p in mod.parameters() if p.requires_grad])


def _data(b: int, n: int = 64, seed: int = 0, dtype: torch.dtype = F64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, generator=g, dtype=dtype),
            torch.randn(b, n, generator=g, dtype=dtype))


# --------------------------------------------------------------------------- first order
@pytest.mark.parametrize("b", [32, 100])
def test_held_gradients_equal_the_leaf_path(b: int) -> None:
    """Same point, same input and weight gradients as the leaf-copy path.  Tolerance 1e-12
    relative (float64): both evaluate the same closed forms, the weight's by autograd through
    ``M = WᵀW`` in one backward pass or in a second one; only the order of floating-point sums
    can differ (≈ 1e-16 per operation, amplified by at most 1/(1 − 0.81) through the adjoint)."""
    mod = _module()
    x, c = _data(b)
    fast, slow = _run(mod, x, c, True), _run(mod, x, c, False)
    for a, s in zip(fast, slow):
        assert torch.allclose(a, s, rtol=1e-12, atol=1e-14)


def test_held_gradients_match_finite_differences() -> None:
    """gradcheck of the input and the weight (float64, solves at 1e-12: the implicit gradient
    of an unconverged point would differ from central differences by far more than atol)."""
    mod = _module(m=64, tol=1e-12, backward_tol=1e-12)
    w = mod.weights["W"]
    x, _ = _data(3, seed=1)
    x.requires_grad_()

    def f(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(mod, {"weights.W": ww}, (xx,))
        assert type(out.grad_fn).__name__ == "_PlannedFixedPointBackward"
        return out

    assert torch.autograd.gradcheck(f, (x, w.detach().clone().requires_grad_()), atol=1e-7,
                                    rtol=1e-6)


def test_weight_control_and_float32_equal_the_leaf_path() -> None:
    """With weight control (the controlled W is built with autograd from the raw one) and in
    float32.  Tolerance 1e-5 relative: float32 round-off (6e-8) through the same closed forms,
    amplified by the adjoint's 1/(1 − ρ) ≤ 10 and by ~64-term sums."""
    mod = _module(dtype=torch.float32, tol=1e-6, backward_tol=1e-6,
                  weight_control="spectral_norm")
    x, c = _data(32, dtype=torch.float32)
    fast, slow = _run(mod, x, c, True), _run(mod, x, c, False)
    for a, s in zip(fast, slow):
        assert torch.allclose(a, s, rtol=1e-5, atol=1e-6)


def test_only_the_input_needs_a_gradient() -> None:
    """Frozen weights: M needs no gradient, the input's gradient is still the leaf path's."""
    mod = _module().requires_grad_(False)
    x, c = _data(40, seed=2)
    fast, slow = _run(mod, x, c, True), _run(mod, x, c, False)
    assert torch.allclose(fast[1], slow[1], rtol=1e-12, atol=1e-14)


# -------------------------------------------------------------------------- higher order
def test_held_second_order_matches_gradgradcheck() -> None:
    """create_graph=True differentiates the plan's evaluation T(z, c, M) implicitly."""
    mod = _module(m=64, tol=1e-12, backward_tol=1e-12)
    x, _ = _data(3, seed=3)
    x.requires_grad_()

    def f(xx: torch.Tensor) -> torch.Tensor:
        out = mod(xx)
        assert type(out.grad_fn).__name__ == "_PlannedFixedPointBackward"
        return out

    assert torch.autograd.gradgradcheck(f, (x,), atol=1e-6, rtol=1e-5)


def test_held_second_order_equals_the_leaf_path() -> None:
    """A Hessian-vector product through the weights: the same on both paths (float64, 1e-10:
    two implicit solves at 1e-11 and the same closed forms)."""
    mod = _module(tol=1e-12, backward_tol=1e-12)
    x, c = _data(8, seed=4)
    out = []
    for held in (True, False):
        if not held:
            mod._plan_held = lambda *a: None
        xx = x.detach().clone().requires_grad_()
        z = mod(xx)
        (gx,) = torch.autograd.grad((z * c).sum(), xx, create_graph=True)
        w = mod.weights["W"]
        (hw,) = torch.autograd.grad((gx * c).sum(), w)
        out.append(hw)
    assert torch.allclose(out[0], out[1], rtol=1e-10, atol=1e-12)


def test_third_order_is_refused_on_the_held_path() -> None:
    mod = _module()
    x, _ = _data(3, seed=5)
    x.requires_grad_()
    z = mod(x)
    assert type(z.grad_fn).__name__ == "_PlannedFixedPointBackward"
    (g,) = torch.autograd.grad(z.sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x, create_graph=True)
    with pytest.raises(OptionError, match="third"):
        torch.autograd.grad(h.sum(), x)


# ------------------------------------------------------------------------ failure modes
def test_mask_mode_adjoint_failure_equals_the_leaf_path() -> None:
    """An adjoint that cannot converge in 3 iterations: in mask mode the warning names the
    samples and their rows leave the gradient, as on the leaf path."""
    mod = _module(on_nonconvergence="mask", backward_max_iter=3)
    x, c = _data(32, seed=6)
    res = []
    for held in (True, False):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            res.append(_run(mod, x, c, held))
        msgs = [str(m.message) for m in w if issubclass(m.category, ConvergenceWarning)]
        assert any("left out of the gradient" in m for m in msgs), msgs
    for a, s in zip(*res):
        assert torch.allclose(a, s, rtol=1e-12, atol=1e-14)


def test_unconverged_forward_takes_the_judged_path() -> None:
    """A forward that does not converge is judged as on every path (warn: the warning, and
    gradients through the general backward)."""
    mod = _module(on_nonconvergence="warn", max_iter=3)
    x, c = _data(8, seed=7)
    xx = x.clone().requires_grad_()
    with pytest.warns(ConvergenceWarning, match="did not reach"):
        z = mod(xx)
    assert type(z.grad_fn).__name__ != "_PlannedFixedPointBackward"
    (z * c).sum().backward()
    assert torch.isfinite(xx.grad).all()


def test_the_image_is_not_kept() -> None:
    """The solver's image is dropped after use: not in last_stats, not in a pickle."""
    mod = _module()
    x, c = _data(16, seed=8)
    _run(mod, x, c, True)
    for st in (mod.last_stats, mod.last_backward_stats):
        assert st.image is None and "image" not in st.__dict__
    assert "image" not in pickle.loads(pickle.dumps(mod.last_stats)).__dict__


# --------------------------------------------------------------- σ' read from the image
def _relu_plan(b: int, dtype: torch.dtype, of_value) -> tuple[pl.AffineElementwise, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    c = torch.randn(b, 8, generator=g, dtype=dtype)
    c[0] = 0.0  # pre-activations exactly 0 at z = 0: σ'(0) = 0, where 1[u ≥ 0] would say 1
    m = torch.randn(8, 8, generator=g, dtype=dtype)
    inner = pl.Sum([(1.0, pl.Constant(c)), (1.0, pl.Matrix(m))])
    act = ReLU()
    plan = pl.elementwise(act.torch_sigma, inner, act.sigma_prime, f_inplace=torch.relu_,
                          df_of_value=of_value)
    assert isinstance(plan, pl.AffineElementwise)
    return plan, c


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_derivative_from_the_image_is_the_pre_activation_derivative(dtype: torch.dtype
                                                                    ) -> None:
    """``1[σ(p) > 0]`` read from the solver's image is ``σ'(p)`` exactly, kinks included."""
    plan, c = _relu_plan(6, dtype, ReLU().sigma_prime_of_sigma)
    for z in (torch.zeros_like(c), torch.randn(c.shape, dtype=dtype)):
        image = plan.fn(z)
        _, d_image = plan.linearize_at(z, image)
        _, d_pre = plan.linearize_at(z, None)
        assert torch.equal(d_image, d_pre)


def test_derivative_from_the_image_mutation() -> None:
    """A rule that reads ``1[u ≥ 0]`` fails the test above (it can fail)."""
    plan, c = _relu_plan(6, F64, lambda u: (u >= 0).to(u.dtype))
    z = torch.zeros_like(c)
    _, d_image = plan.linearize_at(z, plan.fn(z))
    _, d_pre = plan.linearize_at(z, None)
    assert not torch.equal(d_image, d_pre)


def test_a_relu_subclass_with_its_own_sigma_reads_no_image() -> None:
    """A subclass that redefines σ gets no value rule (its σ' need not follow from σ)."""

    class Shifted(ReLU):
        def sigma(self, t):  # type: ignore[no-untyped-def]
            return torch.relu(t) + 1.0

    assert ReLU().sigma_prime_of_sigma is not None
    assert Shifted().sigma_prime_of_sigma is None
