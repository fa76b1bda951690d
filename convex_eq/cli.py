"""``convex-eq`` command line: ``demo``, ``tour``, ``derive``, ``verify``, ``bench``.

User mistakes print one readable line plus a hint and exit non-zero; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from .errors import ConvexEqError


class CLIError(ConvexEqError):
    """A user mistake on the command line."""


def load_object(spec: str) -> Any:
    """``FILE[:NAME]`` → the named Objective/DeepComposition in a Python file."""
    from .composition import DeepComposition
    from .objective import Objective

    path, _, name = spec.partition(":")
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"no such file: {path}", term="derive",
                       hint="pass FILE[:NAME] with a Python file defining an objective")
    mod_spec = importlib.util.spec_from_file_location(p.stem, p)
    if mod_spec is None or mod_spec.loader is None:
        raise CLIError(f"cannot import {path}", term="derive")
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)
    except ConvexEqError:
        raise
    except Exception as err:  # a user file: report it in one line (tracebacks via --debug)
        raise CLIError(f"error while running {path}: {type(err).__name__}: {err}",
                       term="derive", hint="fix the file (rerun with --debug for a traceback)"
                       ) from err
    kinds = (Objective, DeepComposition)
    if name:
        if not hasattr(mod, name):
            raise CLIError(f"{path} defines no '{name}'", term="derive")
        obj = getattr(mod, name)
        if callable(obj) and not isinstance(obj, kinds):
            try:
                obj = obj()
            except ConvexEqError:
                raise
            except Exception as err:
                raise CLIError(f"{name}() failed: {type(err).__name__}: {err}", term="derive",
                               hint="rerun with --debug for a traceback") from err
    else:
        found = {k: v for k, v in vars(mod).items() if isinstance(v, kinds)}
        if len(found) != 1:
            raise CLIError(f"{path} defines {len(found)} objectives ({', '.join(found) or 'none'})",
                           term="derive", hint="name one: FILE:NAME")
        obj = next(iter(found.values()))
    if not isinstance(obj, kinds):
        raise CLIError(f"'{name}' is a {type(obj).__name__}, not an objective", term="derive")
    return obj


def load_and_lower(args: argparse.Namespace) -> Any:
    """``lowering.lower`` of the object named by ``args.spec`` with the ``--regularizer`` /
    ``--deep-form`` options (shared by ``derive`` and ``verify``)."""
    import lowering

    obj = load_object(args.spec)
    opts = {}
    if args.regularizer:
        opts["regularizer"] = args.regularizer
    if args.deep_form:
        opts["deep_form"] = args.deep_form
    return lowering.lower(obj, **opts)


def cmd_derive(args: argparse.Namespace) -> int:
    layer = load_and_lower(args)
    print(layer.latex() if args.latex else layer.describe())
    return 0


def cmd_tour(args: argparse.Namespace) -> int:
    from .tour import run

    run(seed=args.seed)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    run(out=args.out, quick=args.quick, progress=not args.no_progress, workers=args.workers)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convex-eq", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show Python tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("derive", help="print the derivation, certificate and contraction")
    d.add_argument("spec", help="FILE[:NAME] of a Python file defining an objective")
    d.add_argument("--latex", action="store_true", help="print LaTeX instead of plain text")
    d.add_argument("--regularizer", choices=["auto", "prox", "gradient"])
    d.add_argument("--deep-form", choices=["composition", "multiblock"])
    d.set_defaults(func=cmd_derive)
    t = sub.add_parser("tour", help="objective-language tour (declare, certify, export, derive)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_tour)
    dm = sub.add_parser("demo", help="derive, verify, edit and train on load_digits (< 5 min)")
    dm.add_argument("--quick", action="store_true", help="< 1 minute version (smoke test)")
    dm.add_argument("--out", default="convex_eq_out", help="output folder (report + plots)")
    dm.add_argument("--no-progress", action="store_true", help="hide tqdm progress bars")
    dm.add_argument("--workers", type=int, default=None,
                    help="training processes, one thread each (default 2; 1 = in-process)")
    dm.set_defaults(func=cmd_demo)
    from verify.cli import add_parser as add_verify

    add_verify(sub)
    try:
        from benchmarks.run import add_parser as add_bench
    except ImportError:  # benchmarks/ ships with the source tree (editable installs)
        b = sub.add_parser("bench", help="benchmarks (needs the source checkout)")
        b.set_defaults(func=_no_bench)
    else:
        add_bench(sub)
    return p


def _no_bench(args: argparse.Namespace) -> int:
    raise CLIError("the benchmarks package is not importable", term="bench",
                   hint="run from a source checkout installed with pip install -e .")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConvexEqError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
