"""Evaluation plans (``lowering/plan.py``): ``T`` specialised to fixed inputs and weights must be
``T`` — the same values, the same transpose Jacobian, the same gradients — and the solvers'
cheap per-iteration residual must never decide a ``converged`` flag on its own."""

from __future__ import annotations

import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq import models
from lowering import plan as pl
from lowering.plan import PlanContext, Root
from lowering.solvers import Tracker, get_solver

T64 = torch.float64


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


def _module(obj: ce.Objective, **kw: object) -> lowering.module.EquilibriumModule:
    return lowering.lower(obj).torch_module(dtype=T64, tol=1e-11, max_iter=2000,
                                            backward_tol=1e-11, backward_max_iter=2000, **kw)


def _inputs(mod: torch.nn.Module, batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(batch, s.size, dtype=T64, generator=g) for s in mod.input_syms}


def _plan_of(mod: torch.nn.Module, x: dict[str, torch.Tensor]) -> Root:
    env = mod.env()
    node = mod.derived.nodes[mod.blocks[0].name]
    p = node.plan(PlanContext(mod.blocks[0].name, x, env, next(iter(x.values())).shape[0]))
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
    assert mod._plan(list(x), list(mod.env()), tensors, z0) is None
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


# ----------------------------------------------------------------------------- the tracker
@pytest.mark.parametrize("scale", [1e20, 1e30, 1e-22, 1e-25])
def test_float32_extreme_scales_never_converge_falsely(scale: float) -> None:
    """float32 iterates with entries ~``scale`` and a true relative residual of 1e-3: plain
    float32 norms overflow (1e20²) or underflow (1e-22²) there, yet the returned flag must say
    "not converged" and the reported residual must be the exact 1e-3 (float64 norms)."""
    n = 50
    fz = torch.full((2, n), scale, dtype=torch.float32)
    z = fz.clone()
    z[:, 0] -= 1e-3 * scale * n ** 0.5  # ||fz − z|| / ||fz|| = 1e-3 (up to float32 rounding)
    tr = Tracker("t", z, 1e-6)
    assert not tr.record(z, fz)
    st = tr.stats()
    assert not bool(st.converged.any())
    exact = (fz.double() - z.double()).norm(dim=1) / fz.double().norm(dim=1)
    # the reported residual is the float64 one of the same float32 vectors: equal to 1e-6
    assert torch.allclose(st.final_residual.double(), exact, rtol=1e-6)


def test_a_false_plain_convergence_is_confirmed_away() -> None:
    """A fixed-point map whose iterates sit at 1e20 in float32: the plain norm of f(z)
    overflows to inf, so the plain residual reads 0 ("converged") at the first step; the exact
    confirmation disagrees and the solve goes on, measuring exactly, to the true fixed point."""
    target = torch.full((1, 8), 1e20, dtype=torch.float32)

    def f(z: torch.Tensor) -> torch.Tensor:
        return 0.5 * z + 0.5 * target  # contraction 0.5 towards target

    z0 = torch.full((1, 8), 3e20, dtype=torch.float32)
    z, st = get_solver("plain")(f, z0, tol=1e-6, max_iter=100)
    assert bool(st.converged.all()) and st.residuals.shape[1] > 5
    assert float((z - target).abs().max() / 1e20) < 1e-5


@pytest.mark.parametrize("norm,expect", [(0.5, "plain"), (0.97, "plain→anderson")])
def test_auto_solver_keeps_plain_when_fast_and_switches_when_slow(norm: float,
                                                                  expect: str) -> None:
    """``solver="auto"`` on a linear map ``z ↦ Mz + q``, ``M`` symmetric with eigenvalues in
    ``[0, norm]``: plain iteration when it contracts fast (0.5: ~30 iterations to 1e-9); plain
    continued by Anderson when the observed rate predicts too many (0.97: ~680); either way the
    result meets the tolerance."""
    g = torch.Generator().manual_seed(0)
    a = torch.linalg.qr(torch.randn(16, 16, dtype=T64, generator=g))[0]
    m = a @ torch.diag(torch.linspace(0, norm, 16, dtype=T64)) @ a.T
    q = torch.randn(4, 16, dtype=T64, generator=g)

    def f(z: torch.Tensor) -> torch.Tensor:
        return z @ m.T + q

    z, st = get_solver("auto")(f, torch.zeros(4, 16, dtype=T64), tol=1e-9, max_iter=500)
    assert st.solver == expect and bool(st.converged.all())
    exact = torch.linalg.solve(torch.eye(16, dtype=T64) - m, q.T).T
    # relative residual 1e-9 with ||(I − M)⁻¹|| ≤ 1/(1 − norm) ≤ 34: error ≤ 4e-8 relative
    assert torch.allclose(z, exact, rtol=1e-6, atol=1e-8)


def test_auto_uses_anderson_on_large_states() -> None:
    """States of ``AUTO_ANDERSON_STATE`` entries or more run Anderson from the start."""
    from lowering.solvers import AUTO_ANDERSON_STATE

    n = AUTO_ANDERSON_STATE
    q = torch.randn(2, n, dtype=T64, generator=torch.Generator().manual_seed(1))
    _, st = get_solver("auto")(lambda z: 0.5 * z + q, torch.zeros(2, n, dtype=T64), tol=1e-9)
    assert st.solver == "anderson" and bool(st.converged.all())
