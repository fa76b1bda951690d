"""Pointwise properties: ``T`` at random points (not only at its fixed point) equals the
prox / gradient step its derivation states, against references that share no code with the
lowering (scipy's scalar minimizer on the defining minimization; verify's lifted objective).

Same fixed points, different ``T`` is invisible to equilibrium checks: e.g. the general Moreau
rule (μ + λ ≠ 1) with ``prox_{λφ}`` in place of ``prox_{(μ+λ)φ}`` passed every equilibrium
property; it fails here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, event, given
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

import convex_eq as ce
import lowering
from convex_eq import L1, Constant, Linear, SqNorm, State, moreau
from tests.fuzz.strategies import Case, well_formed

T64 = torch.float64


def envelope_prox_reference(z: float, lam: float, mu: float, gamma: float, a: float,
                            b: float) -> float:
    """``prox_{λM^μ_φ}(z)`` for ``φ(w) = γ|w| + (a/2)w² − bw`` from its definition alone:
    ``argmin_u λ min_w [φ(w) + (w − u)²/(2μ)] + ½(u − z)²``; the ``u``-minimization is a
    quadratic (``u = (αw + z)/(1 + α)``, ``α = λ/μ``, value ``α/(2(1+α))(w − z)²``), the
    remaining 1-D convex problem in ``w`` is solved by bounded Brent, then finished exactly on
    the smooth piece it landed on."""
    alpha = lam / mu
    kappa = alpha / (1.0 + alpha)

    def h(w: float) -> float:
        return lam * (gamma * abs(w) + 0.5 * a * w * w - b * w) + 0.5 * kappa * (w - z) ** 2

    # strongly convex (modulus ≥ κ): the minimizer is within |∂(λφ)(z)|/κ of z
    r = (lam * (gamma + a * abs(z) + abs(b))) / kappa + 1.0
    w = minimize_scalar(h, bounds=(z - r, z + r), method="bounded",
                        options={"xatol": 1e-13, "maxiter": 2000}).x
    # Brent stops ~1e-8 away (sqrt(eps) relative); h is a quadratic on each side of the kink:
    # 0 if it satisfies 0 ∈ ∂h(0), else one Newton step on the piece Brent's point lies on
    if abs(lam * b + kappa * z) <= lam * gamma and abs(w) <= 1e-6 * (1.0 + abs(z)):
        w = 0.0
    elif w != 0.0:
        sgn = math.copysign(1.0, w)
        w -= (lam * (gamma * sgn + a * w - b) + kappa * (w - z)) / (lam * a + kappa)
    return (alpha * w + z) / (1.0 + alpha)


@st.composite
def general_moreau(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 4))
    lam = draw(st.floats(0.1, 3.0))
    mu = draw(st.floats(0.1, 3.0))
    assume(abs(lam + mu - 1.0) > 0.05)  # the general rule (μ + λ = 1 is the skip rule)
    gamma = draw(st.floats(0.05, 2.0))
    a = draw(st.floats(0.0, 2.0))
    b = np.array(draw(st.lists(st.floats(-2.0, 2.0), min_size=n, max_size=n)))
    zs = np.array(draw(st.lists(st.floats(-4.0, 4.0), min_size=2 * n, max_size=2 * n)))
    return n, lam, mu, gamma, a, b, zs.reshape(2, n)


@given(general_moreau())
def test_general_moreau_rule_is_the_prox_of_the_envelope_pointwise(case: tuple) -> None:
    """``λ·M^μ[γ||z||₁ + (a/2)||z||² − <b, z>]`` with μ + λ ≠ 1: the derivation states
    ``T = prox_{λM^μ_φ}``; ``T(z)`` at two random points per case equals it.  Tolerance 1e-9
    relative: both sides are a few float64 operations on O(1)–O(1e2) numbers (round-off
    ~1e-14, whatever the BLAS or CPU)."""
    n, lam, mu, gamma, a, b, zs = case
    z = State("z", n)
    inner = L1(z) * gamma + SqNorm(z) * a - Linear(Constant("b", b), z)
    d = lowering.lower(moreau(inner, mu) * lam)
    assert d.is_prox, d.describe()
    out = d.apply({"z": torch.as_tensor(zs, dtype=T64)})["z"].numpy()
    for i in range(zs.shape[0]):
        for j in range(n):
            ref = envelope_prox_reference(float(zs[i, j]), lam, mu, gamma, a, float(b[j]))
            assert abs(out[i, j] - ref) <= 1e-9 * (1.0 + abs(ref)), (
                f"T(z)[{j}] = {out[i, j]!r}, prox_(λM^μ_φ)(z)[{j}] = {ref!r} (z = {zs[i, j]}, "
                f"λ = {lam}, μ = {mu}, γ = {gamma}, a = {a}, b = {b[j]})")


def test_general_moreau_reference_is_the_definition() -> None:
    """The reference itself against a closed form: for ``φ = (a/2)w² − bw`` (γ = 0) the
    envelope is quadratic, ``M^μ_φ(u) = (a/2)/(1 + aμ)·u² − b/(1 + aμ)·u + const``, so
    ``prox_{λM}(z) = (z + λb/(1 + aμ)) / (1 + λa/(1 + aμ))`` (float64 algebra: 1e-9)."""
    for z, lam, mu, a, b in ((0.7, 0.4, 2.0, 1.3, -0.5), (-3.0, 2.5, 0.3, 0.2, 1.1)):
        c = 1.0 + a * mu
        exact = (z + lam * b / c) / (1.0 + lam * a / c)
        assert math.isclose(envelope_prox_reference(z, lam, mu, 0.0, a, b), exact,
                            rel_tol=1e-9, abs_tol=1e-9)


def test_the_lowered_objective_is_the_one_evaluated() -> None:
    """Guard: the pointwise test exercises the general rule (not the skip rule)."""
    z = State("z", 2)
    d = lowering.lower(moreau(L1(z) * 0.5 + SqNorm(z), 2.0) * 0.7)
    assert any("skip" in r or "Moreau" in r for r in d.derivation.rules())
    assert isinstance(d.source, ce.Objective)


# ------------------------------------------------------------------ every exact-prox layer
def prox_stationarity(obj: ce.Objective, d: lowering.DerivedLayer, inputs: dict, b: int,
                      z: np.ndarray, u: np.ndarray) -> float | None:
    """``u = prox_G(z)`` iff ``u`` is stationary for the strongly convex ``G(·) + ½||· − z||²``:
    its forward–backward residual on verify's lifted problem (terms' own value rules, autograd,
    the terms' proxes and domain boxes; nothing from the lowering), relative to ``1 + ||u||``.
    None where the lifted problem does not determine the point (auxiliary envelope blocks)."""
    from verify.lifting import lift

    st_ = d.blocks[0]
    psi = obj + SqNorm(st_ - Constant("z_at", z))
    ins = {k: v[b:b + 1] for k, v in inputs.items()}
    env = {s.name: torch.as_tensor(s.resolve(None), dtype=T64)
           for s in psi.symbols if s.kind in ("weight", "constant", "scalar")}
    p = lift(psi, ins, env)
    v = p.lift_point({st_.name: u})
    if v is None or p.coupled:
        return None
    return p.projected_gradient(v) / (1.0 + float(np.linalg.norm(u)))


@given(well_formed(families=("theorem1", "moreau", "fb", "canonical", "random")))
def test_an_exact_prox_layer_is_the_prox_of_its_objective_pointwise(case: Case) -> None:
    """Every derived layer that states ``T = prox_G`` (``is_prox``, one block, a convex claim
    certified at its weights): at random points ``z`` (scales 0.3 and 3), ``u = T(z)`` is the
    minimizer of ``G + ½||· − z||²`` — checked by its first-order residual.  Tolerance 1e-8:
    the terms' value rules and proxes are float64 closed forms (residual ~1e-15 at an exact
    prox, whatever the BLAS/CPU); a different ``T`` with the same fixed points moves ``u`` by
    O(||T(z) − z||) off the minimizer."""
    try:
        d = lowering.lower(case.obj, **case.options)
    except ce.ConvexEqError:
        event("not lowered")
        return
    if not (d.is_prox and len(d.blocks) == 1 and isinstance(d.source, ce.Objective)
            and d.claim.kind == "minimizer" and d.source.certificate().convex):
        event("not an exact prox of a certified convex objective")
        return
    if any(getattr(t, "batch_coupled", False) for t in d.source.terms):
        event("batch-coupled")
        return
    checked = check_prox_pointwise(d, case.input_tensors(), case.batch, case.seed)
    event(f"{case.family}: " + ("checked" if checked else "not determined"))


def check_prox_pointwise(d: lowering.DerivedLayer, inputs: dict, batch: int, seed: int) -> int:
    """``T(z) = prox_G(z)`` at random points (scales 0.3 and 3); returns how many were checked."""
    g = torch.Generator().manual_seed(seed)
    blk = d.blocks[0]
    checked = 0
    for scale in (0.3, 3.0):
        zt = scale * torch.randn(batch, blk.size, generator=g, dtype=T64)
        with torch.no_grad():
            ut = d.apply({blk.name: zt, **inputs})[blk.name]
        for b in range(batch):
            r = prox_stationarity(d.source, d, inputs, b, zt[b].numpy(), ut[b].numpy())
            checked += r is not None
            assert r is None or r <= 1e-8, (
                f"T(z) is not prox_G(z): residual {r:.3e} at scale {scale} "
                f"(G = {d.source}, sample {b})")
    return checked


def test_a_layer_with_the_same_fixed_points_but_another_T_fails_pointwise() -> None:
    """The property can fail: Theorem 1's layer averaged with the identity (0.9T + 0.1z, same
    fixed points, not prox_G) is rejected; the true layer passes."""
    import dataclasses

    from lowering.nodes import Combo, Var

    phi = ce.models.opteq(n=4, m=4, d=3, seed=0, activation="relu", form="conjugate")
    d = lowering.lower(phi)
    x = {"x": torch.as_tensor(np.random.default_rng(0).normal(size=(2, 3)), dtype=T64)}
    assert d.is_prox and check_prox_pointwise(d, x, 2, 0) == 4
    z = d.blocks[0]
    avg = dataclasses.replace(d, nodes={z.name: Combo([(0.9, d.nodes[z.name]), (0.1, Var(z))])})
    with pytest.raises(AssertionError, match="not prox_G"):
        check_prox_pointwise(avg, x, 2, 0)
