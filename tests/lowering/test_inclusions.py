"""Monotone inclusions and saddle objectives lowered to splitting layers (docs/monotone.md):
the splittings agree with each other and with CVXPY references, the equilibrium is unique for
every admissible A, B, the layers train and differentiate, and bad declarations are typed
errors.  verify's checks of inclusion layers are in tests/verify/test_inclusions.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from convex_eq import L1, Dense, Input, Linear, Objective, Potential, SqNorm, State, Weight, models
from convex_eq.errors import ConvergenceError, CurvatureError, ScaleError, ShapeError
from convex_eq.inclusion import Inclusion, Saddle
from convex_eq.operators.monotone import MARGINS, Margin, MonotoneMatrix, Skew
from lowering import lower
from tests.lowering.helpers import decoupled_inclusion
from verify.inclusion import check_inclusion

T64 = torch.float64


def _module(derived, **kw):
    opts = dict(dtype=T64, solver="anderson", tol=1e-13, max_iter=20000)
    opts.update(kw)
    return derived.torch_module(**opts)


def _solve(derived, x, z0=None):
    with torch.no_grad():
        return _module(derived)(torch.as_tensor(x, dtype=T64), z0=z0)


# ---------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("seed", [0, 1])
def test_fb_pr_dr_agree_with_cvxpy_references(seed):
    # ||A||₂ = ||B||₂ = 4 (the certificate's λ_min-free guarantee is what makes this safe;
    # a symmetric layer needs ||W||₂ ≤ 1): Lip(F) ≈ m + 16 + 8
    x = np.random.default_rng(seed + 10).standard_normal((3, 5))
    outs = {}
    for sp in ("forward-backward", "peaceman-rachford", "douglas-rachford"):
        d = lower(models.mon(n=10, d=5, weight_scale=4.0, seed=seed, splitting=sp))
        assert d.certificate.for_every_weight and d.certificate.margin == 0.5
        assert d.certificate.lipschitz > 10.0  # a large instance indeed
        outs[sp] = _solve(d, x).numpy()
        rep = check_inclusion(d, x, tol=1e-6)
        assert rep.passed, str(rep)
        assert set(rep.references) == {"gap", "lcp"}
        # float64 solves to 1e-13 and Clarabel at 1e-11: errors ~1e-9 at most, 1e-6 is safe
        # across BLAS builds and solver versions
        assert rep.worst("lcp rel. error") <= 1e-6 and rep.as_report().passed
        assert rep.worst("distance bound") <= 1e-6
    ref = outs["peaceman-rachford"]
    for sp, z in outs.items():
        assert np.linalg.norm(z - ref) <= 1e-6 * max(1.0, np.linalg.norm(ref)), sp


def test_symmetric_inclusion_reduces_to_the_canonical_rule():
    g = np.random.default_rng(3)
    z, x = State("z", 6), Input("x", 3)
    U = Weight("U", (6, 3), g.standard_normal((6, 3)))
    W = Weight("W", (5, 6), 0.4 * g.standard_normal((5, 6)) / np.sqrt(6))
    h = [SqNorm(z), -Linear(U @ x, z), -SqNorm(W @ z)]
    obj = Objective([Potential("relu", z), *h])
    inc = Inclusion(Potential("relu", z), grad=h)
    a, b = lower(inc), lower(obj)
    assert a.formula() == b.formula() and a.formula(latex=True) == b.formula(latex=True)
    assert a.claim == b.claim
    assert a.derivation.rules() == ["symmetric F is a gradient", *b.derivation.rules()]
    assert "canonical" in b.derivation.rules()[0]
    xs = g.standard_normal((4, 3))
    assert torch.allclose(_solve(a, xs), _solve(b, xs), atol=0, rtol=0)


def _unique_property(broken: bool) -> None:
    # a failing run stops at its first counterexample (no shrinking: each example is a solve)
    phases = (Phase.generate,) if broken else tuple(Phase)

    @settings(phases=phases, report_multiple_bugs=False)
    @given(seed=st.integers(0, 10_000), scale=st.floats(0.5, 6.0))
    def prop(seed: int, scale: float) -> None:
        d = lower(decoupled_inclusion(seed, scale, broken))
        x = torch.as_tensor(np.random.default_rng(seed).standard_normal((2, 3)), dtype=T64)
        z0 = torch.as_tensor(np.random.default_rng(seed + 1).uniform(0.5, 5.0, (2, 6)),
                             dtype=T64)
        mod = _module(d, max_iter=3000)
        try:
            with torch.no_grad():
                a, b = mod(x), mod(x, z0=z0)
        except ConvergenceError as err:  # no unique equilibrium reached: the property fails
            raise AssertionError(str(err)) from err
        # both solves stop at relative residual 1e-13 of a contraction with factor ≤ 0.99:
        # distinct points would differ by O(1); 1e-8 is far above round-off
        assert torch.allclose(a, b, atol=1e-8, rtol=0)

    prop()


def test_uniqueness_for_every_A_B(monkeypatch):
    _unique_property(broken=False)
    # the property can fail: with the margin dropped (and a false certificate claiming it)
    # z₀ keeps whatever the initialisation gave it
    monkeypatch.setitem(MARGINS, "_MarginIgnored",
                        lambda op, env: Margin(op.margin, True, "claimed (broken)"))
    with pytest.raises(AssertionError):
        _unique_property(broken=True)


# ---------------------------------------------------------------------------- training
def test_mon_trains_300_adam_steps_without_weight_control():
    torch.manual_seed(0)
    mod = lower(models.mon(n=6, d=3, seed=0)).torch_module()  # defaults: float32, tol 1e-6
    assert mod.weight_control is None
    head = torch.nn.Linear(6, 1)
    x = torch.randn(8, 3)
    y = torch.sin(2 * x.sum(1, keepdim=True))
    opt = torch.optim.Adam([*mod.parameters(), *head.parameters()], lr=3e-2)
    for _ in range(300):  # on_nonconvergence="raise": any failed forward/backward raises
        opt.zero_grad()
        loss = ((head(mod(x)) - y) ** 2).mean()
        loss.backward()
        opt.step()
        assert bool(mod.last_stats.converged.all())
    env = {k: v.detach().double() for k, v in mod.env().items()}
    cert = mod.derived.source.certificate(env)
    assert cert.for_every_weight and cert.margin == 0.5


# ---------------------------------------------------------------------------- gradients
def test_implicit_gradients_match_finite_differences():
    x = torch.as_tensor(np.random.default_rng(5).standard_normal((3, 4)), dtype=T64)
    r = torch.as_tensor(np.random.default_rng(6).standard_normal((3, 8)), dtype=T64)
    grads = {}
    for sp in ("peaceman-rachford", "forward-backward"):
        mod = _module(lower(models.mon(n=8, d=4, weight_scale=2.0, seed=2, splitting=sp)))
        (mod(x) * r).sum().backward()
        grads[sp] = {k: v.grad.clone() for k, v in mod.weights.items()}
    mod = _module(lower(models.mon(n=8, d=4, weight_scale=2.0, seed=2)))
    for name in ("A", "B", "U"):
        w = mod.weights[name]
        for idx in [(0, 1), (3, 2)]:
            with torch.no_grad():
                w0 = w[idx].item()
                w[idx] = w0 + 1e-6
                fp = float((mod(x) * r).sum())
                w[idx] = w0 - 1e-6
                fm = float((mod(x) * r).sum())
                w[idx] = w0
            fd = (fp - fm) / 2e-6
            # central differences with h = 1e-6 on a 1e-13 solve: error ~1e-7 relative
            assert abs(fd - float(grads["peaceman-rachford"][name][idx])) <= 1e-5 * max(1, abs(fd))
        assert torch.allclose(grads["forward-backward"][name], grads["peaceman-rachford"][name],
                              rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------- saddle
def _saddle() -> Saddle:
    g = np.random.default_rng(0)
    z, w, x = State("z", 6), State("w", 4), Input("x", 3)
    U = Weight("U", (6, 3), g.standard_normal((6, 3)))
    K = Weight("K", (4, 6), 2 * g.standard_normal((4, 6)))
    return Saddle([Potential("relu", z), 0.5 * SqNorm(z), -Linear(U @ x, z)],
                  [SqNorm(w), 0.1 * L1(w)], Dense(K), name="robust")


def test_saddle_primal_dual_layer_has_zero_duality_gap():
    d = lower(_saddle())
    assert d.derivation.rules() == ["saddle optimality system", "primal–dual (Chambolle–Pock)"]
    assert "unique saddle point" in d.claim.statement and d.certificate.for_every_weight
    assert "\\mathrm{prox}_{\\tau G}" in d.latex()
    x = np.random.default_rng(1).standard_normal((3, 3))
    rep = check_inclusion(d, x, tol=1e-6)
    assert rep.passed, str(rep)
    # Clarabel at 1e-11 on both sides: the relative gap is ~1e-10; 1e-6 is safe
    assert abs(rep.worst("duality gap")) <= 1e-6
    out = _solve(d, x)
    assert isinstance(out, tuple) and out[0].shape == (3, 6) and out[1].shape == (3, 4)


def test_mon_conv_variant():
    inc = models.mon(conv=(2, 3), image=(1, 6), weight_scale=2.0)
    d = lower(inc)
    x = np.random.default_rng(0).standard_normal((2, 1, 6))
    out = _solve(d, x)
    assert out.shape == (2, 2, 6)
    assert check_inclusion(d, x.reshape(2, 6), tol=1e-6).passed


# ---------------------------------------------------------------------------- errors
def test_typed_errors():
    z, x = State("z", 4), Input("x", 2)
    q = Weight("U", (4, 2)) @ x
    neg = Dense(Weight("N", (4, 4), -2 * np.eye(4)))
    with pytest.raises(CurvatureError, match="not monotone"):
        lower(Inclusion(Potential("relu", z), grad=[-Linear(q, z)], linear=[neg]))
    skew = Skew(Weight("B", (4, 4)))
    with pytest.raises(CurvatureError, match="not strongly monotone"):
        lower(Inclusion(Potential("relu", z), grad=[-Linear(q, z)], linear=[skew]))
    with pytest.raises(ScaleError, match="margin"):
        MonotoneMatrix(Weight("A", (4, 4)), Weight("B2", (4, 4)), 0.0)
    with pytest.raises(ShapeError, match="affine"):
        Inclusion(Potential("relu", z), grad=[L1(z)], linear=[skew])
    with pytest.raises(ShapeError, match="splitting"):
        Inclusion(Potential("relu", z), linear=[skew], splitting="admm")
    with pytest.raises(CurvatureError, match="convex"):
        Saddle([-SqNorm(z)], [SqNorm(State("w", 3))], Dense(Weight("K", (3, 4))))


def test_measured_margin_tanh_inclusion_is_certified_at_these_weights_only():
    g = np.random.default_rng(0)
    z, x = State("z", 5), Input("x", 2)
    s = g.standard_normal((5, 5))
    W = Weight("W", (5, 5), 2 * np.eye(5) + s - s.T + 0.3 * g.standard_normal((5, 5)))
    inc = Inclusion(Potential("tanh", z), grad=[-Linear(Weight("U", (5, 2)) @ x, z),
                                                0.2 * SqNorm(z)], linear=[Dense(W)])
    d = lower(inc)
    assert not d.certificate.for_every_weight and "at these weights" in d.certificate.text
    assert d.claim.conditions  # the claim names the measured condition
    rep = check_inclusion(d, g.standard_normal((3, 2)), tol=1e-6)
    assert rep.passed, str(rep)
    assert rep.references == ["gap"]  # no LCP for tanh
