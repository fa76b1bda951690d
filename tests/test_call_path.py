"""The per-call path after the cuts of this round (lowering/solvers.py, module.py, backward.py,
plan.py, nodes.py): the cheap gradient switch, the plan linearised at an alias of the output,
the Gram matrix applied without a transpose, ``auto``'s inline prediction, and the
benchmark's hand-loop stop test.  Each shortcut must give what the slower form gave; the tests
that guard one are shown to fail on a broken rule (``test_*_mutation``)."""

from __future__ import annotations

import math

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from benchmarks.hand import done
from convex_eq.errors import ShapeError
from lowering import solvers
from lowering.solvers import grad_off


def _module(m: int = 16, dtype: torch.dtype = torch.float64, **kw):
    layer = lowering.lower(qp_objective(qp_weight(m, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-10, max_iter=500, backward_tol=1e-10,
                backward_max_iter=500, dtype=dtype)
    opts.update(kw)
    return layer.torch_module(**opts)


def _grads(mod, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xx = x.detach().clone().requires_grad_()
    z = mod(xx)
    (z * c).sum().backward()
    return (z.detach(), xx.grad, *[p.grad.clone() for p in mod.parameters()])


# ------------------------------------------------------------------------- grad_off
@pytest.mark.parametrize("start", [True, False])
def test_grad_off_switches_off_and_restores(start: bool) -> None:
    """Inside: gradients off; after: the mode it found, also when the body raises; a region
    entered with gradients off leaves them off (it must not switch them on at exit)."""
    with torch.set_grad_enabled(start):
        with grad_off():
            assert not torch.is_grad_enabled()
        assert torch.is_grad_enabled() is start
        with pytest.raises(ZeroDivisionError):
            with grad_off():
                raise ZeroDivisionError
        assert torch.is_grad_enabled() is start
        with grad_off():
            with torch.enable_grad():  # an inner switch is the inner region's business
                assert torch.is_grad_enabled()
            assert not torch.is_grad_enabled()
        assert torch.is_grad_enabled() is start


def test_grad_off_mutation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch that restores "on" unconditionally breaks the test above (it can fail)."""

    class Broken(grad_off):
        __slots__ = ()

        def __exit__(self, *exc: object) -> None:
            solvers._set_grad_enabled(True)

    monkeypatch.setattr(solvers, "grad_off", Broken)
    monkeypatch.setitem(globals(), "grad_off", Broken)
    with pytest.raises(AssertionError):
        test_grad_off_switches_off_and_restores(False)


# ------------------------------------------------------------------ the linearisation
def test_planned_gradient_matches_finite_differences() -> None:
    """An independent check of the gradient with respect to the input: central differences of
    the solved layer in float64 (tol 1e-13, so the solve's own error, ~1e-13, is far below
    the differences' truncation error ~h² = 1e-10 and round-off ~1e-16/h = 1e-11)."""
    mod = _module(tol=1e-13, backward_tol=1e-13, max_iter=2000, backward_max_iter=2000)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g, dtype=torch.float64)
    c = torch.randn(3, 64, generator=g, dtype=torch.float64)
    _, gx, _ = _grads(mod, x, c)
    h = 1e-5
    with torch.no_grad():
        for i, j in ((0, 0), (1, 17), (2, 63)):
            e = torch.zeros_like(x)
            e[i, j] = h
            fd = ((mod(x + e) * c).sum() - (mod(x - e) * c).sum()) / (2 * h)
            assert abs(float(fd) - float(gx[i, j])) <= 1e-7 * max(1.0, abs(float(fd)))


def test_inplace_change_of_the_output_still_fails_the_backward() -> None:
    """The backward linearises at an alias of its saved output, which it unpacks first:
    changing the output in place before backward raises (as torch's contract says) instead of
    giving a gradient for a point the output no longer is."""
    mod = _module(m=16, dtype=torch.float32, tol=1e-5, backward_tol=1e-5)
    x = torch.randn(4, 64, requires_grad=True)
    z = mod(x)
    z.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_two_backwards_through_one_forward_agree() -> None:
    """``retain_graph=True``: a second backward through the same forward gives the same
    gradient (exactly: the same operations on the same tensors)."""
    mod = _module(m=16, dtype=torch.float32, tol=1e-6, backward_tol=1e-6)
    x = torch.randn(40, 64, requires_grad=True)
    z = mod(x)
    (g1,) = torch.autograd.grad(z.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(g1, g2)


def test_second_order_still_differentiates_the_adjoint() -> None:
    """``create_graph=True`` takes the second-order path (not the plan's linearisation):
    the gradient of a gradient penalty is not zero and matches central differences of the
    first-order gradient (float64, tol 1e-13; h = 1e-5 as above)."""
    mod = _module(m=16, tol=1e-13, backward_tol=1e-13, max_iter=2000, backward_max_iter=2000)
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


# ------------------------------------------------------------------------ auto's watch
def _reference_need(now: float, then: float, tol: float, window: int) -> float:
    """The prediction as it was written before it went inline (the reference)."""
    if not (math.isfinite(now) and math.isfinite(then)) or now <= 0:
        return 0.0
    if now >= then:
        return math.inf
    if now <= tol:
        return 0.0
    rate = (now / then) ** (1.0 / window)
    return math.log(tol / now) / math.log(rate)


@pytest.mark.parametrize("now,then,window", [
    (1e-3, 1e-2, 4), (1e-3, 1e-3, 4), (2e-3, 1e-3, 4), (1e-7, 1e-6, 4), (1e-7, 2e-8, 4),
    (math.nan, 1e-2, 4), (1e-3, math.inf, 4), (0.0, 1e-2, 4), (5e-4, 9e-4, 13),
    (1e-4, 1e-3, 4), (1e-3, 2.5e-3, 4)])
def test_auto_watch_decides_as_the_reference_prediction(now: float, then: float,
                                                        window: int) -> None:
    """The watch switches to Anderson exactly when the reference prediction exceeds the budget
    and schedules the next test from it (the order of its cases matters: a residual below tol
    that grew since the last test predicts no end, as before)."""
    tol, max_iter = 1e-6, 200
    for k_then in (1, 30, 150):
        tr = solvers.Tracker("plain", torch.zeros(1, 1), tol)
        w = solvers._AutoWatch(tr, tol, max_iter)
        w.next, w.then, w.k = k_then + window, then, k_then
        tr.top = now
        k = k_then + window
        need = _reference_need(now, then, tol, window)
        switch = need > min(solvers.AUTO_PLAIN_BUDGET, (max_iter - k) / 2)
        assert w(k) is switch
        if not switch:  # half the prediction, or (a short one) AUTO_WINDOW past its end
            assert w.next == k + (int(need) + solvers.AUTO_WINDOW
                                  if need <= solvers.AUTO_TAIL
                                  else max(solvers.AUTO_WINDOW, int(need) // 2))


# ----------------------------------------------------------------- the hand-loop stop test
def test_hand_stop_test_is_the_module_decision() -> None:
    """``benchmarks.hand.done`` decides as the float64 residual compared with the unrounded
    ``tol`` (the module's rule, :func:`lowering.solvers._meets`), zero-norm samples included
    (0/0 must never read as done; 0 − 0 over the floor reads 0, done)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        fz = torch.randn(6, 8, generator=g)
        z = fz + torch.randn(6, 8, generator=g) * 10.0 ** float(torch.empty(()).uniform_(
            -8, -4, generator=g)) * fz.norm(dim=1, keepdim=True)
        if trial % 7 == 0:
            fz[2] = 0.0
            z[2] = 0.0 if trial % 2 else 1e-3
        tol = (1e-6, 1e-5, 3e-7)[trial % 3]
        r = (fz.double() - z.double()).norm(dim=1) / fz.double().norm(dim=1).clamp_min(1e-30)
        # the plain float32 norms' rounding (≤ (8 + 3)·2⁻²⁴ relative) can only flip samples
        # within that of tol: such draws are skipped, not judged
        if bool(((r - tol).abs() <= 1e-5 * tol).any()):
            continue
        assert done(fz, z, tol) == bool((r <= tol).all())


# ------------------------------------------------------------------ torch.func transforms
@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_torch_func_transforms_are_refused_with_a_typed_error(transform: str) -> None:
    """vmap, grad and jacrev over the module would fail deep inside (an `.item()` under vmap, a
    `requires_grad_` under grad), untyped; the module refuses them first, naming what to do."""
    from convex_eq.errors import OptionError

    mod = _module(m=16, dtype=torch.float32, tol=1e-5, backward_tol=1e-5)
    x = torch.randn(3, 64)
    fns = {"vmap": lambda: torch.func.vmap(lambda xi: mod(xi[None])[0])(x),
           "grad": lambda: torch.func.grad(lambda xi: mod(xi).sum())(x),
           "jacrev": lambda: torch.func.jacrev(lambda xi: mod(xi).sum())(x)}
    with pytest.raises(OptionError, match="torch.func transforms") as err:
        fns[transform]()
    assert "loss.backward()" in str(err.value.hint)


def test_functional_call_still_works() -> None:
    """`torch.func.functional_call` is not a transform: it runs the module with substituted
    parameters and gives the module's own output (the same call, the same operations)."""
    mod = _module(m=16, dtype=torch.float32, tol=1e-5, backward_tol=1e-5)
    x = torch.randn(3, 64)
    ref = mod(x)
    out = torch.func.functional_call(mod, dict(mod.named_parameters()), (x,))
    assert torch.equal(out, ref)


# ------------------------------------------------------- weight control in half precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_norm_is_measured_in_float32(dtype: torch.dtype) -> None:
    """The exact norm ``σ = uᵀAv`` of a half-precision weight is the float64 spectral norm of
    its (half) values to float32 accuracy: a half-precision product rounded σ by up to 2⁻⁸
    relative, and a σ that reads low is no bound.  1e-5 relative: the float32 product of a
    48×64 matrix rounds by at most about 64·2⁻²⁴ ≈ 4e-6 in any summation order, while the
    half-precision product was off by ~1e-3."""
    import convex_eq as ce

    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(48, 64, generator=g, dtype=torch.float64)
    w0 = w0 / torch.linalg.matrix_norm(w0, 2)
    z, q = ce.State("z", 64), ce.Input("q", 64)
    obj = ce.Objective([ce.Potential("relu", z), ce.SqNorm(z), -ce.Linear(q, z),
                        -ce.SqNorm(ce.Weight("W", (48, 64), w0.numpy()) @ z)])
    mod = lowering.lower(obj).torch_module(dtype=dtype, weight_control="spectral_norm",
                                           margin=0.0)
    env = mod._raw_env()
    true = float(torch.linalg.matrix_norm(env["W"].double(), 2))
    sig, _ = mod.weight_control.norms(env)["W"]
    assert abs(sig - true) <= 1e-5 * true


# ------------------------------------------------------------------ the express call
def test_express_call_is_taken_and_equals_the_general_path(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The common call (one flat dense input of the module's dtype) takes the express path, and
    its output, gradients and statistics are bit-equal to the general path's (forced by
    reporting no express width): the same plan, solver and backward run in the same order."""
    mod = _module()
    taken = []
    express = type(mod)._express
    monkeypatch.setattr(type(mod), "_express",
                        lambda self, *a: taken.append(1) or express(self, *a))
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(5, 64, generator=g, dtype=torch.float64), torch.randn(
        5, 64, generator=g, dtype=torch.float64)
    fast = _grads(mod, x, c)
    fast_stats = (mod.last_stats.residuals, mod.last_backward_stats.residuals)
    assert taken == [1]
    monkeypatch.setattr(type(mod), "_express_width", lambda self: 0)
    mod.zero_grad()
    slow = _grads(mod, x, c)
    assert taken == [1]
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert torch.equal(fast_stats[0], mod.last_stats.residuals)
    assert torch.equal(fast_stats[1], mod.last_backward_stats.residuals)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_is_a_typed_error(layout: str) -> None:
    """A sparse input used to fail inside the input check with torch's untyped
    NotImplementedError; it is a ShapeError naming the input and what to pass."""
    mod = _module()
    x = torch.randn(3, 64, dtype=torch.float64)
    x = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    for given in (x, {"q": x}):
        with pytest.raises(ShapeError, match=r"input 'q' is a torch\.sparse_.* q\.to_dense"):
            mod(given)


def _tanh_layer(norm: float):
    from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight

    z, q = State("z", 64), Input("q", 64)
    w = Weight("W", (64, 64), qp_weight(64, norm=norm, seed=0))
    return lowering.lower(Objective([Potential("tanh", z), SqNorm(z), -Linear(q, z),
                                     -SqNorm(w @ z)]))


def test_auto_switches_a_slowing_solve_to_anderson() -> None:
    """A tanh layer at ‖W‖₂ = 0.99 converges fast at first and then slowly: the watch must see
    the slowdown and switch to Anderson.  A watch that re-tests only past each predicted end
    (never halving) let it run 116 plain iterations instead of switching after 49."""
    mod = _tanh_layer(0.99).torch_module(weight_control=None, tol=1e-6, max_iter=400,
                                         backward_tol=1e-6, backward_max_iter=400)
    x = 0.2 * torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    # the switch comes where the rate since the last test predicts 68 further iterations
    # against the budget of 60: a margin of 13 %, far beyond rounding
    mod(x.double())
    assert mod.last_stats.solver == "plain→anderson", mod.last_stats.solver
    assert int(mod.last_stats.iterations.max()) < 80
