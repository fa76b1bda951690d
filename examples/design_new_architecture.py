"""Workflow 1 — design a new architecture by editing an objective.

Not in the papers: a tanh potential, a batch-decorrelation regularizer (applied as a gradient
step inside ∇S), and a Moreau-envelope skip connection.  Prints each derivation and certificate.

    python examples/design_new_architecture.py [--quick]
"""

from __future__ import annotations

import argparse

import torch

import convex_eq as ce
import lowering
from convex_eq import models


def build(gamma: float = 0.05, alpha: float = 0.6) -> dict[str, ce.Objective]:
    """Base tanh OptEq (canonical form) and two successive edits."""
    base = models.opteq(n=12, m=12, d=6, activation="tanh", seed=0)
    z = base.states[0]
    decorrelated = base + gamma * ce.BatchDecorrelation(z)
    skip = alpha * ce.moreau(decorrelated, 1.0 - alpha)
    return {"tanh OptEq": base, "+ batch decorrelation": decorrelated, "+ Moreau skip": skip}


def main(quick: bool = False) -> dict[str, lowering.DerivedLayer]:
    layers = {}
    for name, obj in build().items():
        layer = lowering.lower(obj)
        layers[name] = layer
        print(f"\n##### {name}")
        print(layer.describe())
    # the new layer runs like any torch module (batch-coupled: the regularizer couples samples)
    mod = layers["+ Moreau skip"].torch_module(dtype=torch.float64, tol=1e-8, max_iter=300)
    x = torch.randn(16 if quick else 128, 6, dtype=torch.float64)
    z, stats = mod(x, return_stats=True)
    print(f"\nequilibrium batch {tuple(z.shape)}: {stats}")
    return layers


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    main(p.parse_args().quick)
