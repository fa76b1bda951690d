"""``convex-eq`` command line: ``derive``, ``verify``, ``tour``, ``demo``, ``train-table``,
``certified``, ``reproduce``, ``bench``.

User mistakes print one line naming the command and the step that failed, plus a hint, and
exit 2; ``--debug`` shows tracebacks; ``-v`` logs each step (``-vv``: debug details).  Only the
standard library is imported until a command runs, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from .steps import StepFailed, step
from .verify_command import add_parser as add_verify

log = logging.getLogger("convex_eq_app")
#: the source checkout's ``benchmarks/`` (not installed with the package)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def cmd_derive(args: argparse.Namespace) -> int:
    """Print the derivation (plain text or LaTeX) of the loaded object."""
    from .loading import load_and_lower

    layer = load_and_lower(args)
    with step("print"):
        print(layer.latex() if args.latex else layer.describe())
    return 0


def cmd_tour(args: argparse.Namespace) -> int:
    """Run the objective-language tour."""
    from .tour import run

    with step("tour"):
        run(seed=args.seed)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo (derive, verify, edit and train on MNIST-1D)."""
    from .demo import run
    from .training import resolve_device

    with step("device"):
        device = str(resolve_device(args.device))
    with step("demo"):
        run(out=args.out, quick=args.quick, progress=not args.no_progress, workers=args.workers,
            device=device)
    return 0


def cmd_train_table(args: argparse.Namespace) -> int:
    """Train the MNIST-1D table (equilibrium models vs an MLP and a CNN of equal size)."""
    from .table import TableConfig, run
    from .training import resolve_device

    cfg = TableConfig.quick_config() if args.quick else TableConfig()
    for key in ("epochs", "channels", "kernel", "workers"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.models:
        cfg.models = tuple(args.models)
    cfg.val = args.val
    with step("device"):
        cfg.device = str(resolve_device(args.device))
    with step("train-table"):
        run(out=args.out, cfg=cfg)
    return 0


def cmd_certified(args: argparse.Namespace) -> int:
    """Certified accuracy on MNIST-1D of a conv OptEq and a MON trained under a Lipschitz
    target, with an attack inside the certified radii (docs/theory.md §9.6)."""
    from .certified import CertifiedConfig, run

    cfg = CertifiedConfig.quick_config() if args.quick else CertifiedConfig()
    for key in ("epochs", "channels", "lipschitz_target"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.radii:
        cfg.radii = tuple(args.radii)
    if args.models:
        cfg.models = tuple(args.models)
    with step("certified"):
        run(out=args.out, cfg=cfg)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Run the papers' claims in miniature and write the claim table (docs/reproduce.md)."""
    from . import reproduce

    if args.list:
        for key, claim in reproduce.CLAIMS.items():
            print(f"{key:28s} {claim.source:26s} {claim.statement}")
        return 0
    with step("reproduce"):
        reproduce.run(out=args.out, quick=args.quick, device=args.device, workers=args.workers,
                      only=args.only, resume=args.resume)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks.run ARGS`` from the source checkout (a script, not installed)."""
    if not (BENCHMARKS / "run.py").is_file():
        from .loading import CLIError

        with step("find benchmarks"):
            raise CLIError(f"the benchmarks are not installed with the package (no {BENCHMARKS})",
                           hint="clone the repository and run convex-eq bench from an editable "
                           "install (pip install -e .) or python -m benchmarks.run there")
    root = str(BENCHMARKS.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks.run", *args.bench_args]
    log.info("running %s (PYTHONPATH=%s)", " ".join(cmd), root)
    return subprocess.call(cmd, env=env)


def build_parser() -> argparse.ArgumentParser:
    """The ``convex-eq`` parser with its subcommands."""
    p = argparse.ArgumentParser(prog="convex-eq", description=(
        "Optimization-induced equilibrium networks: derive the fixed-point layer of a hidden "
        "objective, verify its equilibrium, run the tour, the demo or the benchmarks."))
    p.add_argument("--debug", action="store_true", help="show Python tracebacks")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log each step to stderr (-vv: debug details)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("derive", help="print the derivation, certificate and contraction",
                       description="Lower the objective or model that FILE[:NAME] defines and "
                       "print its derivation, certificate and contraction estimate.")
    d.add_argument("spec", help="FILE[:NAME] of a Python file defining an objective")
    d.add_argument("--latex", action="store_true", help="print LaTeX instead of plain text")
    d.add_argument("--regularizer", choices=["auto", "prox", "gradient"])
    d.add_argument("--deep-form", choices=["composition", "multiblock"])
    d.set_defaults(func=cmd_derive)
    add_verify(sub)
    t = sub.add_parser("tour", help="objective-language tour (declare, certify, export, derive)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_tour)
    dm = sub.add_parser("demo", help="derive, verify, edit and train on MNIST-1D (< 5 min)")
    dm.add_argument("--quick", action="store_true", help="< 1 minute version (smoke test)")
    dm.add_argument("--out", default="convex_eq_out", help="output folder (report + plots)")
    dm.add_argument("--no-progress", action="store_true", help="hide tqdm progress bars")
    dm.add_argument("--workers", type=int, default=None,
                    help="training processes, one thread each (default 2; 1 = in-process)")
    dm.add_argument("--device", default="cpu", help="cpu (default), cuda or auto (CUDA when "
                    "present)")
    dm.set_defaults(func=cmd_demo)
    tt = sub.add_parser("train-table", help="MNIST-1D table: the seeds' equilibrium models vs an "
                        "MLP and a CNN of equal parameter count (--quick: < 2 min)")
    tt.add_argument("--quick", action="store_true", help="CI smoke version (< 2 minutes)")
    tt.add_argument("--out", default="convex_eq_table", help="output folder (table + JSON)")
    tt.add_argument("--epochs", type=int, default=None)
    tt.add_argument("--channels", type=int, default=None)
    tt.add_argument("--kernel", type=int, default=None)
    tt.add_argument("--seeds", type=int, nargs="+", default=None)
    tt.add_argument("--models", nargs="+", default=None, help="model names (default: all)")
    tt.add_argument("--workers", type=int, default=None,
                    help="training processes, one thread each (default 2)")
    tt.add_argument("--val", action="store_true",
                    help="report a validation split of train (10 %%) instead of the test set")
    tt.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    tt.set_defaults(func=cmd_train_table)
    c = sub.add_parser("certified", help="MNIST-1D certified accuracy of a conv OptEq and a MON "
                       "trained under a Lipschitz target, with a PGD attack inside the certified "
                       "radii (--quick: < 1 min)")
    c.add_argument("--quick", action="store_true", help="CI smoke version (< 1 minute)")
    c.add_argument("--out", default="convex_eq_certified", help="output folder (table + JSON)")
    c.add_argument("--epochs", type=int, default=None)
    c.add_argument("--channels", type=int, default=None)
    c.add_argument("--lipschitz-target", dest="lipschitz_target", type=float, default=None,
                   help="Lip(x ↦ z*) kept by weight control during training (default 1)")
    c.add_argument("--radii", type=float, nargs="+", default=None, help="ℓ2 radii of the table")
    c.add_argument("--models", nargs="+", default=None, choices=["conv OptEq", "MON"])
    c.set_defaults(func=cmd_certified)
    r = sub.add_parser("reproduce", help="the papers' claims in miniature: a claim table "
                       "(paper's number, measured here, holds?) and plots",
                       description="Train small models on MNIST-1D (generated locally) and check "
                       "the papers' claims, each against a criterion fixed before measuring; "
                       "writes reproduce.md, one PNG per experiment and results.json.")
    r.add_argument("--quick", action="store_true", help="CI smoke run (< 2 min): one seed, one "
                   "epoch, tiny layers — its verdicts are not evidence")
    r.add_argument("--out", default="reproduce_out", help="output folder (report + plots)")
    r.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (CUDA when "
                   "present)")
    r.add_argument("--workers", type=int, default=1,
                   help="training processes, one torch thread each (default 1)")
    r.add_argument("--only", nargs="+", metavar="CLAIM",
                   help="claim keys or prefixes (e.g. tpami mopteq_pe); --list shows them")
    r.add_argument("--list", action="store_true", help="list the claims and exit")
    r.add_argument("--resume", action="store_true", help="reuse the runs an earlier invocation "
                   "with the same budget finished into OUT/runs.jsonl")
    r.set_defaults(func=cmd_reproduce)
    b = sub.add_parser("bench", add_help=False,
                       help="benchmarks vs cvxpylayers, torchdeq, a hand loop (source checkout; "
                       "convex-eq bench --help lists its options)")
    b.set_defaults(func=cmd_bench)  # its arguments go to python -m benchmarks.run (see main)
    return p


def _configure_logging(verbose: int) -> None:
    """Log to stderr (unless the host already configured logging) at WARNING, INFO (-v) or
    DEBUG (-vv); the level is set on the root logger, so a library module that logs under its
    own name (``logging.getLogger(__name__)``) is shown too."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``convex-eq``; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(args.verbose)
    where = f"convex-eq {args.command}"
    try:
        return int(args.func(args) or 0)
    except StepFailed as failed:
        if args.debug:
            raise
        print(f"error: {where} {failed}", file=sys.stderr)
        return 2
    except Exception as err:
        errors = sys.modules.get("convex_eq.errors")  # loaded by every command that can raise it
        if args.debug or errors is None or not isinstance(err, errors.ConvexEqError):
            raise
        print(f"error: {where}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
