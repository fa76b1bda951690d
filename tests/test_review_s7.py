"""Review s7: option combinations of the emitted module against independent references.

1. ``on_nonconvergence='mask'`` leaves samples out of the backward (NaN inputs, or forward
   solves that failed); the adjoint then runs on the remaining rows, and its statistics and
   its failure message used to index those *rows*: ``last_backward_stats`` had fewer entries
   than the batch and the warning named the wrong samples (row 0 for batch sample 1, …).
   Both must name batch samples; the reference is each sample's backward run alone.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import lowering
from convex_eq import Antiderivative, Input, SqNorm, State, Weight
from convex_eq.errors import ConvergenceError, ConvergenceWarning, NonFiniteError, OptionError

F64 = torch.float64


def _layer() -> lowering.DerivedLayer:
    """OptEq ``z = Wᵀrelu(Wz + Ux + b)`` with ``||W||₂ = 0.97`` and a non-orthogonal ``W``:
    the samples' contraction rates differ (their active sets do)."""
    z, x = State("z", 6), Input("x", 4)
    w0 = np.random.default_rng(0).normal(size=(6, 6))
    w = Weight("W", (6, 6), w0 / np.linalg.norm(w0, 2) * 0.97)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) - 0.5)
    return lowering.lower(Antiderivative("relu", w @ z + u @ x + b).conjugate() - SqNorm(z))


def _inputs() -> torch.Tensor:
    return torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(0)) * 2


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
    adjoint converges alone, not converged (NaN residual) for the masked samples."""
    layer = _layer()
    x = _inputs()
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


# 2. Weight control cached the top singular pair of a weight by its version counter and data
#    pointer; a write through ``.data`` (``W.data.copy_(pretrained)``) changes neither, so the
#    stale pair's ``uᵀAv`` (not an upper bound of the new ``||A||₂``) set the scale from then
#    on: the layer ran with ``||W_eff||₂ = 3.1`` against the certified 0.99.
def test_weight_control_sees_writes_through_data() -> None:
    """After ``W.data.copy_(new)`` the controlled weight is ``new·min(1, target/||new||₂)``
    (the reference: a float64 SVD norm of ``new``; 1e-12: a few roundings of a 6×6 SVD and a
    product, far below the 2.1 the stale pair gave)."""
    z, x = State("z", 6), Input("x", 4)
    w = Weight("W", (6, 6), np.linalg.qr(np.random.default_rng(0).normal(size=(6, 6)))[0] * 0.5)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
    m = lowering.lower(Antiderivative("relu", w @ z + u @ x + b).conjugate() - SqNorm(z)
                       ).torch_module(dtype=F64)
    m(_inputs()[:3])  # the pair of the declared W is cached
    new = torch.randn(6, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    m.weights["W"].data.copy_(new)  # neither version nor data pointer changes
    target = m.weight_control.targets[0][2]
    ref = new * min(1.0, target / float(torch.linalg.matrix_norm(new, 2)))
    for _ in range(2):  # the first call after the write and the next (a refreshed cache)
        w_eff = m.env()["W"].detach()
        assert float((w_eff - ref).abs().max()) < 1e-12
        assert float(torch.linalg.matrix_norm(w_eff, 2)) <= target * (1 + 1e-12)


# 3. A warm start ``z0`` with NaN/Inf rows was not checked: the solve reported those samples
#    as "diverged" (hint: raise max_iter), and under ``mask`` a warm start taken from masked
#    outputs kept those samples NaN from call to call.
@pytest.mark.parametrize("mode", ["raise", "warn", "mask"])
@pytest.mark.parametrize("solver", ["plain", "anderson"])
def test_nonfinite_warm_start_is_named(mode: str, solver: str) -> None:
    """A NaN row of ``z0`` raises a ``NonFiniteError`` naming ``z0`` and that sample (in every
    mode); a NaN row of a sample whose input is NaN too (dropped under ``mask``) is accepted,
    and the other samples match a cold-started Anderson reference at 1e-12 (1e-7: a relative
    residual of 1e-10 on a contraction of factor Lip(T) ≤ 0.941 puts the iterate within
    1e-10/(1 − 0.941)·||z|| ≈ 2e-9·||z|| of the fixed point, ||z|| < 10 here)."""
    layer = _layer()
    x = _inputs()[:4]
    m = layer.torch_module(dtype=F64, solver=solver, on_nonconvergence=mode, tol=1e-10,
                           max_iter=2000)
    z0 = torch.zeros(4, 6, dtype=F64)
    z0[2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"z0 contains NaN or Inf in samples 2\b"):
        m(x, z0=z0)
    if mode != "mask":
        return
    x[2] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the NaN input, announced
        out = m(x, z0=z0)
    with torch.no_grad():
        ref = layer.torch_module(dtype=F64, solver="anderson", tol=1e-12,
                                 max_iter=2000)(x[[0, 1, 3]])
    assert torch.isnan(out[2]).all()
    assert float(ref.abs().max()) < 10
    assert float((out[[0, 1, 3]] - ref).abs().max()) < 1e-7


# 4. Weight control's norm ``σ = uᵀAv`` holds the singular pair fixed: exact value and first
#    derivative, but a second derivative w.r.t. a rescaled weight misses the pair's change
#    (a Hessian-vector product w.r.t. W came out 4 % off, silently).  It now refuses with a
#    typed error while the rescaling is active; everything exact keeps working.
def _controlled(norm: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    z, x = State("z", 6), Input("x", 4)
    w0 = np.random.default_rng(0).normal(size=(6, 6))
    w = Weight("W", (6, 6), w0 / np.linalg.norm(w0, 2) * norm)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "weight control rescales 'W'" (norm > 1)
        m = lowering.lower(Antiderivative("relu", w @ z + u @ x + b).conjugate() - SqNorm(z)
                           ).torch_module(dtype=F64, tol=1e-13, max_iter=3000,
                                          backward_tol=1e-13, backward_max_iter=3000)
    g = torch.Generator().manual_seed(0)
    return m, torch.randn(3, 4, dtype=F64, generator=g), torch.randn(3, 6, dtype=F64, generator=g)


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
    m, x, c = _controlled(1.3)  # ||W||₂ = 1.3 > 1: the layer uses W·0.99/1.3
    w = m.weights["W"]
    with pytest.raises(OptionError, match="second-order gradients through the weight control"):
        (g,) = torch.autograd.grad((m(x) * c).sum(), w, create_graph=True)
        torch.autograd.grad(g.sum(), w)  # (before: a Hessian 4 % off, silently)
    (g1,) = torch.autograd.grad((m(x) * c).sum(), w)  # first order: unaffected
    assert torch.isfinite(g1).all()


@pytest.mark.parametrize("norm", [0.8, 1.3])
def test_second_order_that_is_exact_still_runs(norm: float) -> None:
    """Exact second-order paths against central differences of first-order gradients
    (float64, solves at 1e-13; h = 1e-5 gives O(h²) ≈ 1e-10 plus 1e-13/h ≈ 1e-8 relative:
    1e-6 is a hundred times that): a gradient penalty ``||∂ℓ/∂x||²`` differentiated w.r.t. the
    rescaled W (only the scale's first derivative enters), and, with the rescaling inactive
    (``||W||₂ = 0.8``), the Hessian-vector product w.r.t. W itself."""
    m, x, c = _controlled(norm)
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


# 5. With ``sam=`` the SAM iteration stops by ``SAMConfig.tol``/``max_iter`` (defaults 1e-2 and
#    5000): a ``tol=1e-8`` passed next to it was silently ignored (``module.tol`` read 1e-8, the
#    flags said "converged" at a residual of 1e-2), and a failure's hint said "raise max_iter
#    (now 100)", an option SAM does not read.
def _sam_layer():
    from convex_eq.models import opteq

    return lowering.lower(opteq(n=4, m=4, d=2, seed=0))


def test_sam_refuses_forward_solve_options() -> None:
    import convex_eq as ce

    d = _sam_layer()
    cfg = lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]))
    for opts in ({"tol": 1e-8}, {"max_iter": 50}, {"solver": "anderson"}):
        with pytest.raises(OptionError, match=r"SAMConfig\(tol=\.\.\., max_iter=\.\.\.\)"):
            d.torch_module(sam=cfg, **opts)
    d.torch_module(sam=cfg, backward_tol=1e-8)  # the adjoint's options stay available


def test_sam_failure_hint_names_sam_options() -> None:
    import convex_eq as ce

    d = _sam_layer()
    m = d.torch_module(sam=lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]), tol=1e-12, max_iter=3),
                       dtype=F64)
    with pytest.raises(ConvergenceError) as err:
        m(torch.randn(2, 2, dtype=F64, generator=torch.Generator().manual_seed(0)))
    assert "SAMConfig.max_iter (now 3)" in str(err.value)
    assert "raise max_iter" not in str(err.value)


# 6. ``last_stats`` was written only when a call returned: after a ``ConvergenceError`` (or a
#    ``NonFiniteError`` for NaN inputs) it still held the previous call's statistics, "all
#    converged", to whoever caught the error and logged the solver state.
def test_last_stats_describe_the_call_that_raised() -> None:
    layer = _layer()
    x = _inputs()
    m = layer.torch_module(dtype=F64, solver="plain", tol=1e-8, max_iter=500)
    m(x[:3])  # a converged call first
    assert bool(m.last_stats.converged.all())
    m.config.forward.max_iter = 5  # (the same module, now failing)
    with pytest.raises(ConvergenceError) as err:
        m(x)
    st = m.last_stats
    assert st is not None and st.converged.shape == (8,)
    named = [int(i) for i in re.search(r"indices ([0-9, ]+)", str(err.value)).group(1).split(", ")]
    assert st.failed_indices == named
    x[2] = float("nan")
    with pytest.raises(NonFiniteError):
        m(x)
    assert m.last_stats is None  # nothing was solved in that call


# 7. The weight control's singular pair, recomputed inside ``torch.inference_mode()`` (an
#    evaluation after an optimizer step), was cached as inference tensors; the next training
#    call of a float64 module multiplied them into its graph: "Inference tensors cannot be
#    saved for backward" on the second epoch of a train / evaluate loop.
def test_training_after_an_inference_mode_evaluation() -> None:
    """Gradients after an ``inference_mode`` evaluation equal those of a fresh module with the
    same weights (1e-12: the same float64 operations on the same values; the SVD of the same
    matrix may differ in the last bits between calls only through threading, not here)."""
    m, x, c = _controlled(0.9)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    (m(x) * c).sum().backward()
    opt.step()  # the weights change: the next call recomputes the pair
    with torch.inference_mode():
        m(x)
    opt.zero_grad()
    (m(x) * c).sum().backward()
    fresh, _, _ = _controlled(0.9)
    fresh.load_state_dict(m.state_dict())
    (fresh(x) * c).sum().backward()
    for name, p in m.weights.items():
        assert float((p.grad - fresh.weights[name].grad).abs().max()) <= 1e-12, name


# 8. ``weight_control='project'`` measured and rescaled the stored weight before every training
#    forward; its own projection leaves the norm a rounding above the target about half the
#    time, so the next forward wrote into the parameter again (a factor 1 − 1e-16): a loss
#    over two calls of the module then failed in backward ("modified by an inplace
#    operation"), and every forward recomputed the SVD.
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_project_mode_two_calls_in_one_loss(dtype: torch.dtype) -> None:
    """Two calls in one loss backpropagate, and the gradient equals that of the same layer
    without control at the projected weight (float64: 1e-10, the two solves at 1e-12 differ
    by at most ~1e-11 relative on this 0.98-contraction; float32: 1e-4, tol 1e-6 solves of
    a 0.98-contraction agree to ~5e-5 relative).  A weight moved by a step, or written
    through ``.data``, is projected again."""
    tol = 1e-12 if dtype == F64 else 1e-6
    for seed in range(4):  # a projection lands a rounding above its target for some seeds
        z, x = State("z", 6), Input("x", 4)
        w0 = np.random.default_rng(seed).normal(size=(6, 6))
        w = Weight("W", (6, 6), w0 / np.linalg.norm(w0, 2) * 1.5)
        u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
        layer = lowering.lower(Antiderivative("relu", w @ z + u @ x + b).conjugate() - SqNorm(z))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = layer.torch_module(dtype=dtype, weight_control="project", tol=tol, max_iter=3000,
                                   backward_max_iter=3000)
        xs = _inputs()[:3].to(dtype)
        loss = m(xs).sum() + (m(xs) ** 2).sum()
        loss.backward()
        target = m.weight_control.targets[0][2]
        ref = layer.torch_module(dtype=dtype, weight_control=None, tol=tol, max_iter=3000,
                                 backward_max_iter=3000)
        ref.load_state_dict({k: v for k, v in m.state_dict().items() if k != "_extra_state"},
                            strict=False)
        (ref(xs).sum() + (ref(xs) ** 2).sum()).backward()
        for name, p in m.weights.items():
            scale = float(ref.weights[name].grad.abs().max())
            assert float((p.grad - ref.weights[name].grad).abs().max()) <= (
                1e-10 if dtype == F64 else 1e-4) * scale, (seed, name)
        for move in ("step", "data"):
            with torch.no_grad():
                if move == "step":
                    m.weights["W"].mul_(1.2)
                else:
                    m.weights["W"].data.mul_(1.2)
            m(xs)
            got = float(torch.linalg.matrix_norm(m.weights["W"].detach().double(), 2))
            # the projection's own rounding: a few ulps of the weight's dtype
            assert got <= target * (1 + 16 * torch.finfo(dtype).eps), (seed, move, got)


# 9. ``backward='unroll'`` on an empty batch — every sample masked out (all inputs NaN, or
#    every unrolled iterate non-finite) — crashed in the residual bookkeeping ("max():
#    Expected reduction dim …"), where the other strategies return NaN outputs.
@pytest.mark.parametrize("case", ["empty", "all_nan_inputs", "all_diverge"])
def test_unroll_over_no_sample(case: str) -> None:
    """The outputs are NaN (empty for an empty batch), the statistics cover the batch with no
    sample converged, and the backward runs (zero input gradients: no sample reaches it)."""
    layer = _layer()
    x = _inputs()[:3]
    opts = dict(dtype=F64, backward="unroll", on_nonconvergence="mask")
    if case == "empty":
        x = x[:0]
    elif case == "all_nan_inputs":
        x[:] = float("nan")
    else:  # ||W||₂ = 3 without control: the unrolled iterates overflow to inf / NaN
        opts.update(weight_control=None, unroll_steps=2000)
    m = layer.torch_module(**opts)
    if case == "all_diverge":
        with torch.no_grad():
            m.weights["W"].mul_(3.0 / 0.97)
    xs = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the masked samples, announced
        out, st = m(xs, return_stats=True)
    assert out.shape == (x.shape[0], 6) and bool(torch.isnan(out).all())
    assert st.converged.shape == (x.shape[0],) and not bool(st.converged.any())
    torch.nansum(out).backward()
    assert xs.grad is not None and float(xs.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("case", ["empty", "all_nan_inputs"])
def test_sam_over_no_sample(case: str) -> None:
    """The same for the SAM iteration (its own tracker crashed on zero samples)."""
    import convex_eq as ce

    d = _sam_layer()
    m = d.torch_module(sam=lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]), max_iter=50),
                       dtype=F64, on_nonconvergence="mask")
    x = torch.randn(3, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    x = x[:0] if case == "empty" else x * float("nan")
    xs = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        out, st = m(xs, return_stats=True)
    assert bool(torch.isnan(out).all()) and not bool(st.converged.any())
    torch.nansum(out).backward()
    assert xs.grad is not None and float(xs.grad.abs().sum()) == 0.0


# 10. A norm condition on a ``Constant`` (``||C||₂ ≤ 1`` of Theorem 1 with a fixed operator)
#     made the default ``weight_control='auto'`` pick spectral-norm control, which then found
#     no *weight* to control and refused to build the module ("weight control requested …",
#     hint ``weight_bounds={'W': 1.0}``, a weight that does not exist).  A fixed constant needs
#     no control; a constant made learnable (``learnable_constants=True``) does.
@pytest.mark.parametrize("learnable", [False, True])
def test_norm_condition_on_a_constant(learnable: bool) -> None:
    from convex_eq import Constant

    z, x = State("z", 6), Input("x", 4)
    c0 = np.random.default_rng(0).normal(size=(6, 6))
    cmat = Constant("C", c0 / np.linalg.norm(c0, 2) * 0.9)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
    layer = lowering.lower(Antiderivative("relu", cmat @ z + u @ x + b).conjugate() - SqNorm(z))
    assert "||C||₂ ≤ 1" in str(layer.certificate)
    m = layer.torch_module(dtype=F64, learnable_constants=learnable)
    if not learnable:
        assert m.weight_control is None
        return
    assert [(name, t) for _, name, t in m.weight_control.targets] == [("C", 0.99)]
    xs = _inputs()[:4]
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for _ in range(10):  # a loss that pushes ||C|| up
        loss = -(m(xs) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # the controlled C, by a float64 SVD (1e-12: roundings of a 6×6 norm and one product)
    assert float(torch.linalg.matrix_norm(m.env()["C"].detach(), 2)) <= 0.99 + 1e-12
    assert float(torch.linalg.matrix_norm(m.weights["C"].detach(), 2)) > 0.99  # it was pushed


# 11. A layer without tensor weights or constants (e.g. ½||z||² − <x, z> + 0.1||z||₁) had
#     nothing for ``.to()`` / ``.double()`` to convert: ``module.dtype`` stayed the configured
#     float32, so after ``.double()`` float64 inputs were cast down and float32 came out.
@pytest.mark.parametrize("move", ["double", "to", "half"])
def test_weightless_layer_follows_to(move: str) -> None:
    import convex_eq as ce
    from convex_eq import L1, Linear

    z, x = State("z", 4), Input("x", 4)
    m = lowering.lower(ce.Objective([SqNorm(z), -Linear(x, z), L1(z) * 0.1])).torch_module()
    assert not list(m.parameters())
    want = {"double": F64, "to": F64, "half": torch.float16}[move]
    m = m.double() if move == "double" else m.to(F64) if move == "to" else m.half()
    xs = 1.0 + 1e-9 * torch.arange(8, dtype=F64).reshape(2, 4)
    out = m(xs)
    assert m.dtype == want and out.dtype == want
    if want == F64:  # the prox of the L1 term: soft-threshold(x, 0.1), exact in float64
        # (the 1e-9 steps are below float32 resolution: a float32 solve would erase them)
        assert float((out - (xs - 0.1)).abs().max()) <= 1e-15
    assert "dtype_ref" not in m.state_dict()  # not persistent: state dicts are unchanged


def test_classifier_settings_on_a_constant_condition() -> None:
    """The training settings of ``EquilibriumClassifier`` chose the same control and refused
    to build on such a layer; the weight-bearing condition of OptEq is still controlled."""
    from convex_eq import Constant
    from convex_eq.models import opteq
    from lowering.classifier import TrainingSettings

    z, x = State("z", 6), Input("x", 4)
    c0 = np.random.default_rng(0).normal(size=(6, 6))
    cmat = Constant("C", c0 / np.linalg.norm(c0, 2) * 0.9)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
    fixed = lowering.lower(Antiderivative("relu", cmat @ z + u @ x + b).conjugate() - SqNorm(z))
    assert TrainingSettings().module_options(fixed)["weight_control"] is None
    fixed.torch_module(**TrainingSettings().module_options(fixed))
    trained = lowering.lower(opteq(n=6, m=6, d=3))
    assert TrainingSettings().module_options(trained)["weight_control"] == "spectral_norm"
