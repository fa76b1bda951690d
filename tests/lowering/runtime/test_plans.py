"""Evaluation plans (``lowering/plan.py``): ``T`` specialised to fixed inputs and weights must be
``T`` — the same values, the same transpose Jacobian, the same gradients, also at a kink and for
operators without weights — and each check is shown to fail on a broken plan.  The plan's fused
forms (in-place activation on ``c + zM``, ``plus_fn``, Root's broadcast) compute what the unfused
ones compute."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import convex_eq as ce
import lowering
from convex_eq import L1, Input, Linear, Objective, Potential, Scalar, SqNorm, State, Weight, models
from convex_eq.models import deep_opteq, opteq, spectral_weight
from lowering import nodes
from lowering.runtime.backward.implicit import param_grads
from lowering.runtime.call import plan_layer
from lowering.runtime.guards import inputs_of
from lowering.runtime.plan import PLANNERS, PlanContext, Root, plan_of
from lowering.runtime.plan import plans as pl
from tests.lowering.runtime.helpers import qp_module_64

T64 = F64 = torch.float64


def _l1_layer() -> ce.Objective:
    base = models.opteq(n=8, m=8, d=4, seed=1)
    return base + 0.05 * ce.L1(base.states[0])


#: objectives whose one-block layer plans (canonical, tanh, conjugate form, deep OptEq through
#: Substitute/Named/Combo, an ℓ1 prox after the gradient step, a learnable coefficient)
PLANNED = {
    "opteq-relu": lambda: models.opteq(n=8, m=12, d=4, seed=0),
    "opteq-tanh": lambda: models.opteq(n=8, m=6, d=4, activation="tanh", seed=1),
    "opteq-conjugate": lambda: models.opteq(n=8, m=8, d=4, form="conjugate", seed=2),
    "deep-opteq": lambda: models.deep_opteq(L=2, n=6, m=6, d=3, seed=3),
    "opteq-l1": _l1_layer,
    "opteq-conv": lambda: models.opteq(conv=(2, 3), image=(1, 5, 5), seed=4),
}


#: layers without a plan (the node tree and autograd are used): Gaussian kernel, MON's
#: resolvent, two blocks
UNPLANNED = {"geq": lambda: models.geq(n=6, p=6, d=3), "mon": lambda: models.mon(n=6, d=3),
             "mopteq": lambda: models.mopteq()}


def _module(obj: ce.Objective, **kw: object) -> lowering.runtime.module.EquilibriumModule:
    return lowering.lower(obj).torch_module(dtype=T64, tol=1e-11, max_iter=2000,
                                            backward_tol=1e-11, backward_max_iter=2000, **kw)


def _inputs(mod: torch.nn.Module, batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(batch, s.size, dtype=T64, generator=g) for s in mod.input_syms}


def _plan_of(mod: torch.nn.Module, x: dict[str, torch.Tensor]) -> Root:
    env = mod.env()
    node = mod.derived.nodes[mod.blocks[0].name]
    p = plan_of(node, PlanContext(mod.blocks[0].name, x, env, next(iter(x.values())).shape[0]))
    assert p is not None
    return Root(p)


def _plan_errors(mod: torch.nn.Module, seed: int) -> tuple[float, float]:
    """Largest relative differences, at random states, between the plan and ``T`` (values) and
    between the plan's ``Jᵀv`` and autograd's vector–Jacobian product of ``T``."""
    x = _inputs(mod, 5, seed)
    g = torch.Generator().manual_seed(seed + 100)
    z = torch.randn(5, mod.state_size, dtype=T64, generator=g)
    v = torch.randn(5, mod.state_size, dtype=T64, generator=g)
    with torch.no_grad():
        root = _plan_of(mod, x)
        env = mod.env()
        t_tree = mod.T(z, x, env)
        t_plan = root(z)
        _, jt = root.linearize(z)
        jtv = jt(v)
        jtv_plus = jt.plus(v, z)  # the fused adjoint step Jᵀv + b
        blocks = jt.blocks(v)  # per-sample matrices of the direct adjoint (None: map only)
        jtv_blocks = None if blocks is None else (blocks @ v[..., None])[..., 0]
    zz = z.clone().requires_grad_()
    ref = torch.autograd.grad(mod.T(zz, x, env), zz, v)[0]
    val = float((t_plan - t_tree).norm() / t_tree.norm())
    lin = max(float((jtv - ref).norm() / ref.norm()),
              float((jtv_plus - ref - z).norm() / (ref + z).norm()),
              0.0 if jtv_blocks is None else float((jtv_blocks - ref).norm() / ref.norm()))
    return val, lin


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_plan_is_T_and_its_transpose_jacobian(name: str) -> None:
    """At random states (float64): the plan's value equals the node tree's ``T`` and its ``Jᵀv``
    equals autograd's VJP of ``T``; both are the same formulas up to summation order, so 1e-12
    relative is round-off with a wide margin (observed ≤ 1e-15)."""
    mod = _module(PLANNED[name]())
    val, lin = _plan_errors(mod, seed=7)
    assert val <= 1e-12 and lin <= 1e-12, (val, lin)


def test_the_direct_adjoint_blocks_are_formed_for_the_canonical_layer() -> None:
    """The canonical layer's ``Jᵀ`` gives its per-sample blocks (what ``backward_adjoint``'s
    direct solve uses), so the block check above is exercised, not skipped."""
    mod = _module(PLANNED["opteq-relu"]())
    x = _inputs(mod, 2, seed=1)
    with torch.no_grad():
        _, jt = _plan_of(mod, x).linearize(torch.zeros(2, mod.state_size, dtype=T64))
    assert jt is not None and jt.blocks(torch.zeros(2, mod.state_size, dtype=T64)) is not None


def test_wrong_blocks_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block check can fail: blocks missing the diagonal factor σ'(p) are O(1) off."""
    monkeypatch.setattr(pl.DiagonalThenT, "blocks", lambda self, like: self.inner.blocks(like))
    mod = _module(PLANNED["opteq-relu"]())
    _, lin = _plan_errors(mod, seed=7)
    assert lin > 1e-2, lin


def test_a_wrong_elementwise_derivative_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with σ' replaced by 1 (a plausible slip) the Jᵀ error is O(1)."""
    for cls in (pl.Elementwise, pl.AffineElementwise):  # (the nested and the flat form)
        def broken(self, f, inner, df=None, *args, _orig=cls.__init__, **kw):
            _orig(self, f, inner, lambda p: torch.ones_like(p), *args, **kw)

        monkeypatch.setattr(cls, "__init__", broken)
    mod = _module(PLANNED["opteq-relu"]())
    _, lin = _plan_errors(mod, seed=7)
    assert lin > 1e-2, lin


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_planned_gradients_equal_the_general_path(name: str) -> None:
    """First-order gradients (weights and inputs) of the planned layer equal those of the same
    module evaluated by its node tree with autograd VJPs: both solve the same linear systems to
    1e-11 relative (contraction ≤ 0.99: errors ≤ 1e-9), so 1e-7 is a safe bound."""
    mod = _module(PLANNED[name]())
    x0 = _inputs(mod, 4, seed=3)
    grads = []
    for plannable in (True, False):
        mod._plannable = plannable
        mod.zero_grad()
        x = {k: v.clone().requires_grad_() for k, v in x0.items()}
        out = mod(x)
        (out.sin() * torch.arange(out.numel(), dtype=T64).reshape(out.shape)).sum().backward()
        grads.append([p.grad.clone() for p in mod.parameters() if p.grad is not None]
                     + [v.grad.clone() for v in x.values()])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-9), float((a - b).abs().max())


@pytest.mark.parametrize("name", sorted(UNPLANNED))
def test_layers_without_a_plan_use_the_node_tree(name: str) -> None:
    """No plan (a Gaussian kernel term, a resolvent node, two blocks): the module says so and
    still solves and differentiates (the general path)."""
    mod = lowering.lower(UNPLANNED[name]()).torch_module(dtype=T64)
    x = _inputs(mod, 3, seed=1)
    tensors = [*x.values(), *mod.env().values()]
    z0 = torch.zeros(3, mod.state_size, dtype=T64)
    assert plan_layer(mod, list(x), list(mod.env()), tensors, z0) is None
    out = mod(x)
    out = out if isinstance(out, torch.Tensor) else torch.cat([o.flatten(1) for o in out], 1)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in mod.parameters() if p.grad is not None)


def test_second_backward_through_a_planned_layer() -> None:
    """``retain_graph=True`` then a second backward gives the same gradient again (the plan's
    state-free parts keep their graph)."""
    mod = _module(PLANNED["opteq-relu"]())
    x = _inputs(mod, 3, seed=2)
    out = mod(x).pow(2).sum()
    out.backward(retain_graph=True)
    g1 = mod.weights["W"].grad.clone()
    out.backward()
    # the same computation twice: the accumulated gradient is exactly twice (up to round-off)
    assert torch.allclose(mod.weights["W"].grad, 2 * g1, rtol=1e-12, atol=0)


# ------------------------------------------------------------------ plan against node tree
#: plan vs node tree in float64: the two evaluate the same formulas in a different association
#: order (a Gram matrix ``AᵀA z`` against ``Aᵀ(Az)``, a folded constant against a sum), a
#: relative difference of a few ulps times the size (≤ 1e-14 for these n ≤ 32); 1e-10 leaves
#: four orders of magnitude for any BLAS blocking, while the broken plans below miss by O(1)
PLAN_TOL = 1e-10


def _w(name: str, shape: tuple[int, ...], s: float = 0.3) -> Weight:
    rng = np.random.default_rng(sum(map(ord, name)))
    return Weight(name, shape, s * rng.standard_normal(shape))


def _opteq_plus(extra: Callable[[State, Input], list[Any]], act: str = "tanh",
                learn_linear: bool = False) -> Objective:
    z, x = State("z", 6), Input("x", 3)
    q = _w("U", (6, 3), 0.5) @ x + _w("b", (6,), 0.1)
    lin = Linear(q, z)
    if learn_linear:
        lin = Scalar("s", 0.8, low=0.0, learnable=True) * lin
    w = spectral_weight("W", (6, 6), 0.6, 0)
    return Objective([Potential(ce.get_activation(act), z), SqNorm(z), -lin, -SqNorm(w @ z),
                      *extra(z, x)])


def _lasso(learn: bool) -> Objective:
    z, x = State("z", 6), Input("x", 8)
    lam = Scalar("lam", 0.1, low=0.0, learnable=True) if learn else 0.1
    return Objective([lam * L1(z), SqNorm(_w("A", (8, 6)) @ z - x)])


#: one objective per planned node kind and composition: Sigma over a Gram matrix, an
#: ElementwiseGrad (conjugate form), Substitute/Combo (deep, learnable α), conv operators,
#: Prox(L1) with a learnable level, several Gram / offset / elementwise-gradient terms
CASES: dict[str, Callable[[], Any]] = {
    "opteq-relu": lambda: opteq(n=6, m=6, d=3),
    "opteq-softplus": lambda: opteq(n=6, m=6, d=3, activation="softplus"),
    "opteq-conj-tanh": lambda: opteq(n=6, m=5, d=3, activation="tanh", form="conjugate"),
    "deep3-learnable-alpha": lambda: deep_opteq(
        L=3, n=6, m=5, d=3, activation="tanh",
        alpha=Scalar("alpha", 0.5, low=0.05, high=1.0, learnable=True)),
    "conv-opteq": lambda: opteq(conv=(2, 3), image=(1, 4, 4), activation="tanh"),
    "conv-deep": lambda: deep_opteq(L=2, conv=(2, 3), image=(1, 4, 4), activation="sigmoid"),
    "lasso-learnable-l1": lambda: _lasso(True),
    "learnable-linear": lambda: _opteq_plus(lambda z, x: [], learn_linear=True),
    "two-gram-offset": lambda: _opteq_plus(lambda z, x: [
        -0.2 * SqNorm(spectral_weight("W2", (6, 6), 0.5, 3) @ z + _w("c", (6,)))]),
    "wide-input-offset": lambda: _opteq_plus(lambda z, x: [
        -0.1 * SqNorm(spectral_weight("W4", (3, 6), 0.5, 4) @ z - _w("U5", (3, 3)) @ x)]),
    "antiderivative-extra": lambda: _opteq_plus(lambda z, x: [
        -0.2 * ce.Antiderivative(ce.get_activation("softplus"),
                                 spectral_weight("W6", (5, 6), 0.5, 5) @ z
                                 + _w("U6", (5, 3)) @ x)]),
    "l1-and-linear": lambda: _opteq_plus(lambda z, x: [
        0.05 * L1(z), -0.3 * Linear(_w("c2", (6,)), z)]),
}


@functools.cache
def _case_module(name: str) -> torch.nn.Module:
    return lowering.lower(CASES[name]()).torch_module(dtype=F64)


def _plan_vs_tree(module: Any, x: torch.Tensor, z: torch.Tensor, v: torch.Tensor
                  ) -> dict[str, float]:
    """Relative differences plan − tree of ``T(z)``, ``Jᵀv`` and ``(∂T/∂θ)ᵀv`` per tensor
    (inf where the plan has no gradient and the tree a non-zero one)."""
    inputs, env = inputs_of(module, x), module.env()
    keys_in, keys_env = list(inputs), list(env)
    tensors = [inputs[k] for k in keys_in] + [env[k] for k in keys_env]
    with torch.enable_grad():
        planned = plan_layer(module, keys_in, keys_env, tensors, torch.zeros_like(z))
    assert planned is not None, "this layer is expected to have a plan"
    root, leaves = planned
    n_in = len(keys_in)
    ls = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    zz = z.clone().requires_grad_()
    with torch.enable_grad():
        fz = module.T(zz, dict(zip(keys_in, ls[:n_in])), dict(zip(keys_env, ls[n_in:])))
        want = [t for t in ls if t.requires_grad]
        ref = torch.autograd.grad(fz, [zz, *want], v, allow_unused=True)
        out, jt = root.linearize(z)
        mine = [t for t in leaves if t.requires_grad]
        got = (torch.autograd.grad(out, mine, v, allow_unused=True, retain_graph=True)
               if out.requires_grad
               else [None] * len(mine))
    # the backward's own route: closed-form cotangents of the plan's tensors (param_vjp),
    # autograd only from those to the leaves
    got_pv = param_grads(root, z, v, mine, [True] * len(mine))
    with torch.no_grad():
        value = root(z)

    def rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
        b = torch.zeros_like(a) if b is None else b
        if a is None:
            return 0.0 if float(b.abs().max()) == 0.0 else float("inf")
        return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)

    with torch.no_grad():
        jtv = torch.zeros_like(v) if jt is None else jt(v)
    res = {"T": rel(value, fz.detach()), "linearize": rel(out.detach(), fz.detach()),
           "JTv": rel(jtv, ref[0])}
    names = [k for k, t in zip(keys_in + keys_env, ls) if t.requires_grad]
    res.update({f"d/d{n}": rel(a, b) for n, a, b in zip(names, got, ref[1:])})
    res.update({f"param_vjp d/d{n}": rel(a, b) for n, a, b in zip(names, got_pv, ref[1:])})
    return res


def _check(name: str, seed: int, scale: float) -> None:
    module = _case_module(name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, module.input_syms[0].size, dtype=F64, generator=g)
    z = scale * torch.randn(3, module.state_size, dtype=F64, generator=g)
    v = torch.randn(3, module.state_size, dtype=F64, generator=g)
    res = _plan_vs_tree(module, x, z, v)
    bad = {k: e for k, e in res.items() if not e <= PLAN_TOL}
    assert not bad, (name, bad)


@pytest.mark.parametrize("name", list(CASES))
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 4.0]))
def test_plan_equals_node_tree(name: str, seed: int, scale: float) -> None:
    """Values, ``Jᵀv`` and the weight/input/scalar gradients of the plan are the tree's."""
    _check(name, seed, scale)


def _broken_sigma_plan(self: Any, ctx: pl.PlanContext) -> Any:
    inner = plan_of(self.inner, ctx)
    return None if inner is None else pl.Elementwise(self.act.sigma, inner, torch.ones_like)


def _broken_constant_linearize(self: Any, z: torch.Tensor) -> Any:
    return self.c.detach(), None  # the injection's gradient (U, b, x) silently dropped


_AFFINE_PARAM_VJP = pl.AffineElementwise.param_vjp  # (the unpatched rule)


def _broken_affine_param_vjp(self: Any, z: torch.Tensor, g: torch.Tensor) -> Any:
    # the flat σ(c + zM) form: the injection's pair silently dropped (the Gram's kept)
    return [(t, ct) for t, ct in _AFFINE_PARAM_VJP(self, z, g) if t is not self.c]


@pytest.mark.parametrize("patch,case", [
    ((PLANNERS, nodes.Sigma, _broken_sigma_plan), "opteq-softplus"),
    # the backward's route for σ(c + zM): the flat form (the nested one, Constant.param_vjp,
    # is reached by none of these cases: their other nested sums have no closed form here)
    ((pl.AffineElementwise, "param_vjp", _broken_affine_param_vjp), "opteq-softplus"),
    # the canonical pre-activation is one fused addmm (Sum's fast path, no Constant.linearize):
    # the cut graph is seen where the constant is linearised on its own (an extra term)
    ((pl.Constant, "linearize", _broken_constant_linearize), "antiderivative-extra")],
    ids=["sigma-prime-one", "param-vjp-dropped", "constant-detached"])
def test_equivalence_check_catches_a_broken_plan(patch: tuple, case: str,
                                                 monkeypatch: Any) -> None:
    """The check above can fail: σ' replaced by 1, or the injection's gradient cut."""
    where, attr, fn = patch
    if isinstance(where, dict):  # a planner of the node-type table
        monkeypatch.setitem(where, attr, fn)
    else:
        monkeypatch.setattr(where, attr, fn)
    with pytest.raises(AssertionError):
        _check(case, 0, 1.0)


def _kink_layer() -> Any:
    z, x = State("z", 3), Input("x", 3)
    u = Weight("U", (3, 3), np.eye(3))
    w = Weight("W", (3, 3), 0.5 * np.eye(3))
    return lowering.lower(Objective([Potential(ce.get_activation("hardtanh"), z), SqNorm(z),
                                     -Linear(u @ x, z), -SqNorm(w @ z)]))


def test_hardtanh_kink_gradient_same_with_and_without_plan() -> None:
    """``z = hardtanh(x + z/4)`` at ``x = 0.75``: the pre-activation is exactly 1 (all values
    are dyadic, so exact in any BLAS).  The plan takes ``σ'(1) = 0`` in ``Jᵀ`` but autograd's
    ``clamp'(1) = 1`` in ``∂T/∂x`` would give dz/dx = 1, neither one-sided derivative
    (0, 4/3): the planned and the unplanned gradient must agree.  Solves at 1e-12: gradients
    agree to ~1e-11; the pinned miss is 1/3.

    Pins: the plan mixed ``σ'(1) = 0`` and autograd's ``clamp'(1) = 1`` (dz/dx = 1 against the
    tree's 4/3)."""
    grads = []
    for plannable in (True, False):
        m = _kink_layer().torch_module(dtype=F64, weight_control=None, tol=1e-12,
                                       backward_tol=1e-12)
        m._plannable = plannable
        x = torch.tensor([[0.75, 0.3, -0.75]], dtype=F64, requires_grad=True)
        m(x).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("with_weight", [True, False], ids=["with-W", "no-weights"])
def test_gram_term_of_a_parameter_free_operator(with_weight: bool) -> None:
    """``½||P z||²`` with a permutation ``P`` (no weight symbol): the plan's Gram matrix needs a
    dtype and device without one (with and without another term that has a weight).  Plan vs
    tree forward: both solve to 1e-12 with the same iterates up to rounding; 1e-10 covers it."""
    z, x = State("z", 6), Input("x", 6)
    terms = [Potential(ce.get_activation("tanh"), z), SqNorm(z), -Linear(x, z),
             -0.3 * SqNorm(ce.CyclicPermutation([3, 3]) @ z)]
    if with_weight:
        terms.append(-SqNorm(spectral_weight("W", (6, 6), 0.5, 0) @ z))
    layer = lowering.lower(Objective(terms))
    xs = torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    outs = []
    for plannable in (True, False):
        m = layer.torch_module(dtype=F64, weight_control=None, tol=1e-12)
        m._plannable = plannable
        with torch.no_grad():
            outs.append(m(xs))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)


def test_fast_affine_sum_keeps_a_trained_coefficient_equal_to_one() -> None:
    """``Sum([(1, Constant q), (c, Matrix M)])`` with ``c`` a trained scalar tensor equal to 1
    (a learnable scalar declared 1.0 with ``low=0`` maps back to exactly 1.0): ``∂/∂c`` from
    ``param_grads`` is ``<v, zM>``.  Tolerance: ``<v, zM>`` of 3×4 float64 tensors, two
    association orders, ~1e-15 relative; 1e-10 covers any BLAS.

    Pins: the fused ``addmm`` path (``_affine_matrix_fast``) took the 0-d tensor ``c == 1`` for
    the number 1 and dropped ``c``: ``∂/∂c`` came back None where ``<v, zM>`` ≈ −5.6."""
    g = torch.Generator().manual_seed(0)
    q, m, z, v = (torch.randn(*s, dtype=F64, generator=g) for s in [(3, 4), (4, 4), (3, 4),
                                                                     (3, 4)])
    c = torch.tensor(1.0, dtype=F64, requires_grad=True)
    root = pl.Root(pl.Sum([(1.0, pl.Constant(q)), (c, pl.Matrix(m))]))
    (gc,) = param_grads(root, z, v, [c], [True])
    assert gc is not None, "the coefficient's gradient was dropped"
    torch.testing.assert_close(gc, (v * (z @ m)).sum(), rtol=1e-10, atol=0)


def test_first_order_backward_needs_no_value_from_the_linearisation() -> None:
    """``linearize(z, value=False)`` gives the same ``Jᵀ`` as with the value (which it may
    skip computing), on the canonical plan."""
    mod = qp_module_64()
    q = torch.randn(4, 64, dtype=torch.float64)
    z = torch.relu(torch.randn(4, 64, dtype=torch.float64))
    inputs, env = inputs_of(mod, q), mod.env()
    keys_in, keys_env = list(inputs), list(env)
    tensors = [inputs[k] for k in keys_in] + [env[k] for k in keys_env]
    root, _ = plan_layer(mod, keys_in, keys_env, tensors, z)
    out, jt = root.linearize(z)
    none, jt2 = root.linearize(z, value=False)
    assert out is not None and none is None
    v = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(jt2(v), jt(v), rtol=0, atol=0)


# ------------------------------------------------------------------ fused forms
def _fused(c: torch.Tensor, m: torch.Tensor) -> pl.Sum:
    return pl.Sum([(1.0, pl.Constant(c)), (1.0, pl.Matrix(m))])


def test_in_place_activation_only_on_a_fresh_pre_activation() -> None:
    """``relu_`` is applied to the fused ``c + zM`` (a new tensor each call): ``z``, ``c`` and
    ``M`` are unchanged and the value is ``relu(c + zM)``.  On an inner value that may alias
    ``z`` (the identity) the out-of-place ``relu`` is kept."""
    g = torch.Generator().manual_seed(0)
    z, c, m = (torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g),
               torch.randn(6, 6, generator=g))
    z0, c0, m0 = z.clone(), c.clone(), m.clone()
    fused = pl.Elementwise(torch.relu, _fused(c, m), f_inplace=torch.relu_)
    out = fused.fn(z)
    assert torch.equal(out, torch.relu(torch.addmm(c0, z0, m0)))  # same kernel: bitwise
    assert torch.equal(z, z0) and torch.equal(c, c0) and torch.equal(m, m0)
    ident = pl.Elementwise(torch.relu, pl.Identity(), f_inplace=torch.relu_)
    out = ident.fn(z)
    assert torch.equal(z, z0) and out is not z


def test_in_place_activation_keeps_gradients() -> None:
    """Under autograd the in-place ``relu_`` on the fused pre-activation gives the gradient of
    the out-of-place form (the pre-activation is not needed by ``addmm``'s backward)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    m = torch.randn(5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    fused = pl.Elementwise(torch.relu, _fused(c, m), f_inplace=torch.relu_)
    a = torch.autograd.grad(fused.fn(z).sum(), (z, c, m))
    b = torch.autograd.grad(torch.relu(c + z @ m).sum(), (z, c, m))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_root_broadcasts_a_batch_independent_value() -> None:
    """Only the fused ``c + zM`` (and an elementwise map of it) is batch-shaped; a plan whose
    value is ``(1, N)`` keeps Root's broadcast."""
    c = torch.randn(1, 5)
    root = pl.Root(pl.Elementwise(torch.relu, pl.Constant(c)))
    z = torch.zeros(4, 5)
    out = root.fn(z)
    assert out.shape == (4, 5) and torch.equal(out, torch.relu(c).expand(4, 5))
    fused = pl.Root(pl.Elementwise(torch.relu, pl.Sum([(1.0, pl.Constant(c)),
                                                       (1.0, pl.Matrix(torch.eye(5)))]),
                                   f_inplace=torch.relu_))
    assert fused.fn(z).shape == (4, 5)


@pytest.mark.parametrize("b_shape", [(4, 5), (1, 5), (5,)])
def test_plus_fn_equals_plus(b_shape: tuple[int, ...]) -> None:
    """``plus_fn(b)(v) == plus(v, b)`` for a matrix, a
    diagonal-then-matrix, a nested diagonal, and a composition, with ``b`` batched, shared
    ``(1, N)`` or 1-D (the 1-D case takes the unfused fallback).  float64; the fused and the
    unfused forms are the same ``addmm`` or a product-then-add of the same numbers (≤ a few
    ulps apart: 1e-12 relative is safe on any BLAS)."""
    g = torch.Generator().manual_seed(2)
    mt = torch.randn(5, 5, generator=g, dtype=torch.float64)
    d1, d2 = (torch.rand(4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    b = torch.randn(b_shape, generator=g, dtype=torch.float64)
    v = torch.randn(4, 5, generator=g, dtype=torch.float64)
    m = pl.MatrixT(mt)
    for t in (m, pl.DiagonalThenT(d1, m), pl.DiagonalThenT(d2, pl.DiagonalThenT(d1, m)),
              pl.ComposeT(m, pl.DiagonalThenT(d1, m))):
        ref = t(v) + b
        got = t.plus_fn(b)(v)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
        ref_s = t(d2 * v) + b
        assert torch.allclose(t.scaled_plus_fn(d2, b)(v), ref_s, rtol=1e-12, atol=1e-12)


def test_in_place_activation_follows_an_overridden_sigma(monkeypatch: pytest.MonkeyPatch) -> None:
    """An activation derived from ``ReLU`` that overrides ``sigma`` and ``torch_sigma`` (here
    ``min(max(t, 0), 1)``) but not ``torch_sigma_``: the plan evaluates the activation's own
    ``σ`` on the fused ``c + zM`` (ReLU offers ``torch.relu_`` only where a subclass keeps its σ).

    Pins: the subclass inherited ``torch.relu_`` and the planned ``T`` applied a plain ReLU — a
    different map, whose fixed point the solver reported as converged."""
    from convex_eq.activations.relu import ReLU
    from lowering.nodes import Sigma

    class ClippedReLU(ReLU):
        name = "clipped_relu_test"

        @property
        def torch_sigma(self):  # type: ignore[no-untyped-def]
            return lambda t: torch.clamp(t, 0.0, 1.0)

        def sigma(self, t):  # type: ignore[no-untyped-def]
            return torch.clamp(torch.as_tensor(t), 0.0, 1.0)

    g = torch.Generator().manual_seed(0)
    c, m = 3 * torch.randn(4, 6, generator=g), torch.randn(6, 6, generator=g)
    fused = pl.Sum([(1.0, pl.Constant(c)), (1.0, pl.Matrix(m))])

    class Inner:  # a node whose plan is the fused c + zM
        pass

    monkeypatch.setitem(PLANNERS, Inner, lambda node, ctx: fused)
    act = ClippedReLU()
    plan = plan_of(Sigma(act, Inner()), None)  # type: ignore[arg-type]
    z = torch.randn(4, 6, generator=g)
    assert torch.equal(plan.fn(z), act.sigma(torch.addmm(c, z, m)))
