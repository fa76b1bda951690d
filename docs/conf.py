"""Sphinx configuration of the convex-eq documentation (theory, guide, API reference).

The API reference documents what the four public packages export (``__all__`` of
``convex_eq``, ``lowering``, ``lowering.runtime`` and ``verify``), with types in the
descriptions; the options of ``DerivedLayer.torch_module`` are rendered on ``ModuleConfig`` from
its own fields (:func:`_module_options`).
"""

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
    "sphinx.ext.autosummary",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "results/**"]

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
autodoc_typehints_format = "short"
autosummary_generate = False  # the tables link to the entries the automodule directives write

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
    """A package's submodules are not its members (``convex_eq.models`` has its own section)."""
    return True if inspect.ismodule(obj) else None


def _field_doc(cls: type, name: str) -> str:
    """The ``#:`` comment documenting dataclass field ``name`` of ``cls``, on one line."""
    from sphinx.pycode import ModuleAnalyzer

    docs = ModuleAnalyzer.for_module(cls.__module__).find_attr_docs()
    lines = docs.get((cls.__qualname__, name), [])
    return " ".join(line.strip() for line in lines if line.strip())


def _default(cls: type, name: str) -> str:
    import dataclasses

    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f"``{f.default!r}``"
    return f"``{f.default_factory()!r}``"  # type: ignore[misc]


def _module_options(app: Any, what: str, name: str, obj: Any, options: Any,
                    lines: list[str]) -> None:
    """Append to ``ModuleConfig``'s docstring the table of ``torch_module``'s flat keywords,
    rendered from ``FLAT_OPTIONS`` and the documented fields they set."""
    from lowering.runtime import config

    if obj is not config.ModuleConfig:
        return
    groups = {"forward": config.SolveConfig, "backward": config.BackwardConfig,
              "weight_control": config.WeightControlConfig, None: config.ModuleConfig}
    rows = []
    for keyword, (group, field) in config.FLAT_OPTIONS.items():
        cls = groups[group]
        path = f"{group}.{field}" if group else field
        rows.append((f"``{keyword}``", f"``{path}``", _default(cls, field),
                     _field_doc(cls, field)))
    lines += ["", ".. rubric:: The options of ``torch_module``", "",
              "``derived.torch_module(**options)`` takes these flat keywords; each sets one field "
              "of this configuration (an unknown keyword is an error listing the valid ones). "
              "``backend=\"cvxpylayers\"`` instead emits the same layer as an exact conic solve "
              "(:doc:`/guide`, section 3).", "",
              ".. list-table::", "   :header-rows: 1", "   :widths: 18 22 12 48", "",
              "   * - keyword", "     - field", "     - default", "     - meaning"]
    for row in rows:
        lines.append(f"   * - {row[0]}")
        lines += [f"     - {cell}" for cell in row[1:]]
    lines.append("")


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _literal_suffixes)
    app.connect("autodoc-process-docstring", _module_options)
    app.connect("autodoc-skip-member", _skip_submodules)
