"""Workflow 4 — deep OptEq from a feed-forward network (docs/theory.md §5, Lemma 1/2).

Converts a trained-looking ``nn.Sequential`` into weight-tied OptEq layers, checks the outputs
are identical, and prints each layer's hidden objective and its certificate.

    python examples/deep_from_feedforward.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import lowering


def main(quick: bool = False) -> float:
    torch.manual_seed(0)
    widths = (8, 16, 16, 4) if quick else (64, 128, 64, 32, 10)
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.Tanh() if i % 2 else nn.ReLU())
    net = nn.Sequential(*layers).double()
    converted = lowering.convert(net)
    print(converted.describe())
    x = torch.randn(256, widths[0], dtype=torch.float64)
    with torch.no_grad():
        err = float((converted.module()(x) - net(x)).abs().max())
    print(f"\nmax |OptEq reformulation − original| on 256 inputs: {err:.2e}")
    for k, phi in enumerate(converted.objectives):
        layer = lowering.lower(phi)
        print(f"\nlayer {k}: μ = {converted.mus[k]:.4g}; {phi.certificate()}; "
              f"claim: {layer.claim.kind}")
        print("  " + layer.formula())
    return err


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    main(p.parse_args().quick)
