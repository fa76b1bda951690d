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


def add_parser(subparsers: Any, formatter: type[argparse.HelpFormatter] | None = None
               ) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to ``convex-eq``'s subparsers (sets ``func``)."""
    p = subparsers.add_parser(
        "verify", help="verify the equilibrium against its claim (CVXPY / numeric / local "
        "reference); exit code 1 on failure", description=DESCRIPTION,
        formatter_class=formatter or argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("spec", metavar="FILE[:NAME]",
                   help="a Python file defining an objective or model (NAME: which one; "
                   "without it, the file's only one)")
    p.add_argument("--x-seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--batch", type=int, default=1, help="number of random input samples")
    p.add_argument("--gradients", action="store_true",
                   help="also compare dℓ/dx of every backward mode with cvxpylayers and FD")
    p.add_argument("--markdown", metavar="PATH",
                   help="also write a Markdown report with its plots (PNG files beside it; the "
                   "folder must exist; default: none, the report is printed only)")
    p.add_argument("--starts", type=int, default=5, help="starts of the local reference")
    p.add_argument("--reference", choices=["auto", "cvxpy", "numeric", "local"], default="auto",
                   help="the reference to compare with (auto: the one the claim calls for, "
                   "docs/theory.md §9)")
    p.add_argument("--regularizer", choices=["auto", "prox", "gradient"],
                   help="variant of φ + γR edits (default: the rule's 'auto')")
    p.add_argument("--deep-form", choices=["composition", "multiblock"],
                   help="form of a deep model (default: the rule's choice)")
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
    from .errors import output_file
    from .provenance import collect

    markdown = None
    if args.markdown:
        with step("output file"):  # before any work: a typo must not cost the whole check
            markdown = output_file(args.markdown, "--markdown")
    prov = collect(getattr(args, "argv", None))
    from verify.check import check

    from .loading import load_and_lower

    derived = load_and_lower(args)
    with step("random inputs"):
        x = random_inputs(derived, args.batch, args.x_seed)
    with step("check"):
        report = check(derived, x, gradients=args.gradients, starts=args.starts,
                       seed=args.x_seed, reference=args.reference)
    print(report)
    if markdown is not None:
        with step("write markdown"):
            path = report.to_markdown(markdown)
            add_provenance(path, prov)
        print(f"markdown report written to {path}")
    return 0 if report.passed else 1


#: what the columns of the Markdown report's two tables mean
COLUMNS = {
    "quantity / value / tolerance / verdict": "each check verify ran, the worst value over "
    "the samples, the tolerance it is judged against and whether it passed (info: reported, "
    "not judged)",
    "# / label": "the input sample and what its equilibrium was verified to be (minimizer, "
    "local minimizer, stationary point, ...)",
    "rel. error": "||z − z_ref|| / max(||z_ref||, floor): the layer's equilibrium against the "
    "reference's state (floor: the tolerances' scale_floor, 0.01 unless set)",
    "gap": "(G(z) − G(z_ref)) / max(1, |G(z_ref)|): the objective at the layer's equilibrium "
    "above the reference's",
    "residual": "fixed-point residual ||z − T(z)|| / max(1, ||z||) of the equilibrium verify "
    "solved with the layer's map",
    "stationarity": "the objective's first-order optimality residual at the layer's "
    "equilibrium, measured independently of the layer",
    "ref. status": "the reference solver's status",
}


def add_provenance(path: Any, prov: dict[str, Any]) -> None:
    """Put the provenance lines under the report's title and define its columns."""
    from pathlib import Path

    from .provenance import column_lines, header_lines

    p = Path(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    head = ["", *header_lines(prov), *column_lines(COLUMNS)]
    p.write_text("\n".join([lines[0], *head[:-1], *lines[1:]]) + "\n", encoding="utf-8")
