"""Workflow 2 — verify equilibrium = minimizer for a trained model loaded from disk.

Trains a derived OptEq layer (Theorem 1, ReLU) for a few steps, saves its ``state_dict``,
loads it into a fresh module, and checks the loaded layer's equilibrium against CVXPY
(plus the gradients against cvxpylayers and finite differences).

    python examples/verify_trained_model.py [--quick]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import lowering
import verify
from convex_eq import models


def train_and_save(path: str, steps: int) -> None:
    layer = lowering.lower(models.opteq(n=10, m=12, d=4, form="conjugate", seed=1))
    mod = layer.torch_module(dtype=torch.float64, tol=1e-8, weight_control="spectral_norm")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g, dtype=torch.float64)
    target = torch.randn(64, 10, generator=g, dtype=torch.float64)
    opt = torch.optim.Adam(mod.parameters(), lr=2e-2)
    for _ in range(steps):
        loss = ((mod(x) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"trained {steps} steps, final loss {float(loss.detach()):.4f}")
    # store the effective (norm-controlled) weights: the certificate refers to these
    torch.save({k: v.detach() for k, v in mod.env().items() if k in mod.weights}, path)


def load(path: str) -> torch.nn.Module:
    layer = lowering.lower(models.opteq(n=10, m=12, d=4, form="conjugate", seed=99))
    mod = layer.torch_module(dtype=torch.float64, tol=1e-12, max_iter=500)
    state = torch.load(path)
    mod.load_state_dict({f"weights.{k}": v for k, v in state.items()}, strict=False)
    return mod


def main(quick: bool = False) -> verify.Report:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/opteq.pt"
        train_and_save(path, 10 if quick else 200)
        mod = load(path)
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    report = verify.check(mod, x, gradients=not quick)
    print(report)
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    main(p.parse_args().quick)
