"""GEQ / KerDEQ with an input-dependent bandwidth ``γ(x) = c / stat_i ||q̃_i W_h||²``
(``InputBandwidth``, docs/theory.md §3.1): one fixed objective per sample, lowered, checked
against a hand-written torch formula and by verify; GEQ's rule on the residual (it reads z) is
refused with a typed error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import convex_eq as ce
import lowering
from convex_eq.errors import OptionError, ScaleError, ShapeError
from convex_eq.terms.gaussian_kernel import GaussianKernel, InputBandwidth, PatchGaussianKernel
from convex_eq.terms.potential import Potential
from verify.check import check

T64 = torch.float64


def _whole(bw: InputBandwidth | float, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, p, d = 6, 8, 4
    z, x = ce.State("z", n), ce.Input("x", d)
    w = ce.Weight("W", (p, n), 0.3 * rng.normal(size=(p, n)))
    u = ce.Weight("U", (p, d), rng.normal(size=(p, d)))
    b = ce.Weight("b", p, 0.1 * rng.normal(size=p))
    q = u @ x + b
    obj = Potential("relu", z) + ce.SqNorm(z) - GaussianKernel(q - w @ z, bw)
    return obj, (z, x, q, w), tuple(torch.as_tensor(s.value) for s in (w, u, b))


def _patch(bw: InputBandwidth, seed: int = 0):
    """A 1×4×4 image, 2×2 patches (4 of them), ``W_h``: 4 × 3."""
    rng = np.random.default_rng(seed)
    n, d = 16, 5
    z, x = ce.State("z", n), ce.Input("x", d)
    w = ce.Weight("W", (16, n), 0.2 * rng.normal(size=(16, n)))
    u = ce.Weight("U", (16, d), rng.normal(size=(16, d)))
    b = ce.Weight("b", 16, 0.1 * rng.normal(size=16))
    wh = ce.Weight("W_h", (4, 3), rng.normal(size=(4, 3)) / 2)
    s = PatchGaussianKernel(u @ x + b, w @ z, bw, 2, wh, (1, 4, 4))
    obj = Potential("relu", z) + ce.SqNorm(z) - s
    return obj, s, tuple(torch.as_tensor(v.value) for v in (w, u, b, wh))


def _inputs(b: int, d: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(b, d, generator=torch.Generator().manual_seed(seed), dtype=T64)


def test_whole_kernel_layer_matches_a_hand_formula_and_verifies() -> None:
    obj, _, (w, u, b) = _whole(InputBandwidth(0.2))
    d = lowering.lower(obj)
    rules = d.derivation.rules()
    assert rules[1] == "input-dependent parameter (fixed per sample)", rules
    assert "γ(x) = 0.2/max(||U x + b||², 1e-12)" in d.derivation.text()
    # the certificate names γ(x) with its definition (every symbol it prints)
    assert "γ(x) = 0.2/max(||U x + b||², 1e-12)" in d.certificate.text
    assert d.claim.kind == "stationary point"
    xs, zs = _inputs(4, 4), _inputs(4, 6, seed=5)
    q = xs @ u.T + b
    gam = 0.2 / (q * q).sum(-1, keepdim=True)  # one bandwidth per sample
    r = q - zs @ w.T
    ref = torch.relu(torch.exp(-gam * (r * r).sum(-1, keepdim=True)) * (r @ w))
    # float64, a handful of exp/matmul: rounding ~1e-15, margin 1e4
    torch.testing.assert_close(d.apply({"z": zs, "x": xs})["z"], ref, atol=1e-11, rtol=1e-11)
    rep = check(d, xs[:2].numpy(), starts=2)
    assert rep.passed and rep.reference.kind == "local", rep


def test_one_samples_bandwidth_for_the_whole_batch_fails_verify() -> None:
    """A layer that reads γ of sample 0 for every sample (a batch statistic mistake) is exactly
    right on sample 0 and not stationary for the per-sample objective on sample 1."""
    obj, (z, _x, q, w), (_wt, ut, bt) = _whole(InputBandwidth(0.2))
    xs = _inputs(2, 4)
    q0 = xs[:1] @ ut.T + bt
    fixed = Potential("relu", z) + ce.SqNorm(z) - GaussianKernel(q - w @ z,
                                                                  float(0.2 / (q0 * q0).sum()))
    good = lowering.lower(obj)
    wrong = dataclasses.replace(lowering.lower(fixed), source=obj, claim=good.claim)
    rep = check(wrong, xs.numpy(), starts=2)
    assert not rep.passed and rep.pass_rules["stationarity"] is False, rep
    # sample 0: the same map (~1e-14); sample 1: γ off by a factor ~2, residual O(0.1), far
    # above verify's 1e-8 on any platform
    assert rep.samples[0].stationarity <= 1e-10 and rep.samples[1].stationarity > 1e-4, rep


def test_patch_kernel_layer_matches_a_hand_formula_and_verifies() -> None:
    obj, _s, (w, u, b, wh) = _patch(InputBandwidth(0.2, "min"))
    d = lowering.lower(obj)
    assert "γ(x) = 0.2/max(min_i ||[U x + b]_i W_h||², 1e-12)" in d.derivation.text()
    xs, zs = _inputs(3, 5), _inputs(3, 16, seed=7)

    def patches(v: torch.Tensor) -> torch.Tensor:  # (B, 16) → (B, 4 patches, 4), row-major
        return F.unfold(v.reshape(-1, 1, 4, 4), 2, stride=2).transpose(1, 2)

    def unpatches(p: torch.Tensor) -> torch.Tensor:
        return F.fold(p.transpose(1, 2), (4, 4), 2, stride=2).reshape(-1, 16)

    q = xs @ u.T + b
    gam = 0.2 / ((patches(q) @ wh) ** 2).sum(-1).min(-1).values  # GEQ's rule at z = 0
    y = patches(q - zs @ w.T) @ wh
    e = torch.exp(-gam[:, None, None] * (y * y).sum(-1, keepdim=True))
    ref = torch.relu(unpatches(e * (y @ wh.T)) @ w)  # σ(Wᵀ m), m the scattered patches
    # float64, unfold/fold are exact permutations: rounding ~1e-15, margin 1e4
    torch.testing.assert_close(d.apply({"z": zs, "x": xs})["z"], ref, atol=1e-11, rtol=1e-11)
    rep = check(d, xs[:2].numpy(), starts=2)
    assert rep.passed, rep


@pytest.mark.parametrize("stat", ["min", "median", "mean"])
def test_the_input_gradient_includes_the_bandwidth(stat: str) -> None:
    """``∂S/∂x`` (used by the worst-case perturbation) = autograd of the value, γ(x) included."""
    _obj, s, _ = _patch(InputBandwidth(0.3, stat))
    xs = _inputs(2, 5).requires_grad_()
    zs = _inputs(2, 16, seed=9)
    (g_auto,) = torch.autograd.grad(s.value({"z": zs, "x": xs}).sum(), xs)
    g = s.grad({"z": zs, "x": xs.detach()}, wrt="input")["x"]
    # closed form vs autograd of the same float64 formula: ~1e-15 apart; margin 1e4
    torch.testing.assert_close(g, g_auto, atol=1e-11, rtol=1e-10)
    assert g.abs().max() > 1e-3  # not vacuous: x moves S


def test_bandwidth_from_the_residual_is_refused_and_bad_options_are_typed() -> None:
    with pytest.raises(OptionError, match="depends on the state"):
        InputBandwidth(0.2, of="residual")
    with pytest.raises(OptionError, match="statistic"):
        InputBandwidth(0.2, "max")
    with pytest.raises(ScaleError):
        InputBandwidth(-1.0)
    z = ce.State("z", 3)
    with pytest.raises(ShapeError, match="input part q"):  # no input offset to read γ from
        GaussianKernel(ce.Constant("W", np.eye(3)) @ z, InputBandwidth())
    obj, _, _ = _whole(InputBandwidth())
    kern = next(t for t in obj.terms if t.input_parameters())
    with pytest.raises(ScaleError, match="depends on the sample"):
        kern.gamma_value()


def test_a_fixed_gamma_keeps_its_single_argument_and_derivation() -> None:
    obj, _, _ = _whole(0.5)
    d = lowering.lower(obj)
    assert "input-dependent parameter (fixed per sample)" not in d.derivation.rules()
    kern = next(t for t in obj.terms if "Gaussian" in t.label)
    assert len(kern.args) == 1 and kern.label == "Gaussian kernel"


def _grad_and_fd(mod: torch.nn.Module, x: torch.Tensor, h: float = 1e-6) -> tuple[float, float]:
    """``∂/∂U₀₀ Σ z*(x)``: the emitted module's implicit gradient and a central difference."""
    p = dict(mod.named_parameters())["weights.U"]
    mod.zero_grad()
    mod(x).sum().backward()
    g = float(p.grad[0, 0])
    vals = []
    for s in (h, -2 * h, h):
        with torch.no_grad():
            p[0, 0] += s
            vals.append(float(mod(x).sum()))
    return g, (vals[0] - vals[1]) / (2 * h)


def test_the_emitted_module_differentiates_through_the_bandwidth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """γ(x) depends on U (through q = Ux + b): the training gradient must include that path.
    The implicit gradient matches a central difference; with γ's dependence cut (detached) it
    does not — the check can fail."""
    obj, _, _ = _whole(InputBandwidth(0.2))
    mod = lowering.lower(obj).torch_module(tol=1e-10, max_iter=2000, backward_tol=1e-10,
                                           backward_max_iter=2000).double()
    x = _inputs(4, 4, seed=11)
    g, fd = _grad_and_fd(mod, x)
    # equilibria and adjoint solved to 1e-10 relative (at the default 1e-6 the difference
    # quotient measures the derivative of the stopped iterate, ~1e-5 from the implicit one),
    # h = 1e-6: the difference is ~1e-4-accurate at worst
    assert abs(g - fd) <= 1e-5 * max(1.0, abs(fd)), (g, fd)
    monkeypatch.setattr(InputBandwidth, "gamma",
                        lambda self, m: self.c / m.detach().clamp_min(self.floor))
    g_cut, fd_cut = _grad_and_fd(mod, x)
    assert abs(fd_cut - fd) <= 1e-9 * max(1.0, abs(fd))  # the forward map is unchanged
    assert abs(g_cut - fd) > 1e-3 * max(1.0, abs(fd)), (g_cut, fd)
