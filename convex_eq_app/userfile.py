"""A user's Python file named by ``FILE[:NAME]``: run it, find what it defines, pick the object.

Imports only ``convex_eq`` (no torch): listing what a file defines (``convex-eq derive FILE``)
does not load the lowering pass or torch.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from convex_eq.composition import DeepComposition
from convex_eq.errors import ConvexEqError
from convex_eq.objective import Objective

from .errors import CLIError

log = logging.getLogger(__name__)
KINDS = (Objective, DeepComposition)
SPEC_HINT = "pass FILE[:NAME]: a Python file that defines an objective or a model (and its name)"


@dataclass(frozen=True)
class Definition:
    """One thing a file defines that ``FILE:NAME`` can name: an objective or model object, or a
    function of the file callable without arguments (a factory)."""

    name: str
    kind: str
    summary: str


def split_spec(spec: str) -> tuple[Path, str]:
    """``FILE[:NAME]`` → ``(path, name or "")``."""
    path, _, name = spec.partition(":")
    return Path(path), name


def run_file(path: Path) -> ModuleType:
    """Import the file as a module (its errors become one-line ``CLIError``\\ s)."""
    if not path.is_file():
        raise CLIError(f"no such file: {path}", hint=SPEC_HINT)
    mod_spec = importlib.util.spec_from_file_location(path.stem, path)
    if mod_spec is None or mod_spec.loader is None:
        raise CLIError(f"cannot import {path} as a Python module", hint=SPEC_HINT)
    mod = importlib.util.module_from_spec(mod_spec)
    log.info("running %s", path)
    try:
        mod_spec.loader.exec_module(mod)
    except ConvexEqError:
        raise
    except Exception as err:  # a user file: report it in one line (tracebacks via --debug)
        raise CLIError(f"error while running {path}: {type(err).__name__}: {err}",
                       hint="fix the file (rerun with --debug for a traceback)") from err
    return mod


def _summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) if inspect.isfunction(obj) else None
    return doc.strip().splitlines()[0] if doc else ""


def _no_required_args(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)


def definitions(mod: ModuleType) -> list[Definition]:
    """Objects (``Objective``/``DeepComposition``) and factories the file itself defines, in
    file order; imported functions and private names are left out."""
    out = []
    for name, obj in vars(mod).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, KINDS):
            out.append(Definition(name, type(obj).__name__, str(getattr(obj, "name", "") or "")))
        elif inspect.isfunction(obj) and obj.__module__ == mod.__name__ \
                and _no_required_args(obj):
            out.append(Definition(name, "factory", _summary(obj)))
    return out


def listing(path: Path, defs: list[Definition]) -> str:
    """What ``convex-eq derive FILE`` prints: one line per definition and how to pick one."""
    if not defs:
        return (f"{path} defines no objective, model or factory (a function without required "
                "arguments returning one)")
    width = max(len(d.name) for d in defs)
    lines = [f"{path} defines {len(defs)}:"]
    lines += [f"  {d.name:<{width}}  {d.kind:<16}  {d.summary}".rstrip() for d in defs]
    lines.append(f"derive one with: convex-eq derive {path}:NAME")
    return "\n".join(lines)


def pick(mod: ModuleType, path: Path, name: str) -> Any:
    """The object ``NAME`` names (a factory is called without arguments)."""
    if not hasattr(mod, name):
        raise CLIError(f"{path} defines no '{name}'", hint=name_hint(mod))
    obj = getattr(mod, name)
    if callable(obj) and not isinstance(obj, KINDS):
        try:
            obj = obj()
        except ConvexEqError:
            raise
        except Exception as err:
            raise CLIError(f"{name}() failed: {type(err).__name__}: {err}",
                           hint="rerun with --debug for a traceback") from err
    if not isinstance(obj, KINDS):
        raise CLIError(f"'{name}' is a {type(obj).__name__}, not an objective or a model",
                       hint=SPEC_HINT)
    log.info("loaded %s:%s (%s)", path, name, type(obj).__name__)
    return obj


def name_hint(mod: ModuleType) -> str:
    """The names a file defines that ``FILE:NAME`` can pick."""
    names = [d.name for d in definitions(mod)]
    if not names:
        return SPEC_HINT
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return f"name one of: {shown}"
