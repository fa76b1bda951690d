"""``convex-eq verify FILE[:NAME]``: lower, verify at random inputs, print the report."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .steps import step

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Lower the objective or model that FILE[:NAME] defines, solve its equilibrium at random "
    "standard-normal inputs, and verify it against the reference its claim calls for: CVXPY "
    "for DCP-exportable objectives, a certified-convex numeric reference, or a multi-start "
    "local reference for non-convex objectives (reported as a stationary point, never a "
    "minimizer). Prints the report table; exit code 0 if it passed, 1 otherwise."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to ``convex-eq``'s subparsers (sets ``func``)."""
    p = subparsers.add_parser(
        "verify", help="verify the equilibrium against its claim (CVXPY / numeric / local "
        "reference); exit code 1 on failure", description=DESCRIPTION)
    p.add_argument("spec", help="FILE[:NAME] of a Python file defining an objective or model")
    p.add_argument("--x-seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--batch", type=int, default=1, help="number of random input samples")
    p.add_argument("--gradients", action="store_true",
                   help="also compare dℓ/dx of every backward mode with cvxpylayers and FD")
    p.add_argument("--markdown", metavar="PATH",
                   help="also write a Markdown report with its plots (PNG files beside it)")
    p.add_argument("--starts", type=int, default=5, help="starts of the local reference")
    p.add_argument("--reference", choices=["auto", "cvxpy", "numeric", "local"], default="auto")
    p.add_argument("--regularizer", choices=["auto", "prox", "gradient"])
    p.add_argument("--deep-form", choices=["composition", "multiblock"])
    p.set_defaults(func=cmd_verify)
    return p


def random_inputs(derived: Any, batch: int, seed: int) -> dict[str, Any]:
    """Standard normal float64 inputs ``(batch, *shape)`` for every input of the layer."""
    import numpy as np
    import torch

    from .loading import CLIError

    if batch < 1:
        raise CLIError(f"--batch must be ≥ 1 (got {batch})", hint="pass --batch 1 or more")
    g = np.random.default_rng(seed)
    return {s.name: torch.as_tensor(g.standard_normal((batch, *s.shape)), dtype=torch.float64)
            for s in derived.inputs}


def cmd_verify(args: argparse.Namespace) -> int:
    """Run ``verify.check`` on the loaded object; 0 if passed, 1 otherwise."""
    from verify.check import check

    from .loading import load_and_lower

    derived = load_and_lower(args)
    with step("random inputs"):
        x = random_inputs(derived, args.batch, args.x_seed)
    with step("check"):
        report = check(derived, x, gradients=args.gradients, starts=args.starts,
                       seed=args.x_seed, reference=args.reference)
    print(report)
    if args.markdown:
        with step("write markdown"):
            path = report.to_markdown(args.markdown)
        print(f"markdown report written to {path}")
    return 0 if report.passed else 1
