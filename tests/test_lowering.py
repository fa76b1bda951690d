"""Lowering: derived T vs hand-written docs/theory.md formulas, derivation text, backward modes,
solvers, converter, SAM, emitted-module behaviour.  References are written here from
docs/theory.md directly."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convex_eq as ce
import lowering
from convex_eq import models

T64 = torch.float64
GEN = torch.Generator().manual_seed(7)


def W(obj, name: str) -> torch.Tensor:
    return obj.symbol(name).value


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=T64)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    # both sides are closed-form float64 expressions of the same formula: rounding only
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


ACTS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
        "identity": lambda t: t, "hardtanh": lambda t: t.clamp(-1, 1),
        "leaky_relu": lambda t: F.leaky_relu(t, 0.01), "softplus": F.softplus}


# ------------------------------------------------------------------ 1. derived T vs references
@pytest.mark.parametrize("act", list(ACTS))
def test_opteq_conjugate_form(act: str) -> None:
    mu = 1.7
    phi = models.opteq(n=7, m=9, d=3, activation=act, form="conjugate", mu=mu, seed=1)
    d = lowering.lower(phi)
    z, x = randn(4, 7), randn(4, 3)
    w, u, b = W(phi, "W"), W(phi, "U"), W(phi, "b")
    ref = (1 / mu) * ACTS[act](z @ w.T + x @ u.T + b) @ w  # (1/μ)Wᵀσ(Wz + Ux + b)
    close(d.apply({"z": z, "x": x})["z"], ref)
    assert d.claim.kind == "minimizer" and d.is_prox


@pytest.mark.parametrize("act", list(ACTS))
def test_opteq_canonical_form(act: str) -> None:
    g = models.opteq(n=7, m=5, d=3, activation=act, seed=2)
    d = lowering.lower(g)
    z, x = randn(4, 7), randn(4, 3)
    w, u, b = W(g, "W"), W(g, "U"), W(g, "b")
    close(d.apply({"z": z, "x": x})["z"], ACTS[act](z @ w.T @ w + x @ u.T + b))


def test_opteq_conv_canonical() -> None:
    g = models.opteq(conv=(3, 3), image=(1, 6, 6), seed=0)
    d = lowering.lower(g)
    z, x = randn(2, 3 * 36), randn(2, 36)
    wk, uk, b = W(g, "W"), W(g, "U"), W(g, "b")
    wz = F.conv2d(z.reshape(2, 3, 6, 6), wk, padding=1)
    wtwz = F.conv_transpose2d(wz, wk, padding=1).reshape(2, -1)
    ux = F.conv2d(x.reshape(2, 1, 6, 6), uk, padding=1).reshape(2, -1)
    close(d.apply({"z": z, "x": x})["z"], torch.relu(wtwz + ux + b))


def _deep_ref(comp, z0: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    z = z0
    for i in range(1, comp.L + 1):
        w, u, b = (comp.layers[i - 1].symbol(f"{k}{i}").value for k in "WUb")
        z = alpha * torch.relu(z @ w.T + x @ u.T + b) @ w + (1 - alpha) * z
    return z


@pytest.mark.parametrize("L", [2, 3])
def test_deep_opteq_composition_and_multiblock(L: int) -> None:
    comp = models.deep_opteq(L=L, n=6, m=8, d=3, alpha=0.6, seed=L)
    z0, x = randn(3, 6), randn(3, 3)
    d = lowering.lower(comp)
    close(d.apply({"z0": z0, "x": x})["z0"], _deep_ref(comp, z0, x, 0.6))
    mb = lowering.lower(comp, deep_form="multiblock")
    blocks = {b.name: randn(3, 6) for b in mb.blocks}
    out = mb.apply({**blocks, "x": x})
    # Lemma 3: block l is f_l applied to block l-1 (cyclically, z_0 before z_1)
    names = [b.name for b in mb.blocks]
    for i, n in enumerate(names):
        prev = blocks[names[i - 1]]
        one = models.deep_opteq(L=1, n=6, m=8, d=3, alpha=0.6)  # structure only
        _ = one
        w, u, b = (comp.layers[i].symbol(f"{k}{i + 1}").value for k in "WUb")
        close(out[n], 0.6 * torch.relu(prev @ w.T + x @ u.T + b) @ w + 0.4 * prev)
    assert d.claim.kind == ("minimizer" if L == 2 else "inclusion")


def _phi():
    return models.opteq(n=6, m=8, d=3, activation="relu", form="conjugate", seed=5)


def _prox_phi(phi, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w, u, b = W(phi, "W"), W(phi, "U"), W(phi, "b")
    return torch.relu(v @ w.T + x @ u.T + b) @ w


def _hand_decorrelation(zb: torch.Tensor) -> torch.Tensor:
    zm = zb.T  # m × B
    d = torch.diag(1 / zm.norm(dim=1))
    c = d @ zm @ zm.T @ d
    return 0.5 * ((c - torch.eye(zm.shape[0], dtype=T64)) ** 2).sum()


def _hand_hsic(zb: torch.Tensor, s: float) -> torch.Tensor:
    bsz = zb.shape[0]
    h = torch.eye(bsz, dtype=T64) - 1.0 / bsz
    ks = [torch.exp(-((r[:, None] - r[None, :]) ** 2) / (2 * s * s)) for r in zb.T]
    tot = 0.0
    for i in range(len(ks)):
        for j in range(i + 1, len(ks)):
            tot = tot + torch.trace(ks[i] @ h @ ks[j] @ h)
    return tot / (bsz - 1) ** 2


@pytest.mark.parametrize("case", ["sq-prox", "sq-grad", "l1-prox", "incay-grad", "decor-grad",
                                  "hsic-grad"])
def test_regularizer_edits_both_variants(case: str) -> None:
    phi = _phi()
    z = phi.states[0]
    gam = 0.3
    z_v, x = randn(5, 6), randn(5, 3)
    if case.startswith("sq"):
        reg, variant = gam * ce.SqNorm(z), {"prox": "prox", "grad": "gradient"}[case[3:]]
        inner = z_v / (1 + gam) if variant == "prox" else z_v - gam * z_v
    elif case == "l1-prox":
        reg, variant = gam * ce.L1(z), "prox"
        inner = torch.sign(z_v) * (z_v.abs() - gam).clamp_min(0)
    elif case == "incay-grad":
        reg, variant = gam * ce.FeatureIncay(z, 0.5), "gradient"
        nrm = (z_v ** 2).sum(1, keepdim=True)
        inner = (1 + 4 * gam / (nrm + 2 * 0.5) ** 2) * z_v  # docs/theory.md §4, derived sign
    else:
        hand = _hand_decorrelation if case == "decor-grad" else (lambda t: _hand_hsic(t, 1.0))
        term = ce.BatchDecorrelation(z) if case == "decor-grad" else ce.HSIC(z, 1.0)
        reg, variant = gam * term, "gradient"
        zz = z_v.clone().requires_grad_()
        (g,) = torch.autograd.grad(hand(zz), zz)
        inner = z_v - gam * g
    d = lowering.lower(phi + reg, regularizer=variant)
    close(d.apply({"z": z_v, "x": x})["z"], _prox_phi(phi, inner, x), 1e-10)
    expected = "modified minimizer" if variant == "prox" and case != "sq-prox" else None
    if case == "l1-prox":
        assert d.claim.kind == expected
    if case in ("incay-grad", "decor-grad", "hsic-grad"):
        assert d.claim.kind == "stationary point"


def test_l1_gradient_variant_is_refused() -> None:
    phi = _phi()
    with pytest.raises(ce.LoweringError, match="no closed-form prox|neither smooth"):
        lowering.lower(phi + 0.1 * ce.L1(phi.states[0]), regularizer="gradient")


def test_moreau_skip_and_precomposition() -> None:
    phi = _phi()
    z_v, x = randn(4, 6), randn(4, 3)
    d = lowering.lower(0.3 * ce.moreau(phi, 0.7))
    close(d.apply({"z": z_v, "x": x})["z"], 0.3 * _prox_phi(phi, z_v, x) + 0.7 * z_v)
    g = models.opteq(n=5, m=5, d=2, activation="tanh", seed=4)
    m = randn(5, 5) + 3 * torch.eye(5, dtype=T64)
    c = randn(5)
    dp = lowering.lower(ce.precompose(g, m, c))
    w, u, b = W(g, "W"), W(g, "U"), W(g, "b")
    zz, xx = randn(3, 5), randn(3, 2)
    a = zz @ m.T + c
    t = torch.tanh(a @ w.T @ w + xx @ u.T + b)
    ref = torch.linalg.solve(m, (t - c).T).T  # A⁻¹(T(Az))
    close(dp.apply({dp.blocks[0].name: zz, "x": xx})[dp.blocks[0].name], ref, 1e-10)
    assert "not a prox" in dp.derivation.text()


def test_geq_whole_and_patch() -> None:
    g = models.geq(n=6, p=5, d=3, gamma=0.7, seed=1)
    d = lowering.lower(g)
    z, x = randn(4, 6), randn(4, 3)
    w, u, b = W(g, "W"), W(g, "U"), W(g, "b")
    r = x @ u.T + b - z @ w.T
    ref = torch.relu(torch.exp(-0.7 * (r ** 2).sum(1, keepdim=True)) * r @ w)
    close(d.apply({"z": z, "x": x})["z"], ref)
    gp = models.geq(n=10, p=16, d=3, gamma=0.4, patch=2, image=(1, 4, 4), h=3, seed=2)
    dp = lowering.lower(gp)
    z, x = randn(2, 10), randn(2, 3)
    w, u, b, wh = W(gp, "W"), W(gp, "U"), W(gp, "b"), W(gp, "W_h")
    r = (x @ u.T + b - z @ w.T).reshape(2, 1, 4, 4)
    patches = F.unfold(r, kernel_size=2, stride=2).transpose(1, 2)  # (B, #patches, 4)
    proj = patches @ wh
    scale = torch.exp(-0.4 * (proj ** 2).sum(-1, keepdim=True))
    m_patch = scale * proj @ wh.T
    m_img = F.fold(m_patch.transpose(1, 2), (4, 4), kernel_size=2, stride=2).reshape(2, -1)
    close(dp.apply({"z": z, "x": x})["z"], torch.relu(m_img @ w))
    assert d.claim.kind == dp.claim.kind == "stationary point"


def _hand_d(zi: torch.Tensor, pzj: torch.Tensor, c: int) -> torch.Tensor:
    a = zi.reshape(zi.shape[0], c, -1)
    bb = pzj.reshape(pzj.shape[0], c, -1)
    m = a @ bb.transpose(1, 2)
    off = m - torch.diag_embed(torch.diagonal(m, dim1=1, dim2=2))
    return off.abs().sum((1, 2))


def test_mopteq_h_and_d() -> None:
    lam = 0.2
    g = models.mopteq(shapes=((2, 4, 4), (2, 2, 2)), d=3, lam=lam, seed=3)
    d = lowering.lower(g)
    z1, z2, x = randn(3, 32), randn(3, 8), randn(3, 3)
    down = lambda t: F.avg_pool2d(t.reshape(-1, 2, 4, 4), 2).reshape(t.shape[0], -1)  # noqa: E731
    up = lambda t: F.interpolate(t.reshape(-1, 2, 2, 2), scale_factor=2).reshape(  # noqa: E731
        t.shape[0], -1) / 4  # adjoint of the average pool
    zz1, zz2 = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    dsum = (_hand_d(zz1, up(zz2), 2) + _hand_d(zz2, down(zz1), 2)).sum()
    g1, g2 = torch.autograd.grad(dsum, (zz1, zz2))
    w1, u1, b1 = W(g, "W1"), W(g, "U1"), W(g, "b1")
    w2, u2, b2 = W(g, "W2"), W(g, "U2"), W(g, "b2")
    # docs/theory.md §3 row 4: σ(W_iᵀW_i z_i + q_i + ½(P_{i:i+1} z_{i+1} + P_{i-1:i}ᵀ z_{i-1}) −
    # (λ/2)∇D)
    ref1 = torch.relu(z1 @ w1.T @ w1 + x @ u1.T + b1 + 0.5 * (up(z2) + up(z2)) - lam / 2 * g1)
    ref2 = torch.relu(z2 @ w2.T @ w2 + x @ u2.T + b2 + 0.5 * (down(z1) + down(z1)) - lam / 2 * g2)
    out = d.apply({"z1": z1, "z2": z2, "x": x})
    close(out["z1"], ref1, 1e-10)
    close(out["z2"], ref2, 1e-10)
    assert d.claim.kind == "stationary point"


# ------------------------------------------------------------------ 2. derivation text
def test_l1_prox_derivation_text_and_incay_sign() -> None:
    phi = _phi()
    z = phi.states[0]
    d = lowering.lower(phi + 0.1 * ce.L1(z))
    text = d.describe()
    assert "soft-threshold" in text and "regularizer edit, prox variant" in text
    assert "minimizer of" in str(d.claim) and "M^1[0.1·||z||₁]" in str(d.claim)
    assert "NOT of φ + 0.1·||z||₁" in d.derivation.text()
    assert "\\mathrm{soft}" in d.latex()
    # incay gradient variant: sign from the term, checked by finite differences of R
    eps, gam = 0.5, 0.2
    di = lowering.lower(phi + gam * ce.FeatureIncay(z, eps), regularizer="gradient")
    zv, x = randn(1, 6), randn(1, 3)
    rfun = lambda t: 2.0 / ((t ** 2).sum() + 2 * eps)  # noqa: E731
    fd = torch.zeros(6, dtype=T64)
    for i in range(6):
        e = torch.zeros(1, 6, dtype=T64)
        e[0, i] = 1e-6
        fd[i] = (rfun(zv + e) - rfun(zv - e)) / 2e-6
    ref = _prox_phi(phi, zv - gam * fd, x)
    # central differences, h = 1e-6: ~1e-9 accuracy on ∇R
    close(di.apply({"z": zv, "x": x})["z"], ref, 1e-7)


# ------------------------------------------------------------------ 3. backward modes
def _small_module(**kw):
    d = lowering.lower(models.opteq(n=8, m=10, d=3, form="conjugate", seed=3))
    return d.torch_module(dtype=T64, **kw)


def test_gradcheck_ift_and_unrolled_agreement() -> None:
    m = _small_module(tol=1e-12, max_iter=500, backward_tol=1e-12)
    x = randn(3, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: m(t), (x,), atol=1e-6, rtol=1e-5)
    loss = lambda mod: (mod(x) ** 2).sum()  # noqa: E731
    g_ift = torch.autograd.grad(loss(m), list(m.parameters()))
    unr = _small_module(backward="unroll", unroll_steps=400)
    unr.load_state_dict(m.state_dict())
    g_unr = torch.autograd.grad(loss(unr), list(unr.parameters()))
    for a, b in zip(g_ift, g_unr):
        # contraction 0.81: 400 unrolled steps are exact to ~1e-30; IFT solved to 1e-12
        assert float((a - b).norm() / b.norm()) < 1e-8
    one = _small_module(backward="phantom", phantom_steps=1, tol=1e-12)
    one.load_state_dict(m.state_dict())
    g_one = torch.autograd.grad(loss(one), list(one.parameters()))
    dev = max(float((a - b).norm() / b.norm()) for a, b in zip(g_one, g_ift))
    print(f"one-step (phantom k=1) gradient relative deviation from IFT: {dev:.3e}")
    assert 0 < dev < 1.0  # an approximation, not the exact gradient


# ------------------------------------------------------------------ 4. solvers
def test_anderson_beats_plain_at_norm_09() -> None:
    d = lowering.lower(models.opteq(n=64, m=128, d=16, form="conjugate", weight_norm=0.9))
    x = torch.randn(32, 16, generator=GEN, dtype=T64)
    its = {}
    for s in ("plain", "anderson", "broyden"):
        mod = d.torch_module(solver=s, tol=1e-6, max_iter=500, dtype=T64)
        with torch.no_grad():
            _, st = mod(x, return_stats=True)
        assert bool(st.converged.all()) and st.max_residual <= 1e-6
        its[s] = st.mean_iterations
    print("mean iterations to 1e-6 at ||W||₂ = 0.9:", its)
    assert its["anderson"] <= 0.7 * its["plain"]


# ------------------------------------------------------------------ 5. converter
@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
@pytest.mark.parametrize("widths", [(5, 7, 3), (4, 9, 9, 6, 2), (10, 3), (3, 16, 8, 8, 8, 1)])
def test_converter_reproduces_mlps(act: type, widths: tuple[int, ...]) -> None:
    torch.manual_seed(sum(widths))
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(act())
    seq = nn.Sequential(*layers).double()
    net = lowering.convert(seq)
    x = randn(20, widths[0])
    with torch.no_grad():
        assert float((net.module()(x) - seq(x)).abs().max()) < 1e-5
    hidden = net.module().hidden(x)
    for k, obj in enumerate(net.objectives):  # each hidden layer is μ_k·prox_{φ_k}
        d = lowering.lower(obj)
        assert d.is_prox
        close(net.mus[k] * d.apply({f"u{k}": hidden[k]})[f"u{k}"], hidden[k + 1], 1e-10)


# ------------------------------------------------------------------ 6. SAM
def test_sam_selects_argmin_of_r_on_a_subspace_of_fixed_points() -> None:
    n = 6
    g = np.random.default_rng(0)
    q_, _ = np.linalg.qr(g.standard_normal((n, n)))
    v_, _ = np.linalg.qr(g.standard_normal((n, n)))
    s = np.array([1.0, 1.0, 0.6, 0.5, 0.3, 0.1])  # two singular values exactly 1
    wmat = q_ @ np.diag(s) @ v_.T
    bvec = q_[:, 2:] @ g.standard_normal(n - 2)  # b ⟂ left singular vectors with s = 1
    z, x = ce.State("z", n), ce.Input("x", 1)
    w = ce.Weight("W", (n, n), wmat)
    u = ce.Weight("U", (n, 1), np.zeros((n, 1)))
    b = ce.Weight("b", n, bvec)
    phi = ce.Objective([ce.Antiderivative("identity", w @ z + u @ x + b).conjugate(),
                        -ce.SqNorm(z)])
    c = g.standard_normal(n)
    cz = ce.Constant("c", c)
    cfg = lowering.SAMConfig(R=ce.SqNorm(z - cz), rho=0.1, c=0.44, max_iter=5000, tol=1e-2)
    mod = lowering.lower(phi).torch_module(sam=cfg, dtype=T64)
    with torch.no_grad():
        zs = mod(torch.zeros(1, 1, dtype=T64))[0].numpy()
    # closed form: Fix T = {(I - WᵀW)z = Wᵀb}; argmin ½||z - c||² over it
    a = np.eye(n) - wmat.T @ wmat
    zp = np.linalg.pinv(a) @ wmat.T @ bvec
    v1 = v_[:, :2]
    ref = zp + v1 @ v1.T @ c
    err = np.linalg.norm(zs - ref) / np.linalg.norm(ref)
    print(f"SAM relative error to argmin_(Fix T) R after 5000 steps: {err:.2e}")
    assert err < 1e-2
    # plain iteration from 0 converges to a different fixed point (not the R-minimizer)
    plain = lowering.lower(phi).torch_module(solver="plain", tol=1e-10, max_iter=2000, dtype=T64)
    with torch.no_grad():
        zp2 = plain(torch.zeros(1, 1, dtype=T64))[0].numpy()
    assert np.linalg.norm(zp2 - ref) / np.linalg.norm(ref) > 10 * err


# ------------------------------------------------------------------ 7. module behaviour
def test_state_dict_dtypes_and_errors() -> None:
    m = _small_module(tol=1e-10)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    m2 = _small_module(tol=1e-10)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)
    buf.seek(0)
    m2.load_state_dict(torch.load(buf))
    x = randn(4, 3)
    assert torch.equal(m(x), m2(x))
    m32 = lowering.lower(models.opteq(n=8, m=10, d=3, form="conjugate", seed=3)).torch_module(
        dtype=torch.float32, tol=1e-5)
    out32 = m32(x.float())
    assert out32.dtype == torch.float32
    assert float((out32.double() - m(x)).abs().max()) < 1e-4  # float32 at tol 1e-5
    m64 = m32.to(T64)
    assert m64(x).dtype == T64
    with pytest.raises(ce.ShapeError, match="expected"):
        m(randn(4, 5))
    with pytest.raises(ce.NonFiniteError):
        m(torch.full((2, 3), float("nan"), dtype=T64))
    with pytest.raises(ce.OptionError, match="unknown solver"):
        _small_module(solver="newton")
    with pytest.raises(TypeError):
        _small_module(colour="red")


def test_divergent_configuration_raises_helpfully() -> None:
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="conjugate", weight_norm=1.5,
                                    activation="identity", seed=0))
    m = d.torch_module(solver="plain", max_iter=50, dtype=T64)
    with pytest.raises((ce.ConvergenceError, ce.NonFiniteError)) as err:
        m(randn(2, 3))
    msg = str(err.value)
    assert "Lip(T)" in msg or "diverged" in msg
    with pytest.warns(ce.ConvergenceWarning, match="Lip"):
        d.torch_module(solver="plain", max_iter=3, on_nonconvergence="warn",
                       dtype=T64)(randn(2, 3))


def test_torch_compile_matches_eager() -> None:
    m = _small_module(tol=1e-10)
    x = randn(4, 3)
    ref = m(x)
    g_ref = torch.autograd.grad(ref.sum(), list(m.parameters()))
    cm = torch.compile(m)
    out = cm(x)
    # inside torch.compile the solves run in compiled chunks, which may stop a few iterations
    # after the eager loop (docs/theory.md §8); both points have relative residual ≤ 1e-10 of
    # a contraction of this small layer, so they agree to ~1e-9 of |z| (|z| = O(1)) on any BLAS
    close(out, ref, 1e-8)
    g = torch.autograd.grad(out.sum(), list(m.parameters()))
    for a, b in zip(g, g_ref):
        close(a, b, 1e-7)


def test_weight_control_keeps_the_certificate() -> None:
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="conjugate", weight_norm=1.4, seed=1))
    for mode in ("spectral_norm", "project"):
        m = d.torch_module(weight_control=mode, margin=0.05, dtype=T64)
        _ = m(randn(2, 3))
        w_eff = m.env()["W"]
        assert float(torch.linalg.matrix_norm(w_eff.detach(), 2)) <= 0.95 + 1e-3


def test_weight_control_two_forwards_before_one_backward() -> None:
    """The power-iteration buffer is updated in place by every forward; the first forward's
    graph must survive it (it raised "modified by an inplace operation" before the clone)."""
    d = lowering.lower(models.opteq(conv=(4, 3), image=(1, 8, 8)))
    m = d.torch_module(weight_control="spectral_norm", dtype=T64)
    x = randn(3, 64)
    (m(x).sum() + m(2 * x).sum()).backward()
    assert torch.isfinite(m.weights["W"].grad).all()


def test_perturbation_from_objective() -> None:
    g = models.opteq(n=6, m=6, d=4, seed=0)
    p = lowering.perturbation(g, 0.05)
    assert p.exact and "sign(Uᵀ(z))" in str(p)
    z, x = randn(3, 6), randn(3, 4)
    delta = p.delta({"z": z, "x": x})["x"]
    close(delta, 0.05 * torch.sign(z @ W(g, "U")))
    # it maximizes G(z; x - δ) over the ℓ∞ ball (G affine in x): compare with random signs
    base = g.value_tensor({"z": z, "x": x - delta})
    for _ in range(5):
        other = 0.05 * torch.sign(randn(3, 4))
        assert bool((g.value_tensor({"z": z, "x": x - other}) <= base + 1e-12).all())


def test_unknown_lowering_option_and_no_rule() -> None:
    with pytest.raises(ce.OptionError, match="unknown option"):
        lowering.lower(_phi(), colour="red")
    z = ce.State("z", 3)
    with pytest.raises(ce.LoweringError, match="no lowering rule"):
        lowering.lower(ce.Objective([ce.L1(z), ce.Potential("relu", z)]))
    assert math.isfinite(1.0)


def test_cvxpylayers_backend_matches_fixed_point_module() -> None:
    d = lowering.lower(models.opteq(n=6, m=8, d=3, form="conjugate", seed=3))
    fp = d.torch_module(tol=1e-12, max_iter=500, dtype=T64)
    cl = d.torch_module(backend="cvxpylayers")
    x = randn(3, 3).requires_grad_()
    z_fp, z_cl = fp(x), cl(x)
    assert z_cl.shape == z_fp.shape
    # SCS at eps 1e-10 (cvxpylayers' conic solve) vs fixed point at 1e-12
    assert float((z_fp - z_cl).abs().max()) < 1e-6
    (g_fp,) = torch.autograd.grad(z_fp.sum(), x)
    (g_cl,) = torch.autograd.grad(z_cl.sum(), x)
    assert float((g_fp - g_cl).norm() / g_fp.norm()) < 1e-4
    with pytest.raises(ce.OptionError, match="unknown option"):
        d.torch_module(backend="cvxpylayers", solver="anderson")
    with pytest.raises(ce.OptionError, match="unknown backend"):
        d.torch_module(backend="jax")


def test_forward_backward_with_only_smooth_terms_uses_one_as_the_prox_term() -> None:
    """``M^μ[c||z||₁](z) + ½||z − Ux||²`` (all smooth): one prox-able term becomes g, the
    printed gradient step keeps its parentheses, and T's fixed point is the minimizer."""
    z, x = ce.State("z", 4), ce.Input("x", 3)
    U = ce.Weight("U", (4, 3), np.random.default_rng(0).normal(size=(4, 3)))
    phi = ce.moreau(ce.L1(z) * 0.3, 0.5) + ce.SqNorm(z - U @ x)
    d = lowering.lower(phi)
    assert d.derivation.steps[-1].rule == "forward–backward fallback"
    assert "(z - (z - U x))" in d.describe()
    xv = torch.as_tensor(np.random.default_rng(1).normal(size=(2, 3)))
    m = d.torch_module(dtype=T64, tol=1e-12, max_iter=500)
    zs = m(xv).detach()
    u = xv @ torch.as_tensor(U.value).T  # the unregularized minimizer, which z* must not be
    zz = zs.clone().requires_grad_()
    g = torch.autograd.grad(phi.value_tensor({"z": zz, "x": xv}).sum(), zz)[0]
    assert float(g.abs().max()) < 1e-9, "gradient of the (smooth) objective vanishes at z*"
    assert not torch.allclose(zs, u)
