"""Import layering, read from the source with ``ast`` (nothing is imported).

Layers, bottom to top: ``convex_eq`` (declare) → ``lowering`` (derive) → ``verify`` (check) →
``convex_eq_app`` (command line, demo, tour).  A module may import its own layer and the layers
below it, never one above -- deferred imports inside functions included.  There is no cycle
between files, deferred imports inside functions included (``if TYPE_CHECKING:`` blocks, which
never run, excluded).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("convex_eq", "lowering", "verify", "convex_eq_app")

def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name → file, for every module of the four packages."""
    out = {}
    for pkg in LAYERS:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, deferred: bool, typing: bool
             ) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements run at import time (module level, in ``if``/``try`` blocks), with
    ``deferred`` also those inside functions and classes, with ``typing`` also those under
    ``if TYPE_CHECKING:`` (annotations only)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n
        elif isinstance(n, ast.If) and _is_type_checking(n):
            todo += n.body if typing else []
        elif isinstance(n, (ast.If, ast.Try, ast.ExceptHandler)) or deferred:
            todo += list(ast.iter_child_nodes(n))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def targets(name: str, deferred: bool, typing: bool = False,
            modules: dict[str, Path] = MODULES) -> dict[str, int]:
    """Our modules that module ``name`` imports → line of the first such import."""
    path = modules[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: dict[str, int] = {}
    for node in _imports(tree, deferred, typing):
        if isinstance(node, ast.Import):
            found = [_owner(a.name, modules) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                     else _owner(base, modules) for a in node.names]
        for t in found:
            if t and t != name:
                out.setdefault(t, node.lineno)
    return out


def _layer(name: str) -> int:
    return LAYERS.index(name.split(".")[0])


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(comp)
    return comps


def test_the_tree_is_read() -> None:
    assert {"convex_eq.objective", "lowering.lower", "verify.check",
            "convex_eq_app.cli"} <= set(MODULES)
    assert "lowering" in targets("convex_eq_app.loading", deferred=False)


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_import_runs_up_a_layer(layer: str) -> None:
    up = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
          for m in MODULES if m.split(".")[0] == layer
          for t, line in targets(m, deferred=True, typing=True).items()
          if _layer(t) > _layer(m)]
    assert not up, "imports running up a layer:\n" + "\n".join(up)


def test_no_import_time_cycle_between_files() -> None:
    graph = {m: set(targets(m, deferred=False)) for m in MODULES}
    assert _cycles(graph) == []


def test_no_cycle_between_files_deferred_imports_included() -> None:
    """No cycle closes through an import inside a function either: a method that builds an object
    of a module above its own (``LinOp @ LinOp`` → ``Compose``, ``Term + Term`` → ``Objective``)
    asks ``convex_eq._algebra`` (or a rule registry) for it instead of importing that module."""
    graph = {m: set(targets(m, deferred=True)) for m in MODULES}
    cycles = _cycles(graph)
    detail = [f"{a} -> {b} (line {targets(a, deferred=True)[b]})"
              for comp in cycles for a in sorted(comp) for b in sorted(graph[a] & comp)]
    assert not cycles, "import cycle(s) between files:\n" + "\n".join(detail)


def test_no_cycle_in_the_core_annotation_imports_included() -> None:
    """In ``convex_eq`` not even an ``if TYPE_CHECKING:`` import closes a cycle (a module that
    only reads another's objects types them by a protocol, e.g. ``certificate.TermSum``)."""
    core = {m: p for m, p in MODULES.items() if m.split(".")[0] == "convex_eq"}
    graph = {m: set(targets(m, deferred=True, typing=True, modules=core)) for m in core}
    assert _cycles(graph) == []


def test_reader_sees_deferred_typing_and_relative_imports(tmp_path: Path) -> None:
    """The reader itself can fail: a planted upward import and a planted cycle are found."""
    files = {
        "convex_eq/__init__.py": "",
        "convex_eq/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from lowering import x\n",
        "convex_eq/b.py": "def f():\n    try:\n        pass\n    except Exception:\n"
                          "        import verify.check\n",
        "convex_eq/c.py": "from . import d\n",
        "convex_eq/d.py": "from .c import thing\n",
        "lowering/__init__.py": "", "verify/__init__.py": "", "verify/check.py": "",
        "convex_eq_app/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = _modules(tmp_path)
    assert targets("convex_eq.a", deferred=False, modules=mods) == {}
    assert "lowering" in targets("convex_eq.a", deferred=True, typing=True, modules=mods)
    assert "verify.check" in targets("convex_eq.b", deferred=True, modules=mods)
    assert "verify.check" not in targets("convex_eq.b", deferred=False, modules=mods)
    graph = {m: set(targets(m, deferred=False, modules=mods)) for m in mods}
    assert _cycles(graph) == [{"convex_eq.c", "convex_eq.d"}]


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_distribution_installs_the_four_packages_and_not_benchmarks() -> None:
    """pyproject's package selection: benchmarks/ is run from the checkout, not installed."""
    import tomllib

    find_packages = pytest.importorskip("setuptools").find_packages  # the build backend
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found = find_packages(where=str(ROOT), **conf["tool"]["setuptools"]["packages"]["find"])
    assert {p.split(".")[0] for p in found} == set(LAYERS)
    assert conf["project"]["scripts"]["convex-eq"] == "convex_eq_app.cli:main"


def test_no_cycle_between_files_annotation_imports_included() -> None:
    """In every product package not even an ``if TYPE_CHECKING:`` import closes a cycle."""
    graph = {m: set(targets(m, deferred=True, typing=True)) for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, f"annotation-import cycle(s): {cycles}"


def test_the_deriving_side_imports_nothing_of_the_runtime() -> None:
    """``lowering``'s deriving modules (``lower``, the rules, ``DerivedLayer``, the nodes, the
    trace, the converter, the perturbation) import nothing of ``lowering.runtime`` — deferred and
    annotation-only imports included; only the package face ``lowering/__init__.py`` joins the
    two wings (the runtime registers its emitters there)."""
    deriving = [m for m in MODULES if m.split(".")[0] == "lowering" and m != "lowering"
                and not m.startswith("lowering.runtime")]
    assert "lowering.nodes" in deriving and "lowering.rules.theorem1" in deriving
    bad = [f"{m} imports {t}" for m in deriving
           for t in targets(m, deferred=True, typing=True) if t.startswith("lowering.runtime")]
    assert not bad, "\n".join(bad)


def _private_imports(name: str) -> list[str]:
    """``from M import _x`` of a private name from another module (a private module of one's own
    package, ``from . import _mod``, is allowed)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in _imports(tree, deferred=True, typing=True):
        if not isinstance(node, ast.ImportFrom):
            continue
        for a in node.names:
            if not a.name.startswith("_") or a.name.startswith("__"):
                continue
            if node.level and node.module is None:  # from . import _module
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name} from "
                       f"{'.' * node.level}{node.module or ''}")
    return out


def test_no_private_name_crosses_modules() -> None:
    bad = [line for m in MODULES for line in _private_imports(m)]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
