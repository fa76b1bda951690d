"""``lowering.lower``: the derived ``T`` of each seed model (OptEq in its conjugate, canonical and
convolutional forms, GEQ whole and patch-split, MOptEq) against the docs/theory.md formula
written out here, and unknown options or objectives no rule takes refused.  The individual
rules are tested in tests/lowering/rules/."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import convex_eq as ce
import lowering
from convex_eq import models
from tests.lowering.helpers import W, close, randn, relu_phi

T64 = torch.float64


ACTS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
        "identity": lambda t: t, "hardtanh": lambda t: t.clamp(-1, 1),
        "leaky_relu": lambda t: F.leaky_relu(t, 0.01), "softplus": F.softplus}


@pytest.mark.parametrize("act", list(ACTS))
def test_opteq_conjugate_form(act: str) -> None:
    mu = 1.7
    phi = models.opteq(n=7, m=9, d=3, activation=act, form="conjugate", mu=mu, seed=1)
    d = lowering.lower(phi)
    z, x = randn(4, 7), randn(4, 3)
    w, u, b = W(phi, "W"), W(phi, "U"), W(phi, "b")
    ref = (1 / mu) * ACTS[act](z @ w.T + x @ u.T + b) @ w  # (1/μ)Wᵀσ(Wz + Ux + b)
    close(d.apply({"z": z, "x": x})["z"], ref)
    assert d.claim.kind == "minimizer" and d.is_prox


@pytest.mark.parametrize("act", list(ACTS))
def test_opteq_canonical_form(act: str) -> None:
    g = models.opteq(n=7, m=5, d=3, activation=act, seed=2)
    d = lowering.lower(g)
    z, x = randn(4, 7), randn(4, 3)
    w, u, b = W(g, "W"), W(g, "U"), W(g, "b")
    close(d.apply({"z": z, "x": x})["z"], ACTS[act](z @ w.T @ w + x @ u.T + b))


def test_opteq_conv_canonical() -> None:
    g = models.opteq(conv=(3, 3), image=(1, 6, 6), seed=0)
    d = lowering.lower(g)
    z, x = randn(2, 3 * 36), randn(2, 36)
    wk, uk, b = W(g, "W"), W(g, "U"), W(g, "b")
    wz = F.conv2d(z.reshape(2, 3, 6, 6), wk, padding=1)
    wtwz = F.conv_transpose2d(wz, wk, padding=1).reshape(2, -1)
    ux = F.conv2d(x.reshape(2, 1, 6, 6), uk, padding=1).reshape(2, -1)
    close(d.apply({"z": z, "x": x})["z"], torch.relu(wtwz + ux + b))


def test_geq_whole_and_patch() -> None:
    g = models.geq(n=6, p=5, d=3, gamma=0.7, seed=1)
    d = lowering.lower(g)
    z, x = randn(4, 6), randn(4, 3)
    w, u, b = W(g, "W"), W(g, "U"), W(g, "b")
    r = x @ u.T + b - z @ w.T
    ref = torch.relu(torch.exp(-0.7 * (r ** 2).sum(1, keepdim=True)) * r @ w)
    close(d.apply({"z": z, "x": x})["z"], ref)
    gp = models.geq(n=10, p=16, d=3, gamma=0.4, patch=2, image=(1, 4, 4), h=3, seed=2)
    dp = lowering.lower(gp)
    z, x = randn(2, 10), randn(2, 3)
    w, u, b, wh = W(gp, "W"), W(gp, "U"), W(gp, "b"), W(gp, "W_h")
    r = (x @ u.T + b - z @ w.T).reshape(2, 1, 4, 4)
    patches = F.unfold(r, kernel_size=2, stride=2).transpose(1, 2)  # (B, #patches, 4)
    proj = patches @ wh
    scale = torch.exp(-0.4 * (proj ** 2).sum(-1, keepdim=True))
    m_patch = scale * proj @ wh.T
    m_img = F.fold(m_patch.transpose(1, 2), (4, 4), kernel_size=2, stride=2).reshape(2, -1)
    close(dp.apply({"z": z, "x": x})["z"], torch.relu(m_img @ w))
    assert d.claim.kind == dp.claim.kind == "stationary point"


def _hand_d(zi: torch.Tensor, pzj: torch.Tensor, c: int) -> torch.Tensor:
    a = zi.reshape(zi.shape[0], c, -1)
    bb = pzj.reshape(pzj.shape[0], c, -1)
    m = a @ bb.transpose(1, 2)
    off = m - torch.diag_embed(torch.diagonal(m, dim1=1, dim2=2))
    return off.abs().sum((1, 2))


def test_mopteq_h_and_d() -> None:
    lam = 0.2
    g = models.mopteq(shapes=((2, 4, 4), (2, 2, 2)), d=3, lam=lam, seed=3, decorrelation="sign")
    d = lowering.lower(g)
    y1, y2, x = randn(3, 32), randn(3, 8), randn(3, 3)
    down = lambda t: F.avg_pool2d(t.reshape(-1, 2, 4, 4), 2).reshape(t.shape[0], -1)  # noqa: E731
    up = lambda t: F.interpolate(t.reshape(-1, 2, 2, 2), scale_factor=2).reshape(  # noqa: E731
        t.shape[0], -1) / 4  # adjoint of the average pool
    w1, u1, b1 = W(g, "W1"), W(g, "U1"), W(g, "b1")
    w2, u2, b2 = W(g, "W2"), W(g, "U2"), W(g, "b2")
    # the signed branch states z̃_i = W_iᵀ y_i (rows: y_i W_i)
    zz1, zz2 = (y1 @ w1).requires_grad_(), (y2 @ w2).requires_grad_()
    dsum = (_hand_d(zz1, up(zz2), 2) + _hand_d(zz2, down(zz1), 2)).sum()
    g1, g2 = torch.autograd.grad(dsum, (zz1, zz2))
    zz1, zz2 = zz1.detach(), zz2.detach()
    # MOptEq Eq. 6 (docs/theory.md §3 row 4): y_i = σ(W_i h_i(z̃) + q_i),
    # h_i = ½(P_{i:i+1} z̃_{i+1} + P_{i-1:i}ᵀ z̃_{i-1}) − (λ/2)∇_{z̃_i}ΣD
    h1 = 0.5 * (up(zz2) + up(zz2)) - lam / 2 * g1
    h2 = 0.5 * (down(zz1) + down(zz1)) - lam / 2 * g2
    ref1 = torch.relu(h1 @ w1.T + x @ u1.T + b1)
    ref2 = torch.relu(h2 @ w2.T + x @ u2.T + b2)
    out = d.apply({"y1": y1, "y2": y2, "x": x})
    close(out["y1"], ref1, 1e-10)
    close(out["y2"], ref2, 1e-10)
    assert d.claim.kind == "stationary point"


def test_unknown_lowering_option_and_no_rule() -> None:
    with pytest.raises(ce.OptionError, match="unknown option"):
        lowering.lower(relu_phi(), colour="red")
    z = ce.State("z", 3)
    with pytest.raises(ce.LoweringError, match="no lowering rule"):
        lowering.lower(ce.Objective([ce.L1(z), ce.Potential("relu", z)]))
    assert math.isfinite(1.0)
