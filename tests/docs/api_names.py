"""What the API reference must document: the names the four public packages export (their
``__all__``), the seed models, and every public member of the exported classes."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterator
from functools import cache
from typing import Any

#: the packages whose ``__all__`` is the public API
PACKAGES = ("convex_eq", "lowering", "lowering.runtime", "verify")
PROJECT = ("convex_eq", "lowering", "verify")


def _ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in PROJECT


@cache
def _attr_docs(module: str) -> dict[tuple[str, str], list[str]]:
    from sphinx.pycode import ModuleAnalyzer

    try:
        return ModuleAnalyzer.for_module(module).find_attr_docs()
    except Exception:  # a module without source: nothing documented by comments
        return {}


def _member_doc(cls: type, name: str) -> str:
    """The documentation of member ``name`` as the reference shows it: its own docstring (a
    function, property, class or static method) or its ``#:`` comment, else that of the same
    member of a project base class (autodoc inherits docstrings)."""
    for klass in cls.__mro__:
        if not _ours(klass):
            continue
        value = vars(klass).get(name)
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if inspect.isfunction(func) or isinstance(func, property):
            doc = inspect.getdoc(func) or ""
        else:  # a dataclass field or a class attribute: its ``#:`` comment
            doc = " ".join(_attr_docs(klass.__module__).get((klass.__qualname__, name), []))
        if doc.strip():
            return doc
    return ""


def public_objects() -> Iterator[tuple[str, Any]]:
    """``(qualified name, object)`` of every exported object, each object once (the first
    package exporting it names it), and of the public functions of ``convex_eq.models``."""
    seen: set[int] = set()
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if id(obj) in seen or inspect.ismodule(obj):
                continue
            seen.add(id(obj))
            yield f"{pkg}.{name}", obj
    models = importlib.import_module("convex_eq.models")
    for name, obj in vars(models).items():
        if inspect.isfunction(obj) and obj.__module__ == models.__name__ \
                and not name.startswith("_"):
            yield f"convex_eq.models.{name}", obj


def public_members(cls: type) -> list[str]:
    """Public members of an exported class defined by the project (fields, methods,
    properties, class attributes), inherited ones included."""
    names = set()
    for klass in cls.__mro__:
        if _ours(klass):
            names |= {n for n in vars(klass) if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    return sorted(names)


def undocumented() -> list[str]:
    """Every public name without documentation (data exported as values are documented in the
    reference's pages; see :func:`exported_data`)."""
    out = []
    for qual, obj in public_objects():
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        if not (inspect.getdoc(obj) or "").strip() or (
                inspect.isclass(obj) and obj.__doc__ is None):
            out.append(qual)
        if inspect.isclass(obj):
            out += [f"{qual}.{m}" for m in public_members(obj) if not _member_doc(obj, m)]
    return out


def exported_data() -> list[str]:
    """Exported names that are values (registries, the version), documented by hand."""
    return [q for q, o in public_objects() if not (inspect.isclass(o) or callable(o))]
