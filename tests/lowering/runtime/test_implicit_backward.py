"""The implicit backward (lowering/backward.py ``ImplicitBackward``, docs/theory.md §8): the
gradient through the equilibrium by the implicit function theorem, against finite differences,
a dense exact solve and the unrolled iteration; the backward's graph and memory; its failure
reports (raise, warn, mask) per batch sample; batch-coupled layers."""

from __future__ import annotations

import copy
import gc
import math
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.errors import ConvergenceError, ConvergenceWarning, OptionError
from convex_eq.models import opteq
from lowering.runtime import backward as bw
from lowering.runtime.guards import inputs_of
from lowering.runtime.parameters import raw_env
from tests.lowering.helpers import randn
from tests.lowering.runtime.helpers import (
    conv_layer,
    output_and_grads,
    qp_module,
    small_module,
    uneven_inputs,
    uneven_relu_layer,
)

T64 = F64 = torch.float64


def test_gradcheck_ift_and_unrolled_agreement() -> None:
    m = small_module(tol=1e-12, max_iter=500, backward_tol=1e-12)
    x = randn(3, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: m(t), (x,), atol=1e-6, rtol=1e-5)
    loss = lambda mod: (mod(x) ** 2).sum()  # noqa: E731
    g_ift = torch.autograd.grad(loss(m), list(m.parameters()))
    unr = small_module(backward="unroll", unroll_steps=400)
    unr.load_state_dict(m.state_dict())
    g_unr = torch.autograd.grad(loss(unr), list(unr.parameters()))
    for a, b in zip(g_ift, g_unr):
        # contraction 0.81: 400 unrolled steps are exact to ~1e-30; IFT solved to 1e-12
        assert float((a - b).norm() / b.norm()) < 1e-8
    one = small_module(backward="phantom", phantom_steps=1, tol=1e-12)
    one.load_state_dict(m.state_dict())
    g_one = torch.autograd.grad(loss(one), list(one.parameters()))
    dev = max(float((a - b).norm() / b.norm()) for a, b in zip(g_one, g_ift))
    print(f"one-step (phantom k=1) gradient relative deviation from IFT: {dev:.3e}")
    assert 0 < dev < 1.0  # an approximation, not the exact gradient


def test_implicit_gradient_matches_dense_exact_solve_during_training():
    """At 5 points of a training run (float32 module, tol 1e-5) the module's gradient of the
    loss w.r.t. W equals the exact implicit gradient computed here: z* re-solved in float64,
    J = ∂T/∂z dense, g = (I − Jᵀ)⁻¹ ∂ℓ/∂z, dℓ/dW = (∂T/∂W)ᵀ g.  Bound 10·tol: both sides
    stop at relative residual tol (the error of g is ≤ tol·||g||/(1 − ||J||), ||J|| ≤ 0.99
    under weight control, measured ≤ 3·tol here); float32 round-off (1e-7) is far below."""
    tol = 1e-5
    d = conv_layer(channels=3, image=(1, 5, 5))
    torch.manual_seed(0)
    m = d.torch_module(dtype=torch.float32, tol=tol, max_iter=300)
    head = nn.Linear(m.state_size, 3)
    opt = torch.optim.Adam([*m.parameters(), *head.parameters()], lr=3e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 1, 5, 5, generator=g)
    y = torch.randint(0, 3, (24,), generator=g)
    for step in range(25):
        loss = nn.functional.cross_entropy(head(m(x).reshape(24, -1)), y)
        opt.zero_grad()
        loss.backward()
        if step % 6 == 0:
            got = m.weights["W"].grad.double()
            want = _exact_implicit_grad(m, head, x, y)
            err = float((got - want).norm() / want.norm())
            assert err <= 10 * tol, (step, err)
        opt.step()


def _exact_implicit_grad(m, head, x, y) -> torch.Tensor:
    mm = copy.deepcopy(m).double()
    hh = copy.deepcopy(head).double()
    with torch.no_grad():
        z = mm(x.double()).reshape(x.shape[0], -1)
    inputs = inputs_of(mm, x.double())
    w = mm.weights["W"].detach().clone().requires_grad_()
    n = z.shape[1]
    grads = torch.zeros_like(w)
    for i in range(x.shape[0]):
        zi = z[i:i + 1].clone().requires_grad_()
        loss = nn.functional.cross_entropy(hh(zi), y[i:i + 1], reduction="sum") / x.shape[0]
        v = torch.autograd.grad(loss, zi)[0][0]
        xi = {k: t[i:i + 1] for k, t in inputs.items()}

        def t_of(zz, ww, xi=xi):
            env = dict(raw_env(mm))
            env["W"] = ww
            env = mm.weight_control(mm, env) if mm.weight_control is not None else env
            return mm.T(zz[None], xi, env)[0]

        J = torch.autograd.functional.jacobian(lambda zz: t_of(zz, w.detach()), zi[0].detach())
        gvec = torch.linalg.solve(torch.eye(n, dtype=T64) - J.T, v)
        fz = t_of(zi[0].detach(), w)
        grads += torch.autograd.grad(fz, w, gvec)[0]
    return grads


def test_planned_gradient_matches_finite_differences() -> None:
    """An independent check of the gradient with respect to the input: central differences of
    the solved layer in float64 (tol 1e-13, so the solve's own error, ~1e-13, is far below
    the differences' truncation error ~h² = 1e-10 and round-off ~1e-16/h = 1e-11)."""
    mod = qp_module(tol=1e-13, backward_tol=1e-13, max_iter=2000, backward_max_iter=2000)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g, dtype=torch.float64)
    c = torch.randn(3, 64, generator=g, dtype=torch.float64)
    _, gx, _ = output_and_grads(mod, x, c)
    h = 1e-5
    with torch.no_grad():
        for i, j in ((0, 0), (1, 17), (2, 63)):
            e = torch.zeros_like(x)
            e[i, j] = h
            fd = ((mod(x + e) * c).sum() - (mod(x - e) * c).sum()) / (2 * h)
            assert abs(float(fd) - float(gx[i, j])) <= 1e-7 * max(1.0, abs(float(fd)))


def test_inplace_change_of_the_output_fails_the_backward() -> None:
    """The backward linearises at an alias of its saved output, which it unpacks first:
    changing the output in place before backward raises (as torch's contract says) instead of
    giving a gradient for a point the output no longer is."""
    mod = qp_module(m=16, dtype=torch.float32, tol=1e-5, backward_tol=1e-5)
    x = torch.randn(4, 64, requires_grad=True)
    z = mod(x)
    z.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_two_backwards_through_one_forward_agree() -> None:
    """``retain_graph=True``: a second backward through the same forward gives the same
    gradient (exactly: the same operations on the same tensors)."""
    mod = qp_module(m=16, dtype=torch.float32, tol=1e-6, backward_tol=1e-6)
    x = torch.randn(40, 64, requires_grad=True)
    z = mod(x)
    (g1,) = torch.autograd.grad(z.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(g1, g2)


def _module(m: int = 128, dtype: torch.dtype = torch.float64, **kw: object):
    layer = lowering.lower(qp_objective(qp_weight(m, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-8, max_iter=300, backward_tol=1e-8,
                backward_max_iter=300, dtype=dtype)
    opts.update(kw)
    return layer.torch_module(**opts)


@pytest.fixture
def problems(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every ``FixedPointProblem`` the implicit backward attaches."""
    seen: list[weakref.ref] = []
    orig = bw.ImplicitBackward.attach

    def attach(self, problem, *args, **kw):
        seen.append(weakref.ref(problem))
        return orig(self, problem, *args, **kw)

    monkeypatch.setattr(bw.ImplicitBackward, "attach", attach)
    return seen


@pytest.fixture
def no_cyclic_gc():
    """Reference counting only: what a cycle keeps alive stays alive (restored afterwards)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("batch", [1, 40])  # 1: the direct adjoint; 40: the iterative one
@pytest.mark.parametrize("backward", [False, True])
def test_output_and_problem_freed_without_the_cyclic_collector(
        batch: int, backward: bool, problems: list, no_cyclic_gc: None) -> None:
    """With the cyclic collector off, dropping the output (after a backward or without one)
    frees it and the backward's problem at once (reference counts reach zero: no cycle).

    Pins: the plan's linearisation held the output tensor itself, whose ``grad_fn`` holds the
    problem: a cycle that kept the whole graph alive until the cyclic collector ran."""
    mod = _module()
    x = torch.randn(batch, 64, dtype=torch.float64, requires_grad=True)
    z = mod(x)
    assert problems and problems[-1]() is not None
    out = weakref.ref(z)
    if backward:
        z.sum().backward()
    del z
    assert out() is None, "the output is kept alive by a reference cycle"
    assert problems[-1]() is None, "the backward's problem is kept alive by a reference cycle"


@pytest.mark.parametrize("adjoint", ["iterative", "auto"])
def test_an_unconverged_adjoint_is_reported(adjoint: str) -> None:
    """``_report`` trusts ``all_converged`` only as a shortcut: an adjoint solve cut off after
    3 iterations (ρ(J) ≈ 0.97, far from tol) raises, with the samples named."""
    layer = lowering.lower(qp_objective(qp_weight(16, d=8, norm=0.97)))
    mod = layer.torch_module(weight_control=None, dtype=torch.float64, tol=1e-6,
                             backward_adjoint=adjoint, backward_max_iter=3)
    q = torch.randn(4, 8, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64).requires_grad_()
    z = mod(q)
    with pytest.raises(ConvergenceError, match="adjoint fixed point did not reach"):
        torch.autograd.grad((z * torch.arange(z.numel()).reshape(z.shape)).sum(), q,
                            create_graph=adjoint == "auto")


@pytest.mark.parametrize("create_graph", [False, True])
def test_mask_mode_backward_when_every_sample_failed(create_graph: bool) -> None:
    """on_nonconvergence='mask' with every sample of the batch unconverged: the forward returns
    all-NaN rows as documented, and the backward gives the masked samples no gradient (an
    exact zero), as the direct adjoint and a batch with one surviving sample do.

    Pins: the iterative adjoint ran on the empty (0, N) batch and died in ``Tracker.record``
    with a bare RuntimeError ("max(): Expected reduction dim ...")."""
    layer = lowering.lower(qp_objective(qp_weight(16, d=8, norm=0.97)))
    mod = layer.torch_module(weight_control=None, solver="plain", tol=1e-6, max_iter=6,
                             on_nonconvergence="mask", backward_adjoint="iterative")
    q = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z, st = mod(q, return_stats=True)
    assert not bool(st.converged.any()) and bool(z.isnan().all())
    (gq,) = torch.autograd.grad(z.nan_to_num().sum(), q, create_graph=create_graph)
    assert torch.equal(gq, torch.zeros_like(gq))
    assert not math.isnan(float(gq.detach().sum()))


def _adjoint_fails_alone(layer, state: dict, x: torch.Tensor, opts: dict) -> bool:
    """Whether sample ``x`` (one row) fails its adjoint solve when run alone (raise mode).
    Plain iteration treats samples independently and each flag describes that sample's own
    returned iterate, so a sample fails alone exactly when it fails inside a batch."""
    m = layer.torch_module(**{**opts, "on_nonconvergence": "raise"})
    m.load_state_dict(state)
    xi = x.clone().requires_grad_()
    try:
        m(xi).sum().backward()
    except ConvergenceError:
        return True
    return False


@pytest.mark.parametrize("drop", ["nan_input", "forward_failure"])
def test_masked_backward_names_batch_samples(drop: str) -> None:
    """With samples masked out, the adjoint failure warning names the batch indices of the
    samples whose adjoint fails (the same set as each sample's backward run alone), and
    ``last_backward_stats`` covers the whole batch: converged exactly where the sample's
    adjoint converges alone, not converged (NaN residual) for the masked samples.

    Pins: the adjoint's statistics and its warning indexed the remaining rows, not the batch:
    fewer entries than the batch, and the wrong samples named (row 0 for batch sample 1)."""
    layer = uneven_relu_layer()
    x = uneven_inputs()
    opts = dict(dtype=F64, solver="plain", tol=1e-8,
                max_iter=500 if drop == "nan_input" else 30,
                backward_adjoint="iterative", backward_solver="plain", backward_max_iter=3)
    if drop == "nan_input":
        x[0] = float("nan")
    m = layer.torch_module(**opts, on_nonconvergence="mask")
    xs = x.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = m(xs)
        masked = torch.isnan(out).any(dim=1)
        torch.nansum(out).backward()
    assert masked.any() and not masked.all()  # the case under test: some samples left out
    state = m.state_dict()
    kept = [i for i in range(8) if not masked[i]]
    fails = [i for i in kept if _adjoint_fails_alone(layer, state, x[i:i + 1], opts)]
    assert fails  # the case under test: some adjoint solves fail
    msgs = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)
            and str(w.message).startswith("backward:")]
    assert len(msgs) == 1
    named = [int(i) for i in re.search(r"indices ([0-9, ]+)", msgs[0]).group(1).split(", ")]
    assert named == fails
    st = m.last_backward_stats
    assert st.converged.shape == (8,)
    for i in range(8):  # booleans: exact
        assert bool(st.converged[i]) == (i in kept and i not in fails), i
    assert torch.isnan(st.residuals[masked]).all()
    assert st.failed_indices == sorted(set(fails) | set(torch.nonzero(masked).flatten().tolist()))


def _mask_case() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The QP layer in mask mode with an adjoint capped at 20 plain iterations: inputs shifted
    down leave few ReLUs on, and the adjoint (a contraction on the active units only) converges
    in 1–17 iterations (samples 1–5: 13, 0, 2, 0, 0 units on); samples 0, 6, 7 (28, 45, 49 on)
    need 30, 34 and 57 and fail (float64, tol 1e-10: each count is several factors of the rate
    away from the cap, whatever the BLAS)."""
    layer = lowering.lower(qp_objective(qp_weight(16, norm=0.9, seed=0)))
    mod = layer.torch_module(dtype=torch.float64, weight_control=None, tol=1e-12, max_iter=500,
                             backward_tol=1e-10, backward_max_iter=20, backward_solver="plain",
                             backward_adjoint="iterative", on_nonconvergence="mask")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, dtype=torch.float64, generator=g)
    x = x + torch.tensor([0, -1, -1.5, -2, -2.5, -3, 0.5, 1.0], dtype=torch.float64)[:, None]
    c = torch.randn(8, 64, dtype=torch.float64, generator=g)
    return mod, x, c


def test_mask_leaves_an_unconverged_adjoint_out_of_the_gradient() -> None:
    """Under on_nonconvergence='mask' the samples whose adjoint solve failed are named in a
    warning and left out of the gradient, as the forward's failed samples are: their input
    gradient rows are zero and the weights' gradient equals that of the converged samples
    alone (the reference: the same module on that subset, where every adjoint converges).

    Pins: they were only warned about, and their unconverged rows entered the weights'
    gradient."""
    mod, x, c = _mask_case()
    xx = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match=r"indices 0, 6, 7.*left out of the gradient"):
        (mod(xx) * c).sum().backward()
    ok = mod.last_backward_stats.converged
    assert ok.tolist() == [False, True, True, True, True, True, False, False]
    assert float(xx.grad[~ok].abs().max()) == 0.0
    w_grad = mod.weights["W"].grad.clone()
    assert float(w_grad.abs().max()) > 0.0  # (the converged samples have units on)
    mod.zero_grad()
    sub = x[ok].clone().requires_grad_()
    (mod(sub) * c[ok]).sum().backward()
    assert bool(mod.last_backward_stats.converged.all())
    # the converged samples' adjoints in the two runs both meet the relative residual 1e-10 of
    # the same contraction (‖DM‖ ≤ ‖W‖₂² = 0.81), so each is within 1e-10/(1 − 0.81) ≈ 5e-10
    # relative of the exact one (the full batch iterates them longer: its stop waits for the
    # worst sample); 1e-8 bounds their difference on any BLAS, while unconverged rows entering
    # the weights' gradient would be O(1) of it
    ref = mod.weights["W"].grad
    assert float((w_grad - ref).abs().max()) <= 1e-8 * float(ref.abs().max())
    assert float((xx.grad[ok] - sub.grad).abs().max()) <= 1e-8 * float(sub.grad.abs().max())


def test_nested_batch_coupling_uses_the_iterative_adjoint_and_refuses_mask() -> None:
    """A batch decorrelation inside a Moreau envelope couples the samples: the direct (per-sample
    block) adjoint does not apply, mask mode is refused, and the gradient equals the unrolled
    one.

    Pins: with the coupling unseen the gradient was 0.84/6.1 off, reported as a 1e-17
    residual."""
    import convex_eq as ce

    base = opteq(n=6, m=6, d=3, activation="tanh")
    z = base.states[0]
    obj = 0.6 * ce.moreau(base + 0.05 * ce.BatchDecorrelation(z), 0.4)
    layer = lowering.lower(obj)
    with pytest.raises(OptionError, match="couples the batch"):
        layer.torch_module(dtype=torch.float64, on_nonconvergence="mask")
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, kw in {"implicit": {"backward_adjoint": "direct", "backward_tol": 1e-12,
                                  "backward_solver": "anderson"},
                     "unroll": {"backward": "unroll", "unroll_steps": 400}}.items():
        module = lowering.lower(obj).torch_module(dtype=torch.float64, tol=1e-10,
                                                  max_iter=1000, **kw)
        (module(x) ** 2).sum().backward()
        grads[name] = module.weights["W"].grad
        if name == "implicit":  # coupled: the per-sample Jacobian does not apply
            assert module._batch_coupled and module.last_backward_stats.solver == "anderson"
            # even if the coupling were missed, the direct solve's residual (one true VJP)
            # fails and the adjoint is iterated
            module._batch_coupled = False
            module.zero_grad()
            (module(x) ** 2).sum().backward()
            assert module.last_backward_stats.solver == "anderson"
            grads["missed"] = module.weights["W"].grad
    # 400 contraction steps reach the fixed point to round-off; the adjoint is solved to 1e-12
    for name in ("implicit", "missed"):
        assert torch.allclose(grads[name], grads["unroll"], rtol=1e-7, atol=1e-9), name
