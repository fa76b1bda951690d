"""Typed errors of the command line, and the check of an output path before any work starts."""

from __future__ import annotations

from pathlib import Path

from convex_eq.errors import ConvexEqError


class CLIError(ConvexEqError):
    """A user mistake on the command line."""


class OutputPathError(CLIError):
    """An output path cannot be written where it was asked for (its folder does not exist, or
    it names a file where a folder is needed)."""


def output_dir(path: str | Path, option: str = "--out") -> Path:
    """The output folder ``path``, created if missing; its parent must exist (no silent
    ``mkdir -p`` of a mistyped path), and it must not be a file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{p} is a file, not a folder", term=option,
                              hint="pass a folder for the report, its plots and its JSON")
    if not p.exists():
        parent = p.resolve().parent
        if not parent.is_dir():
            raise OutputPathError(f"the folder {parent} does not exist", term=option,
                                  hint=f"create it first (mkdir -p {parent}) or pass another "
                                  "path")
        p.mkdir()
    return p


def output_file(path: str | Path, option: str) -> Path:
    """The output file ``path``: its folder must exist and it must not be a folder."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{p} is a folder, not a file", term=option,
                              hint="pass a file name, e.g. report.md")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise OutputPathError(f"the folder {parent} does not exist", term=option,
                              hint=f"create it first (mkdir -p {parent}) or pass another path")
    return p
