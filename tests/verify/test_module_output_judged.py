"""verify judges what an emitted module returns: its own forward at the given inputs, as
configured, against the reference (docs/theory.md §9.5).  Every distance is checked against an
independent float64 numpy fixed-point iteration of the layer written here, never verify's own
solve."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import lowering
import verify
from convex_eq import models

T64 = torch.float64
X = np.random.default_rng(7).normal(size=(3, 4))


def opteq_layer() -> tuple[lowering.DerivedLayer, dict[str, np.ndarray]]:
    """ReLU OptEq (conjugate form, ``||W||₂ = 0.8``): ``T(z) = Wᵀ relu(Wz + Ux + b)``."""
    phi = models.opteq(n=6, m=6, d=4, form="conjugate", weight_norm=0.8, seed=3)
    weights = {s.name: np.asarray(s.resolve(None), dtype=np.float64) for s in phi.symbols
               if s.kind == "weight"}
    return lowering.lower(phi), weights


def fixed_point(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """``z* = Wᵀ relu(W z* + U x + b)`` by 400 plain float64 iterations: a 0.64-contraction,
    so the iterate is within 0.64⁴⁰⁰ (below 1e-70) of the fixed point, relative."""
    z = np.zeros((x.shape[0], w["W"].shape[1]))
    for _ in range(400):
        z = np.maximum(z @ w["W"].T + x @ w["U"].T + w["b"], 0.0) @ w["W"]
    return z


def own_output(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.as_tensor(x, dtype=module.dtype)).double().numpy()


def rel_distance(a: np.ndarray, ref: np.ndarray, floor: float = 1e-2) -> np.ndarray:
    """Per sample, as verify states it: ``||a − ref|| / max(||ref||, floor)`` (``verify.check``
    uses 1e-2, ``check_inclusion`` its LCP floor 1e-3)."""
    return np.linalg.norm(a - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), floor)


def shifted(module: torch.nn.Module, by: float) -> torch.nn.Module:
    """The module with its forward's output moved by ``by`` in every entry."""
    forward = module.forward

    def moved(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        return (out[0] + by, *out[1:]) if isinstance(out, tuple) else out + by

    module.forward = moved  # type: ignore[method-assign]
    return module


def test_a_correct_module_at_its_default_tolerance_passes() -> None:
    """Default module (float32, tol 1e-6): its output is within (tol + γ)·κ of the fixed point,
    κ = 1/(1 − 0.64(1 + tol + γ)) ≈ 2.8, so verify passes it; the distance it reports is the
    independent one to float32 rounding (1e-6 absolute on a relative distance, safe on any
    BLAS: float32 matvecs of size 6 differ by a few ulps, 1e-7 relative)."""
    d, w = opteq_layer()
    module = d.torch_module()
    rep = verify.check(module, X)
    assert rep.passed, rep
    assert rep.module is not None and rep.module.failure == ""
    z_star = fixed_point(w, X)
    want = rel_distance(own_output(module, X), z_star)
    assert np.all(want <= np.asarray(rep.module.allowance))
    np.testing.assert_allclose(rep.module.tight_distance, want, atol=1e-6)


def test_an_unrolled_module_of_two_steps_fails_with_its_distance() -> None:
    """``backward="unroll", unroll_steps=2`` returns the second plain iterate from 0: far from
    the fixed point, and verify says so with the distance (relative agreement 1e-4 with the
    independent one: both are float64 measures of the same float32 output, whose own
    rounding is 1e-7 relative)."""
    d, w = opteq_layer()
    module = d.torch_module(backward="unroll", unroll_steps=2)
    rep = verify.check(module, X)
    assert not rep.passed
    fail = next(f for f in rep.failures if f.startswith("module output"))
    assert "unrolled K = 2: not an equilibrium" in fail
    want = rel_distance(own_output(module, X), fixed_point(w, X))
    assert want.max() > 1e-2  # the case is a real one: two steps are far from z*
    got = np.asarray(rep.module.distance)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert f"{got.max():.3e}" in fail


@pytest.mark.parametrize("by", [1e-3, 0.3])
def test_a_module_whose_output_is_moved_fails_with_its_distance(by: float) -> None:
    """An output moved by ``by`` (every entry) is ``by·√n/||z*||`` away from the fixed point,
    above the allowance (≈ 1e-5 at tol 1e-6); verify reports that distance (relative
    agreement 1e-4, as above)."""
    d, w = opteq_layer()
    module = shifted(d.torch_module(), by)
    rep = verify.check(module, X)
    assert not rep.passed
    fail = next(f for f in rep.failures if f.startswith("module output"))
    assert "module output differs from the reference (cvxpy)" in fail
    want = rel_distance(own_output(module, X), fixed_point(w, X))
    got = np.asarray(rep.module.distance)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert np.all(got > np.asarray(rep.module.allowance))
    # the tight re-solve of the same weights is still the layer's equilibrium
    assert rep.max_rel_error is not None and rep.max_rel_error <= 1e-6


def mon_layer() -> tuple[lowering.DerivedLayer, dict[str, np.ndarray]]:
    """A ReLU MON layer: ``0 ∈ Mz − (Ux + b) + N_{z ≥ 0}(z)``, ``M = mI + AᵀA − (B − Bᵀ)``."""
    inc = models.mon(n=6, d=4, margin=0.9, weight_scale=1.0, seed=1)
    weights = {s.name: np.asarray(s.resolve(None), dtype=np.float64) for s in inc.symbols
               if s.kind == "weight"}
    return lowering.lower(inc), weights


def mon_solution(w: dict[str, np.ndarray], x: np.ndarray, margin: float = 0.9) -> np.ndarray:
    """Projected forward steps ``z ← max(0, z − α(Mz − q))`` with ``α = m/||M||₂²``: a
    contraction of factor ``√(1 − αm)`` below 0.99, so 6000 steps leave under 1e-26."""
    a, b = w["A"], w["B"]
    m = margin * np.eye(a.shape[1]) + a.T @ a - (b - b.T)
    q = x @ w["U"].T + w["b"]
    alpha = margin / np.linalg.norm(m, 2) ** 2
    z = np.zeros_like(q)
    for _ in range(6000):
        z = np.maximum(z - alpha * (z @ m.T - q), 0.0)
    return z


def test_check_inclusion_judges_the_module_output_too() -> None:
    """A MON module moved by 1e-3 fails ``check_inclusion`` with its distance to the LCP
    solution; the module as emitted passes (distances against the independent projected
    iteration, to float32 rounding)."""
    d, w = mon_layer()
    z_star = mon_solution(w, X)
    good = d.torch_module()
    rep = verify.check_inclusion(good, X)
    assert rep.passed, rep
    np.testing.assert_allclose(rep.module.tight_distance,
                               rel_distance(own_output(good, X), z_star, 1e-3), atol=1e-6)
    bad = shifted(d.torch_module(), 1e-3)
    rep = verify.check_inclusion(bad, X)
    assert not rep.passed
    fail = next(f for f in rep.failures if f.startswith("module output"))
    want = rel_distance(own_output(bad, X), z_star, 1e-3)
    np.testing.assert_allclose(rep.module.distance, want, rtol=1e-4)
    assert "differs from the reference (lcp)" in fail
