"""``FILE[:NAME]`` → the objective or model a user's Python file defines, and its lowering."""

from __future__ import annotations

import argparse
from typing import Any

import lowering

from .errors import CLIError
from .steps import step
from .userfile import SPEC_HINT, definitions, pick, run_file, split_spec

__all__ = ["CLIError", "load_and_lower", "load_object"]


def load_object(spec: str) -> Any:
    """The ``Objective``/``DeepComposition`` named by ``FILE[:NAME]`` (without NAME: the only
    object the file defines; a callable NAME is called without arguments)."""
    path, name = split_spec(spec)
    mod = run_file(path)
    if name:
        return pick(mod, path, name)
    objects = [d for d in definitions(mod) if d.kind != "factory"]
    if len(objects) != 1:
        names = ", ".join(d.name for d in definitions(mod)) or "none"
        raise CLIError(f"{path} defines {len(objects)} objectives or models and no NAME was "
                       f"given (it defines: {names})", hint=f"name one: {path}:NAME; "
                       f"convex-eq derive {path} lists them" if names != "none" else SPEC_HINT)
    return pick(mod, path, objects[0].name)


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
