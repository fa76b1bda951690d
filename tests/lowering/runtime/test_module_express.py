"""The module's express call (lowering/runtime/express.py ``express_call``): the common call
(one flat dense input of the module's dtype) skips the general path's bookkeeping and must give
its output, gradients and statistics.

Its held-tensor backward (lowering/backward.py ``_PlannedFixedPoint``): the plan's state-free
tensors ``(c, M)`` are the autograd inputs and ``σ'`` at ``z*`` is read from the solver's last
image.  It must give the gradients the leaf-copy path gives (forced by a ``plan_held`` that
finds no plan), at every order the implicit backward supports, in every failure mode; the
derivative read from the image must be the one read from the pre-activation (a broken rule makes
that test fail).

Its re-planner (the held builder of the node-type table, used by ``plan_held``): after the first
call has planned ``σ(c + zM)`` by the general path, later calls rebuild that plan from the node
tree's builder.  The builder must give the very plan the general path gives (same tensors from
the same operations: outputs and gradients bit for bit), step aside wherever the general path
would build another form, and a builder that disagrees must never be used (a deliberately broken
one is refused)."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import warnings
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

import lowering
import lowering.runtime.express as runtime_express
import lowering.runtime.module as runtime_module
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
from convex_eq.activations.relu import ReLU
from convex_eq.errors import ConvergenceWarning, OptionError
from convex_eq.models import opteq
from convex_eq.symbols import Scalar
from lowering.runtime.express import checked_builder as _checked_builder
from lowering.runtime.plan import PlanContext, plan_of
from lowering.runtime.plan import plans as pl
from tests.lowering.runtime.helpers import output_and_grads, qp_module

F32, F64 = torch.float32, torch.float64


# ------------------------------------------------------------------ the express call
def test_express_call_is_taken_and_equals_the_general_path(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The common call (one flat dense input of the module's dtype) takes the express path, and
    its output, gradients and statistics are bit-equal to the general path's (forced by
    reporting no express width): the same plan, solver and backward run in the same order."""
    mod = qp_module()
    taken = []
    express = runtime_module.express_call
    monkeypatch.setattr(runtime_module, "express_call",
                        lambda *a: taken.append(1) or express(*a))
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(5, 64, generator=g, dtype=torch.float64), torch.randn(
        5, 64, generator=g, dtype=torch.float64)
    fast = output_and_grads(mod, x, c)
    fast_stats = (mod.last_stats.residuals, mod.last_backward_stats.residuals)
    assert taken == [1]
    monkeypatch.setattr(runtime_module, "express_width", lambda m: -1)
    mod.zero_grad()
    slow = output_and_grads(mod, x, c)
    assert taken == [1]
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert torch.equal(fast_stats[0], mod.last_stats.residuals)
    assert torch.equal(fast_stats[1], mod.last_backward_stats.residuals)


# ------------------------------------------------------------------ the held-tensor backward
def _module(m: int = 64, dtype: torch.dtype = F64, **kw):
    layer = lowering.lower(qp_objective(qp_weight(m, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-11, max_iter=500, backward_tol=1e-11,
                backward_max_iter=500, dtype=dtype)
    opts.update(kw)
    return layer.torch_module(**opts)



@contextlib.contextmanager
def leaf_path(on: bool = True) -> Iterator[None]:
    """Within the block (when ``on``) the express call finds no held plan: the leaf-copy path."""
    if not on:
        yield
        return
    with mock.patch.object(runtime_express, "plan_held", lambda *a: None):
        yield

def _run(mod, x: torch.Tensor, c: torch.Tensor, held: bool) -> tuple[torch.Tensor, ...]:
    """Output and gradients (input, then every parameter) of ``Σ c ⊙ z``; ``held=False``
    forces the leaf-copy path."""
    mod.zero_grad()
    xx = x.detach().clone().requires_grad_()
    with leaf_path(not held):  # the leaf-copy path: no plan posed on its held tensors
        z = mod(xx)
    is_held = type(z.grad_fn).__name__ == "PlannedFixedPointBackward"
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
        assert type(out.grad_fn).__name__ == "PlannedFixedPointBackward"
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
        assert type(out.grad_fn).__name__ == "PlannedFixedPointBackward"
        return out

    assert torch.autograd.gradgradcheck(f, (x,), atol=1e-6, rtol=1e-5)


def test_held_second_order_equals_the_leaf_path() -> None:
    """A Hessian-vector product through the weights: the same on both paths (float64, 1e-10:
    two implicit solves at 1e-11 and the same closed forms)."""
    mod = _module(tol=1e-12, backward_tol=1e-12)
    x, c = _data(8, seed=4)
    out = []
    for held in (True, False):
        xx = x.detach().clone().requires_grad_()
        with leaf_path(not held):
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
    assert type(z.grad_fn).__name__ == "PlannedFixedPointBackward"
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
    assert type(z.grad_fn).__name__ != "PlannedFixedPointBackward"
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


# ------------------------------------------------------------------ the re-planner
def _pair(obj: Objective, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical modules of ``obj``; the second never uses a builder (the general path on
    every call: ``_held_builder = False`` is what a refused builder leaves)."""
    opts = dict(weight_control=None, tol=1e-6, max_iter=300, dtype=F32)
    opts.update(kw)
    layer = lowering.lower(obj)
    a, b = layer.torch_module(**opts), layer.torch_module(**opts)
    b.load_state_dict(a.state_dict())
    b.__dict__["_held_builder"] = False
    return a, b


def _step(mod: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
    mod.zero_grad()
    xx = x.detach().clone().requires_grad_()
    z = mod(xx)
    (z * c).sum().backward()
    return [z.detach(), xx.grad, *[p.grad.clone() for p in mod.parameters()
                                   if p.grad is not None]]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    # exact: the builder runs the same tensor operations as the general path (only the Python
    # around them differs), so any difference at all is a different computation
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("trained", [False, True])
def test_canonical_layer_rebuilds_the_same_plan(trained: bool) -> None:
    """The canonical ``relu(WᵀWz + q)`` with ``q`` the input itself: the builder is made on
    the first call and later calls give the general path's output and gradients exactly, with
    the weight frozen and trained."""
    a, b = _pair(qp_objective(qp_weight(64, norm=0.9, seed=0)))
    if not trained:
        a.requires_grad_(False)
        b.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for batch in (32, 7, 32):
        x, c = torch.randn(batch, 64, generator=g), torch.randn(batch, 64, generator=g)
        _equal(_step(a, x, c), _step(b, x, c))
        assert callable(a.__dict__["_held_builder"])
        z = a(x.clone().requires_grad_())
        assert type(z.grad_fn).__name__ == "PlannedFixedPointBackward"


def test_injection_through_weights_rebuilds_the_same_plan() -> None:
    """OptEq with ``q = Ux + b`` (an operator and a bias in the constant): the builder takes
    the general constant's evaluation; input and every weight gradient equal."""
    a, b = _pair(opteq(n=24, m=24, d=10, seed=1), dtype=F64, tol=1e-10)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, c = torch.randn(16, 10, generator=g, dtype=F64), torch.randn(16, 24, generator=g,
                                                                     dtype=F64)
        _equal(_step(a, x, c), _step(b, x, c))
    assert callable(a.__dict__["_held_builder"])


def test_builder_steps_aside_where_the_general_path_plans_otherwise() -> None:
    """Batch 1 with the weight trained: the Gram matrix does not pay (``n > 25·B``), the
    general path applies ``Aᵀ(A·)`` and the call takes the leaf-copy plan; the builder says
    None there and the module still gives the general path's result."""
    a, b = _pair(qp_objective(qp_weight(64, norm=0.9, seed=0)))
    g = torch.Generator().manual_seed(2)
    x, c = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    _equal(_step(a, x, c), _step(b, x, c))  # makes the builder
    build = a.__dict__["_held_builder"]
    assert callable(build)
    x1 = torch.randn(1, 64, generator=g, requires_grad=True)
    env = a.env()
    assert build({"q": x1}, env, torch.zeros(1, 64)) is None
    x1, c1 = x1.detach(), torch.randn(1, 64, generator=g)
    _equal(_step(a, x1, c1), _step(b, x1, c1))


def test_learnable_scalar_coefficient_has_no_builder() -> None:
    """A coefficient read from the weights on every call (a learnable scalar) is not a
    number the builder could fold: no builder, the general path on every call."""
    z, q = State("z", 8), Input("q", 8)
    w = Weight("W", (8, 8), qp_weight(8, d=8, norm=0.5, seed=3))
    s = Scalar("s", 0.5, low=0.1, high=0.9, learnable=True)
    obj = Objective([Potential("relu", z), SqNorm(z), -(s * Linear(q, z)), -SqNorm(w @ z)],
                    name="scalar")
    mod = lowering.lower(obj).torch_module(weight_control=None, dtype=F64)
    mod(torch.randn(4, 8, dtype=F64, requires_grad=True)).sum().backward()
    assert mod.__dict__["_held_builder"] is False  # (posed once, refused: the general path)


def test_a_builder_that_disagrees_is_refused() -> None:
    """``_checked_builder`` compares the rebuilt plan with the general one: a builder off by
    a factor in ``c`` or in ``M``, or with another activation, is refused (False)."""
    mod = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0))).torch_module(
        weight_control=None, dtype=F32)
    x = torch.randn(32, 64, requires_grad=True)
    mod(x).sum().backward()
    good = mod.__dict__["_held_builder"]
    assert callable(good)
    env, z0 = mod.env(), torch.zeros(32, 64)
    ctx = PlanContext("z", {"q": x}, env, 32, z0)
    plan = plan_of(mod.derived.nodes["z"], ctx)
    assert _checked_builder(good, plan, ctx) is good

    def scaled(fc: float, fm: float, f=None, f_=None):
        def build(values, env_, like):
            p = good(values, env_, like)
            return pl.AffineElementwise.fused(f or p.f, fc * p.c, fm * p.m, p.df,
                                              f_ or p.f_inplace, p.df_of_value)
        return build

    assert _checked_builder(scaled(1.0, 1.0), plan, ctx) is not False  # (the control)
    assert _checked_builder(scaled(1.0001, 1.0), plan, ctx) is False
    assert _checked_builder(scaled(1.0, 0.999), plan, ctx) is False
    assert _checked_builder(scaled(1.0, 1.0, torch.tanh), plan, ctx) is False
    assert _checked_builder(scaled(1.0, 1.0, None, torch.tanh_), plan, ctx) is False
    assert _checked_builder(lambda *a: None, plan, ctx) is False
    assert _checked_builder(None, plan, ctx) is False


def test_copies_and_pickles_make_their_own_builder() -> None:
    """The builder closes over the node tree: a deepcopy or a pickled module does not carry
    it (it is made again on the copy's first call) and computes the same results."""
    mod = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0))).torch_module(
        weight_control=None, dtype=F32)
    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    ref = _step(mod, x, c)
    _step(mod, x, c)
    assert callable(mod.__dict__["_held_builder"])
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    for other in (copy.deepcopy(mod), pickle.loads(pickle.dumps(mod)),
                  torch.load(buf, weights_only=False)):
        assert "_held_builder" not in other.__dict__
        _equal(_step(other, x, c), ref)
        assert callable(other.__dict__["_held_builder"])
        _equal(_step(other, x, c), ref)
