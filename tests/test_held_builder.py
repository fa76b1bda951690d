"""The express call's re-planner (lowering/nodes.py ``Node.held_builder``, used by
lowering/module.py ``_plan_held``): after the first call has planned ``σ(c + zM)`` by the
general path, later calls rebuild that plan from the node tree's builder.  The builder must give
the very plan the general path gives (same tensors from the same operations: outputs and
gradients bit for bit), step aside wherever the general path would build another form, and a
builder that disagrees must never be used (a deliberately broken one is refused)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
from convex_eq.models import opteq
from convex_eq.symbols import Scalar
from lowering import plan as pl
from lowering.module import _checked_builder
from lowering.plan import PlanContext

F32, F64 = torch.float32, torch.float64


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
        assert type(z.grad_fn).__name__ == "_PlannedFixedPointBackward"


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
    plan = mod.derived.nodes["z"].plan(ctx)
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
