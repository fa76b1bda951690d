"""Train a derived equilibrium layer on your own tensors through a ``torch.utils.data.DataLoader``.

Any ``DataLoader`` that yields ``(x, y)`` batches works; here the tensors are three Gaussian
blobs in 8 dimensions (replace them with yours).  The layer is the OptEq of Theorem 1
(``convex_eq.models.opteq``), read by a linear head (``EquilibriumClassifier``), trained by the
toolkit's loop ``convex_eq_app.training.fit`` (Adam, cosine schedule, solver statistics per
epoch), and its trained equilibrium is then verified against CVXPY.

    python examples/train_on_your_data.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import lowering
import verify
from convex_eq import models
from convex_eq_app.training import TrainConfig, fit
from lowering.runtime import EquilibriumClassifier, TrainingSettings


def your_tensors(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three Gaussian blobs in R^8 (features ``(n, 8)``, labels ``(n,)``): stand-ins for yours."""
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(3, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return centers[y] + torch.randn(n, 8, generator=g), y


def main(quick: bool = False) -> dict:
    torch.manual_seed(0)
    x, y = your_tensors(600 if quick else 3000)
    split = len(y) * 4 // 5
    train = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=64, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    test = (x[split:], y[split:])

    layer = lowering.lower(models.opteq(n=16, m=16, d=8, form="canonical", seed=0))
    model = EquilibriumClassifier(layer, TrainingSettings(tol=1e-5), pool="none", classes=3)
    result = fit(model, train, TrainConfig(epochs=2 if quick else 10, lr=1e-2), "OptEq",
                 progress=not quick, test=test)
    print(f"test accuracy {100 * result.accuracy:.1f} % after {len(result.history)} epochs; "
          f"{result.history[-1]['fwd_iters']:.1f} forward iterations per step in the last one")

    # the trained layer is still the minimizer of its objective (weight control kept ||W||₂ < 1)
    report = verify.check(model.eq, test[0][:3].double())
    print(report.label, "passed" if report.passed else "FAILED")
    return {"result": result, "report": report, "model": model}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two epochs on 600 samples")
    main(quick=ap.parse_args().quick)
