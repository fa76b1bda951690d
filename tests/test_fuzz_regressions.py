"""Regression tests for the bugs the fuzzing of issue 7 found (one test per fix; each test fails
on the code before the fix)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import convex_eq as ce
import lowering
from convex_eq import (
    L1,
    Antiderivative,
    AntiderivativeConjugate,
    DeepComposition,
    Input,
    Linear,
    Objective,
    Potential,
    SqNorm,
    State,
    Weight,
    models,
    moreau,
)
from convex_eq.operators import Dense

T64 = torch.float64


def _theorem1(n: int = 3, act: str = "relu", w: np.ndarray | None = None, name: str = "z",
              seed: int = 0) -> tuple[Objective, State, Input]:
    rng = np.random.default_rng(seed)
    z, x = State(name, n), Input("x", 2)
    W = Weight(f"W_{name}", (n, n), 0.6 * np.eye(n) if w is None else w)
    U = Weight(f"U_{name}", (n, 2), rng.standard_normal((n, 2)))
    psi = Antiderivative(act, Dense(W) @ z + Dense(U) @ x)
    return Objective([psi.conjugate(), -SqNorm(z)], name="phi"), z, x


# ----------------------------------------------------------------- lowering/rules/deep.py
def test_multiblock_contraction_is_the_largest_layer_constant_not_the_product() -> None:
    """One application of the multi-block T moves each block through one layer, so its
    Lipschitz constant is max_l Lip(f_l); the product (valid for the L-fold composition) was
    reported and is violated."""
    x = Input("x", 2)
    layers = []
    for i, s in enumerate((0.9, 0.3)):
        z = State(f"z{i}", 2)
        psi = Antiderivative("identity", Dense(Weight(f"W{i}", (2, 2), s * np.eye(2))) @ z
                             + Dense(Weight(f"U{i}", (2, 2), np.eye(2))) @ x)
        layers.append(Objective([psi.conjugate(), -SqNorm(z)]))
    d = lowering.lower(DeepComposition(layers, 1.0), deep_form="multiblock")
    c = d.contraction.value()
    assert c == pytest.approx(0.81)  # max(0.9², 0.3²), not 0.9²·0.3² = 0.0729
    xv = torch.zeros(1, 2, dtype=T64)
    z = {"z0": torch.zeros(1, 2, dtype=T64), "z1": torch.zeros(1, 2, dtype=T64), "x": xv}
    z2 = {**z, "z1": torch.ones(1, 2, dtype=T64)}  # z1 is the input block of f_1
    t1, t2 = d.apply(z), d.apply(z2)
    num = torch.cat([t1[k] - t2[k] for k in ("z0", "z1")], 1).norm()
    den = torch.cat([z[k] - z2[k] for k in ("z0", "z1")], 1).norm()
    assert float(num / den) <= c + 1e-12
    assert float(num / den) > 0.0729  # the old (product) bound was not a Lipschitz bound
    comp = lowering.lower(DeepComposition(layers, 1.0), deep_form="composition")
    assert comp.contraction.value() == pytest.approx(0.81 * 0.09)  # composition: product


# ----------------------------------------------------------------- lowering/rules/moreau_skip.py
def test_moreau_general_rule_refuses_an_inner_objective_without_closed_form_prox() -> None:
    """μ + λ ≠ 1 needs prox_{(μ+λ)φ} in closed form; for φ = ψ* − ½||·||² ``lower`` used to
    derive a layer whose T raised LoweringError on every evaluation."""
    phi, z, _x = _theorem1()
    with pytest.raises(ce.LoweringError, match="no prox_") as err:
        lowering.lower(Objective([moreau(phi, 0.3) * 0.5]))
    assert "M^0.3" in str(err.value)
    # a prox-able inner objective still lowers, and T evaluates
    ok = Objective([moreau(Objective([L1(z) * 0.5, SqNorm(z) * -0.2]), 0.3) * 0.5])
    d = lowering.lower(ok)
    assert torch.isfinite(d.apply({"z": torch.randn(2, 3, dtype=T64)})["z"]).all()
    too_concave = Objective([moreau(Objective([L1(z), SqNorm(z) * -2.0]), 0.3) * 0.5])
    with pytest.raises(ce.LoweringError, match="quadratic coefficient"):
        lowering.lower(too_concave)


def test_envelope_used_through_its_gradient_needs_the_inner_prox() -> None:
    """∇M^μ_φ = (v − prox_{μφ}(v))/μ: with φ = ||z||₁ − ½||z||² and μ ≥ 1, prox_{μφ} does not
    exist (the envelope is −∞); ``lower`` derived a canonical layer whose T raised."""
    z = State("z", 3)
    env = moreau(Objective([L1(z) * 0.5, -SqNorm(z)]), 1.4) * 0.05
    obj = Objective([Potential("relu", z), SqNorm(z), env,
                     SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z) * -1.0])
    with pytest.raises(ce.LoweringError, match="Moreau envelope") as err:
        lowering.lower(obj)
    assert err.value.term == str(env)
    # prox variant of a regularizer edit needs prox_{(μ+λ)φ}: falls back to the gradient step
    phi, zz, _x = _theorem1()
    reg = moreau(Objective([L1(zz) * 0.5, SqNorm(zz) * -0.6]), 1.0) * 0.8  # μ ok, μ + λ not
    d = lowering.lower(phi + reg)
    assert d.info["variant"] == "gradient"
    assert torch.isfinite(d.apply({"z": torch.randn(2, 3, dtype=T64),
                                   "x": torch.randn(2, 2, dtype=T64)})["z"]).all()


# ----------------------------------------------------------------- convex_eq/terms/moreau.py
def test_envelope_gradient_lipschitz_bound_of_a_weakly_convex_inner_function() -> None:
    """φ = 0.5||z||₁ − 0.6·½||z||², μ = 1: ∇M changes with slope a/(1 − μa) = 1.5 along large
    |v|, but grad_lipschitz reported 1/μ = 1 (valid for convex φ only)."""
    z = State("z", 1)
    env = moreau(Objective([L1(z) * 0.5, SqNorm(z) * -0.6]), 1.0)
    v = torch.tensor([[5.0], [6.0]], dtype=T64)
    g = env.grad({"z": v})["z"]
    slope = float((g[1] - g[0]).abs() / (v[1] - v[0]).abs())
    assert slope == pytest.approx(1.5)
    assert env.grad_lipschitz() >= slope - 1e-12
    assert moreau(Objective([L1(z)]), 0.5).grad_lipschitz() == pytest.approx(2.0)  # convex: 1/μ


# ----------------------------------------------------------------- lowering/rules/common.proxable
@pytest.mark.parametrize("neg", ["l1", "potential"])
def test_negative_multiple_of_a_proxable_term_is_not_lowered_as_a_prox_step(neg: str) -> None:
    """−||z||₁ or −Σf_σ(z) as the 'prox-able' term of the forward–backward rule: ``Term.prox``
    refuses a negative coefficient, so the derived T raised ScaleError on every evaluation."""
    z = State("z", 3)
    t = L1(z) * -1.0 if neg == "l1" else Potential("tanh", z) * -1.0
    obj = Objective([t, SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z)])
    with pytest.raises(ce.LoweringError) as err:
        lowering.lower(obj)
    assert str(obj) in str(err.value)


def test_negative_l1_in_canonical_form_is_not_an_extra_prox() -> None:
    z = State("z", 3)
    obj = Objective([Potential("relu", z), SqNorm(z), L1(z) * -0.1,
                     SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z) * -1.0])
    with pytest.raises(ce.LoweringError):
        lowering.lower(obj)


def test_negative_smooth_regularizer_uses_the_gradient_step() -> None:
    """φ − 0.1·½||z||²: the auto variant picked the prox step of a negative multiple (T raised
    ScaleError); it is smooth, so the gradient variant applies: T(z) = prox_φ(1.1 z)."""
    phi, z, _x = _theorem1()
    d = lowering.lower(phi + SqNorm(z) * -0.1)
    assert d.info["variant"] == "gradient"
    zv, xv = torch.randn(4, 3, dtype=T64), torch.randn(4, 2, dtype=T64)
    w, u = phi.symbol("W_z").value, phi.symbol("U_z").value
    ref = torch.relu(1.1 * zv @ w.T + xv @ u.T) @ w
    torch.testing.assert_close(d.apply({"z": zv, "x": xv})["z"], ref, rtol=1e-12, atol=1e-12)
    env = moreau(L1(z) * 0.5, 1.0) * -0.1  # a negative envelope: gradient step as well
    d2 = lowering.lower(phi + env)
    assert torch.isfinite(d2.apply({"z": zv, "x": xv})["z"]).all()
    with pytest.raises(ce.LoweringError, match="non-positive"):
        lowering.lower(phi + SqNorm(z) * -0.1, regularizer="prox")


# ----------------------------------------------------------------- convex_eq/terms/moreau.py
@pytest.mark.parametrize("mu", [math.nan, math.inf])
def test_moreau_envelope_refuses_a_non_finite_mu(mu: float) -> None:
    """``μ ≤ 0`` was refused but NaN and +inf passed (``nan <= 0`` is False)."""
    z = State("z", 2)
    with pytest.raises(ce.ScaleError, match="μ"):
        moreau(L1(z), mu)


# ----------------------------------------------------------------- convex_eq/activations/base.py
@pytest.mark.parametrize("act", ["identity", "leaky_relu", "relu", "softplus"])
def test_prox_of_a_conjugate_potential_stays_in_its_domain(act: str) -> None:
    """prox_{t f_σ*} via the Moreau identity v − t·prox_{f_σ/t}(v/t) left 5e-17 where the
    exact value is 0 (the edge of dom f_σ*), so f_σ* of the prox was +∞ (identity: ι_{0})."""
    a = ce.get_activation(act, slope=0.3) if act == "leaky_relu" else ce.get_activation(act)
    v = torch.tensor([0.055988528498338484, 0.3523299032448493, 1.614604087979768, -0.7],
                     dtype=T64)
    for t in (0.3, 1.0, 2.5):
        p = a.prox_conjugate(v, t)
        lo, hi = a.conjugate_domain
        assert bool(((p >= lo) & (p <= hi)).all())
        assert torch.isfinite(a.conjugate_potential(p)).all()
    z = State("z", 1)
    g = Objective([Potential(a, z).conjugate() * 2.0, SqNorm(z) * -0.3])
    p = g.prox(torch.tensor([[0.055988528498338484]], dtype=T64), 2.5, {})
    assert torch.isfinite(g.value_tensor({"z": p})).all()


# ----------------------------------------------------------------- convex_eq/terms/potential.py
def test_not_dcp_potential_export_names_the_term() -> None:
    """The refusal named only the activation ('softplus'), not which term of the objective."""
    z, z2 = State("z", 2), State("y", 2)
    obj = Objective([Potential("relu", z2), SqNorm(z2), Potential("softplus", z), SqNorm(z)])
    with pytest.raises(ce.NotDCPError) as err:
        obj.to_cvxpy()
    assert err.value.term == "Σ f_softplus(z)"
    obj2 = Objective([AntiderivativeConjugate("softplus", z)])
    with pytest.raises(ce.NotDCPError) as err2:
        obj2.to_cvxpy()
    assert "(∫softplus)*(z)" in err2.value.term


# ----------------------------------------------------------------- convex_eq/terms/conjugate.py
def test_not_dcp_conjugate_export_and_value_name_the_term() -> None:
    phi = models.opteq(n=2, m=4, d=2, activation="softplus", form="conjugate")
    conj = str(phi.terms[0])
    with pytest.raises(ce.NotDCPError) as err:
        phi.to_cvxpy(x=np.zeros(2))
    assert conj in str(err.value)
    # Mᵀ (2×4) is not injective: the value is the inner problem min{Σσ̃*(y) − <q,y> : Mᵀy = z},
    # once refused for softplus (not DCP), now solved through its Fenchel dual (no CVXPY);
    # checked against an independent SLSQP solve of the inner problem itself
    import scipy.optimize as so

    t = phi.terms[0]
    m = t.op.matrix(None)
    q = t.q.evaluate({"x": torch.zeros(1, 2, dtype=torch.float64)}, None)[0].numpy()
    zv = t.s * m.T @ np.array([0.5, 0.2, 0.9, 0.4])  # in dom ψ* = s·Mᵀ(0, ∞)⁴
    act = t.act

    def inner(y: np.ndarray) -> float:
        return float(act.antiderivative_conjugate(torch.as_tensor(y)).sum()) - float(q @ y)

    res = so.minimize(inner, np.full(4, 0.5), method="SLSQP", bounds=[(1e-9, None)] * 4,
                      constraints=[{"type": "eq", "fun": lambda y: m.T @ y - zv / t.s}],
                      options={"ftol": 1e-14, "maxiter": 500})
    val = float(phi.terms[0].value({"z": torch.as_tensor(zv[None]),
                                    "x": torch.zeros(1, 2, dtype=torch.float64)}))
    # SLSQP at ftol 1e-14 on a smooth 4-variable problem: ~1e-8 in value; margin 100×
    assert res.success and abs(val - t.coef(None) * t.s * res.fun) <= 1e-6, (val, res)


# ----------------------------------------------------------------- convex_eq/export.py
def test_export_of_a_constant_objective_has_a_solution() -> None:
    """Σ f_identity(z) = 0: CVXPY leaves the unused variable unset although the status is
    'optimal'; ``state_values`` raised "problem has no solution (status optimal)"."""
    z = State("z", (1, 2, 2))
    exp = Objective([Potential("identity", z)]).to_cvxpy()
    assert exp.solve() == 0.0
    assert exp.state_values()["z"].shape == (1, 2, 2)


def test_export_solver_failure_is_a_project_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ExportedProblem.solve`` let ``cvxpy.error.SolverError`` escape (seen twice in a
    thorough fuzz run on random objectives, Clarabel failing)."""
    import cvxpy as cp

    z = State("z", 2)
    exp = Objective([L1(z), SqNorm(z)]).to_cvxpy()

    def fail(*args: object, **kwargs: object) -> None:
        raise cp.error.SolverError("Solver 'CLARABEL' failed.")

    monkeypatch.setattr(exp.problem, "solve", fail)
    with pytest.raises(ce.SolverError, match="CLARABEL"):
        exp.solve()


# ----------------------------------------------------------------- lowering/derived.py
def test_T_with_different_batch_sizes_raises_a_shape_error() -> None:
    """Blocks and inputs of different batch sizes hit a torch broadcasting RuntimeError."""
    d = lowering.lower(models.opteq(n=3, m=3, d=2))
    with pytest.raises(ce.ShapeError, match="batch sizes differ"):
        d.T(z=np.zeros((3, 3)), x=np.zeros((2, 2)))
    out = d.T(z=np.zeros(3), x=np.zeros((2, 2)))  # one sample broadcasts (as Objective.value)
    assert out.shape == (2, 3)


# ----------------------------------------------------------------- lowering/module.py
def _module_two_inputs() -> nn.Module:
    z, x, y = State("z", 3), Input("x", 2), Input("y", 2)
    obj = Objective([Potential("relu", z), SqNorm(z),
                     Linear(Dense(Weight("U", (3, 2))) @ x + Dense(Weight("V", (3, 2))) @ y, z)
                     * -1.0, SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z) * -1.0])
    return lowering.lower(obj).torch_module(dtype=T64)


def test_module_inputs_with_different_batch_sizes_raise_a_shape_error() -> None:
    m = _module_two_inputs()
    with pytest.raises(ce.ShapeError, match="batch sizes"):
        m({"x": torch.zeros(3, 2, dtype=T64), "y": torch.zeros(2, 2, dtype=T64)})


@pytest.mark.parametrize("bad", ["numel", "batch", "numpy"])
def test_module_z0_of_the_wrong_shape_raises_a_shape_error(bad: str) -> None:
    """``z0.reshape(B, N)`` raised a torch RuntimeError (or AttributeError for numpy)."""
    m = lowering.lower(models.opteq(n=3, m=3, d=2)).torch_module()
    z0 = {"numel": torch.zeros(2, 4), "batch": torch.zeros(3, 2), "numpy": np.zeros((2, 3))}[bad]
    with pytest.raises(ce.ShapeError, match="z0"):
        m(torch.zeros(2, 2), z0=z0)
    assert m(torch.zeros(2, 2), z0=torch.zeros(2, 3)).shape == (2, 3)


@pytest.mark.parametrize("name", ["b", "W_h", "gamma"])
def test_module_parameter_of_the_wrong_shape_raises_naming_it(name: str) -> None:
    """A wrongly shaped bias / patch weight / scalar put into the module surfaced as a torch
    broadcasting or matmul RuntimeError inside T."""
    m = lowering.lower(models.geq(n=4, p=4, d=3, patch=2, image=(1, 2, 2))).torch_module()
    if name == "gamma":
        m.scalar_gamma = torch.ones(2, dtype=T64)
    else:
        m.weights[name] = nn.Parameter(torch.zeros(*[s + 1 for s in m.weights[name].shape]))
    with pytest.raises(ce.ShapeError) as err:
        m(torch.randn(2, 3))
    assert err.value.term == name


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_module_with_a_non_finite_weight_raises(value: float) -> None:
    """An Inf weight could yield a finite output (relu(-inf) = 0) from a broken model."""
    m = lowering.lower(models.opteq(n=3, m=3, d=2)).torch_module(dtype=T64)
    with torch.no_grad():
        m.weights["U"][0, 0] = value
    x = torch.tensor([[-1.0, 0.0]], dtype=T64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ce.NonFiniteError) as err:
            m(x)
    assert err.value.term == "U"


# ----------------------------------------------------------------- verify/lifting.py
@pytest.mark.parametrize("which", ["l1", "linf"])
def test_verify_an_input_free_envelope_whose_lifted_problem_has_no_smooth_part(which: str) -> None:
    """``M^μ[c·||z||₁]`` lifts to a prox term only: the stationarity residual took the autograd
    gradient of a constant and raised an untyped RuntimeError (found by the thorough fuzz)."""
    import verify

    z = State("z", 4)
    inner = L1(z) * 0.3 if which == "l1" else ce.LinfBallIndicator(z, 0.5)
    phi = moreau(inner, 0.5) if which == "l1" else moreau(inner, 1.0) * 0.9
    report = verify.check(lowering.lower(phi), {})
    assert report.passed, report
    assert report.label == "minimizer"


# ----------------------------------------------------------------- lowering/weight_control.py
def test_eval_forward_leaves_parameters_alone_and_keeps_the_bound() -> None:
    """Eval forwards leave the parameters alone (bit-identical repeats) and still enforce
    ||W||₂ ≤ bound − margin (exact SVD here; the control uses a guaranteed bound, so the
    allowance is only the float64 round-off of one rescaling, 1e-12), also on a module never
    run in training mode."""
    d = lowering.lower(models.opteq(n=6, m=6, d=3, form="conjugate", weight_norm=1.4, seed=1))
    for mode in ("spectral_norm", "project"):
        m = d.torch_module(weight_control=mode, margin=0.05, dtype=T64).eval()
        w0 = m.weights["W"].detach().clone()
        with torch.no_grad():
            outs = [m(torch.ones(2, 3, dtype=T64)) for _ in range(3)]
            w_eff = m.env()["W"]
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert torch.equal(m.weights["W"], w0)
        assert float(torch.linalg.matrix_norm(w_eff, 2)) <= 0.95 + 1e-12


# ----------------------------------------------------------------- lowering/derived.py
def test_a_batch_independent_update_is_broadcast_to_the_batch() -> None:
    """``Σf_id(z) + ½||z||² + c<b, z>`` lowers to ``z ← −c·b``: T returned shape (1, n) for a
    batch of 2 (found by the thorough fuzz)."""
    z = State("z1", (1, 2, 2))
    b = ce.Constant("b2", np.arange(4.0))
    d = lowering.lower(Objective([Potential("identity", z), SqNorm(z), Linear(b, z) * 0.5]))
    out = d.apply({"z1": torch.zeros(2, 4, dtype=T64)})["z1"]
    assert out.shape == (2, 4)
    assert torch.equal(out[1], -0.5 * torch.arange(4.0, dtype=T64))
    m = d.torch_module(dtype=T64)
    assert m.T(torch.zeros(3, 4, dtype=T64), {}, m.env()).shape == (3, 4)


# ----------------------------------------------------------------- lowering/solvers.py
def test_float32_residual_norm_does_not_overflow_into_false_convergence() -> None:
    """At |x| ~ 1e20 a float32 ``||·||`` overflowed to inf and ``r/inf = 0`` reported a wrong
    iterate (67 % off) as converged (found by the thorough fuzz)."""
    from lowering.solvers import rel_residual

    fz = torch.tensor([[3e19, -4e19, 2e20]])
    r = rel_residual(fz, fz * (1 + 1e-3))
    assert r.dtype == torch.float32 and abs(float(r) - 1e-3) < 1e-6  # float32 rounding of 1e-3
    d = lowering.lower(models.opteq(n=5, m=4, d=3, form="conjugate", weight_norm=0.999, seed=3))
    m = d.torch_module(dtype=torch.float32, tol=1e-7, max_iter=3, on_nonconvergence="raise")
    with pytest.raises(ce.ConvergenceError):
        m(torch.tensor([[8.0328e19, 1.7483e19, 8.8978e18]]))


# ----------------------------------------------------------------- lowering/converter.py
@pytest.mark.parametrize("scale, error", [(1e-274, ce.ScaleError), (1e160, ce.ScaleError),
                                          (math.nan, ce.NonFiniteError),
                                          (math.inf, ce.NonFiniteError)])
def test_converter_refuses_weights_outside_float64_range_naming_the_layer(
        scale: float, error: type) -> None:
    """ZeroDivisionError (1e-274: μ underflowed), OverflowError (1e160) and a LinAlgError
    (NaN/Inf) escaped ``lowering.convert`` before."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[0].weight.mul_(scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error) as err:
            lowering.convert(net)
    assert err.value.term == "convert: Linear 1"


# ----------------------------------------------------------------- lowering/rules/moreau_skip.py
def test_general_envelope_rule_of_a_weakly_convex_inner_function_bounds_lip_honestly() -> None:
    """``0.25·M^0.5[||z||₁ − ½||z||²]`` claimed "prox of a convex function is nonexpansive"
    (Lip 1); T expands by up to a/(1 + tq) + 1 − a = 2 (found by the thorough fuzz)."""
    z = State("z1", 1)
    d = lowering.lower(moreau(L1(z) - SqNorm(z), ce.Scalar("mu2", 0.5)) * 0.25)
    bound = d.contraction.value(None)
    assert bound == pytest.approx(2.0, rel=1e-12)
    a, b = torch.tensor([[1.0]], dtype=T64), torch.tensor([[1.1]], dtype=T64)  # past 0.75
    ratio = float((d.apply({"z1": a})["z1"] - d.apply({"z1": b})["z1"]).norm() / 0.1)
    assert 1.0 < ratio <= bound * (1 + 1e-12)


# ----------------------------------------------------------------- verify (false FAILs)
def _verified(phi: Objective, x: object = None) -> object:
    import verify

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify.check(lowering.lower(phi), {} if x is None else x, starts=2)


def test_verify_linf_ball_is_a_box_in_the_stationarity_check() -> None:
    """``−<c, z> + ι(||z||∞ ≤ 1)``: the layer and CVXPY agree (7e-11) but the independent
    projected gradient ignored the ball (residual ||c|| ≈ 1.6 → false FAIL)."""
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U, b = Weight("U3", (4, 3), rng.normal(size=(4, 3))), Weight("b2", 4, rng.normal(size=4))
    rep = _verified(-Linear(U @ x + b, z) + ce.LinfBallIndicator(z, 1.0), rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12


def test_verify_numeric_reference_starts_inside_an_open_conjugate_domain() -> None:
    """``Σf*_softplus(z) + ...``: dom f*_softplus = (−∞, 0); the numeric reference started on
    the boundary, where the NaN gradient read as 0, and "converged" to z = 0 (objective 0.82
    above the layer's, which is right: z* = −0.68845 by scalar minimization)."""
    z = State("z1", 1)
    phi = (ce.PotentialConjugate("softplus", z) + moreau(ce.LinfBallIndicator(z, 0.5), 1.0) * 0.05
           + SqNorm(z))
    rep = _verified(phi)
    assert rep.passed, rep
    assert rep.samples[0].rel_error <= 1e-9
    # independent reference: bounded scalar minimization of G with scipy (xatol 1e-12); the
    # layer's fixed point agrees to 1e-7 (scipy's bracketing accuracy on a flat minimum)
    from scipy.optimize import minimize_scalar

    def g(v: float) -> float:
        return float(phi.value_tensor({"z1": torch.tensor([[v]], dtype=T64)}))

    ref = minimize_scalar(g, bounds=(-20.0, -1e-12), method="bounded",
                          options={"xatol": 1e-12}).x
    z_layer = lowering.lower(phi).apply({"z1": torch.tensor([[ref]], dtype=T64)})["z1"]
    assert abs(float(z_layer) - ref) <= 1e-7  # T(z_ref) ≈ z_ref: the scipy point is a fixed point
    assert abs(ref + 0.68845) <= 1e-5


def test_verify_minimizer_at_zero_is_not_failed_by_interior_point_noise() -> None:
    """``Σf_relu(z) + ½||z||²``: z* = 0 on z ≥ 0 with a zero multiplier (degenerate); Clarabel
    at gap 1e-11 lands 1.6e-6 away (interior points converge like sqrt(gap) there), a false
    FAIL (relative error 1.6e-3).  The disagreeing CVXPY point is now polished by local
    minimization from that point (not from the layer's) before comparing."""
    z = State("z1", (1, 2, 2))
    rep = _verified(Objective([Potential("relu", z), SqNorm(z)]))
    assert rep.passed, rep
    assert rep.samples[0].abs_error <= 1e-12
    assert any("polished" in n for n in rep.samples[0].notes)


@pytest.mark.parametrize("act", ["softplus", "clamp"])
def test_verify_conjugate_antiderivative_domain_is_a_box(act: str) -> None:
    """dom σ̃* = range of σ ((0, ∞) for softplus, [0, 1] for clamp) was not a box of the lifted
    problem: the numeric reference stuck at the edge (rel. error 1.5e2) and the stationarity
    check ignored the bound (residual ≈ 1.2) — both false FAILs."""
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U, b = Weight("U3", (4, 3), rng.normal(size=(4, 3))), Weight("b2", 4, rng.normal(size=4))
    if act == "softplus":
        phi = (AntiderivativeConjugate(act, z) * 0.5
               + moreau(ce.LinfBallIndicator(z, 1.0), 0.733) * 0.49)
        rep = _verified(phi)
    else:
        rep = _verified(AntiderivativeConjugate(act, z) * 0.97 - Linear(U @ x + b, z),
                        rng.normal(size=(2, 3)))
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12


# ----------------------------------------------------------------- lowering/rules/regularizers.py
def test_gradient_and_prox_regularizer_edits_together_are_not_nested() -> None:
    """φ + R_g (gradient variant) + R_p (prox variant) lowered to prox_φ(prox_{R_p}(z − ∇R_g(z))),
    whose fixed points put ∇M¹_{R_p} at z − ∇R_g(z): not stationary for the claimed
    φ + R_g + M¹[R_p] (rel. error 4e-2, found by the thorough fuzz).  Now
    prox_φ(prox_{R_p}(z) − ∇R_g(z)): the claim's stationarity condition exactly."""
    rng = np.random.default_rng(0)
    z = State("z1", 4)
    W = Weight("W2", (4, 4), np.linalg.qr(rng.normal(size=(4, 4)))[0] * 0.9)
    phi = (Antiderivative("sigmoid", Dense(W) @ z).conjugate() - SqNorm(z)
           + moreau(L1(z), 1.0) * 0.5 - SqNorm(z) * 0.5)
    d = lowering.lower(phi)
    assert "prox_{0.5·M^1[||z1||₁](z1)}(z1) + 0.5·z1" in d.describe()
    rep = _verified(phi)
    assert rep.passed, rep
    assert rep.label.startswith("modified minimizer")


def test_verify_reports_a_second_minimizer_of_a_flat_convex_objective() -> None:
    """``ι(||z||∞ ≤ 1) + ½M^½[Σf_leaky_relu]``: every z ∈ [0, 1]ⁿ is a minimizer; the layer and
    CVXPY pick different ones (relative error 1.0, gap 0, stationarity 0) — a false FAIL."""
    z = State("z1", 3)
    phi = ce.LinfBallIndicator(z, 1.0) + moreau(Objective([Potential("leaky_relu", z)]), 0.5) * 0.5
    rep = _verified(phi)
    assert rep.passed, rep
    s = rep.samples[0]
    assert s.argmin_not_unique and s.rel_error > 0.5 and abs(s.gap) <= 1e-12
    assert any("not a single point" in n for n in s.notes)


def test_verify_nonsmooth_conjugate_potential_is_a_prox_term_of_the_lifted_problem() -> None:
    """f*_hardtanh(w) = |w| is nonsmooth: L-BFGS-B stalled (reference projected gradient 1.2)
    and the stationarity check took a gradient of |·| (0.83) — "reference solver failed"."""
    rng = np.random.default_rng(0)
    z = State("z1", 4)
    c = ce.Constant("c", rng.normal(size=4) * 3)
    rep = _verified(ce.PotentialConjugate("hardtanh", z) + SqNorm(z - c) * 1.78)
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12


def test_verify_batch_coupled_objective_uses_the_batch_gradient() -> None:
    """OptEq + batch decorrelation: the stationarity check lifted one sample at a time, where the
    coupled term is a different function (residual 6e-2, false FAIL).  Now the smooth gradient is
    the batch objective's; a layer for another coefficient still fails."""
    import dataclasses

    x = np.random.default_rng(0).normal(size=(5, 3))
    phi = models.opteq(n=4, m=4, d=3, seed=0)
    z = phi.states[0]
    d = lowering.lower(phi + ce.BatchDecorrelation(z) * 0.05)
    import verify

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify.check(d, x, starts=2)
        # the second-order check now sees the batch problem (one function of all samples)
        assert rep.passed and rep.label == "local minimizer", rep
        assert max(s.stationarity for s in rep.samples) <= 1e-10
        wrong = dataclasses.replace(d, source=phi + ce.BatchDecorrelation(z) * 0.5)
        bad = verify.check(wrong, x, starts=2)
    assert not bad.passed and any("stationarity" in f for f in bad.failures), bad


def test_verify_unwraps_nested_precompositions_and_polishes_through_them() -> None:
    """(φ∘A)∘B with φ = c||u||₁ + ½uᵀQu: the stationarity check unwrapped one level only, so ℓ1
    was differentiated (residual 0.48, false FAIL); a degenerate minimizer of a precomposed
    relu objective was compared with the unpolished CVXPY point (relative error 2e-4)."""
    rng = np.random.default_rng(3)
    z = State("z1", 4)
    a = rng.normal(size=(4, 4))
    q = ce.Constant("Q2", a @ a.T / 4 + 0.1 * np.eye(4))
    phi = L1(z) * 0.41 + ce.QuadraticForm(q, z) * 0.41
    nested = ce.precompose(ce.precompose(phi, np.linalg.qr(rng.normal(size=(4, 4)))[0],
                                         rng.normal(size=4)), rng.normal(size=(4, 4)))
    rep = _verified(nested)
    assert rep.passed, rep
    assert max(s.stationarity for s in rep.samples) <= 1e-12
    rng = np.random.default_rng(0)
    W = Weight("W2", (4, 4), np.linalg.qr(rng.normal(size=(4, 4)))[0] * 0.9)
    relu = Objective([Potential("relu", z), SqNorm(z), -SqNorm(Dense(W) @ z) * 0.5])
    rep = _verified(ce.precompose(relu, np.linalg.qr(rng.normal(size=(4, 4)))[0]))
    assert rep.passed, rep
    assert any("polished" in n for n in rep.samples[0].notes)


def test_verify_polishes_an_inaccurate_cvxpy_solution_instead_of_failing() -> None:
    """``Σf_tanh(z) + ½||z||² − <c, z>``: Clarabel at gap 1e-11 ends 'optimal_inaccurate' (the
    entropy cones); that was "reference solver failed".  The point is now polished by local
    minimization and used only if it is stationary to the reference tolerance."""
    z = State("z1", 4)
    c = ce.Constant("c", np.random.default_rng(0).normal(size=4) * 3)
    rep = _verified(Objective([Potential("tanh", z), SqNorm(z), -Linear(c, z)]))
    assert rep.passed, rep
    assert rep.reference.statuses == ["optimal_inaccurate → polished"]
    assert rep.samples[0].rel_error <= 1e-12


def test_verify_point_conjugate_domain_stays_a_closed_box() -> None:
    """f*_identity = ι{0}: moving the 'open' ends inside by 1e-12 made lo > hi and scipy raised
    an untyped ValueError from verify.check (found by the thorough fuzz)."""
    z = State("z1", 3)
    rep = _verified(ce.precompose(ce.PotentialConjugate("identity", z) + SqNorm(z),
                                  np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))[0]))
    assert rep.passed, rep


# ----------------------------------------------------------------- verify/equilibrium.py
def test_verify_reports_a_diverging_layer_instead_of_raising() -> None:
    """``z ← relu(1 + 10z)`` has no fixed point; the tight solve's NaN/Inf escaped verify.check
    as NonFiniteError (typed, but verify's job is the report)."""
    import os
    import tempfile

    z = State("z", 3)
    one = ce.Constant("one", np.ones(3))
    obj = Objective([Potential("relu", z), SqNorm(z), -Linear(one, z), -SqNorm(z) * 10.0])
    rep = _verified(obj)
    assert not rep.passed and rep.label == "equilibrium not found"
    assert any("diverged" in f for f in rep.failures), rep.failures
    rep.to_markdown(os.path.join(tempfile.mkdtemp(), "report.md"))  # renders without history


# ----------------------------------------------------------------- lowering/nodes.py
def test_prox_of_an_envelope_whose_inner_objective_reads_an_input() -> None:
    """M¹[c||z||₁ + <Ux, z>] as the prox term of forward–backward: the Prox node called the
    envelope's prox without the input values, so T raised "no value given for input 'x'"
    (found by the thorough fuzz after the all-smooth forward–backward rule)."""
    import verify

    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U = Weight("U3", (4, 3), rng.normal(size=(4, 3)))
    phi = moreau(L1(z) * 0.5 + Linear(U @ x, z), 2.0) * 2 + moreau(ce.LinfBallIndicator(z), 1.0)
    d = lowering.lower(phi)
    assert "prox_{2·M^2[0.5·||z1||₁ + <U3 x, z1>](z1)}" in d.describe()  # the envelope is g
    out = d.torch_module(dtype=T64)(torch.ones(2, 3, dtype=T64))
    assert torch.isfinite(out).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify.check(d, rng.normal(size=(2, 3)))
    assert rep.passed, rep
