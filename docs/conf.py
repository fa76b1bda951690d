"""Sphinx configuration of the convex-eq documentation (theory, guide, API reference)."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "convex-eq"
author = "convex-eq contributors"
copyright = "2026, convex-eq contributors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"

html_theme = "alabaster"

_INLINE_LITERAL = re.compile(r"``[^`]+?``(?=([^\W_])?)")


def _literal_suffixes(app: Any, what: str, name: str, obj: Any, options: Any,
                      lines: list[str]) -> None:
    """Docstrings write plurals of inline literals (````nn.Parameter````s); reST needs an escaped
    space between the closing backquotes and the letter, which this adds."""
    text = _INLINE_LITERAL.sub(lambda m: m.group(0) + ("\\ " if m.group(1) else ""),
                               "\n".join(lines))
    lines[:] = text.split("\n")


def _skip_submodules(app: Any, what: str, name: str, obj: Any, skip: bool,
                     options: Any) -> bool | None:
    """A package's imported submodules are documented on their own, not as its members."""
    return True if inspect.ismodule(obj) else None


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _literal_suffixes)
    app.connect("autodoc-skip-member", _skip_submodules)
