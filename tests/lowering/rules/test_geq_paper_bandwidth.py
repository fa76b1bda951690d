"""GEQ's bandwidth rule as the paper runs it, ``γ(x, z) = 0.2/min_i ||(x̃_i − z̃_i)W_h||²``
recomputed in every iteration (``ResidualBandwidth``, docs/theory.md §3.2): the derivation
claims a fixed point of that iteration, never a stationary point of one objective, and the
claim is checked against autograd of the declared kernel's value; the per-input rule keeps its
stationarity claim; the kernel-factor-1 limit is printed and is not OptEq's layer; gradients
through the bandwidth are exact (not stopped)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import LoweringError, OptionError, ScaleError
from convex_eq.terms import InputBandwidth, PatchGaussianKernel, ResidualBandwidth

T64 = torch.float64


def _patch_geq(gamma):
    """A 1×4×4 image layout, 2×2 patches, full-size W_h (4 × 4)."""
    return models.geq(n=16, p=16, d=3, patch=2, image=(1, 4, 4), gamma=gamma, seed=1)


def _kernel(obj) -> PatchGaussianKernel:
    return next(t for t in obj.terms if isinstance(t, PatchGaussianKernel))


def _solve(obj, x: torch.Tensor) -> torch.Tensor:
    mod = lowering.lower(obj).torch_module(tol=1e-13, max_iter=2000, dtype=T64)
    with torch.no_grad():
        z, st = mod(x, return_stats=True)
    assert bool(st.converged.all()), st.max_residual
    return z.reshape(x.shape[0], -1)


def _projected_residual(kernel, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``||z − relu(z − ∇G(z))|| / max(1, ||z||)`` per sample, ``G = ½||z||² + kernel`` (ReLU's
    potential is the indicator of z ≥ 0: the unit-step projected gradient), ``∇`` by autograd
    of the kernel's *value* — an independent route from the layer's gradient rule."""
    z = z.detach().clone().requires_grad_()
    g_val = 0.5 * (z * z).sum(-1) + kernel.value({"z": z, "x": x})
    (grad,) = torch.autograd.grad(g_val.sum(), z)
    r = z - torch.relu(z - grad)
    return (r.norm(dim=-1) / z.norm(dim=-1).clamp_min(1.0)).detach()


def test_the_papers_rule_claims_a_fixed_point_of_its_iteration() -> None:
    obj = _patch_geq("paper")
    d = lowering.lower(obj)
    assert d.claim.kind == "fixed point of the iteration"
    assert "NOT a stationary point of z ↦ G(z; x, γ(x, z))" in d.claim.statement
    assert "state-dependent parameter (recomputed in every iteration)" in d.derivation.rules()
    text = d.describe()
    assert "γ(x, z) = 0.2/max(min_i ||[U x + b - W z]_i W_h||², 1e-12)" in text
    assert "not stationary points of this objective" in text  # the certificate's long text
    assert "stationarity ⇔ fixed point" not in text
    assert d.contraction.value() == np.inf  # no bound: ∂γ/∂z is unbounded


def test_the_fixed_point_is_stationary_only_at_its_own_frozen_bandwidth() -> None:
    """At the iteration's fixed point ``z*``: ``G(·; x, γ̄)`` with ``γ̄ = γ(x, z*)`` frozen is
    stationary there (the claim), ``z ↦ G(z; x, γ(x, z))`` is not (what is not claimed)."""
    obj = _patch_geq("paper")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=T64)
    z = _solve(obj, x)
    kern = next(t for t in obj.terms if isinstance(t, PatchGaussianKernel))
    gam = kern.bandwidth({"z": z, "x": x})
    frozen = torch.stack([_projected_residual(kern.at_bandwidth(float(g)), z[b:b + 1],
                                              x[b:b + 1])[0] for b, g in enumerate(gam)])
    varying = _projected_residual(kern, z, x)
    # the solve stops at 1e-13 relative: the frozen objective's residual is ~1e-13 (10 × margin
    # for the Lipschitz factor of the map and float64 rounding of a 16-entry layer)
    assert float(frozen.max()) <= 1e-11, frozen
    # the missing ∂S/∂γ·∇_z γ term is O(1) here, not a rounding effect
    assert float(varying.min()) > 1e-3, varying


def test_the_input_rule_keeps_its_stationarity_claim() -> None:
    obj = _patch_geq("input")
    d = lowering.lower(obj)
    assert d.claim.kind == "stationary point"
    assert "input-dependent parameter (fixed per sample)" in d.derivation.rules()
    assert "γ(x) = 0.2/max(min_i ||[U x + b]_i W_h||², 1e-12)" in d.describe()
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=T64)
    z = _solve(obj, x)
    # γ(x) reads the input only: the declared G(·; x, γ(x)) itself is stationary at z*
    assert float(_projected_residual(_kernel(obj), z, x).max()) <= 1e-11


def test_the_kernel_factor_one_limit_is_printed_and_is_not_opteq() -> None:
    """At ``γ → 0`` the patch layer tends to ``σ(WᵀP_h(q − Wz))``, ``P_h`` the patch-wise
    ``W_hW_hᵀ`` (a hand formula), which is not OptEq's ``σ(WᵀWz + q)``."""
    obj = _patch_geq(1e-9)
    d = lowering.lower(obj)
    assert "not OptEq's σ(WᵀWz + q)" in d.derivation.text()
    w, u, b, wh = (obj.symbol(n).value.detach().double() for n in ("W", "U", "b", "W_h"))
    gen = torch.Generator().manual_seed(2)
    x, z = torch.randn(2, 3, generator=gen, dtype=T64), torch.randn(2, 16, generator=gen,
                                                                      dtype=T64)
    r = (x @ u.T + b - z @ w.T).reshape(2, 2, 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(2, 4, 4)
    m = (r @ wh @ wh.T).reshape(2, 2, 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(2, 16)
    limit = torch.relu(m @ w)
    got = d.apply({"z": z, "x": x})["z"]
    # e^{-γn} = 1 − O(γn) with γ = 1e-9, n = O(10): the layer is 1e-8-close to the limit
    torch.testing.assert_close(got, limit, atol=1e-7, rtol=1e-7)
    opteq = torch.relu(z @ w.T @ w + x @ u.T + b)
    assert float((got - opteq).abs().max()) > 0.1


def test_gradients_flow_through_the_state_dependent_bandwidth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No stop-gradient: ``∂T/∂z`` includes ``∂γ/∂z``, so the implicit gradient of ``z*`` is the
    derivative of the iteration's fixed point (a central difference); with the bandwidth
    detached it is not."""
    obj = _patch_geq("paper")
    mod = lowering.lower(obj).torch_module(tol=1e-12, max_iter=2000, backward_tol=1e-12,
                                           backward_max_iter=2000, dtype=T64)
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(3), dtype=T64)
    p = dict(mod.named_parameters())["weights.U"]

    def grad_and_fd(h: float = 1e-6) -> tuple[float, float]:
        mod.zero_grad()
        mod(x).sum().backward()
        g = float(p.grad[0, 0])
        vals = []
        for s in (h, -2 * h, h):
            with torch.no_grad():
                p[0, 0] += s
                vals.append(float(mod(x).sum()))
        return g, (vals[0] - vals[1]) / (2 * h)

    g, fd = grad_and_fd()
    # equilibria and adjoint to 1e-12, h = 1e-6: the difference quotient is ~1e-6-accurate
    assert abs(g - fd) <= 1e-5 * max(1.0, abs(fd)), (g, fd)
    monkeypatch.setattr(ResidualBandwidth, "gamma",
                        lambda self, m: self.c / m.detach().clamp_min(self.floor))
    g_cut, fd_cut = grad_and_fd()
    assert abs(fd_cut - fd) <= 1e-9 * max(1.0, abs(fd))  # the forward map is unchanged
    assert abs(g_cut - fd) > 1e-3 * max(1.0, abs(fd)), (g_cut, fd)


def test_the_residual_rule_refuses_what_has_no_meaning_for_an_iteration() -> None:
    kern = _kernel(_patch_geq("paper"))
    vals = {"z": torch.zeros(1, 16, dtype=T64), "x": torch.ones(1, 3, dtype=T64)}
    with pytest.raises(LoweringError, match="not the stationarity map"):
        kern.grad(vals, wrt="input")
    with pytest.raises(ScaleError, match=r"γ\(x, z\) depends on the sample"):
        kern.gamma_value()
    with pytest.raises(OptionError, match="ResidualBandwidth"):
        InputBandwidth(0.2, of="residual")
    with pytest.raises(OptionError, match="statistic"):
        ResidualBandwidth(0.2, "max")
    with pytest.raises(ScaleError):
        ResidualBandwidth(0.0)
