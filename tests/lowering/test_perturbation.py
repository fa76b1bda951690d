"""The perturbation read from an objective (lowering/perturbation.py ``lowering.perturbation``):
the worst-case ℓ∞ input perturbation of an objective affine in its input."""

from __future__ import annotations

import torch

import lowering
from convex_eq import models
from tests.lowering.helpers import W, close, randn

T64 = torch.float64


def test_perturbation_from_objective() -> None:
    """``δ = ε·sign(Uᵀz)`` for OptEq, and it maximises ``G(z; x − δ)`` over the ℓ∞ ball (no
    random sign pattern does better; 1e-12: float64 sums of the same terms)."""
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


# ------------------------------------------------------------------ MOptEq Algorithm 2 (PE)
def paper_algorithm2(ys, Ws, Us, bs, g, lens, c, lam, phi, eps) -> list:
    """MOptEq Algorithm 2 in numpy: for i = 1…L, ``zp_i = h_i(z̃)`` (from the input state),
    ``y_i = σ(W_i zp_i + U_i(g − δ_{i−1}) + b_i)``, ``δ_i = ε·sign(U_iᵀ y_i)``, ``δ_0 = 0``."""
    import numpy as np

    from tests.convex_eq.models.test_mopteq import paper_T

    n = len(ys)
    delta = np.zeros_like(g)
    out = []
    for i in range(n):
        yi = paper_T(ys, Ws, Us, bs, g - delta, lens, c, lam, phi)[i]  # Eq. 6, branch i
        out.append(yi)
        delta = eps * np.sign(Us[i].T @ yi)
    return out


def test_pe_layer_is_the_papers_algorithm_2() -> None:
    import numpy as np

    from tests.convex_eq.models.test_mopteq import conv_matrix

    c, length, lam, eps = 3, 8, 0.2, 0.15
    kernels, scales = (3, 5, 3), (1, 2, 4)
    obj = models.conv_mopteq(image=(2, length), channels=c, kernels=kernels, scales=scales,
                             lam=lam, decorrelation="sign", seed=2, branch_inputs=True)
    rng = np.random.default_rng(3)
    for i in range(3):
        b = obj.symbol(f"b{i + 1}")
        b.value = torch.as_tensor(rng.standard_normal(b.value.shape))
    pe = lowering.perturbation_enhanced(lowering.lower(obj), eps)
    lens = [length // s for s in scales]
    Ws = [conv_matrix(obj.symbol(f"W{i + 1}").value.numpy(), lens[i], 1, k // 2)
          for i, k in enumerate(kernels)]
    Us = [conv_matrix(obj.symbol(f"U{i + 1}").value.numpy(), length, s, k // 2)
          for i, (k, s) in enumerate(zip(kernels, scales))]
    bs = [obj.symbol(f"b{i + 1}").value.numpy() for i in range(3)]
    for trial in range(3):
        ys = [rng.standard_normal(c * n) for n in lens]
        g = rng.standard_normal(2 * length)
        want = paper_algorithm2(ys, Ws, Us, bs, g, lens, c, lam, np.sign, eps)
        gt = torch.as_tensor(g)[None]
        got = pe.T(**{f"y{i + 1}": torch.as_tensor(y)[None] for i, y in enumerate(ys)},
                   **{f"x{i + 1}": gt for i in range(3)})
        # 1e-10: float64 sums, no iteration (as the MOptEq Eq. 6 test)
        for i, w in enumerate(want):
            err = float(np.abs(got[f"y{i + 1}"][0].numpy() - w).max())
            assert err <= 1e-10, f"branch {i + 1}, trial {trial}: {err:.3e}"
        # δ changes the layer: without PE the later branches differ
        base = lowering.lower(obj).T(**{f"y{i + 1}": torch.as_tensor(y)[None]
                                        for i, y in enumerate(ys)},
                                     **{f"x{i + 1}": gt for i in range(3)})
        assert float((base["y3"] - got["y3"]).abs().max()) > 1e-3


def test_pe_refuses_a_layer_with_one_shared_input() -> None:
    import pytest

    from convex_eq.errors import LoweringError

    d = lowering.lower(models.conv_mopteq(image=(1, 8), channels=2))
    with pytest.raises(LoweringError, match="one input per branch"):
        lowering.perturbation_enhanced(d, 0.1)


def test_pe_module_returns_fixed_points_of_its_own_map() -> None:
    """The module's output, re-evaluated outside its solve, is a fixed point of the PE map: the
    solve's once-per-solve injection ``U x + b`` must not be reused for an input that the
    perturbation replaces in every evaluation (a stale cache there reports "converged" at a
    point ``T`` moves by ~10 %)."""
    obj = models.conv_mopteq(image=(1, 8), channels=2, branch_inputs=True, lam=0.05)
    pe = lowering.perturbation_enhanced(lowering.lower(obj), 0.1)
    m = pe.torch_module(dtype=T64, tol=1e-10, max_iter=300)
    env = m.env()
    for seed in range(6):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed), dtype=T64)
        inp = {"x1": x, "x2": x}
        with torch.no_grad():
            out, st = m(inp, return_stats=True)
            o = torch.cat([t.reshape(3, -1) for t in out], 1)
            t = m.T(o, inp, env)
        res = torch.linalg.vector_norm(t - o, dim=1) / torch.linalg.vector_norm(t, dim=1)
        # converged at tol 1e-10 in float64: the returned point's residual is the solver's
        assert bool(st.converged.all())
        assert float(res.max()) <= 1e-9, (seed, res)
