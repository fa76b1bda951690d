"""Phantom gradients (``backward="phantom"``, the GEQ paper's training gradient) on multi-branch
GEQ: the module's gradient equals autograd through ``k`` damped applications of an independent
torch transcription of GEQ's iteration from ``z*``, for the input and the paper's bandwidth rule;
with many steps it approaches the implicit gradient; a classifier with average fusion, weight
normalisation and phantom gradients takes a training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowering
from convex_eq import models
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

T64 = torch.float64
SCALES, CH, CS, P, HID, K = (1, 2), 8, 4, 2, 8, 3


def _model(gamma: str):
    return models.conv_geq((1, 16), CH, scales=SCALES, channel_split=CS, hidden=HID,
                           gamma=gamma, seed=4)


def _branch_step(z: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], i: int,
                 stride: int, rule: str) -> torch.Tensor:
    """One GEQ step of branch ``i`` (``(B, C, L)``): ``σ(Wᵀm)``, ``m`` the patches
    ``e^{−γ||(x̃_j − z̃_j)W_h||²}(x̃_j − z̃_j)W_hW_hᵀ``, with torch's own convolutions."""
    u, b, wt, wh = (w[f"{n}{i}"] for n in ("U", "b", "W", "W_h"))
    bsz, c, length = z.shape
    r = F.conv1d(x, u, stride=stride, padding=K // 2) + b.reshape(c, length) \
        - F.conv1d(z, wt, padding=K // 2)
    pt = r.reshape(bsz, c // CS, CS, length // P, P).permute(0, 1, 3, 2, 4)
    y = pt.reshape(bsz, -1, CS * P) @ wh
    n = (y * y).sum(-1)
    if rule == "paper":  # the residual at the current state
        src = n
    else:  # the input part alone: the residual at z = 0
        q = F.conv1d(x, u, stride=stride, padding=K // 2) + b.reshape(c, length)
        qp = q.reshape(bsz, c // CS, CS, length // P, P).permute(0, 1, 3, 2, 4)
        src = ((qp.reshape(bsz, -1, CS * P) @ wh) ** 2).sum(-1)
    gamma = 0.2 / src.min(dim=-1).values.clamp_min(1e-12)
    m = (torch.exp(-gamma[:, None, None] * n[..., None]) * y) @ wh.T
    m = m.reshape(bsz, c // CS, length // P, CS, P).permute(0, 1, 3, 2, 4).reshape(bsz, c,
                                                                                   length)
    return torch.relu(F.conv_transpose1d(m, wt, padding=K // 2))


def _loss(zs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return sum((z * torch.linspace(-1.0, 1.0, z.shape[-1], dtype=T64)).sum() for z in zs)


@pytest.mark.parametrize("rule", ["input", "paper"])
@pytest.mark.parametrize(("steps", "damping"), [(1, 1.0), (3, 0.6)])
def test_phantom_gradient_is_autograd_of_damped_geq_steps(rule: str, steps: int,
                                                          damping: float) -> None:
    mod = lowering.lower(_model(rule)).torch_module(
        tol=1e-12, max_iter=500, dtype=T64, backward="phantom", phantom_steps=steps,
        phantom_damping=damping)
    x = torch.randn(3, 1, 16, generator=torch.Generator().manual_seed(1), dtype=T64)
    zs = mod(x)
    _loss(zs).backward()
    got = {n: p.grad.clone() for n, p in mod.weights.items()}
    w = {n: p.detach().clone().requires_grad_() for n, p in mod.weights.items()}
    ref_z = []
    for i, (sc, z0) in enumerate(zip(SCALES, zs), start=1):
        z = z0.detach()
        for _ in range(steps):
            z = damping * _branch_step(z, x, w, i, sc, rule) + (1 - damping) * z
        ref_z.append(z)
    ref = torch.autograd.grad(_loss(tuple(ref_z)), list(w.values()))
    for (name, g), r in zip(got.items(), ref):
        # the same float64 operations in another arrangement from the same z*: rounding only
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-9, msg=name)
        assert float(r.abs().max()) > 0, name  # every weight receives a gradient


def test_many_phantom_steps_approach_the_implicit_gradient() -> None:
    d = lowering.lower(_model("input"))
    x = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(2), dtype=T64)

    def grads(**opt) -> torch.Tensor:
        mod = d.torch_module(tol=1e-12, max_iter=500, dtype=T64, **opt)
        _loss(mod(x)).backward()
        return torch.cat([p.grad.reshape(-1) for p in mod.weights.values()])

    exact = grads(backward="implicit", backward_tol=1e-12, backward_max_iter=500)
    many = grads(backward="phantom", phantom_steps=60)
    one = grads(backward="phantom", phantom_steps=1)
    rel = lambda g: float((g - exact).norm() / exact.norm())  # noqa: E731
    # a contraction (||W||₂²||W_h||₂² = 0.81 at init): the truncated Neumann series of 60
    # steps is within 0.81^60 ≈ 3e-6 of the implicit gradient
    assert rel(many) < 1e-4 < rel(one), (rel(many), rel(one))


def test_a_fused_weight_normalised_geq_classifier_trains_with_phantom_gradients() -> None:
    d = lowering.lower(_model("paper"))
    settings = TrainingSettings(backward="phantom", tol=1e-4, max_iter=30,
                                weight_normalization=("W1", "W2"))
    clf = EquilibriumClassifier(d, settings, fusion="average", pool="avg", pooled=4)
    x = torch.randn(16, 1, 16, generator=torch.Generator().manual_seed(3))
    y = torch.arange(16) % 10
    opt = torch.optim.SGD(clf.parameters(), lr=0.1)
    loss = F.cross_entropy(clf(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in clf.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values()), grads
    assert any("original0" in n for n in grads) and any("original1" in n for n in grads)
    opt.step()
    assert bool(torch.isfinite(F.cross_entropy(clf(x), y)))
