"""Tests of ``convex_eq.activations`` against independent references (float64).

References are independent of the code under test: proximal maps, conjugates and σ̃* are
recomputed by scipy scalar minimization from *function values only* (``potential``,
``conjugate_potential``, ``antiderivative``), σ̃ by scipy ``quad`` of σ (softplus: the dilogarithm
via ``scipy.special.spence``), derivatives by central finite differences, closed forms by numpy
formulas typed in from docs/theory.md §1 (with the exact ``+log 2`` constant for the sigmoid).

Tolerances: ``minimize_scalar`` locates a minimizer of a smooth objective only to about
``sqrt(eps) ≈ 1.5e-8`` relative (the objective is flat to second order there), and numeric (quad)
potentials add ~1e-13 noise, so argmin comparisons use ``ARGMIN_TOL = 1e-6``; optimal *values*
are second-order accurate and use ``VALUE_TOL = 1e-8``; central differences with ``h = 1e-6``
have O(h²) truncation and O(eps/h) rounding error, so ``FD_TOL = 1e-6``.
"""

from __future__ import annotations

import functools
import math

import cvxpy as cp
import numpy as np
import pytest
import sympy as sp
import torch
from scipy import integrate, special
from scipy.optimize import minimize_scalar

import convex_eq as ce
from convex_eq import (
    Objective,
    Potential,
    SqNorm,
    State,
)
from convex_eq.activations import (
    Activation,
    SympyActivation,
    _numeric,
    available_activations,
    from_sympy,
    get_activation,
    register_activation,
)
from convex_eq.errors import ActivationError, NotDCPError, OptionError, ScaleError

ARGMIN_TOL = 1e-6


VALUE_TOL = 1e-8


FD_TOL = 1e-6


R = 40.0  # search half-width for unbounded domains


T = sp.Symbol("t")


@functools.cache
def make(key: str) -> Activation:
    """The activations under test (registry ones and three sympy-derived ones)."""
    if key == "leaky_relu":
        return get_activation("leaky_relu", slope=0.2)
    if key == "clamp_shifted":  # box not containing 0: f_σ = ι - c₀²/2 with c₀ = 0.5
        return get_activation("clamp", lo=0.5, hi=2.0)
    if key == "sym_atan":  # closed forms everywhere: f_σ = -log cos u - u²/2
        return from_sympy(sp.atan(T), T)
    if key == "sym_sqrt":  # closed forms: σ⁻¹(u) = u - 1/(4u), f_σ = -log(u)/4 + const
        return from_sympy((T + sp.sqrt(T**2 + 1)) / 2, T)
    if key == "sym_numeric":  # grid check, numeric σ⁻¹, numeric σ̃ (quad)
        return from_sympy(T / (1 + sp.Abs(T)), T, name="softsign")
    return get_activation(key)


REGISTRY_KEYS = [
    "identity",
    "relu",
    "leaky_relu",
    "hardtanh",
    "clamp_shifted",
    "tanh",
    "sigmoid",
    "softplus",
]


SYMPY_KEYS = ["sym_atan", "sym_sqrt", "sym_numeric"]


ALL_KEYS = REGISTRY_KEYS + SYMPY_KEYS


SMOOTH_KEYS = [k for k in ALL_KEYS if k not in ("relu", "hardtanh", "clamp_shifted")]


V_GRID = np.array([-8.0, -3.0, -1.7, -0.9, -0.25, 0.0, 0.4, 0.8, 1.3, 2.2, 3.0, 8.0])


def tens(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def scalar(fn, x: float) -> float:
    return float(fn(torch.tensor(float(x), dtype=torch.float64)))


def search_bounds(lo: float, hi: float) -> tuple[float, float]:
    return max(lo, -R), min(hi, R)


def interior_points(lo: float, hi: float) -> np.ndarray:
    """Points strictly inside ``(lo, hi)``, chosen without using the activation."""
    fr = np.array([0.05, 0.2, 0.37, 0.5, 0.66, 0.81, 0.95])
    if math.isfinite(lo) and math.isfinite(hi):
        return lo + (hi - lo) * fr
    off = np.array([0.05, 0.3, 0.9, 1.7, 2.6, 4.0])
    if math.isfinite(lo):
        return lo + off
    if math.isfinite(hi):
        return hi - off
    return np.array([-3.0, -1.2, -0.4, 0.0, 0.3, 1.1, 2.5])


def numeric_argmin(fun, lo: float, hi: float) -> float:
    if lo == hi:
        return lo
    res = minimize_scalar(
        fun, bounds=(lo, hi), method="bounded", options={"xatol": 1e-11, "maxiter": 1000}
    )
    return float(res.x)


def numeric_prox(act: Activation, v: float, t: float = 1.0) -> float:
    """argmin_u t f_σ(u) + (u - v)²/2 from potential values only (bounded Brent)."""
    lo, hi = search_bounds(*act.domain)
    return numeric_argmin(lambda u: t * scalar(act.potential, u) + 0.5 * (u - v) ** 2, lo, hi)


def numeric_prox_conj(act: Activation, v: float, t: float = 1.0) -> float:
    """argmin_w t f_σ*(w) + (w - v)²/2 from conjugate_potential values only."""
    lo, hi = search_bounds(*act.conjugate_domain)
    fun = lambda w: t * scalar(act.conjugate_potential, w) + 0.5 * (w - v) ** 2  # noqa: E731
    return numeric_argmin(fun, lo, hi)


def numeric_sup(fun, lo: float, hi: float) -> float:
    """sup of a concave ``fun`` on ``[lo, hi]`` (bounded Brent, plus the two end points)."""
    x = numeric_argmin(lambda z: -fun(z), lo, hi)
    return max(fun(x), fun(lo), fun(hi))


# ----------------------------------------------------------------------------- 1. prox = σ
@pytest.mark.parametrize("key", ALL_KEYS)
def test_prox_of_potential_is_sigma(key):
    act = make(key)
    sig = act.sigma(tens(V_GRID)).numpy()
    ref = np.array([numeric_prox(act, v) for v in V_GRID])
    np.testing.assert_allclose(ref, sig, atol=ARGMIN_TOL, rtol=ARGMIN_TOL)
    # and the prox method at t = 1 is σ exactly
    assert torch.equal(act.prox(tens(V_GRID)), act.sigma(tens(V_GRID)))


# -------------------------------------------------------------------- 2. prox with t ≠ 1
@pytest.mark.parametrize("t", [0.3, 2.5])
@pytest.mark.parametrize("key", ALL_KEYS)
def test_scaled_prox_matches_numeric(key, t):
    act = make(key)
    vs = V_GRID[1:-1]
    got = act.prox(tens(vs), t).numpy()
    ref = np.array([numeric_prox(act, v, t) for v in vs])
    np.testing.assert_allclose(got, ref, atol=ARGMIN_TOL, rtol=ARGMIN_TOL)


@pytest.mark.parametrize("key", SMOOTH_KEYS)
def test_scaled_prox_optimality_residual(key):
    # t (σ⁻¹(u) - u) + u - v = 0 at u = prox_{t f}(v): solved to ~1e-12
    act = make(key)
    v = tens(np.linspace(-2.5, 2.5, 11))
    for t in (0.3, 2.5):
        u = act.prox(v, t)
        s = act.inverse(u)
        # residual measured in the pre-activation variable: t s + (1 - t) σ(s) - v
        res = t * s + (1 - t) * act.sigma(s) - v
        assert float(res.abs().max()) < 1e-9


# ------------------------------------------------------------- 3. Moreau and Fenchel–Young
@pytest.mark.parametrize("key", ALL_KEYS)
def test_moreau_identity_numeric(key):
    act = make(key)
    vs = V_GRID[1:-1]
    pc = np.array([numeric_prox_conj(act, v) for v in vs])
    np.testing.assert_allclose(act.sigma(tens(vs)).numpy() + pc, vs, atol=ARGMIN_TOL)
    # the Moreau-based prox_conjugate agrees with the numeric prox of t f*, t = 1 and 2.5
    np.testing.assert_allclose(act.prox_conjugate(tens(vs)).numpy(), pc, atol=ARGMIN_TOL)
    pc25 = np.array([numeric_prox_conj(act, v, 2.5) for v in vs[::2]])
    got = act.prox_conjugate(tens(vs[::2]), 2.5).numpy()
    np.testing.assert_allclose(got, pc25, atol=ARGMIN_TOL)


@pytest.mark.parametrize("key", ALL_KEYS)
def test_conjugate_is_numeric_sup(key):
    act = make(key)
    lo, hi = act.conjugate_domain
    dlo, dhi = search_bounds(*act.domain)
    f = lambda u: scalar(act.potential, u)  # noqa: E731
    ws = interior_points(max(lo, -3.0), min(hi, 3.0)) if lo < hi else np.array([lo])
    for w in ws:
        ref = numeric_sup(lambda u, w=w: w * u - f(u), dlo, dhi)
        assert scalar(act.conjugate_potential, w) == pytest.approx(
            ref, rel=VALUE_TOL, abs=VALUE_TOL
        )
    # outside dom f*: the sup grows without bound with the search box, and f* = +inf
    for w in [x for x in (lo - 0.5, hi + 0.5) if math.isfinite(x)]:
        assert scalar(act.conjugate_potential, w) == math.inf
        sups = [numeric_sup(lambda u, w=w: w * u - f(u), *search_bounds_r(act, r)) for r in (5, 50)]
        assert sups[1] - sups[0] > 1.0


def search_bounds_r(act: Activation, r: float) -> tuple[float, float]:
    lo, hi = act.domain
    return max(lo, -r), min(hi, r)


@pytest.mark.parametrize("key", ALL_KEYS)
def test_fenchel_young(key):
    act = make(key)
    rng = np.random.default_rng(0)
    xs = interior_points(*act.domain)
    lo, hi = act.conjugate_domain
    ys = rng.uniform(max(lo, -4.0), min(hi, 4.0), size=(len(xs), 5)) if lo < hi else None
    fx = act.potential(tens(xs)).numpy()
    if ys is not None:
        fy = act.conjugate_potential(tens(ys)).numpy()
        assert np.all(fx[:, None] + fy >= xs[:, None] * ys - 1e-10)
    # equality at y = ∇f(x)
    g = act.potential_grad(tens(xs))
    gap = fx + act.conjugate_potential(g).numpy() - xs * g.numpy()
    np.testing.assert_allclose(gap, 0.0, atol=1e-9)


# ------------------------------------------------------------------------ 4. derivatives
def central_fd(fn, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    return (fn(tens(x + h)).numpy() - fn(tens(x - h)).numpy()) / (2 * h)


@pytest.mark.parametrize("key", ALL_KEYS)
def test_potential_grad_autograd_and_fd(key):
    act = make(key)
    lo, hi = act.domain
    x = interior_points(lo, hi)
    x = x[(x - 1e-5 > lo) & (x + 1e-5 < hi)]
    pg = act.potential_grad(tens(x)).numpy()
    np.testing.assert_allclose(pg, central_fd(act.potential, x), atol=FD_TOL, rtol=FD_TOL)
    xt = tens(x).requires_grad_(True)
    (auto,) = torch.autograd.grad(act.potential(xt).sum(), xt)
    np.testing.assert_allclose(auto.numpy(), pg, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("key", ALL_KEYS)
def test_antiderivative_derivative_is_sigma(key):
    act = make(key)
    a = np.array([-4.0, -1.3, -0.2, 0.35, 1.0, 2.7, 5.0])
    sig = act.sigma(tens(a)).numpy()
    np.testing.assert_allclose(central_fd(act.antiderivative, a), sig, atol=FD_TOL, rtol=FD_TOL)
    at = tens(a).requires_grad_(True)
    (auto,) = torch.autograd.grad(act.antiderivative(at).sum(), at)
    np.testing.assert_allclose(auto.numpy(), sig, atol=1e-12, rtol=1e-12)
    assert float(act.antiderivative(tens(0.0))) == 0.0


@pytest.mark.parametrize("key", ALL_KEYS)
def test_antiderivative_is_quad_of_sigma(key):
    act = make(key)
    for a in (-3.0, -0.6, 0.8, 4.0):
        ref = integrate.quad(lambda x: scalar(act.sigma, x), 0.0, a, epsabs=1e-13)[0]
        assert scalar(act.antiderivative, a) == pytest.approx(ref, rel=1e-10, abs=1e-12)


def test_softplus_antiderivative_is_dilogarithm():
    # σ̃(a) = -Li₂(-e^a) - π²/12 = -spence(1 + e^a) - π²/12 (independent of quad)
    act = make("softplus")
    a = np.linspace(-30.0, 30.0, 41)
    ref = -special.spence(1.0 + np.exp(a)) - math.pi**2 / 12
    np.testing.assert_allclose(act.antiderivative(tens(a)).numpy(), ref, atol=1e-11, rtol=1e-12)
    # end values: f(0) = σ̃*(0) = π²/12, f*(0) = -inf f = -lim_{u→∞} f(u) = π²/12
    assert scalar(act.potential, 0.0) == pytest.approx(math.pi**2 / 12, rel=1e-12)
    assert scalar(act.conjugate_potential, 0.0) == pytest.approx(
        -scalar(act.potential, 40.0), rel=1e-12
    )


@pytest.mark.parametrize("key", SMOOTH_KEYS)
def test_prox_and_conjugate_autograd(key):
    act = make(key)
    v = np.linspace(-2.0, 2.0, 8)  # avoids the kinks at 0 (leaky ReLU, softsign)
    vt = tens(v).requires_grad_(True)
    (auto,) = torch.autograd.grad(act.prox(vt, 2.5).sum(), vt)
    np.testing.assert_allclose(
        auto.numpy(), central_fd(lambda x: act.prox(x, 2.5), v), atol=FD_TOL, rtol=FD_TOL
    )
    lo, hi = act.conjugate_domain
    if lo < hi:
        w = interior_points(max(lo, -3.0), min(hi, 3.0))
        wt = tens(w).requires_grad_(True)
        (auto,) = torch.autograd.grad(act.conjugate_potential(wt).sum(), wt)
        fd = central_fd(act.conjugate_potential, w)
        np.testing.assert_allclose(auto.numpy(), fd, atol=FD_TOL, rtol=FD_TOL)


@pytest.mark.parametrize("key", ALL_KEYS)
def test_no_nan_gradients_and_dtype(key):
    act = make(key)
    lo, hi = act.domain
    x32 = tens(interior_points(lo, hi)).float().requires_grad_(True)
    fns = [act.sigma, act.antiderivative, act.potential, act.antiderivative_conjugate]
    fns += [lambda z: act.prox(z, 2.5), act.prox_conjugate]
    for fn in fns:
        y = fn(x32)
        assert y.dtype == torch.float32
        (g,) = torch.autograd.grad(y.sum(), x32)
        assert bool(torch.isfinite(g).all()), fn
    # outside the domain the potential is +inf, with finite (zero) gradients
    out = [p for p in (lo - 0.5, hi + 0.5) if math.isfinite(p)]
    if out:
        xo = tens(out).requires_grad_(True)
        val = act.potential(xo)
        assert bool(torch.isinf(val).all()) and bool((val > 0).all())
        (g,) = torch.autograd.grad(val.sum(), xo)
        assert bool(torch.isfinite(g).all())


def test_prox_gradient_wrt_tensor_scale():
    act = make("tanh")
    v = tens([0.3, -1.2, 2.0])
    t = tens([0.5, 2.0, 7.0]).requires_grad_(True)
    (auto,) = torch.autograd.grad(act.prox(v, t).sum(), t)
    h = 1e-6
    fd = (act.prox(v, t.detach() + h) - act.prox(v, t.detach() - h)) / (2 * h)
    np.testing.assert_allclose(auto.numpy(), fd.numpy(), atol=FD_TOL, rtol=FD_TOL)


def test_safeguarded_newton_where_plain_newton_diverges():
    # Newton on atan from |x0| > 1.39 diverges; the bracket safeguard must still converge
    target = tens([0.0, 0.5, -1.2])
    x = _numeric.solve_increasing(
        torch.atan,
        lambda z: 1 / (1 + z * z),
        target,
        tens([-50.0] * 3),
        tens([50.0] * 3),
        x0=tens([5.0, -8.0, 9.0]),
    )
    np.testing.assert_allclose(x.numpy(), np.tan(target.numpy()), atol=1e-13)


def test_extreme_scales_and_inputs():
    for key in ("tanh", "sigmoid", "softplus", "sym_numeric"):
        act = make(key)
        v = tens([-30.0, -5.0, -1e-9, 0.0, 1e-9, 5.0, 30.0])
        for t in (1e-3, 1e3):
            u = act.prox(v, t)
            assert bool(torch.isfinite(u).all())
            ref = [numeric_prox(act, float(x), t) for x in v[[1, 3, 5]]]
            np.testing.assert_allclose(u[[1, 3, 5]].numpy(), ref, atol=ARGMIN_TOL)


# --------------------------------------------------------------------- 5. σ̃* and f_σ
@pytest.mark.parametrize("key", ALL_KEYS)
def test_potential_plus_half_square_is_antiderivative_conjugate(key):
    act = make(key)
    u = interior_points(*act.domain)
    np.testing.assert_allclose(
        act.potential(tens(u)).numpy() + 0.5 * u**2,
        act.antiderivative_conjugate(tens(u)).numpy(),
        atol=1e-12,
        rtol=1e-12,
    )


@pytest.mark.parametrize("key", ALL_KEYS)
def test_antiderivative_conjugate_is_numeric_sup(key):
    act = make(key)
    for u in interior_points(*act.domain):
        ref = numeric_sup(lambda a, u=u: u * a - scalar(act.antiderivative, a), -60.0, 60.0)
        got = scalar(act.antiderivative_conjugate, u)
        assert got == pytest.approx(ref, rel=VALUE_TOL, abs=VALUE_TOL)


def test_closed_forms_from_the_table():
    u = np.linspace(-0.95, 0.95, 9)
    tanh_f = 0.5 * ((1 + u) * np.log1p(u) + (1 - u) * np.log1p(-u)) - u**2 / 2
    np.testing.assert_allclose(make("tanh").potential(tens(u)).numpy(), tanh_f, atol=1e-14)
    p = np.linspace(0.02, 0.98, 9)
    sig_f = p * np.log(p) + (1 - p) * np.log(1 - p) + math.log(2) - p**2 / 2  # exact +log 2
    np.testing.assert_allclose(make("sigmoid").potential(tens(p)).numpy(), sig_f, atol=1e-14)
    lk = 0.5 * (1 / 0.2 - 1) * np.minimum(u, 0) ** 2
    np.testing.assert_allclose(make("leaky_relu").potential(tens(u)).numpy(), lk, atol=1e-14)
    q = np.linspace(-1.5, 1.5, 7)
    np.testing.assert_allclose(
        make("sym_atan").potential(tens(q)).numpy(), -np.log(np.cos(q)) - q**2 / 2, atol=1e-12
    )
    # ends of the domains: finite limits, +inf outside
    assert scalar(make("tanh").potential, 1.0) == pytest.approx(math.log(2) - 0.5)
    assert scalar(make("sigmoid").potential, 0.0) == pytest.approx(math.log(2))
    assert scalar(make("sigmoid").potential, 1.0 + 1e-12) == math.inf
    assert scalar(make("relu").potential, -1e-12) == math.inf
    assert scalar(make("clamp_shifted").potential, 1.0) == -0.125
    assert scalar(make("sym_atan").potential, math.pi / 2 + 1e-9) == math.inf


# -------------------------------------------------------------------------- 6. CVXPY
CVX_KEYS = ["identity", "relu", "leaky_relu", "hardtanh", "clamp_shifted", "tanh", "sigmoid"]


def _violation(cons) -> float:
    return max([float(np.max(c.violation())) for c in cons], default=0.0)


@pytest.mark.parametrize("key", CVX_KEYS)
def test_cvxpy_forms_values_and_constraints(key):
    act = make(key)
    lo, hi = act.domain
    pts = interior_points(lo, hi)
    pts = np.concatenate([pts, [x for x in (lo, hi) if math.isfinite(x)]])  # closed domain
    u = cp.Variable(len(pts))
    u.value = pts
    pot_sum = float(act.potential(tens(pts)).sum())
    conj_sum = float(act.antiderivative_conjugate(tens(pts)).sum())
    c, expr, cons = act.cvxpy_split(u)
    assert c == act.quadratic_coefficient_of_potential
    assert expr.is_dcp() and expr.is_convex() and all(k.is_dcp() for k in cons)
    assert float(expr.value) + c * 0.5 * float(np.sum(pts**2)) == pytest.approx(pot_sum, rel=1e-10)
    assert _violation(cons) == 0.0
    e2, c2 = act.cvxpy_antiderivative_conjugate(u)
    assert float(e2.value) == pytest.approx(conj_sum, rel=1e-10, abs=1e-12)
    assert _violation(c2) == 0.0
    if c == 0.0:
        e1, c1 = act.cvxpy_potential(u)
        assert float(e1.value) == pytest.approx(pot_sum, rel=1e-10, abs=1e-12)
        assert _violation(c1) == 0.0
    else:
        with pytest.raises(NotDCPError):
            act.cvxpy_potential(u)
    # points outside the domain violate the constraints
    for bad in [x for x in (lo - 0.25, hi + 0.25) if math.isfinite(x)]:
        u.value = np.full(len(pts), bad)
        assert _violation(cons) > 0.2 and _violation(c2) > 0.2


@pytest.mark.parametrize("key", CVX_KEYS)
def test_cvxpy_split_solves_the_prox(key):
    # argmin_u f_σ(u) + ½||u - v||² = σ(v): with f_σ = expr + c||u||²/2 the exporter collects
    # (1 + c)/2 ||u||² - <v, u> (never a concave term); solved by Clarabel
    act = make(key)
    v = np.array([-1.7, -0.3, 0.4, 1.2, 2.5])
    u = cp.Variable(len(v))
    c, expr, cons = act.cvxpy_split(u)
    obj = expr + 0.5 * (1 + c) * cp.sum_squares(u) - v @ u
    prob = cp.Problem(cp.Minimize(obj), cons)
    assert prob.is_dcp()
    prob.solve(solver=cp.CLARABEL)
    np.testing.assert_allclose(u.value, act.sigma(tens(v)).numpy(), atol=2e-5)


@pytest.mark.parametrize("key", ["softplus", *SYMPY_KEYS])
def test_cvxpy_not_exportable(key):
    act = make(key)
    u = cp.Variable(3)
    for fn in (act.cvxpy_potential, act.cvxpy_split, act.cvxpy_antiderivative_conjugate):
        with pytest.raises(NotDCPError) as exc:
            fn(u)
        assert act.name in str(exc.value)
    assert act.quadratic_coefficient_of_potential is None


def test_not_dcp_message():
    with pytest.raises(NotDCPError) as exc:
        make("tanh").cvxpy_potential(cp.Variable(2))
    msg = str(exc.value)
    for part in ("tanh", "σ̃* - u²/2", "not DCP", "difference of convex", "quadratic form"):
        assert part in msg


# ---------------------------------------------------------------------- 7. refusals etc.
def test_registry_names_and_errors():
    names = available_activations()
    for n in ("identity", "relu", "leaky_relu", "hardtanh", "clamp", "tanh", "sigmoid", "softplus"):
        assert n in names
    assert get_activation("clamp").name == "clamp"
    assert get_activation("leaky_relu", slope=0.5).slope == 0.5
    with pytest.raises(ActivationError) as exc:
        get_activation("swish")
    assert "swish" in str(exc.value) and "relu" in str(exc.value) and "known" in str(exc.value)
    for slope in (0.0, 1.5, -0.1):
        with pytest.raises(ScaleError) as exc:
            get_activation("leaky_relu", slope=slope)
        assert "leaky_relu" in str(exc.value) and "(0, 1]" in str(exc.value)
    for name, lo, hi in (("hardtanh", 1.0, 1.0), ("clamp", 2.0, -1.0)):
        with pytest.raises(ScaleError) as exc:
            get_activation(name, lo=lo, hi=hi)
        assert name in str(exc.value) and "lo < hi" in str(exc.value)
    with pytest.raises(OptionError):
        get_activation("relu", slope=0.1)
    with pytest.raises(ActivationError):
        register_activation("relu", lambda: make("relu"))
    register_activation("my_atan_test", lambda: make("sym_atan"), overwrite=True)
    assert get_activation("my_atan_test") is make("sym_atan")


@pytest.mark.parametrize(
    ("expr", "condition", "detail"),
    [
        (-T, "not nondecreasing", "σ'(t) = -1 < 0"),
        (2 * T, "not 1-Lipschitz", "σ'(t) = 2 > 1"),
        (T**3, "not 1-Lipschitz", "sup σ'(t) = oo > 1"),
        (sp.sin(T), "not nondecreasing", "inf σ'(t) = -1 < 0"),
        (2 * T / (1 + sp.Abs(T)), "not 1-Lipschitz", "grid"),
        (-T / (1 + sp.Abs(T)), "not nondecreasing", "grid"),
    ],
)
def test_sympy_refusals(expr, condition, detail):
    with pytest.raises(ActivationError) as exc:
        from_sympy(expr, T)
    msg = str(exc.value)
    assert f"σ(t) = {expr}" in msg and condition in msg and detail in msg


def test_prox_scale_errors():
    for key in ("tanh", "relu", "softplus"):
        for t in (0.0, -1.0):
            with pytest.raises(ScaleError) as exc:
                make(key).prox(tens([0.5]), t)
            assert make(key).name in str(exc.value)


def test_sympy_derivation_and_fallbacks():
    closed = make("sym_atan")
    assert isinstance(closed, SympyActivation) and closed.check_method == "symbolic"
    assert all(closed.symbolic.values())
    text = "\n".join(closed.derivation)
    for part in ("σ(t) = atan(t)", "σ'(t)", "checks", "σ⁻¹(u) = tan(u)", "σ̃(a)", "f_σ(u)"):
        assert part in text
    assert closed.domain == pytest.approx((-math.pi / 2, math.pi / 2))
    num = make("sym_numeric")
    assert num.check_method == "grid" and num.name == "softsign"
    assert not num.symbolic["inverse"] and not num.symbolic["antiderivative"]
    assert "scipy quad" in "\n".join(num.derivation)
    assert num.domain == (-1.0, 1.0) and num.smooth_potential


def test_attributes_and_display():
    assert make("sigmoid").lipschitz == 0.25 and make("tanh").lipschitz == 1.0
    assert make("relu").domain == (0.0, math.inf) and not make("relu").smooth_potential
    assert make("softplus").conjugate_domain == (-math.inf, 0.0)
    for key in ALL_KEYS:
        act = make(key)
        assert act.name in str(act)
        assert isinstance(act.latex_sigma, str) and act.latex_sigma
        assert "x" in act.latex_potential("x") or act.latex_potential("x") == "0"
        assert isinstance(act.latex_antiderivative("a"), str)


@pytest.mark.parametrize("base", ["relu", "tanh", "sigmoid"])
def test_a_subclass_with_its_own_sigma_is_not_given_the_parents_torch_op(base: str) -> None:
    """An activation derived from ReLU / tanh / sigmoid that overrides only ``sigma`` is
    evaluated by its own ``σ``: the parent's torch op (``torch.relu``, ``torch.relu_``, …) is
    offered only to classes that keep the parent's ``sigma``."""
    from convex_eq.activations.relu import ReLU
    from convex_eq.activations.sigmoid import Sigmoid
    from convex_eq.activations.tanh import Tanh

    parent = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid}[base]

    class Halved(parent):  # type: ignore[misc, valid-type]
        name = f"halved_{base}_test"

        def sigma(self, t):  # type: ignore[no-untyped-def]
            return 0.5 * parent.sigma(self, t)

    act, plain = Halved(), parent()
    t = torch.linspace(-3, 3, 13)
    assert torch.equal(act.torch_sigma(t), 0.5 * plain.sigma(t))
    assert act.torch_sigma_ is None
    assert plain.torch_sigma_ is (torch.relu_ if base == "relu" else None)


@pytest.mark.parametrize("act", ["identity", "leaky_relu", "relu", "softplus"])
def test_prox_of_a_conjugate_potential_stays_in_its_domain(act: str) -> None:
    """``prox_{t f_σ*}`` stays in ``dom f_σ*`` (so ``f_σ*`` of it is finite), also where the
    exact value is its edge 0, and so does an objective's prox through it.

    Pins: the Moreau identity v − t·prox_{f_σ/t}(v/t) left 5e-17 where the exact value is 0,
    and f_σ* of the prox was +∞ (identity: ι_{0})."""
    a = ce.get_activation(act, slope=0.3) if act == "leaky_relu" else ce.get_activation(act)
    v = torch.tensor([0.055988528498338484, 0.3523299032448493, 1.614604087979768, -0.7],
                     dtype=torch.float64)
    for t in (0.3, 1.0, 2.5):
        p = a.prox_conjugate(v, t)
        lo, hi = a.conjugate_domain
        assert bool(((p >= lo) & (p <= hi)).all())
        assert torch.isfinite(a.conjugate_potential(p)).all()
    z = State("z", 1)
    g = Objective([Potential(a, z).conjugate() * 2.0, SqNorm(z) * -0.3])
    p = g.prox(torch.tensor([[0.055988528498338484]], dtype=torch.float64), 2.5, {})
    assert torch.isfinite(g.value_tensor({"z": p})).all()
