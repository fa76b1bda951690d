"""Objective language: proxes, conjugates, gradients, CVXPY export, certificates, refusals.

References are independent of the code under test: hand-written CVXPY problems, scipy
minimization, torch.autograd and central finite differences.
"""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest
import torch
from scipy.optimize import minimize

import convex_eq as ce
from convex_eq import models
from convex_eq.terms import (
    L1,
    Antiderivative,
    AntiderivativeConjugate,
    Linear,
    MoreauEnvelope,
    Potential,
    QuadraticForm,
    SqNorm,
)

RNG = np.random.default_rng(1234)
T64 = torch.float64


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.atleast_2d(a), dtype=T64)


def _val(term: ce.Term, z: ce.State, v: np.ndarray, extra: dict | None = None) -> float:
    vals = {z.name: _t(v), **(extra or {})}
    return float(term.value(vals, None)[0])


# --------------------------------------------------------------------------- 2. closed-form proxes
def _numeric_prox_cvxpy(act: str, v: np.ndarray, t: float) -> np.ndarray:
    """Hand-written CVXPY prox of t·f_σ (independent of the exporter)."""
    u = cp.Variable(v.size)
    cons = []
    obj = 0.5 * cp.sum_squares(u - v)
    if act == "relu":
        cons = [u >= 0]
    elif act == "hardtanh":
        cons = [u >= -1, u <= 1]
    elif act == "leaky_relu":
        a = 0.01
        obj = obj + t * (1 / a - 1) / 2 * cp.sum_squares(cp.neg(u))
    prob = cp.Problem(cp.Minimize(obj), cons)
    prob.solve(solver=cp.CLARABEL)
    return u.value


@pytest.mark.parametrize("act", ["relu", "hardtanh", "leaky_relu", "identity"])
@pytest.mark.parametrize("t", [1.0, 0.4, 2.5])
def test_potential_prox_matches_cvxpy(act: str, t: float) -> None:
    z = ce.State("z", 7)
    term = Potential(act, z)
    v = 2 * RNG.standard_normal(7)
    got = term.prox(_t(v), t)[0].numpy()
    # Clarabel default tolerances reach ~1e-8 on these tiny QPs
    np.testing.assert_allclose(got, _numeric_prox_cvxpy(act, v, t), atol=1e-6)


def _scipy_prox(fun, v: np.ndarray, t: float, bounds=None) -> np.ndarray:
    res = minimize(lambda u: t * fun(u) + 0.5 * np.sum((u - v) ** 2), np.clip(v, -0.5, 0.5),
                   method="L-BFGS-B", bounds=bounds, options={"ftol": 1e-15, "gtol": 1e-12,
                                                              "maxiter": 5000})
    return res.x


@pytest.mark.parametrize("t", [0.3, 1.0, 3.0])
def test_smooth_term_proxes_match_scipy(t: float) -> None:
    z = ce.State("z", 5)
    v = RNG.standard_normal(5)
    cases = [
        (SqNorm(z), None),
        (0.7 * SqNorm(z), None),
        (AntiderivativeConjugate("tanh", z), [(-1 + 1e-12, 1 - 1e-12)] * 5),
        (AntiderivativeConjugate("sigmoid", z), [(1e-12, 1 - 1e-12)] * 5),
        (AntiderivativeConjugate("relu", z), [(0, None)] * 5),
        (MoreauEnvelope(L1(z), 0.6) * 0.8, None),
        (MoreauEnvelope(Potential("relu", z), 0.5), None),
    ]
    for term, bounds in cases:
        got = term.prox(_t(v), t)[0].numpy()
        ref = _scipy_prox(lambda u, term=term: _val(term, z, u), v, t, bounds)
        # L-BFGS-B on a smooth strongly convex 5-d problem: ~1e-7 accuracy
        np.testing.assert_allclose(got, ref, atol=2e-6, err_msg=str(term))


def test_objective_prox_absorbs_quadratic_and_linear() -> None:
    z, x = ce.State("z", 4), ce.Input("x", 4)
    obj = L1(z) * 0.3 + 0.5 * SqNorm(z) - Linear(x, z)
    v, xv = RNG.standard_normal(4), RNG.standard_normal(4)
    got = obj.prox(_t(v), 0.7, {"x": _t(xv)})[0].numpy()
    u = cp.Variable(4)
    cp.Problem(cp.Minimize(0.7 * (0.3 * cp.norm1(u) + 0.25 * cp.sum_squares(u) - xv @ u)
                           + 0.5 * cp.sum_squares(u - v))).solve(solver=cp.CLARABEL)
    np.testing.assert_allclose(got, u.value, atol=1e-7)


# --------------------------------------------------------------------------- 3. conjugates
def _conj_cases(z: ce.State) -> list[ce.Term]:
    return [Potential("relu", z), Potential("hardtanh", z), Potential("leaky_relu", z),
            Potential("tanh", z), 2.0 * Potential("relu", z), SqNorm(z), 0.5 * SqNorm(z),
            0.4 * L1(z), AntiderivativeConjugate("tanh", z)]


def test_moreau_identity_for_every_term_with_a_conjugate() -> None:
    z = ce.State("z", 6)
    for term in _conj_cases(z):
        conj = term.conjugate()
        if not conj.has_prox:
            continue
        v = _t(2 * RNG.standard_normal(6))
        lhs = term.prox(v, 1.0) + conj.prox(v, 1.0)
        torch.testing.assert_close(lhs, v, atol=1e-9, rtol=0, msg=str(term))


def test_fenchel_young_with_equality_at_the_gradient() -> None:
    z = ce.State("z", 5)
    smooth = [SqNorm(z), 0.5 * SqNorm(z), Antiderivative("tanh", z), Antiderivative("relu", z),
              Antiderivative("sigmoid", z), Antiderivative("softplus", z),
              1.5 * Antiderivative("leaky_relu", z), Potential("leaky_relu", z)]
    for f in smooth:
        fs = f.conjugate()
        for _ in range(5):
            xv = RNG.standard_normal(5)
            yv = f.grad({"z": _t(xv)})["z"][0].numpy()
            eq = _val(f, z, xv) + _val(fs, z, yv) - xv @ yv
            assert abs(eq) < 1e-7, (str(f), eq)
            other = yv + 0.3 * RNG.standard_normal(5)
            gap = _val(f, z, xv) + _val(fs, z, other) - xv @ other
            assert gap >= -1e-9, (str(f), gap)


def test_separable_affine_conjugate_fenchel_young() -> None:
    """ψ(z) + ψ*(v) ≥ <z, v>, equality at v = ∇ψ(z) — checks the y-form value of ψ*."""
    for act in ["relu", "tanh", "leaky_relu", "identity"]:
        z = ce.State("z", 6)
        x = ce.Input("x", 3)
        w = models.spectral_weight("W", (4, 6), 0.9, seed=5)  # m = 4 ≤ n: y unique
        u = ce.Weight("U", (4, 3))
        psi = 0.8 * Antiderivative(act, w @ z + u @ x)
        psis = psi.conjugate()
        assert isinstance(psis, ce.SeparableAffineConjugate)
        for _ in range(4):
            zv, xv = RNG.standard_normal(6), RNG.standard_normal(3)
            vals = {"z": _t(zv), "x": _t(xv)}
            grad = psi.grad(vals)["z"]
            lhs = float(psi.value(vals)[0] + psis.value({"z": grad, "x": _t(xv)})[0])
            assert abs(lhs - float(grad[0] @ _t(zv)[0])) < 1e-8, act
            # off the gradient (but still in range Wᵀ): strict inequality
            other = grad + 0.2 * _t(RNG.standard_normal(4)) @ w.value
            val = float(psis.value({"z": other, "x": _t(xv)})[0])
            if np.isfinite(val):
                assert float(psi.value(vals)[0]) + val >= float(other[0] @ _t(zv)[0]) - 1e-9


# --------------------------------------------------------------------------- 4. gradients
def _grad_cases() -> list[tuple[ce.Objective, list[ce.State]]]:
    z, y = ce.State("z", 5), ce.State("y", 4)
    x = ce.Input("x", 3)
    w = ce.Weight("W", (4, 5), seed=1)
    u = ce.Weight("U", (4, 3), seed=2)
    q = ce.Constant("Q", (lambda a: a @ a.T)(RNG.standard_normal((5, 5))))
    cases = [
        ce.Objective([SqNorm(w @ z + u @ x)]),
        ce.Objective([-Linear(u @ x, w @ z)]),
        ce.Objective([QuadraticForm(q, z)]),
        ce.Objective([Antiderivative(a, w @ z + u @ x) for a in
                      ["relu", "tanh", "sigmoid", "softplus", "leaky_relu", "identity"]]),
        ce.Objective([Potential("leaky_relu", z), Potential("identity", y)]),
        ce.Objective([MoreauEnvelope(L1(z), 0.7) * 1.3, MoreauEnvelope(SqNorm(y), 0.2)]),
        ce.Objective([SqNorm(w @ z - y), 0.3 * SqNorm(y)]),
    ]
    return [(c, c.states) for c in cases]


@pytest.mark.parametrize("case", range(7))
def test_gradient_rules_match_autograd_and_finite_differences(case: int) -> None:
    obj, states = _grad_cases()[case]
    vals = {s.name: _t(RNG.standard_normal(s.size) + 0.3) for s in states}
    for inp in obj.inputs:
        vals[inp.name] = _t(RNG.standard_normal(inp.size))
    g = obj.grad_tensor(vals)
    leaves = {k: v.clone().requires_grad_() for k, v in vals.items()}
    obj.value_tensor(leaves).sum().backward()
    for s in states:
        # closed-form rule vs autograd of the value: agree to rounding (float64)
        torch.testing.assert_close(g[s.name], leaves[s.name].grad, atol=1e-10, rtol=1e-9)
        h = 1e-6
        fd = torch.zeros(s.size, dtype=T64)
        for i in range(s.size):
            e = torch.zeros(1, s.size, dtype=T64)
            e[0, i] = h
            plus = obj.value_tensor({**vals, s.name: vals[s.name] + e})
            minus = obj.value_tensor({**vals, s.name: vals[s.name] - e})
            fd[i] = (plus - minus)[0] / (2 * h)
        # central differences with h = 1e-6: truncation ~1e-12·f''', rounding ~1e-10
        torch.testing.assert_close(g[s.name][0], fd, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- 5. CVXPY export
EXPORTABLE_ACTS = ["relu", "leaky_relu", "hardtanh", "identity"]


def _feasible(act: str, n: int) -> np.ndarray:
    v = RNG.standard_normal(n)
    if act == "relu":
        return np.abs(v)
    if act == "hardtanh":
        return np.clip(v, -0.9, 0.9)
    return v


@pytest.mark.parametrize("act", EXPORTABLE_ACTS)
def test_canonical_opteq_export_value_and_solve(act: str) -> None:
    obj = models.opteq(n=7, m=6, d=3, activation=act, seed=3)
    xv = RNG.standard_normal(3)
    ex = obj.to_cvxpy(x=xv)
    for _ in range(5):
        zv = _feasible(act, 7)
        f = np.zeros(ex.variable.size)
        f[ex.blocks["z"]] = zv
        assert ex.max_violation(f) <= 1e-12
        # same function, two code paths (CVXPY expression vs torch value): rounding only
        ref = ex.objective_at(f)
        assert abs(ref - obj.value(z=zv, x=xv)) <= 1e-9 * (1 + abs(ref))
    ex.solve()
    assert ex.problem.status == cp.OPTIMAL
    assert ex.state_values()["z"].shape == (7,)


@pytest.mark.parametrize("act", EXPORTABLE_ACTS)
def test_conjugate_opteq_export_in_y_form(act: str) -> None:
    """docs/theory.md §2: min_y Σσ̃*(y) - <q,y> - ½||Wᵀy||², z = Wᵀy (m ≤ n so y is determined by
    z)."""
    obj = models.opteq(n=7, m=5, d=3, activation=act, form="conjugate", seed=4)
    xv = RNG.standard_normal(3)
    ex = obj.to_cvxpy(x=xv)
    w = obj.symbol("W").value.numpy()
    assert ex.variable.size == 5  # only the auxiliary y; z is substituted
    for _ in range(5):
        yv = _feasible(act, 5)
        zv = w.T @ yv
        np.testing.assert_allclose(ex.state_maps["z"] @ yv, zv, atol=1e-12)
        assert abs(ex.objective_at(yv) - obj.value(z=zv, x=xv)) <= 1e-8 * (1 + abs(obj.value(
            z=zv, x=xv)))
    ex.solve()
    assert ex.problem.status == cp.OPTIMAL


def test_export_moreau_envelope_of_dcp_term_and_regularized() -> None:
    z, x = ce.State("z", 6), ce.Input("x", 6)
    obj = ce.Objective([0.7 * MoreauEnvelope(L1(z) + 0.5 * SqNorm(z), 0.5), SqNorm(z),
                        -Linear(x, z), 0.2 * L1(z)])
    xv = RNG.standard_normal(6)
    ex = obj.to_cvxpy(x=xv)
    for _ in range(5):
        zv = RNG.standard_normal(6)
        # at the inner minimizer u = prox_{μ f}(z) the lifted objective equals the envelope
        u = obj.terms[0].inner_prox(_t(zv), 0.5, {}, None)[0].numpy()
        f = np.zeros(ex.variable.size)
        f[ex.blocks["z"]] = zv
        aux = next(k for k in ex.blocks if k != "z")
        f[ex.blocks[aux]] = u
        assert abs(ex.objective_at(f) - obj.value(z=zv, x=xv)) < 1e-9
    val = ex.solve()
    assert ex.problem.status == cp.OPTIMAL
    zs = ex.state_values()["z"]
    assert abs(val - obj.value(z=zs, x=xv)) < 1e-7


def test_export_regularized_opteq_prox_variant_objective() -> None:
    import lowering

    phi = models.opteq(n=6, m=6, d=3, activation="relu", form="conjugate", seed=2)
    layer = lowering.lower(phi + 0.1 * L1(phi.states[0]))
    xv = RNG.standard_normal(3)
    ex = layer.source.to_cvxpy(x=xv)
    ex.solve()
    assert ex.problem.status == cp.OPTIMAL


# --------------------------------------------------------------------------- certificates
def test_certificate_texts() -> None:
    phi = models.opteq(n=6, m=6, d=3, form="conjugate")
    w = phi.symbol("W").value
    assert phi.certificate().text == "convex if ||W||₂ ≤ 1 (now 0.9)"
    bad = phi.certificate(W=w * (1.37 / 0.9))
    assert bad.text == "convex if ||W||₂ ≤ 1 (now 1.37)" and not bad.holds
    assert models.geq().certificate().text == "not convex: Gaussian kernel term"
    z = ce.State("z", 3)
    assert ce.Objective([SqNorm(z), L1(z)]).certificate().text == "convex"
    # sigmoid: f_σ is 3-strongly convex (L_σ = 1/4), so the bound is ||W||₂ ≤ 2
    assert models.opteq(activation="sigmoid").certificate().text.startswith("convex if ||W||₂ ≤ 2 ")


def test_certificate_generic_lambda_min_matches_numpy() -> None:
    obj = models.mopteq(fusion="H")
    cert = obj.certificate()
    assert cert.kind == "conditional" and "λ_min" in cert.text
    # independent: assemble ½yᵀQy from the dense matrices by hand (H on z̃_i = W_iᵀ y_i)
    y1, y2 = obj.states
    n1, n2 = y1.size, y2.size
    w1 = obj.symbol("W1").value.numpy()
    w2 = obj.symbol("W2").value.numpy()
    p12 = ce.downsample_or_identity(y2.shape, y1.shape).matrix()
    q = np.eye(n1 + n2)
    # -½ H(z̃1, z̃2) - ½ H(z̃2, z̃1) = -z̃1ᵀ P12 z̃2 = -y1ᵀ W1 P12 W2ᵀ y2  (P21 = P12ᵀ)
    q[:n1, n1:] -= w1 @ p12 @ w2.T
    q[n1:, :n1] -= (w1 @ p12 @ w2.T).T
    assert abs(cert.values[0] - np.linalg.eigvalsh(q).min()) < 1e-10


# --------------------------------------------------------------------------- 7. refusals
def test_refusals_name_the_term() -> None:
    z, x = ce.State("z", 4), ce.Input("x", 3)
    w = ce.Weight("W", (5, 4))
    with pytest.raises(ce.ShapeError, match="z"):
        _ = w @ z + x  # sizes 5 and 3
    with pytest.raises(ce.ShapeError, match="sizes differ"):
        Linear(x, z)
    with pytest.raises(ce.ActivationError, match="swish"):
        Potential("swish", z)
    with pytest.raises(ce.ScaleError, match="μ"):
        MoreauEnvelope(L1(z), -1.0)
    lam = ce.Scalar("lam", 0.1)
    with pytest.raises(ce.ScaleError, match="lower bound"):
        _ = L1(z) * lam
    with pytest.raises(ce.NotDCPError, match="Gaussian kernel"):
        models.geq().to_cvxpy(x=np.zeros(8))
    with pytest.raises(ce.NotDCPError, match="certified convex.*not DCP"):
        models.opteq(activation="tanh").to_cvxpy(x=np.zeros(8))
    with pytest.raises(ce.NotDCPError, match="softplus"):
        models.opteq(activation="softplus").to_cvxpy(x=np.zeros(8))
    with pytest.raises(ce.ShapeError, match="one sample"):
        models.opteq().to_cvxpy(x=np.zeros((2, 8)))
    with pytest.raises(ce.ShapeError, match="unknown symbol 'y'"):
        models.opteq().value(z=np.zeros(16), x=np.zeros(8), y=1)
    with pytest.raises(ce.ShapeError, match="z"):
        models.opteq().value(z=np.zeros(15), x=np.zeros(8))
    with pytest.raises(ce.ShapeError, match="not invertible"):
        ce.precompose(models.opteq(n=3, m=3, d=2), np.zeros((3, 3)))
    with pytest.raises(ce.ScaleError, match="gamma"):
        models.geq(gamma=-1.0)


def test_value_batched_and_unbatched() -> None:
    obj = models.opteq(n=5, m=5, d=2, activation="tanh")
    zb = np.clip(RNG.standard_normal((3, 5)), -0.9, 0.9)
    xb = RNG.standard_normal((3, 2))
    batch = obj.value(z=zb, x=xb)
    assert batch.shape == (3,)
    assert abs(obj.value(z=zb[1], x=xb[1]) - batch[1]) < 1e-12
    t = obj.value(z=torch.as_tensor(zb), x=torch.as_tensor(xb))
    assert isinstance(t, torch.Tensor)
