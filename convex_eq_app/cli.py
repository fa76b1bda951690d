"""``convex-eq`` command line: ``derive``, ``verify``, ``tour``, ``demo``, ``train-table``,
``certified``, ``reproduce``, ``results``, ``bench``.

User mistakes print one line naming the command and the step that failed, plus a hint, and
exit 2; ``--debug`` shows tracebacks; ``-v`` logs each step (``-vv``: debug details).  Only the
standard library and the plain configuration dataclasses are imported until a command runs, so
``--help`` is fast; each command imports what it needs (``derive FILE`` without NAME, which only
lists, loads neither torch nor the lowering pass).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from .configs import Budget, DemoConfig, TableConfig
from .steps import StepFailed, step
from .verify_command import add_parser as add_verify

log = logging.getLogger("convex_eq_app")
#: the source checkout's ``benchmarks/`` (not installed with the package)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except where there is none to show (a default
    of None, whose meaning the help text states, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _at_least_one(text: str) -> int:
    """An integer ≥ 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def cmd_derive(args: argparse.Namespace) -> int:
    """Print the derivation (plain text or LaTeX) of the loaded object; without NAME, derive the
    file's only objective, or list what the file defines when it has none or several."""
    from .userfile import definitions, listing, run_file, split_spec

    path, name = split_spec(args.spec)
    if not name:
        with step("load"):
            defs = definitions(run_file(path))
        if sum(d.kind != "factory" for d in defs) != 1:
            print(listing(path, defs))
            return 0
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


def _device(args: argparse.Namespace) -> str:
    from .training import resolve_device

    with step("device"):
        return str(resolve_device(args.device))


def _out_dir(args: argparse.Namespace) -> None:
    """Check ``--out`` before any work (a typed error for a folder that cannot be made)."""
    from .errors import output_dir

    with step("output folder"):
        output_dir(args.out)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo (derive, verify, edit and train on MNIST-1D)."""
    _out_dir(args)
    from .demo import run

    device = _device(args)
    with step("demo"):
        run(out=args.out, quick=args.quick, progress=not args.no_progress, workers=args.workers,
            device=device, seed=args.seed, epochs=args.epochs, argv=args.argv)
    return 0


def cmd_train_table(args: argparse.Namespace) -> int:
    """Train the MNIST-1D table (equilibrium models vs an MLP and a CNN of equal size)."""
    _out_dir(args)
    from .table import run

    cfg = TableConfig.quick_config() if args.quick else TableConfig()
    for key in ("epochs", "channels", "kernel", "workers", "eval_every"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.models:
        cfg.models = tuple(args.models)
    cfg.val = args.val
    cfg.warm_start = args.warm_start
    cfg.jacobian_reg = args.jacobian_reg
    cfg.tol_schedule = tuple(args.tol_schedule) if args.tol_schedule else None
    cfg.backward, cfg.backward_solver = args.backward, args.backward_solver
    cfg.anderson_m = args.anderson_m
    cfg.device = _device(args)
    with step("train-table"):
        run(out=args.out, cfg=cfg, progress=not args.no_progress, argv=args.argv)
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
    _out_dir(args)
    with step("reproduce"):
        reproduce.run(out=args.out, quick=args.quick, device=args.device, workers=args.workers,
                      only=args.only, resume=args.resume, seeds=args.seeds, epochs=args.epochs,
                      progress=not args.no_progress, argv=args.argv,
                      from_table=args.from_table)
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    """Write the results page from the JSON the commands wrote."""
    from .errors import output_file
    from .results import write_page

    with step("output file"):
        out = output_file(args.out, "--out")
    with step("results"):
        path = write_page(args.sources, out)
    print(f"wrote {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks.run ARGS`` from the source checkout (a script, not installed)."""
    if not (BENCHMARKS / "run.py").is_file():
        from .errors import CLIError

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


def _training_options(p: argparse.ArgumentParser, out: str, workers: int | None,
                      epochs: str, device_help: str = "cpu, cuda, cuda:N or auto (CUDA when "
                      "present)") -> None:
    """The options every command that trains has: ``--quick``, ``--out``, ``--seed``,
    ``--epochs``, ``--device``, ``--workers``, ``--no-progress``."""
    p.add_argument("--quick", action="store_true",
                   help="smoke run (tiny models, one epoch): checks that every step runs; its "
                   "numbers are not results, and the report says so")
    p.add_argument("--out", default=out, metavar="DIR",
                   help="output folder for the report, plots, results.json and checkpoints/ "
                   "(its parent folder must exist)")
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs ({epochs})")
    p.add_argument("--device", default="cpu", help=device_help)
    p.add_argument("--workers", type=int, default=workers,
                   help="training processes of one torch thread each (1: in this process)")
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bars")


def build_parser() -> argparse.ArgumentParser:
    """The ``convex-eq`` parser with its subcommands."""
    p = argparse.ArgumentParser(prog="convex-eq", formatter_class=HelpFormatter, description=(
        "Optimization-induced equilibrium networks: derive the fixed-point layer of a hidden "
        "objective, verify its equilibrium, run the tour, the demo or the benchmarks."))
    p.add_argument("--debug", action="store_true", help="show Python tracebacks")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log each step to stderr (-vv: debug details)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("derive", help="print the derivation, certificate and contraction",
                       formatter_class=HelpFormatter,
                       description="Lower the objective or model that FILE[:NAME] defines and "
                       "print its derivation, certificate and contraction estimate. Without "
                       ":NAME, derive the only objective FILE defines, or list the objectives, "
                       "models and factories (functions without required arguments) it "
                       "defines.")
    d.add_argument("spec", metavar="FILE[:NAME]",
                   help="a Python file defining objectives (NAME: an objective, a model or a "
                   "factory function in it)")
    d.add_argument("--latex", action="store_true", help="print LaTeX instead of plain text")
    d.add_argument("--regularizer", choices=["auto", "prox", "gradient"],
                   help="variant of φ + γR edits (lowering.lower's option; default: the rule's "
                   "'auto')")
    d.add_argument("--deep-form", choices=["composition", "multiblock"],
                   help="form of a deep model (default: the rule's choice)")
    d.set_defaults(func=cmd_derive)

    add_verify(sub, HelpFormatter)

    t = sub.add_parser("tour", help="objective-language tour (declare, certify, export, derive)",
                       formatter_class=HelpFormatter)
    t.add_argument("--seed", type=int, default=0, help="seed of the tour's random weights")
    t.set_defaults(func=cmd_tour)

    full, quick = DemoConfig(), DemoConfig.quick_config()
    dm = sub.add_parser("demo", help="derive, verify, edit and train on MNIST-1D (a few minutes)",
                        formatter_class=HelpFormatter,
                        description="Derive the conv OptEq layer, verify it against CVXPY, edit "
                        "its objective three ways, train the four derived models and an MLP of "
                        "equal size on MNIST-1D, verify every trained layer; writes report.md, "
                        "results.json, three plots and checkpoints/ into --out.")
    _training_options(dm, "convex_eq_out", full.workers,
                      f"default {full.epochs}; --quick: {quick.epochs}")
    dm.add_argument("--seed", type=int, default=full.seed,
                    help="seed of the initial weights, the data order and the augmentation")
    dm.set_defaults(func=cmd_demo)

    full_t, quick_t = TableConfig(), TableConfig.quick_config()
    tt = sub.add_parser("train-table", formatter_class=HelpFormatter,
                        help="MNIST-1D table: the seeds' equilibrium models vs an MLP and a CNN "
                        "of equal parameter count",
                        description="Train every seed model of convex_eq.models (and an MLP and "
                        "a CNN with the conv OptEq's parameter count) on MNIST-1D with one "
                        "loop, verify each trained layer; writes table.md, results.json, "
                        "epochs.jsonl and checkpoints/ into --out.")
    _training_options(tt, "convex_eq_table", full_t.workers,
                      f"default {full_t.epochs}; --quick: {quick_t.epochs}")
    tt.add_argument("--seed", "--seeds", dest="seeds", type=int, nargs="+", default=None,
                    metavar="SEED", help=f"training seeds, one run per model and seed "
                    f"(default {' '.join(map(str, full_t.seeds))})")
    tt.add_argument("--channels", type=int, default=None,
                    help=f"channels of the conv layers (default {full_t.channels}; --quick: "
                    f"{quick_t.channels})")
    tt.add_argument("--kernel", type=int, default=None,
                    help=f"kernel size (default {full_t.kernel}; --quick: {quick_t.kernel})")
    tt.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                    help="model names, quoted (default: all; e.g. 'conv OptEq' 'CNN (same "
                    "#params)')")
    tt.add_argument("--eval-every", dest="eval_every", type=int, default=None,
                    help=f"measure the held-out accuracy every N epochs and after the last "
                         f"(default {TableConfig.eval_every})")
    tt.add_argument("--val", action="store_true",
                    help="report a validation split of train (10 %%) instead of the test set")
    tt.add_argument("--warm-start", action="store_true",
                    help="start each training signal's solve from its equilibrium of the epoch "
                    "before (equilibrium rows with a uniqueness certificate; refused for others)")
    tt.add_argument("--jacobian-reg", type=float, default=0.0, metavar="GAMMA",
                    help="add GAMMA times a Hutchinson estimate of ||dT/dz||_F^2 / (B N) to the "
                    "equilibrium rows' loss (Jacobian regularisation; 0: off)")
    tt.add_argument("--backward", choices=("implicit", "phantom"), default="implicit",
                    help="gradient of the convex equilibrium rows: the exact implicit gradient "
                    "or the one-step phantom gradient (GEQ always trains with phantom "
                    "gradients, as its paper)")
    tt.add_argument("--backward-solver", default=None, metavar="SOLVER",
                    help="adjoint solver of the implicit gradient: anderson, plain, broyden, "
                    "or auto (a direct solve when small, conjugate gradients on a symmetric "
                    "adjoint); default: the forward's (anderson)")
    tt.add_argument("--anderson-m", type=_at_least_one, default=None, metavar="M",
                    help="memory of the equilibrium rows' forward Anderson solve (default: the "
                    "solver's, 5; a shorter memory makes each iteration cheaper)")
    tt.add_argument("--tol-schedule", type=float, nargs=2, default=None,
                    metavar=("START", "END"),
                    help="the equilibrium rows' solver tolerance, geometric from START in the "
                    "first epoch to END in the last (default: the table's fixed tolerance)")
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

    full_b, quick_b = Budget.full(), Budget.quick_budget()
    r = sub.add_parser("reproduce", formatter_class=HelpFormatter,
                       help="the papers' claims on MNIST-1D with power: a claim table "
                       "(paper effect, measured difference, SE, MDD, verdict) and plots",
                       description="Train the MNIST-1D table's models (and the claims' own "
                       "variants of the same size) on several seeds and test the papers' "
                       "claims, each against the paper's effect and the smallest difference "
                       "the run can detect; writes reproduce.md, one PNG per experiment, "
                       "results.json and checkpoints/ into --out.")
    _training_options(r, "reproduce_out", 1,
                      f"default {full_b.epochs}; --quick: {quick_b.epochs}")
    r.add_argument("--seed", "--seeds", dest="seeds", type=int, nargs="+", default=None,
                   metavar="SEED", help=f"training seeds (default "
                   f"{' '.join(map(str, full_b.seeds))}; --quick: "
                   f"{' '.join(map(str, quick_b.seeds))})")
    r.add_argument("--only", nargs="+", metavar="CLAIM",
                   help="claim keys or prefixes (e.g. tpami mopteq_pe; default: all); --list "
                   "shows them")
    r.add_argument("--list", action="store_true", help="list the claims and exit")
    r.add_argument("--resume", action="store_true", help="reuse the runs an earlier invocation "
                   "with the same budget finished into OUT/runs.jsonl")
    r.add_argument("--from-table", nargs="+", metavar="DIR", default=None,
                   help="reuse the runs (results and checkpoints) of finished convex-eq "
                   "train-table runs in DIR... trained with the same epochs, data set and "
                   "sizes, together covering the seeds (default: train every run)")
    r.set_defaults(func=cmd_reproduce)

    rs = sub.add_parser("results", formatter_class=HelpFormatter,
                        help="write the results page from the JSON of demo, train-table and "
                        "reproduce runs",
                        description="Read the results.json that convex-eq demo, train-table "
                        "and reproduce wrote (or the folders holding them) and write one "
                        "Markdown page: a section per run, headed by its date, commit, "
                        "versions, machine and command.")
    rs.add_argument("--from", dest="sources", nargs="+", required=True, metavar="PATH",
                    help="results.json files or the output folders holding them")
    rs.add_argument("--out", default="docs/results.md", help="the Markdown page to write")
    rs.set_defaults(func=cmd_results)

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
    args.argv = list(sys.argv[1:] if argv is None else argv)
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
