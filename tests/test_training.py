"""The emitted module as a training component: exact gradients (first and second order),
certificates that hold at every optimizer step, honest convergence flags, per-sample failures,
and the ordinary PyTorch protocols (pickle, state_dict, dtypes)."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceError, NonFiniteError, OptionError, ShapeError
from lowering.solvers import get_solver
from lowering.weight_control import norm_conditions

T64 = torch.float64


def _conv_layer(channels: int = 4, image: tuple[int, int, int] = (1, 6, 6), seed: int = 0):
    return lowering.lower(models.opteq(conv=(channels, 3), image=image, seed=seed))


def _exact_norms(module: nn.Module) -> list[tuple[float, float]]:
    """(dense-SVD norm of each certified operator at the module's effective weights, bound)."""
    with torch.no_grad():
        env = {k: v.detach().double() for k, v in module.env().items()}
        out = []
        for op, bound in norm_conditions(module.derived):
            dense = op.apply(torch.eye(op.in_size, dtype=T64), env).T  # columns A e_i
            out.append((float(torch.linalg.matrix_norm(dense, 2)), bound))
    return out


def _scaled_residual(module: nn.Module, x: torch.Tensor, z: torch.Tensor) -> np.ndarray:
    """||T(z) − z|| / ||T(z)|| per sample, computed here in float64 after dividing by the largest
    magnitude (independent of the solvers' own residual code)."""
    with torch.no_grad():
        env = {k: v.detach().double() for k, v in module.env().items()}
        inputs = {module.input_syms[0].name: x.double().reshape(x.shape[0], -1)}
        zf = z.detach().double().reshape(z.shape[0], -1)
        tz = module.T(zf, inputs, env)
    out = []
    for a, b in zip(tz.numpy(), zf.numpy()):
        s = max(np.abs(a).max(), np.abs(a - b).max(), 1e-300)
        out.append(np.linalg.norm((a - b) / s) / max(np.linalg.norm(a / s), 1e-300))
    return np.array(out)


# ----------------------------------------------------------------------------- adjoint
def test_float32_adjoint_converges_for_tiny_loss_gradients():
    """The demo's stall: ∂ℓ/∂z of a well-fitted batch is ~1e-10; Anderson's ridge (then
    sqrt(float32 tiny) ≈ 1e-19 against a Gram matrix ~1e-20) dominated and the solve crawled at
    the cap.  The Gram matrix now lives in float64: the solve must take about as many
    iterations as for an O(1) right-hand side."""
    d = _conv_layer()
    m = d.torch_module(dtype=torch.float32, tol=1e-6)
    x = torch.randn(16, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z = m(x).reshape(16, -1)
    inputs, env = m._inputs(x), {k: v.detach() for k, v in m.env().items()}
    z0 = z.clone().requires_grad_()
    f0 = m.T(z0, inputs, env)
    v = torch.randn(z.shape, generator=torch.Generator().manual_seed(2))
    iters = {}
    for scale in (1.0, 1e-10):
        rhs = v * scale

        def adj(y, rhs=rhs):
            return torch.autograd.grad(f0, z0, y, retain_graph=True)[0] + rhs

        with torch.no_grad():
            _, st = get_solver("anderson")(adj, rhs, tol=1e-6, max_iter=200)
        assert bool(st.converged.all()), st
        iters[scale] = int(st.iterations.max())
    # the iteration count may differ by round-off, not by the factor of 5-10 seen before
    assert iters[1e-10] <= iters[1.0] + 3, iters


def test_implicit_gradient_matches_dense_exact_solve_during_training():
    """At 5 points of a training run (float32 module, tol 1e-5) the module's gradient of the
    loss w.r.t. W equals the exact implicit gradient computed here: z* re-solved in float64,
    J = ∂T/∂z dense, g = (I − Jᵀ)⁻¹ ∂ℓ/∂z, dℓ/dW = (∂T/∂W)ᵀ g.  Bound 10·tol: both sides
    stop at relative residual tol (the error of g is ≤ tol·||g||/(1 − ||J||), ||J|| ≤ 0.99
    under weight control, measured ≤ 3·tol here); float32 round-off (1e-7) is far below."""
    tol = 1e-5
    d = _conv_layer(channels=3, image=(1, 5, 5))
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
    inputs = mm._inputs(x.double())
    w = mm.weights["W"].detach().clone().requires_grad_()
    n = z.shape[1]
    grads = torch.zeros_like(w)
    for i in range(x.shape[0]):
        zi = z[i:i + 1].clone().requires_grad_()
        loss = nn.functional.cross_entropy(hh(zi), y[i:i + 1], reduction="sum") / x.shape[0]
        v = torch.autograd.grad(loss, zi)[0][0]
        xi = {k: t[i:i + 1] for k, t in inputs.items()}

        def t_of(zz, ww, xi=xi):
            env = dict(mm._raw_env())
            env["W"] = ww
            env = mm.weight_control(mm, env) if mm.weight_control is not None else env
            return mm.T(zz[None], xi, env)[0]

        J = torch.autograd.functional.jacobian(lambda zz: t_of(zz, w.detach()), zi[0].detach())
        gvec = torch.linalg.solve(torch.eye(n, dtype=T64) - J.T, v)
        fz = t_of(zi[0].detach(), w)
        grads += torch.autograd.grad(fz, w, gvec)[0]
    return grads


# ----------------------------------------------------------------------------- weight control
def test_weight_control_certificate_holds_at_every_training_step():
    """300 Adam steps at lr 3e-2 that push W up (the loss rewards large features): the exact
    norm of the controlled operator (dense SVD of the materialised convolution, computed here)
    never exceeds the certificate's bound; weight control is on by default."""
    d = _conv_layer(channels=4, image=(1, 6, 6))
    m = d.torch_module(dtype=torch.float32, tol=1e-4, max_iter=200)
    assert m.weight_control is not None  # default 'auto' with a norm condition
    opt = torch.optim.Adam(m.parameters(), lr=3e-2)
    x = torch.randn(16, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    worst = 0.0
    for _ in range(300):
        z = m(x)
        loss = -(z ** 2).mean()  # rewards growth: drives ||W|| against its bound
        opt.zero_grad()
        loss.backward()
        opt.step()
        for val, bound in _exact_norms(m):
            worst = max(worst, val / bound)
            assert val <= bound, (val, bound)
    assert worst > 0.8  # the bound was actually exercised, not trivially far away


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_weight_control_gradient_matches_finite_differences(kind):
    """d/dW ⟨R, W_eff(W)⟩ by autograd vs central differences (float64, h = 1e-5: truncation
    O(h²) ≈ 1e-10 relative, round-off ≈ 1e-16/h ≈ 1e-11), with the scale active (σ > target)."""
    if kind == "dense":
        d = lowering.lower(models.opteq(n=6, m=6, d=3, form="conjugate", weight_norm=0.9, seed=1))
    else:
        d = _conv_layer(channels=3, image=(1, 5, 5), seed=1)
    m = d.torch_module(dtype=T64, weight_control="spectral_norm", margin=0.3)
    W = m.weights["W"]
    with torch.no_grad():
        W.mul_(1.5)
    R = torch.randn(W.shape, dtype=T64, generator=torch.Generator().manual_seed(0))

    def value() -> torch.Tensor:
        return (m.env()["W"] * R).sum()

    assert m.weight_norms()["W"][0] > 0  # sanity: bound computed
    grad = torch.autograd.grad(value(), W)[0]
    rng = torch.Generator().manual_seed(1)
    for _ in range(3):
        dirn = torch.randn(W.shape, dtype=T64, generator=rng)
        h = 1e-5
        with torch.no_grad():
            W.add_(h * dirn)
            up = float(value())
            W.sub_(2 * h * dirn)
            dn = float(value())
            W.add_(h * dirn)
        fd = (up - dn) / (2 * h)
        ad = float((grad * dirn).sum())
        assert abs(fd - ad) <= 1e-6 * max(abs(fd), 1e-12), (fd, ad)


# ----------------------------------------------------------------------------- second order
def _small_dense(seed: int = 0):
    return lowering.lower(models.opteq(n=4, m=4, d=2, activation="tanh", form="canonical",
                                       weight_norm=0.6, seed=seed))


@pytest.mark.parametrize("backward", ["implicit", "unroll"])
def test_gradgradcheck(backward):
    """Second-order autograd through the layer (inputs and W), float64, tight solves."""
    d = _small_dense()
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
    """The reported bug: grad(grad(...)) through the implicit backward was silently 0.  A
    gradient penalty's gradient now equals the one of a long unrolled (contractive) iteration."""
    d = _small_dense(seed=3)
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


def test_phantom_refuses_second_order_with_a_typed_error():
    m = _small_dense().torch_module(dtype=T64, backward="phantom", weight_control=None)
    x = torch.randn(2, 2, dtype=T64, requires_grad=True)
    z = m(x)
    with pytest.raises(OptionError, match="first-order gradients only"):
        torch.autograd.grad(z.sum(), x, create_graph=True)
    z = m(x)
    (g,) = torch.autograd.grad(z.sum(), x)  # first order still works
    assert torch.isfinite(g).all()


# ----------------------------------------------------------------------------- honest flags
@pytest.mark.parametrize("dtype", [torch.float32, T64])
@pytest.mark.parametrize("solver", ["plain", "anderson", "broyden"])
def test_expansive_layer_never_reports_a_non_fixed_point_as_converged(solver, dtype):
    """||W||₂ = 1.5, canonical ReLU OptEq, no weight control: every sample flagged converged is
    a fixed point (scaled residual computed here ≤ tol); the others raise or are flagged."""
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="canonical", weight_norm=1.5, seed=0))
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    for max_iter in (300, 1000, 10000):
        m = d.torch_module(dtype=dtype, solver=solver, max_iter=max_iter, tol=1e-6,
                           weight_control=None)
        with pytest.raises((ConvergenceError, NonFiniteError)):
            m(x)
        # mask: the only mode that returns (NaN for failed samples) instead of raising on a
        # diverged sample, so the flags of every sample can be inspected
        m = d.torch_module(dtype=dtype, solver=solver, max_iter=max_iter, tol=1e-6,
                           weight_control=None, on_nonconvergence="mask")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z, st = m(x, return_stats=True)
        conv = st.converged.numpy()
        if conv.any():
            r = _scaled_residual(m, x, z)[conv]
            # float32: the module's residual is measured in float32 (rounding 1e-7 ≪ tol)
            assert np.all(r <= 1e-6 * 1.01), r


def test_overflowing_iterate_norm_is_not_zero():
    """Components of 1e200 (float64): the unscaled ||·||² overflows to inf and x/inf = 0 used to
    read as 'converged'."""
    from lowering.solvers import rel_residual

    fz = torch.full((1, 10), 1e200, dtype=T64)
    z = fz * 0.5
    r = rel_residual(fz, z)
    assert abs(float(r) - 0.5) < 1e-12


@pytest.mark.parametrize("scale", [2e153, 1e160, 1e300])  # 2e153: only ||f(z)|| overflows
def test_tracker_never_converges_on_an_overflowing_norm(scale):
    """The solvers' fast residual (plain float64 norms) must hand an overflowing ||f(z)|| to the
    scaled form: f(z) with entries ~scale and ||f(z) − z|| / ||f(z)|| = 1e-3 is not converged at
    tol 1e-6, whichever of the two norms overflows."""
    from lowering.solvers import Tracker

    fz = torch.full((2, 50), scale, dtype=T64)
    z = fz.clone()
    z[:, 0] -= 1e-3 * scale * np.sqrt(50)  # relative residual 1e-3
    tr = Tracker("t", z, 1e-6)
    assert not tr.record(z, fz)
    st = tr.stats()
    assert not bool(st.converged.any())
    assert torch.allclose(st.final_residual, torch.full((2,), 1e-3, dtype=T64), rtol=1e-9)


# ----------------------------------------------------------------------------- defaults train
@pytest.mark.parametrize("lr", [1e-3, 1e-2, 3e-2])
def test_default_options_train_on_digits_with_the_certificate_at_every_step(lr):
    """An ordinary loop with torch_module() defaults (digits, Adam, 300 steps, batch 64): never
    raises, and the exact norm of every certified operator stays ≤ its bound at every step."""
    from sklearn.datasets import load_digits

    xs, ys = load_digits(return_X_y=True)
    xs = torch.as_tensor((xs - xs.mean()) / xs.std(), dtype=torch.float32)
    ys = torch.as_tensor(ys)
    d = lowering.lower(models.opteq(n=24, m=24, d=64, seed=0))
    torch.manual_seed(0)
    m = d.torch_module()
    head = nn.Linear(24, 10)
    opt = torch.optim.Adam([*m.parameters(), *head.parameters()], lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        idx = torch.randint(0, len(xs), (64,), generator=g)
        loss = nn.functional.cross_entropy(head(m(xs[idx])), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        for val, bound in _exact_norms(m):
            assert val <= bound, (val, bound)
    assert float(loss) < 2.3  # it learned something (chance level is ln 10 ≈ 2.30)


# ----------------------------------------------------------------------------- per-sample
def _nan_batch():
    d = lowering.lower(models.opteq(n=6, m=6, d=3, seed=0))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    bad = x.clone()
    bad[3, 1] = float("nan")
    return d, x, bad


def test_nan_sample_is_named():
    d, _, bad = _nan_batch()
    m = d.torch_module()
    with pytest.raises(NonFiniteError, match="samples 3"):
        m(bad)


def test_mask_mode_drops_only_the_failing_sample():
    d, x, bad = _nan_batch()
    m = d.torch_module(on_nonconvergence="mask")
    ref = m(x).detach()
    with pytest.warns(UserWarning, match="3"):
        out, st = m(bad, return_stats=True)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[[0, 1, 2, 4]]).all()
    assert torch.allclose(out[[0, 1, 2, 4]], ref[[0, 1, 2, 4]], atol=1e-6)
    assert st.failed_indices == [3]
    loss = out[st.converged].pow(2).sum()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


# ----------------------------------------------------------------------------- protocols
def test_pickle_torch_save_and_deepcopy_round_trip():
    d = _conv_layer()
    m = d.torch_module()
    x = torch.randn(3, 1, 6, 6)
    ref = m(x).detach()
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert torch.equal(clone(x).detach(), ref)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert torch.equal(again(x).detach(), ref)


def test_state_dict_of_another_layer_is_refused_by_name():
    conj = lowering.lower(models.opteq(n=6, m=6, d=3, form="conjugate", seed=0))
    canon = lowering.lower(models.opteq(n=6, m=6, d=3, form="canonical", seed=0))
    a, b = conj.torch_module(), canon.torch_module()
    assert {k: v.shape for k, v in a.state_dict().items() if torch.is_tensor(v)} == \
        {k: v.shape for k, v in b.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ShapeError, match="another layer"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(canon.torch_module().state_dict())  # the same layer loads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_modules_solve_in_float32(dtype):
    d = lowering.lower(models.opteq(n=6, m=6, d=3, seed=0))
    m32 = d.torch_module(dtype=torch.float32)
    mh = d.torch_module(dtype=dtype)
    x = torch.randn(4, 3)
    out = mh(x)
    assert out.dtype == dtype
    # the half module's weights are the float32 ones rounded to 8/11 mantissa bits
    assert torch.allclose(out.float(), m32(x), atol=5e-2)
    out.float().sum().backward()
    assert mh.weights["W"].grad.dtype == dtype


def test_sam_with_unroll_is_refused():
    import convex_eq as ce

    d = lowering.lower(models.opteq(n=4, m=4, d=2, seed=0))
    cfg = lowering.SAMConfig(R=ce.SqNorm(d.blocks[0]))
    with pytest.raises(OptionError, match="SAM with backward='unroll'"):
        d.torch_module(sam=cfg, backward="unroll")


def test_hint_never_suggests_what_is_set():
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="canonical", weight_norm=1.5, seed=0))
    m = d.torch_module(weight_control=None, max_iter=5)
    with pytest.raises((ConvergenceError, NonFiniteError)) as err:
        m(torch.randn(4, 3) * 3)
    assert "solver='anderson'" not in str(err.value)  # anderson is the solver here
    assert "weight_control='spectral_norm'" in str(err.value)
