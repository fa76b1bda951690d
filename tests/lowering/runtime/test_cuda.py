"""The emitted module on a CUDA device (skipped where torch sees none; ``python -m
benchmarks.gpu`` runs these first on a machine with a GPU).

References: a float64 NumPy fixed-point iteration and a dense SVD for the canonical OptEq layer;
for the other seed layers the same layer on the CPU, whose own correctness is pinned against
independent references by the CPU tests — here only the device must not change the numbers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
F64 = torch.float64


def _grads(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    z = m(x)
    z = z if isinstance(z, torch.Tensor) else torch.cat([t.flatten(1) for t in z], 1)
    w = torch.linspace(-1, 1, z.numel(), dtype=z.dtype, device=z.device).reshape(z.shape)
    gs = torch.autograd.grad((z * w).sum(), [x, *m.parameters()], allow_unused=True)
    return z.detach(), [g for g in gs if g is not None]


def test_opteq_on_cuda_matches_a_numpy_fixed_point_and_its_gradient() -> None:
    d = lowering.lower(models.opteq(n=24, m=24, d=6, seed=1))
    m = d.torch_module(dtype=F64, tol=1e-12, max_iter=500, backward_tol=1e-12).cuda()
    x = torch.randn(8, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    z = m(x.cuda()).detach().cpu().numpy()
    env = {k: v.detach().cpu().numpy() for k, v in m.env().items()}
    q = x.numpy() @ env["U"].T + env["b"]
    M = env["W"].T @ env["W"]
    ref = np.zeros_like(q)
    for _ in range(3000):  # ||W||₂ = 0.9: rate 0.81, converged to round-off long before
        ref = np.maximum(q + ref @ M, 0.0)
    # tol 1e-12 relative at rate ≤ 0.81: within ~5e-12·||z|| of the fixed point on any GPU
    assert np.abs(z - ref).max() <= 1e-9 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("name", ["opteq", "conv", "deep", "mon", "geq"])
def test_seed_layers_give_the_same_outputs_and_gradients_on_cuda_as_on_the_cpu(name: str) -> None:
    obj = {"opteq": lambda: models.opteq(), "conv": lambda: models.opteq(conv=(3, 3),
                                                                         image=(1, 12)),
           "deep": lambda: models.deep_opteq(), "mon": lambda: models.mon(),
           "geq": lambda: models.geq()}[name]()
    d = lowering.lower(obj)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu = d.torch_module(dtype=F64, tol=1e-11, max_iter=1000, backward_tol=1e-11,
                             backward_max_iter=1000)
        gpu = d.torch_module(dtype=F64, tol=1e-11, max_iter=1000, backward_tol=1e-11,
                             backward_max_iter=1000).cuda()
        gpu.load_state_dict(cpu.state_dict())
        g = torch.Generator().manual_seed(3)
        x = torch.randn(5, *d.inputs[0].shape, dtype=F64, generator=g)
        zc, gc = _grads(cpu, x)
        zg, gg = _grads(gpu, x.cuda())
    # both solves stop at relative residual 1e-11; the two equilibria differ by at most
    # ~2·tol/(1 − Lip) relative, and reductions in another order by round-off
    scale = max(1.0, float(zc.abs().max()))
    assert float((zg.cpu() - zc).abs().max()) <= 1e-8 * scale
    for a, b in zip(gc, gg):
        assert float((b.cpu() - a).abs().max()) <= 1e-7 * max(1.0, float(a.abs().max()))


def test_weight_control_on_cuda_measures_the_exact_norm() -> None:
    d = lowering.lower(models.opteq(conv=(3, 3), image=(1, 6, 6), seed=0))
    m = d.torch_module(dtype=F64).cuda()
    with torch.no_grad():
        m.weights["W"].mul_(2.0)  # above its bound: rescaled to 0.99
    op = m.weight_control.targets[0][0]
    env = m.env()
    w = env["W"].detach().cpu()
    dense = op.apply(torch.eye(op.in_size, dtype=F64), {"W": w}).T.numpy()
    assert abs(np.linalg.norm(dense, 2) - 0.99) <= 1e-8


def test_warm_start_and_a_training_step_on_cuda() -> None:
    d = lowering.lower(models.opteq(conv=(4, 3), image=(1, 16), seed=0))
    m = d.torch_module(warm_start=16).cuda()
    x = torch.randn(16, 1, 16, device="cuda")
    ids = torch.arange(16, device="cuda")
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        z = m(x, sample_ids=ids)
        loss = ((z - 0.5) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] and m.warm_start_cache.hits >= 16 * 4
    assert next(m.parameters()).device.type == "cuda"
