"""``convex-eq verify FILE[:NAME]``: lower a stated objective/model, verify its equilibrium at
random inputs, print the report table; exit code 0 if it passed, 1 otherwise."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

T64 = torch.float64


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to ``convex-eq``'s subparsers (sets ``func``)."""
    p = subparsers.add_parser(
        "verify", help="verify the equilibrium against its claim (CVXPY / numeric / local "
        "reference, docs/theory.md §9); exit code 1 on failure",
        description=__doc__.splitlines()[0])
    p.add_argument("spec", help="FILE[:NAME] of a Python file defining an objective or model")
    p.add_argument("--x-seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--batch", type=int, default=1, help="number of random input samples")
    p.add_argument("--gradients", action="store_true",
                   help="also compare dℓ/dx of every backward mode with cvxpylayers and FD")
    p.add_argument("--markdown", metavar="PATH", help="also write a Markdown report with plots")
    p.add_argument("--starts", type=int, default=5, help="starts of the local reference")
    p.add_argument("--reference", choices=["auto", "cvxpy", "numeric", "local"], default="auto")
    p.add_argument("--regularizer", choices=["auto", "prox", "gradient"])
    p.add_argument("--deep-form", choices=["composition", "multiblock"])
    p.set_defaults(func=cmd_verify)
    return p


def random_inputs(derived: Any, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Standard normal inputs ``(batch, *shape)`` for every input of the layer."""
    if batch < 1:
        from convex_eq.errors import OptionError

        raise OptionError("--batch must be ≥ 1", term="verify")
    g = np.random.default_rng(seed)
    return {s.name: torch.as_tensor(g.standard_normal((batch, *s.shape)), dtype=T64)
            for s in derived.inputs}


def cmd_verify(args: argparse.Namespace) -> int:
    """Run ``verify.check`` on the loaded object; 0 if passed, 1 otherwise."""
    from convex_eq.cli import load_and_lower

    from .check import check

    derived = load_and_lower(args)
    x = random_inputs(derived, args.batch, args.x_seed)
    report = check(derived, x, gradients=args.gradients, starts=args.starts,
                   seed=args.x_seed, reference=args.reference)
    print(report)
    if args.markdown:
        path = report.to_markdown(args.markdown)
        print(f"markdown report written to {path}")
    return 0 if report.passed else 1
