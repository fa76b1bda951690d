"""``FILE[:NAME]`` → the objective or model a user's Python file defines, and its lowering."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Any

import lowering
from convex_eq.composition import DeepComposition
from convex_eq.errors import ConvexEqError
from convex_eq.objective import Objective

from .steps import step

log = logging.getLogger(__name__)
KINDS = (Objective, DeepComposition)
SPEC_HINT = "pass FILE[:NAME]: a Python file that defines an objective or a model (and its name)"


class CLIError(ConvexEqError):
    """A user mistake on the command line."""


def load_object(spec: str) -> Any:
    """The ``Objective``/``DeepComposition`` named by ``FILE[:NAME]`` (the only one if no NAME;
    a callable NAME is called without arguments)."""
    path, _, name = spec.partition(":")
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"no such file: {path}", hint=SPEC_HINT)
    mod_spec = importlib.util.spec_from_file_location(p.stem, p)
    if mod_spec is None or mod_spec.loader is None:
        raise CLIError(f"cannot import {path} as a Python module", hint=SPEC_HINT)
    mod = importlib.util.module_from_spec(mod_spec)
    log.info("running %s", p)
    try:
        mod_spec.loader.exec_module(mod)
    except ConvexEqError:
        raise
    except Exception as err:  # a user file: report it in one line (tracebacks via --debug)
        raise CLIError(f"error while running {path}: {type(err).__name__}: {err}",
                       hint="fix the file (rerun with --debug for a traceback)") from err
    if name:
        if not hasattr(mod, name):
            raise CLIError(f"{path} defines no '{name}'", hint=_name_hint(mod))
        obj = getattr(mod, name)
        if callable(obj) and not isinstance(obj, KINDS):
            try:
                obj = obj()
            except ConvexEqError:
                raise
            except Exception as err:
                raise CLIError(f"{name}() failed: {type(err).__name__}: {err}",
                               hint="rerun with --debug for a traceback") from err
    else:
        found = _found(mod)
        if len(found) != 1:
            raise CLIError(f"{path} defines {len(found)} objectives "
                           f"({', '.join(found) or 'none'})", hint="name one: FILE:NAME")
        name, obj = next(iter(found.items()))
    if not isinstance(obj, KINDS):
        raise CLIError(f"'{name}' is a {type(obj).__name__}, not an objective or a model",
                       hint=SPEC_HINT)
    log.info("loaded %s:%s (%s)", path, name, type(obj).__name__)
    return obj


def _found(mod: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(mod).items() if isinstance(v, KINDS)}


def _name_hint(mod: Any) -> str:
    """The objectives and the functions the file defines (a function NAME is called)."""
    names = list(_found(mod)) + [k for k, v in vars(mod).items() if not k.startswith("_")
                                 and inspect.isfunction(v) and v.__module__ == mod.__name__]
    if not names:
        return SPEC_HINT
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return f"name one of: {shown}"


def load_and_lower(args: argparse.Namespace) -> Any:
    """Steps 'load' and 'lower': ``lowering.lower`` of ``args.spec`` with the
    ``--regularizer`` / ``--deep-form`` options (shared by ``derive`` and ``verify``)."""
    with step("load"):
        obj = load_object(args.spec)
    opts = {}
    if args.regularizer:
        opts["regularizer"] = args.regularizer
    if args.deep_form:
        opts["deep_form"] = args.deep_form
    with step("lower"):
        return lowering.lower(obj, **opts)
