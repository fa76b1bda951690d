"""Regularizer, kernel and coupling terms: ℓ1 / ℓ∞-ball indicator, feature incay, batch
decorrelation, HSIC, Gaussian kernels (plain and patch-split), MOptEq coupling H and D.

All numerics in float64.  Every closed-form gradient is compared with two independent references:
torch autograd of ``term.value(...).sum()`` and central finite differences.  Central differences
with step ``h = 1e-5`` have truncation error ``O(h²·|f'''|) ≈ 1e-10`` and round-off error
``O(eps·|f|/h) ≈ 1e-11`` on these O(1) functions, so a relative tolerance of 1e-6 is loose
enough never to fail by accident yet tight enough to catch any wrong factor or sign.
"""

from __future__ import annotations

import math

import cvxpy as cp
import numpy as np
import pytest
import torch

import convex_eq as ce
from convex_eq import Objective, SqNorm, moreau
from convex_eq.errors import NotDCPError, ScaleError, ShapeError
from convex_eq.export import ExportContext
from convex_eq.operators import Conv2d, Dense, Identity, downsample_or_identity
from convex_eq.symbols import Constant, Input, Scalar, State, Weight
from convex_eq.terms.coupling import ChannelDecorrelation, Coupling
from convex_eq.terms.decorrelation import BatchDecorrelation
from convex_eq.terms.gaussian_kernel import GaussianKernel, PatchGaussianKernel
from convex_eq.terms.hsic import HSIC
from convex_eq.terms.incay import FeatureIncay
from convex_eq.terms.l1 import L1, LinfBallIndicator

DT = torch.float64


FD_STEP = 1e-5


RTOL = 1e-6


def _rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=DT)


# --------------------------------------------------------------------------- gradient references
def autograd_grad(term, values, env=None):
    vals = {k: v.clone().requires_grad_(True) for k, v in values.items()}
    total = term.value(vals, env).sum()
    names = [s.name for s in term.states()]
    gs = torch.autograd.grad(total, [vals[n] for n in names])
    return dict(zip(names, gs))


def fd_grad(term, values, env=None, h=FD_STEP):
    out = {}
    for s in term.states():
        base = values[s.name]
        g = torch.zeros_like(base)
        for idx in np.ndindex(*base.shape):
            plus = {**values, s.name: base.clone()}
            minus = {**values, s.name: base.clone()}
            plus[s.name][idx] += h
            minus[s.name][idx] -= h
            fp = float(term.value(plus, env).sum())
            fm = float(term.value(minus, env).sum())
            g[idx] = (fp - fm) / (2 * h)
        out[s.name] = g
    return out


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, what: str = ""):
    err = float((a - b).norm())
    ref = max(float(b.norm()), 1e-12)
    assert err <= rtol * ref, f"{what}: relative error {err / ref:.3g} > {rtol:g}"


# --------------------------------------------------------------------------- term cases
def _case_incay():
    z = State("z", 5)
    return FeatureIncay(z, 0.3), {"z": _rand(3, 5, seed=1)}, None


def _case_incay_affine():
    z, x = State("z", 4), Input("x", 3)
    W = Weight("W", (3, 4), seed=2)
    return 0.7 * FeatureIncay(W @ z + x, 0.2), {"z": _rand(3, 4, seed=3),
                                                 "x": _rand(3, 3, seed=4)}, None


def _case_decorrelation():
    z = State("z", 4)
    return BatchDecorrelation(z), {"z": _rand(6, 4, seed=5)}, None


def _case_decorrelation_affine():
    z = State("z", 3)
    W = Weight("W", (5, 3), seed=6)
    return 1.5 * BatchDecorrelation(W @ z), {"z": _rand(7, 3, seed=7)}, None


def _case_hsic():
    z = State("z", 4)
    return HSIC(z, 0.8), {"z": _rand(5, 4, seed=8)}, None


def _case_hsic_scalar():
    z = State("z", 3)
    lam = Scalar("lam", 0.4, low=0)
    sig = Scalar("sigma", 1.3, low=0, low_open=True)
    return HSIC(z, sig) * lam, {"z": _rand(6, 3, seed=9)}, None


def _case_gauss_dense():
    z, x = State("z", 4), Input("x", 5)
    W = Weight("W", (5, 4), seed=10)
    gam = Scalar("gamma", 0.3, low=0, low_open=True)
    return GaussianKernel(x - W @ z, gam), {"z": _rand(3, 4, seed=11, scale=0.5),
                                            "x": _rand(3, 5, seed=12, scale=0.5)}, None


def _case_gauss_conv():
    z, q = State("z", (2, 4, 4)), Input("q", (3, 4, 4))
    conv = Conv2d(Weight("K", (3, 2, 3, 3), seed=13), (2, 4, 4), padding=1)
    return 2.0 * GaussianKernel(q - conv @ z, 0.05), {"z": _rand(2, 32, seed=14, scale=0.3),
                                                      "q": _rand(2, 48, seed=15, scale=0.3)}, None


def _case_patch():
    z, q = State("z", (2, 4, 4)), Input("q", (2, 4, 4))
    conv = Conv2d(Weight("K", (2, 2, 3, 3), seed=16), (2, 4, 4), padding=1)
    Wh = Weight("W_h", (8, 3), seed=17)
    term = PatchGaussianKernel(q, conv @ z, 0.4, 2, Wh, (2, 4, 4))
    values = {"z": _rand(2, 32, seed=18, scale=0.4), "q": _rand(2, 32, seed=19, scale=0.4)}
    return term, values, None


def _case_coupling_down():
    zi, zj = State("z_i", (2, 2, 2)), State("z_j", (2, 4, 4))
    P = downsample_or_identity(zj.shape, zi.shape)
    values = {"z_i": _rand(3, 8, seed=20), "z_j": _rand(3, 32, seed=21)}
    return 0.5 * Coupling(zi, zj, P), values, None


def _case_coupling_same_state():
    z = State("z", 4)
    M = Constant("M", _rand(4, 4, seed=22))
    return Coupling(z, z, M), {"z": _rand(3, 4, seed=23)}, None


def _case_channel_decorrelation():
    zi, zj = State("z_i", (3, 2, 2)), State("z_j", (3, 4, 4))
    P = downsample_or_identity(zj.shape, zi.shape)
    return ChannelDecorrelation(zi, zj, P), {"z_i": _rand(2, 12, seed=24),
                                             "z_j": _rand(2, 48, seed=25)}, None


def _case_channel_decorrelation_up():
    zi, zj = State("z_i", (2, 4, 4)), State("z_j", (2, 2, 2))
    P = downsample_or_identity(zj.shape, zi.shape)  # transpose of the down-sampling
    return 0.3 * ChannelDecorrelation(zi, zj, P), {"z_i": _rand(2, 32, seed=26),
                                                   "z_j": _rand(2, 8, seed=27)}, None


CASES = {
    "incay": _case_incay,
    "incay_affine": _case_incay_affine,
    "decorrelation": _case_decorrelation,
    "decorrelation_affine": _case_decorrelation_affine,
    "hsic": _case_hsic,
    "hsic_scalar": _case_hsic_scalar,
    "gauss_dense": _case_gauss_dense,
    "gauss_conv": _case_gauss_conv,
    "patch": _case_patch,
    "coupling_down": _case_coupling_down,
    "coupling_same_state": _case_coupling_same_state,
    "channel_decorrelation": _case_channel_decorrelation,
    "channel_decorrelation_up": _case_channel_decorrelation_up,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_matches_autograd_and_finite_differences(case):
    term, values, env = CASES[case]()
    g = term.grad(values, env)
    ga = autograd_grad(term, values, env)
    gf = fd_grad(term, values, env)
    assert set(g) == set(ga) == {s.name for s in term.states()}
    for name in g:
        assert g[name].shape == values[name].shape
        assert_rel_close(g[name], ga[name], 1e-10, f"{case}/{name} vs autograd")
        assert_rel_close(g[name], gf[name], RTOL, f"{case}/{name} vs finite differences")


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_values_and_grads(case):
    term, values, env = CASES[case]()
    v64 = term.value(values, env)
    g64 = term.grad(values, env)
    v32 = term.value({k: v.float() for k, v in values.items()}, env)
    g32 = term.grad({k: v.float() for k, v in values.items()}, env)
    assert v32.dtype == torch.float32 and v32.shape == v64.shape
    assert torch.allclose(v32.double(), v64, rtol=1e-4, atol=1e-5)
    for k in g64:
        assert g32[k].dtype == torch.float32
        assert torch.allclose(g32[k].double(), g64[k], rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- feature incay
def test_incay_gradient_sign_is_derived_not_printed():
    z = State("z", 6)
    eps = 0.25
    term = FeatureIncay(z, eps)
    u = _rand(4, 6, seed=30)
    vals = {"z": u}
    g = term.grad(vals)["z"]
    a = (u * u).sum(-1, keepdim=True) + 2 * eps
    assert torch.allclose(g, -4 * u / a**2)
    # g points to the origin; a small step along -g decreases R in every sample
    assert bool(((g * u).sum(-1) < 0).all())
    t = 1e-3
    assert bool((term.value({"z": u - t * g}) < term.value(vals)).all())
    # layer of docs/theory.md §4: z - γ∇R = (1 + 4γ/(||z||²+2ε)²) z (enlarges the features)
    gam = 0.1
    assert torch.allclose(u - gam * g, (1 + 4 * gam / a**2) * u)
    # the sign printed in the paper (+4z/(...)²) is not the gradient: it is not a descent direction
    printed = 4 * u / a**2
    assert not torch.allclose(printed, autograd_grad(term, vals)["z"])
    assert bool((term.value({"z": u - t * printed}) > term.value(vals)).all())


def test_incay_lipschitz_bound_holds_and_is_attained_near_zero():
    z = State("z", 3)
    eps = 0.2
    term = FeatureIncay(z, eps)
    bound = term.grad_lipschitz()
    assert bound == pytest.approx(1 / eps**2)
    gen = torch.Generator().manual_seed(31)
    worst = 0.0
    for scale in (1e-3, 0.1, 0.5, 1.0, 3.0):
        a = scale * torch.randn(200, 3, generator=gen, dtype=DT)
        b = a + 1e-4 * torch.randn(200, 3, generator=gen, dtype=DT)
        ga, gb = term.grad({"z": a})["z"], term.grad({"z": b})["z"]
        ratio = (ga - gb).norm(dim=-1) / (a - b).norm(dim=-1)
        worst = max(worst, float(ratio.max()))
    assert worst <= bound * (1 + 1e-9)
    assert worst >= 0.9 * bound  # the sup of the Hessian norm is attained at z = 0


def test_incay_rejects_nonpositive_eps_and_has_no_export():
    z = State("z", 3)
    with pytest.raises(ScaleError, match="2/"):
        FeatureIncay(z, 0.0)
    eps = Scalar("eps", 0.1)
    term = FeatureIncay(z, eps)
    with pytest.raises(ScaleError) as err:
        term.value({"z": _rand(2, 3)}, {"eps": -1.0})
    assert err.value.term == str(term)
    assert term.curvature().kind == "unknown" and "convex" in term.curvature().reason
    assert not term.has_prox
    ctx = ExportContext([z], {}, None)
    ctx.finalize_variables()
    with pytest.raises(NotDCPError) as err:
        term.export(ctx)
    assert "feature incay" in str(err.value) and str(term) in str(err.value)


# --------------------------------------------------------------------------- ℓ1 and its conjugate
def _numeric_prox_l1(v: np.ndarray, t: float) -> np.ndarray:
    u = cp.Variable(v.size)
    cp.Problem(cp.Minimize(cp.norm1(u) + cp.sum_squares(u - v) / (2 * t))).solve(
        solver=cp.CLARABEL, tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
    return np.asarray(u.value)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_l1_prox_matches_numeric_prox(seed):
    z = State("z", 7)
    term = L1(z)
    v = _rand(2, 7, seed=40 + seed, scale=1.5)
    for t in (0.3, 1.0, 2.2):
        p = term.prox(v, t).numpy()
        for b in range(v.shape[0]):
            np.testing.assert_allclose(p[b], _numeric_prox_l1(v[b].numpy(), t), atol=1e-7)


def test_l1_prox_scalar_coefficient():
    z = State("z", 5)
    lam = Scalar("lam", 0.5, low=0)
    term = L1(z) * lam * 2.0
    v = _rand(3, 5, seed=44, scale=2.0)
    c = 0.5 * 2.0 * 0.7  # prox of t·coef·||·||₁ with t = 0.7
    expected = torch.sign(v) * torch.clamp(v.abs() - c, min=0)
    assert torch.allclose(term.prox(v, 0.7), expected)
    assert torch.allclose(term.prox(v, 0.7, {"lam": 1.0}),
                          torch.sign(v) * torch.clamp(v.abs() - 1.4, min=0))


@pytest.mark.parametrize("coef", [1.0, 0.3, 2.5])
def test_moreau_identity_with_linf_ball_conjugate(coef):
    z = State("z", 6)
    term = coef * L1(z)
    conj = term.conjugate()
    assert isinstance(conj, LinfBallIndicator)
    v = _rand(5, 6, seed=45, scale=2.0)
    assert torch.allclose(term.prox(v) + conj.prox(v), v, atol=1e-14)
    # prox of the conjugate is the projection onto the ℓ∞ ball of radius coef
    assert torch.allclose(conj.prox(v), v.clamp(-coef, coef))
    # the biconjugate is the original term
    back = conj.conjugate()
    assert isinstance(back, L1) and back.coef() == pytest.approx(coef)


def test_moreau_identity_with_scalar_coefficient():
    z = State("z", 4)
    lam = Scalar("lam", 0.8, low=0)
    term = L1(z) * lam
    conj = term.conjugate()
    assert lam in conj.symbols()
    v = _rand(3, 4, seed=46, scale=2.0)
    for env in (None, {"lam": 1.7}):
        assert torch.allclose(term.prox(v, 1.0, env) + conj.prox(v, 1.0, env), v, atol=1e-14)


def test_fenchel_young_l1_linf():
    z = State("z", 5)
    c = 1.3
    f = c * L1(z)
    fstar = f.conjugate()
    x = _rand(50, 5, seed=47, scale=2.0)
    gen = torch.Generator().manual_seed(48)
    y_in = c * (2 * torch.rand(50, 5, generator=gen, dtype=DT) - 1)  # ||y||∞ ≤ c
    y_out = y_in.clone()
    y_out[:, 0] = c * 1.01
    fx = f.value({"z": x})
    inner = (x * y_in).sum(-1)
    assert bool((fstar.value({"z": y_in}) == 0).all())
    assert bool(torch.isinf(fstar.value({"z": y_out})).all())
    assert bool((fx + fstar.value({"z": y_in}) >= inner - 1e-12).all())
    # equality exactly for y ∈ ∂f(x) = c·sign(x)
    y_sub = c * torch.sign(x)
    assert torch.allclose(fx + fstar.value({"z": y_sub}), (x * y_sub).sum(-1))
    # the conjugate value is the sup: a numeric sup over x for y inside the ball is 0
    yv = y_in[0].numpy()
    xv = cp.Variable(5)
    prob = cp.Problem(cp.Maximize(yv @ xv - c * cp.norm1(xv)), [cp.norm_inf(xv) <= 100])
    prob.solve(solver=cp.CLARABEL)
    assert prob.value == pytest.approx(0.0, abs=1e-6)


def test_l1_and_ball_export_solve_to_their_prox():
    from convex_eq.objective import Objective
    from convex_eq.terms.quadratic import SqNorm

    z, x = State("z", 6), Input("x", 6)
    xv = _rand(1, 6, seed=49, scale=2.0)
    c = 0.6
    obj = Objective([SqNorm(z - x), c * L1(z)])
    prob = obj.to_cvxpy(x=xv[0].numpy())
    prob.solve()
    expected = torch.sign(xv[0]) * torch.clamp(xv[0].abs() - c, min=0)
    np.testing.assert_allclose(prob.state_values()["z"], expected.numpy(), atol=1e-7)
    obj2 = Objective([SqNorm(z - x), (c * L1(z)).conjugate()])
    prob2 = obj2.to_cvxpy(x=xv[0].numpy())
    prob2.solve()
    np.testing.assert_allclose(prob2.state_values()["z"], xv[0].clamp(-c, c).numpy(), atol=1e-7)


def test_l1_refusals():
    z = State("z", 3)
    with pytest.raises(NotDCPError):
        (-1.0 * L1(z)).conjugate()
    with pytest.raises(ScaleError) as err:
        LinfBallIndicator(z, 0.0)
    assert "ι" in err.value.term
    ctx = ExportContext([z], {}, None)
    ctx.finalize_variables()
    with pytest.raises(NotDCPError) as err:
        (-2.0 * L1(z)).export(ctx)
    assert "||z||₁" in str(err.value)


# --------------------------------------------------------------------------- Gaussian kernels
def _lipschitz_ratios(term, name, values, n_pairs, seed, scales):
    """Max of ||∇(a) - ∇(b)|| / ||a - b|| over near and far random pairs in state ``name``."""
    gen = torch.Generator().manual_seed(seed)
    dim = next(s.size for s in term.states() if s.name == name)
    worst = 0.0
    for scale in scales:
        a = scale * torch.randn(n_pairs, dim, generator=gen, dtype=DT)
        b = a + 1e-3 * scale * torch.randn(a.shape, generator=gen, dtype=DT)
        other = {k: v.expand(n_pairs, -1) for k, v in values.items() if k != name}
        ga = term.grad({**other, name: a})[name]
        gb = term.grad({**other, name: b})[name]
        worst = max(worst, float(((ga - gb).norm(dim=-1) / (a - b).norm(dim=-1)).max()))
        a2 = scale * torch.randn(n_pairs, a.shape[1], generator=gen, dtype=DT)
        ga2 = term.grad({**other, name: a2})[name]
        worst = max(worst, float(((ga - ga2).norm(dim=-1) / (a - a2).norm(dim=-1)).max()))
    return worst


def test_gaussian_kernel_gradient_formula_and_lipschitz_one():
    r = State("r", 5)
    gam = 0.7
    term = GaussianKernel(r, gam)
    u = _rand(4, 5, seed=50)
    e = torch.exp(-gam * (u * u).sum(-1, keepdim=True))
    assert torch.allclose(term.value({"r": u}), e[:, 0] / (2 * gam))
    assert torch.allclose(term.grad({"r": u})["r"], -e * u)
    assert term.grad_lipschitz() == 1.0
    worst = _lipschitz_ratios(term, "r", {}, 300, 51, (1e-3, 0.3, 1.0, 2.0))
    assert worst <= 1.0 + 1e-9
    assert worst >= 0.95  # attained at r = 0: the bound is tight


def test_gaussian_kernel_lipschitz_through_weight():
    z, x = State("z", 4), Input("x", 6)
    W = Weight("W", (6, 4), seed=52)
    term = GaussianKernel(x - W @ z, 0.5)
    wn = float(np.linalg.norm(W.value.numpy(), 2))
    bound = term.grad_lipschitz()
    assert bound == pytest.approx(wn**2, rel=1e-8)
    xv = _rand(1, 6, seed=53, scale=0.2)
    worst = _lipschitz_ratios(term, "z", {"x": xv}, 300, 54, (1e-2, 0.3, 1.0))
    assert worst <= bound * (1 + 1e-8)


def test_gaussian_kernel_layer_matches_math_formula():
    # ∇_z S for S = (1/2γ) exp(-γ||q - Wz||²) is e^{-γ||q-Wz||²} Wᵀ(q - Wz)   (docs/theory.md §3)
    z, q = State("z", 4), Input("q", 5)
    W = Weight("W", (5, 4), seed=55)
    gam = 0.3
    term = GaussianKernel(q - W @ z, gam)
    zv, qv = _rand(3, 4, seed=56), _rand(3, 5, seed=57)
    r = qv - zv @ W.value.T
    expected = torch.exp(-gam * (r * r).sum(-1, keepdim=True)) * (r @ W.value)
    assert torch.allclose(term.grad({"z": zv, "q": qv})["z"], expected)


def _patch_reference_value(r: np.ndarray, shape, p: int, wh: np.ndarray, gam: float) -> float:
    c, h, w = shape
    img = r.reshape(c, h, w)
    tot = 0.0
    for i in range(0, h, p):
        for j in range(0, w, p):
            patch = img[:, i:i + p, j:j + p].reshape(-1)  # (C, p, p) row-major
            y = patch @ wh
            tot += math.exp(-gam * float(y @ y))
    return tot / (2 * gam)


def test_patch_kernel_value_matches_explicit_loop():
    term, values, _ = _case_patch()
    v = term.value(values).numpy()
    conv = term.wz.entries[0].op
    zimg = conv.apply(values["z"]).numpy()
    r = values["q"].numpy() - zimg
    wh = term.W_h.value.numpy()
    for b in range(r.shape[0]):
        assert v[b] == pytest.approx(_patch_reference_value(r[b], (2, 4, 4), 2, wh, 0.4),
                                     rel=1e-12)
    assert term.n_patches == 4


def test_patch_kernel_one_patch_identity_equals_gaussian_kernel():
    z, q = State("z", (3, 4, 4)), Input("q", (3, 4, 4))
    conv = Conv2d(Weight("K", (3, 3, 3, 3), seed=58), (3, 4, 4), padding=1)
    gam = 0.05
    patch = PatchGaussianKernel(q, conv @ z, gam, 4, Constant("I48", np.eye(48)), (3, 4, 4))
    plain = GaussianKernel(q - conv @ z, gam)
    vals = {"z": _rand(3, 48, seed=59, scale=0.5), "q": _rand(3, 48, seed=60, scale=0.5)}
    assert patch.n_patches == 1
    assert torch.allclose(patch.value(vals), plain.value(vals), rtol=1e-13)
    assert torch.allclose(patch.grad(vals)["z"], plain.grad(vals)["z"], rtol=1e-12)
    assert patch.grad_lipschitz() == pytest.approx(plain.grad_lipschitz(), rel=1e-8)


def test_patch_kernel_lipschitz_bound():
    z, q = State("z", (2, 4, 4)), Input("q", (2, 4, 4))
    Wh = Weight("W_h", (8, 5), seed=61)
    gam = 0.5
    term = PatchGaussianKernel(q, z, gam, 2, Wh, (2, 4, 4))
    bound = term.grad_lipschitz()
    assert bound == pytest.approx(float(np.linalg.norm(Wh.value.numpy(), 2)) ** 2, rel=1e-12)
    worst = _lipschitz_ratios(term, "z", {"q": torch.zeros(1, 32, dtype=DT)}, 200, 62,
                              (1e-3, 0.3, 1.0))
    assert worst <= bound * (1 + 1e-9)
    assert worst >= 0.5 * bound


def test_patch_kernel_unpatch_inverts_patches():
    term, _, _ = _case_patch()
    r = _rand(3, 32, seed=63)
    assert torch.equal(term.unpatch(term.patches(r)), r)


def test_gaussian_kernel_scale_errors():
    z, x = State("z", 3), Input("x", 3)
    for bad in (0.0, -1.0):
        with pytest.raises(ScaleError) as err:
            GaussianKernel(x - z, bad)
        assert "exp(" in err.value.term and "γ" in str(err.value)
    gam = Scalar("gamma", 0.5)
    term = GaussianKernel(x - z, gam)
    assert gam in term.symbols()
    with pytest.raises(ScaleError) as err:
        term.value({"z": _rand(1, 3), "x": _rand(1, 3)}, {"gamma": -0.5})
    assert err.value.term == str(term)
    with pytest.raises(ScaleError):
        PatchGaussianKernel(Input("q", (1, 2, 2)), State("w", (1, 2, 2)), -0.1, 2, np.eye(4),
                            (1, 2, 2))
    # a Scalar's own declared range is enforced too, reported against the term
    capped = GaussianKernel(x - z, Scalar("gamma2", 0.5, low=0, high=1))
    with pytest.raises(ScaleError, match="admissible range") as err:
        capped.value({"z": _rand(1, 3), "x": _rand(1, 3)}, {"gamma2": 2.0})
    assert err.value.term == str(capped)


def test_patch_kernel_shape_errors():
    z, q = State("z", (2, 6, 6)), Input("q", (2, 6, 6))
    with pytest.raises(ShapeError, match="does not divide") as err:
        PatchGaussianKernel(q, z, 0.5, 4, Weight("Wa", (32, 3)), (2, 6, 6))
    assert "patches" in err.value.term
    with pytest.raises(ShapeError, match=r"W_h has shape \(10, 3\)"):
        PatchGaussianKernel(q, z, 0.5, 2, Weight("Wb", (10, 3)), (2, 6, 6))
    with pytest.raises(ShapeError, match="image_shape"):
        PatchGaussianKernel(q, z, 0.5, 2, Weight("Wc", (8, 3)), (2, 4, 4))
    with pytest.raises(ShapeError, match="size"):
        PatchGaussianKernel(Input("q2", (2, 4, 4)), z, 0.5, 2, Weight("Wd", (8, 3)), (2, 6, 6))


def test_kernels_refuse_export_and_are_not_convex():
    z, x = State("z", 3), Input("x", 3)
    for term in (GaussianKernel(x - z, 0.5),
                 PatchGaussianKernel(Input("q", (1, 2, 2)), State("w", (1, 2, 2)), 0.5, 1,
                                     np.eye(1), (1, 2, 2))):
        cur = term.curvature()
        assert cur.kind == "unknown"
        assert cur.reason == "Gaussian kernel term is neither convex nor concave"
        ctx = ExportContext(term.states(), {"x": np.zeros(3), "q": np.zeros(4)}, None)
        ctx.finalize_variables()
        with pytest.raises(NotDCPError) as err:
            term.export(ctx)
        assert err.value.term == str(term)


# --------------------------------------------------------------------------- decorrelation, HSIC
def test_batch_decorrelation_matches_numpy():
    term, values, _ = _case_decorrelation()
    u = values["z"].numpy()
    Z = u.T
    D = np.diag(1.0 / np.linalg.norm(Z, axis=1))
    R = 0.5 * np.linalg.norm(D @ Z @ Z.T @ D - np.eye(Z.shape[0]), "fro") ** 2
    v = term.value(values).numpy()
    np.testing.assert_allclose(v, np.full(u.shape[0], R / u.shape[0]), rtol=1e-12)
    assert v.sum() == pytest.approx(R, rel=1e-12)
    assert term.batch_coupled


def test_batch_decorrelation_zero_row_is_finite():
    z = State("z", 3)
    term = BatchDecorrelation(z)
    u = _rand(5, 3, seed=70)
    u[:, 1] = 0.0  # a dead feature
    v = term.value({"z": u})
    g = term.grad({"z": u})["z"]
    ga = autograd_grad(term, {"z": u})["z"]
    assert torch.isfinite(v).all() and torch.isfinite(g).all() and torch.isfinite(ga).all()
    assert torch.allclose(g, ga)
    assert torch.all(g[:, 1] == 0)
    # the remaining features: R of the non-zero rows only
    ref = BatchDecorrelation(State("y", 2)).value({"y": u[:, [0, 2]]})
    assert torch.allclose(v, ref)


def test_batch_decorrelation_of_one_sample_is_constant_with_zero_gradient() -> None:
    """With one sample ``D Z = sign(uᵀ)``, so ``R = ½k(k − 1)`` for ``k`` non-zero features and
    its gradient is exactly 0, also next to a zero feature (entries ~1e-15: the round-off of a
    state that is 0), where autograd through the row normalization returned ~0.1."""
    term = 0.19239 * BatchDecorrelation(State("z", 4))
    tiny = [float.fromhex(h) for h in ("-0x1.acp-51", "-0x1.4p-51", "0x0p+0", "0x1.6p-51")]
    for row, k in ((tiny, 3), ([0.3, -2.0, 5.0, 1e-3], 4), ([0.0, 0.0, 1.0, 0.0], 1)):
        u = torch.tensor([row], dtype=torch.float64, requires_grad=True)
        v = term.value({"z": u})
        assert float(v.detach()[0]) == 0.19239 * 0.5 * k * (k - 1)  # the closed form, exactly
        (g,) = torch.autograd.grad(v.sum(), u)
        assert torch.equal(g, torch.zeros_like(g))
        analytic = term.grad({"z": u.detach()})["z"]
        assert torch.equal(analytic, torch.zeros(1, 4, dtype=torch.float64))


def _hsic_reference(u: np.ndarray, sigma: float) -> float:
    B, m = u.shape
    H = np.eye(B) - np.ones((B, B)) / B
    Ks = []
    for i in range(m):
        x = u[:, i]
        Ks.append(np.exp(-((x[:, None] - x[None, :]) ** 2) / (2 * sigma**2)))
    tot = 0.0
    for i in range(m):
        for j in range(i + 1, m):
            tot += np.trace(Ks[i] @ H @ Ks[j] @ H) / (B - 1) ** 2
    return tot


def test_hsic_matches_pairwise_loop():
    for seed, (B, m, s) in enumerate([(5, 4, 0.8), (8, 3, 2.0), (2, 2, 0.5)]):
        z = State(f"z{seed}", m)
        term = HSIC(z, s)
        u = _rand(B, m, seed=80 + seed)
        v = term.value({z.name: u}).numpy()
        R = _hsic_reference(u.numpy(), s)
        np.testing.assert_allclose(v, np.full(B, R / B), rtol=1e-11)


def test_hsic_is_zero_for_independent_constant_feature():
    z = State("z", 2)
    u = _rand(6, 2, seed=90)
    u[:, 1] = 3.0  # a constant feature: its centred Gram matrix vanishes
    assert float(HSIC(z, 1.0).value({"z": u}).abs().max()) < 1e-15


def test_decorrelation_hsic_errors_and_refusals():
    with pytest.raises(ShapeError, match="at least 2 features"):
        HSIC(State("a", 1), 1.0)
    with pytest.raises(ShapeError, match="at least 2 features"):
        BatchDecorrelation(State("b", 1))
    z = State("z", 3)
    with pytest.raises(ScaleError) as err:
        HSIC(z, 0.0)
    assert "HSIC" in err.value.term
    with pytest.raises(ShapeError, match="at least 2 samples"):
        HSIC(z, 1.0).value({"z": _rand(1, 3)})
    for term in (HSIC(z, 1.0), BatchDecorrelation(z)):
        assert term.curvature().kind == "unknown"
        ctx = ExportContext([z], {}, None)
        ctx.finalize_variables()
        with pytest.raises(NotDCPError) as err:
            term.export(ctx)
        assert err.value.term == str(term)


# --------------------------------------------------------------------------- coupling H and D
def test_coupling_value_equals_dense_bilinear_form():
    term, values, _ = _case_coupling_down()
    P = term.P.matrix()
    zi, zj = values["z_i"].numpy(), values["z_j"].numpy()
    expected = 0.5 * np.einsum("bi,ij,bj->b", zi, P, zj)
    np.testing.assert_allclose(term.value(values).numpy(), expected, rtol=1e-12)
    assert term.grad_lipschitz() == pytest.approx(0.5 * 0.5 * 2)  # |c|·||P||·(1 + 1), ||P|| = 1/2
    assert term.raw_grad_lipschitz(None) == [0.5, 0.5]


def test_coupling_quad_parts_reproduce_value():
    term, values, _ = _case_coupling_down()
    (qp,) = term.quad_parts()
    assert qp.coef == 0.5 and qp.u2 is not None and qp.source == str(term)
    v = qp.coef * (qp.u1.evaluate(values) * qp.u2.evaluate(values)).sum(-1)
    assert torch.allclose(v, term.value(values))
    assert term.curvature().kind == "unknown"


def test_coupling_export_through_collected_quadratic():
    from convex_eq.objective import Objective
    from convex_eq.terms.quadratic import Linear, SqNorm

    zi, zj, x = State("z_i", (1, 2, 2)), State("z_j", (1, 4, 4)), Input("x", (1, 2, 2))
    P = downsample_or_identity(zj.shape, zi.shape)
    c = 0.8
    obj = Objective([SqNorm(zi), SqNorm(zj), c * Coupling(zi, zj, P), -1.0 * Linear(x, zi)])
    xv = _rand(1, 4, seed=100)[0].numpy()
    prob = obj.to_cvxpy(x=xv)
    prob.solve()
    Pm = P.matrix()
    K = np.block([[np.eye(4), c * Pm], [c * Pm.T, np.eye(16)]])
    sol = np.linalg.solve(K, np.concatenate([xv, np.zeros(16)]))
    got = prob.state_values()
    np.testing.assert_allclose(got["z_i"].reshape(-1), sol[:4], atol=1e-7)
    np.testing.assert_allclose(got["z_j"].reshape(-1), sol[4:], atol=1e-7)


def test_channel_decorrelation_matches_loop():
    term, values, _ = _case_channel_decorrelation()
    zi = values["z_i"].numpy().reshape(2, 3, 4)
    pz = term.P.apply(values["z_j"]).numpy().reshape(2, 3, 4)
    expected = np.zeros(2)
    for b in range(2):
        for k1 in range(3):
            for k2 in range(3):
                if k1 != k2:
                    expected[b] += abs(float(zi[b, k1] @ pz[b, k2]))
    np.testing.assert_allclose(term.value(values).numpy(), expected, rtol=1e-12)


def test_channel_decorrelation_is_nonsmooth_with_ae_gradient():
    term, values, _ = _case_channel_decorrelation()
    assert term.smooth is False and term.almost_everywhere_grad is True
    assert term.grad_lipschitz() == math.inf
    g, s = term.grad(values), term.subgradient(values)
    for k in g:
        assert torch.equal(g[k], s[k])
    # sign(0) = 0: with z_j = 0 all inner products vanish and the z_i-gradient is 0
    g0 = term.grad({**values, "z_j": torch.zeros_like(values["z_j"])})
    assert torch.all(g0["z_i"] == 0)
    assert term.curvature().kind == "unknown"
    ctx = ExportContext(term.states(), {}, None)
    ctx.finalize_variables()
    with pytest.raises(NotDCPError) as err:
        term.export(ctx)
    assert err.value.term == str(term)


def test_coupling_shape_errors():
    zi, zj = State("z_i", (2, 2, 2)), State("z_j", (2, 4, 4))
    wrong = downsample_or_identity((2, 8, 8), (2, 2, 2))
    with pytest.raises(ShapeError, match="P maps size 128") as err:
        Coupling(zi, zj, wrong)
    assert "z_i" in err.value.term
    with pytest.raises(ShapeError, match="no P was given"):
        Coupling(zi, zj)
    with pytest.raises(ShapeError, match="P maps"):
        ChannelDecorrelation(zi, zj, Identity(8))
    with pytest.raises(ShapeError, match="channel"):
        ChannelDecorrelation(State("a", 6), State("b", 6), None, channels=4)
    with pytest.raises(ShapeError, match="infer"):
        ChannelDecorrelation(State("a", 6), State("b", 6))
    # a Weight matrix is accepted as P (Dense)
    M = Weight("M", (8, 32), seed=110)
    t = Coupling(zi, zj, M)
    assert isinstance(t.P, Dense) and M in t.symbols()


def test_printing_is_readable():
    z, x = State("z", 4), Input("q", 4)
    W = Weight("W", (4, 4))
    gam = Scalar("gamma", 0.5, low=0, low_open=True)
    expected = "\\frac{1}{2\\gamma} e^{-\\gamma\\|q - W z\\|^2}"
    assert GaussianKernel(x - W @ z, gam).latex() == expected
    assert str(L1(z)) == "||z||₁"
    assert "2/(||z||²" in str(FeatureIncay(z, 0.1))
    zi = State("z_i", 4)
    assert str(Coupling(zi, z)) == "z_iᵀ I z"


# --------------------------------------------------------------------------- Moreau envelopes
def test_envelope_gradient_lipschitz_bound_of_a_weakly_convex_inner_function() -> None:
    """φ = 0.5||z||₁ − 0.6·½||z||², μ = 1: ∇M changes with slope a/(1 − μa) = 1.5 along large
    |v|, and ``grad_lipschitz`` bounds it (for convex φ it is 1/μ).

    Pins: ``grad_lipschitz`` reported 1/μ = 1, valid for convex φ only."""
    z = State("z", 1)
    env = moreau(Objective([L1(z) * 0.5, SqNorm(z) * -0.6]), 1.0)
    v = torch.tensor([[5.0], [6.0]], dtype=DT)
    g = env.grad({"z": v})["z"]
    slope = float((g[1] - g[0]).abs() / (v[1] - v[0]).abs())
    assert slope == pytest.approx(1.5)
    assert env.grad_lipschitz() >= slope - 1e-12
    assert moreau(Objective([L1(z)]), 0.5).grad_lipschitz() == pytest.approx(2.0)  # convex: 1/μ


@pytest.mark.parametrize("mu", [math.nan, math.inf])
def test_moreau_envelope_refuses_a_non_finite_mu(mu: float) -> None:
    """A NaN or infinite μ is a ScaleError naming μ, as μ ≤ 0 is.

    Pins: NaN and +inf passed (``nan <= 0`` is False)."""
    z = State("z", 2)
    with pytest.raises(ce.ScaleError, match="μ"):
        moreau(L1(z), mu)
