"""The a posteriori error bound on random samples of every certified seed layer
(``python -m benchmarks.error_bounds [--samples N] [--dtype float64|float32]``): each module's own
forward (its default solver and tolerance), its per-sample bound, and the distance of its output
to the tight float64 equilibrium (:func:`verify.bounds.check_error_bound`); prints the
distribution of bound/distance per layer and whether the bound held for every sample.

The saddle layer is the example of docs/monotone.md §4 (``convex_eq.models`` has no saddle seed).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import lowering
from convex_eq import L1, Dense, Input, Linear, Potential, SqNorm, State, Weight, models
from convex_eq.inclusion import Saddle
from verify.bounds import check_error_bound


def saddle() -> Saddle:
    """``min_z max_w Σf_relu(z) + ½·½||z||² − ⟨Ux, z⟩ + ⟨Kz, w⟩ − (½||w||² + 0.1||w||₁)``."""
    g = np.random.default_rng(0)
    z, w, x = State("z", 6), State("w", 4), Input("x", 3)
    U = Weight("U", (6, 3), g.standard_normal((6, 3)))
    K = Weight("K", (4, 6), 2 * g.standard_normal((4, 6)))
    return Saddle([Potential("relu", z), 0.5 * SqNorm(z), -Linear(U @ x, z)],
                  [SqNorm(w), 0.1 * L1(w)], Dense(K), name="robust")


#: the certified seed layers
SEEDS: dict[str, Callable[[], Any]] = {
    "OptEq (dense)": lambda: models.opteq(),
    "OptEq (conv)": lambda: models.opteq(conv=(8, 5), image=(1, 40)),
    "deep OptEq (L=2)": lambda: models.deep_opteq(),
    "MON (Peaceman–Rachford)": lambda: models.mon(),
    "MON (conv)": lambda: models.mon(conv=(8, 5), image=(1, 40)),
    "saddle (Chambolle–Pock)": saddle,
}


def run(samples: int = 1000, dtype: torch.dtype = torch.float64, seed: int = 0
        ) -> list[dict[str, Any]]:
    """One row per seed: bound/distance min, median, max over the samples above the reference's
    accuracy, the number of samples where the bound failed, and the time."""
    rows = []
    for name, make in SEEDS.items():
        m = lowering.lower(make()).torch_module(dtype=dtype, max_iter=2000)
        g = torch.Generator().manual_seed(seed)
        shape = m.derived.inputs[0].shape
        x = torch.randn(samples, *shape, generator=g, dtype=torch.float64).to(dtype)
        t0 = time.perf_counter()
        rep = check_error_bound(m, x)
        r = rep.ratios()
        rows.append({"layer": name, "samples": samples, "compared": int(r.size),
                     "failures": len(rep.failures), "min": float(r.min()),
                     "median": float(np.median(r)), "max": float(r.max()),
                     "seconds": time.perf_counter() - t0, "formula": rep.formula})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = "| layer | samples (compared) | bound fails | bound/true min | median | max | s |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['samples']} ({r['compared']}) | {r['failures']} | "
                     f"{r['min']:.3g} | {r['median']:.3g} | {r['max']:.3g} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.error_bounds", description=__doc__)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = run(args.samples, getattr(torch, args.dtype))
    print(table(rows))
    print(f"module dtype {args.dtype}; torch threads 1; load {load:.2f} → "
          f"{os.getloadavg()[0]:.2f}")
    return int(any(r["failures"] for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
