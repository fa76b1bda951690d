"""The a posteriori error bound ``||o − o*|| ≤ c_e·||T(u) − u||`` and the Lipschitz bound of
``x ↦ o*(x)`` of a certified layer (docs/theory.md §9.6), each against a reference that does not
use them: a tight float64 solve (or a numpy transcription of the layer), the exact Jacobian of
the solution map from the implicit function theorem (dense SVD), and dense SVDs of the operators.
Where no certificate holds the bound is refused with a reason, never given as a number."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import lowering
from convex_eq import L1, Dense, Input, Linear, Potential, SqNorm, State, Weight, models
from convex_eq.errors import CertificateError
from convex_eq.inclusion import Saddle
from convex_eq.operators.base import norm_policy
from lowering.runtime.bounds import certified_norm, module_constants
from verify.equilibrium import environment, equilibrium, operator, prepare_inputs

F64 = torch.float64


def _saddle(strongly_convex: bool = True) -> Saddle:
    """The saddle example of docs/monotone.md §4 (``convex_eq.models`` has no saddle seed)."""
    g = np.random.default_rng(0)
    z, w, x = State("z", 6), State("w", 4), Input("x", 3)
    U = Weight("U", (6, 3), g.standard_normal((6, 3)))
    K = Weight("K", (4, 6), 2 * g.standard_normal((4, 6)))
    G = [Potential("relu", z), -Linear(U @ x, z)]
    if strongly_convex:
        G.append(0.5 * SqNorm(z))
    return Saddle(G, [SqNorm(w), 0.1 * L1(w)], Dense(K), name="robust")


SEEDS = {
    "opteq": lambda: models.opteq(),
    "opteq-conv": lambda: models.opteq(conv=(4, 3), image=(1, 12)),
    "deep": lambda: models.deep_opteq(),
    "mon": lambda: models.mon(),
    "mon-conv": lambda: models.mon(conv=(4, 3), image=(1, 12)),
    "saddle": _saddle,
}


def _module(name: str, **options: object) -> lowering.EquilibriumModule:
    return lowering.lower(SEEDS[name]()).torch_module(dtype=F64, max_iter=2000, **options)


def _inputs(m: lowering.EquilibriumModule, b: int, seed: int = 0) -> torch.Tensor:
    size = m.derived.inputs[0].size
    return torch.randn(b, size, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _flat(out: object) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1).detach()


def _tight(m: lowering.EquilibriumModule, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(state, output)`` of the tight float64 solve (Anderson, then plain iteration, to a
    relative residual of 1e-13) at the module's controlled weights."""
    d = m.derived
    env, inputs = environment(d, m), prepare_inputs(d, x)
    z, info = equilibrium(d, inputs, env, tol=1e-13, max_iter=5000)
    assert info.converged
    return z, d.output(z, inputs, env)


@pytest.mark.parametrize("name", list(SEEDS))
def test_error_bound_dominates_the_distance_to_a_tight_float64_solve(name: str) -> None:
    m = _module(name)
    x = _inputs(m, 200)
    with torch.no_grad():
        out = _flat(m(x))
    bound = m.error_bound()
    _, ref = _tight(m, x)
    dist = torch.linalg.vector_norm(out - ref, dim=1)
    # the reference stops at relative residual 1e-13: its own error is below 1e-11·||o*|| for
    # these layers (certified factors ≤ 30), far under the module's tol-1e-6 distances
    slack = 1e-11 * torch.linalg.vector_norm(ref, dim=1).clamp_min(1.0)
    assert bool((dist <= bound + slack).all()), (dist - bound).max()
    keep = dist > 10 * slack
    assert int(keep.sum()) >= 50
    # the tightness claim: within 10× of the true distance for the median sample
    assert float((bound[keep] / dist[keep]).median()) <= 10.0


def _numpy_opteq(env: dict[str, torch.Tensor], x: np.ndarray) -> np.ndarray:
    """``z = relu(Ux + b + WᵀWz)`` by plain iteration in float64 numpy to 1e-14 (a transcription
    of the canonical ReLU OptEq layer, docs/theory.md §3 row 1)."""
    U, b, W = (env[k].detach().double().numpy() for k in ("U", "b", "W"))
    q, M = x @ U.T + b, W.T @ W
    z = np.zeros_like(q)
    for _ in range(20000):
        z, prev = np.maximum(q + z @ M, 0.0), z
        if np.abs(z - prev).max() < 1e-15:
            break
    return z


def test_error_bound_at_a_given_state_brackets_the_distance_to_the_numpy_equilibrium() -> None:
    # for an L-contraction, (1 − L)||u − u*|| ≤ ||T(u) − u|| ≤ (1 + L)||u − u*||: the bound
    # lies between the distance and (1 + L)/(1 − L) times it, whatever the state
    m = _module("opteq")
    x = _inputs(m, 64, seed=1)
    zstar = torch.from_numpy(_numpy_opteq(m.env(), x.numpy()))
    g = torch.Generator().manual_seed(2)
    lc = module_constants(m).contraction
    for scale in (1e-6, 1e-3, 1e-1, 1.0):
        z = zstar + scale * torch.randn(zstar.shape, generator=g, dtype=F64)
        dist = torch.linalg.vector_norm(z - zstar, dim=1)
        bound = m.error_bound(x, z)
        # 1e-12: the numpy iteration's own error (stopped at steps of 1e-15, rate ≤ 0.81);
        # 1e-9 relative: the bound's rounding allowance (N + 3)·2⁻⁵³ ≈ 2e-15, with room
        assert bool((bound >= dist - 1e-12).all())
        assert bool((bound <= (1 + lc) / (1 - lc) * dist * (1 + 1e-9) + 1e-12).all())


def test_statistics_carry_the_norm_of_T_at_the_returned_iterate() -> None:
    # converged solves, and an unconverged one whose best iterates are replayed per sample
    for max_iter in (100, 3):
        m = lowering.lower(models.opteq()).torch_module(dtype=F64, max_iter=max_iter,
                                                        on_nonconvergence="warn", solver="plain")
        x = _inputs(m, 32, seed=3)
        with torch.no_grad(), pytest.warns() if max_iter == 3 else contextlib.nullcontext():
            z, st = m(x, return_stats=True)
        tz = operator(m.derived, prepare_inputs(m.derived, x), environment(m.derived, m))(z)
        want = torch.linalg.vector_norm(tz, dim=1)
        # float64 evaluations of the same T at the same z: equal to round-off (16 entries)
        assert torch.allclose(st.image_norm, want, rtol=1e-13, atol=0.0)
        absolute = torch.linalg.vector_norm(tz - z, dim=1)
        # the solver's T (planned: σ(c + zM), M = WᵀW formed once) rounds differently from
        # this one (Wᵀ(Wz)): the two residuals agree up to (N + 3)·u·||T(z)|| (N = 16)
        gap = (st.abs_residual - absolute).abs()
        assert bool((gap <= 1e-10 * absolute + 19 * 2.0 ** -53 * want).all()), gap.max()


def test_certified_norm_is_an_upper_bound_of_the_dense_svd_of_the_convolution() -> None:
    d = lowering.lower(models.opteq(conv=(6, 5), image=(2, 30)))
    env = {s.name: torch.as_tensor(s.resolve(None)) for s in d.parameters}
    W = env["W"].numpy()
    # the convolution as a dense matrix built here with numpy (zero padding 2, 6 channels)
    n, c, k = 30, 6, W.shape[-1]
    mat = np.zeros((c * n, c * n))
    for o in range(c):
        for i in range(c):
            for t in range(n):
                for j in range(k):
                    s = t + j - k // 2
                    if 0 <= s < n:
                        mat[o * n + t, i * n + s] += W[o, i, j]
    exact = np.linalg.svd(mat, compute_uv=False)[0]
    op = next(t for t in d.source.terms if "W" in str(t)).args[0].entries[0].op
    got = certified_norm(op, env)
    # above the exact norm, by no more than the stated 8·max(m, n)·2⁻⁵³ plus SVD round-off
    assert exact <= got <= exact * (1 + 1e-11)
    with norm_policy(lambda o, e: 123.0):  # every estimated norm goes through the policy
        assert op.norm(env) == 123.0


def test_splitting_factor_bounds_the_reflected_resolvent_of_the_declared_operator() -> None:
    # Peaceman–Rachford on a 48-entry conv MON, whose step comes from an estimate of ||M||₂:
    # the certified factor dominates ||(I − αM)(I + αM)⁻¹||₂ formed densely here
    m = _module("mon-conv")
    d = m.derived
    env = {k: v.detach() for k, v in m.env().items()}
    M = d.payload.inclusion.matrix(env)
    _, lip = d.nodes[d.blocks[0].name].consts(env)
    a = 1.0 / lip
    eye = np.eye(M.shape[0])
    exact = np.linalg.norm((eye - a * M) @ np.linalg.inv(eye + a * M), 2)
    assert exact <= module_constants(m).contraction <= 1.0


@pytest.mark.parametrize("name", ["opteq", "opteq-conv", "deep", "mon", "saddle"])
def test_lipschitz_bound_dominates_the_exact_jacobian_of_the_solution_map(name: str) -> None:
    m = _module(name)
    d = m.derived
    x = _inputs(m, 12, seed=4)
    z, _ = _tight(m, x)
    env = environment(d, m)
    xname = d.inputs[0].name
    worst = 0.0
    for i in range(len(x)):
        xi, zi = x[i:i + 1], z[i:i + 1]

        def t(zz: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
            return operator(d, {xname: xx}, env)(zz)

        def o(zz: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
            return d.output(zz, {xname: xx}, env)

        jz, jx = torch.autograd.functional.jacobian(t, (zi, xi))
        jz, jx = jz[0, :, 0, :], jx[0, :, 0, :]
        # implicit function theorem: dz*/dx = (I − ∂T/∂z)⁻¹ ∂T/∂x; the output map's Jacobian
        jzx = torch.linalg.solve(torch.eye(jz.shape[0], dtype=F64) - jz, jx)
        jo = torch.autograd.functional.jacobian(o, (zi, xi))[0][0, :, 0, :]
        worst = max(worst, float(torch.linalg.matrix_norm(jo @ jzx, ord=2)))
    lip = m.lipschitz_bound()
    # dense float64 SVDs: round-off far below the 1e-9 relative allowed here
    assert worst <= lip * (1 + 1e-9)
    assert worst > 0.05 * lip  # the bound is not vacuous on these layers


def test_no_contraction_is_refused_with_the_reason() -> None:
    obj = models.opteq(weight_norm=1.05)
    m = lowering.lower(obj).torch_module(dtype=F64, weight_control=None, max_iter=5,
                                         on_nonconvergence="warn")
    with pytest.warns():
        m(_inputs(m, 4))
    with pytest.raises(CertificateError, match="not below 1"):
        m.error_bound()
    with pytest.raises(CertificateError, match="not below 1"):
        m.lipschitz_bound()


def test_a_bound_from_statistics_of_other_weights_is_refused() -> None:
    m = _module("opteq")
    with pytest.raises(CertificateError, match="no forward"):
        m.error_bound()
    x = _inputs(m, 4)
    with torch.no_grad():
        m(x)
    assert bool(torch.isfinite(m.error_bound()).all())
    with torch.no_grad():
        m.weights["U"].mul_(0.5)  # an optimizer step, in effect
    with pytest.raises(CertificateError, match="weights changed"):
        m.error_bound()
    assert bool(torch.isfinite(m.error_bound(x)).all())  # solved again at the new weights


def test_saddle_without_strong_convexity_is_refused() -> None:
    m = lowering.lower(_saddle(strongly_convex=False)).torch_module(dtype=F64, max_iter=50,
                                                                     on_nonconvergence="warn")
    with pytest.raises(CertificateError, match="not both strongly convex"):
        m.error_bound(_inputs(m, 2))
    with pytest.raises(CertificateError, match="not both strongly convex"):
        m.lipschitz_bound()


def test_a_layer_without_an_input_rule_is_refused() -> None:
    obj = models.opteq(n=8, m=8, d=4, form="conjugate")
    edited = lowering.lower(obj.__class__([*obj.terms, 0.1 * L1(obj.states[0])]))
    assert "regularizer" in " ".join(edited.derivation.rules())
    m = edited.torch_module(dtype=F64)
    assert bool(torch.isfinite(m.error_bound(_inputs(m, 3))).all())
    with pytest.raises(CertificateError, match="no input Lipschitz rule"):
        m.lipschitz_bound()


def test_half_precision_output_is_refused() -> None:
    m = lowering.lower(models.opteq()).torch_module(dtype=torch.bfloat16)
    with pytest.raises(CertificateError, match="rounds its output"):
        m.error_bound(torch.randn(2, 8))
