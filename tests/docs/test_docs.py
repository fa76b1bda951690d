"""The documentation: it builds with warnings as errors, it covers every public module, it cites
sections that exist, and nothing shipped points outside the repository."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


DOCS = ROOT / "docs"


#: what a user gets: the packages (every top-level package, the application layer included),
#: examples, benchmarks, the README, the changelog and the docs
SHIPPED = sorted({"convex_eq", "lowering", "verify", "examples", "benchmarks", "docs", "README.md",
                  "CHANGELOG.md", "pyproject.toml"}
                 | {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"})


TEXT_SUFFIXES = {".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".json", ".yaml", ".yml"}


#: references that only exist on the machines the project was written on
OUTSIDE = [
    (re.compile(r"\.\./shared"), "a path to ../shared"),
    (re.compile(r"MATH\.md|\bMATH §"), "a specification outside the repository (MATH.md)"),
    (re.compile(r"(?<![\w.])/(?:work|home|root|Users|mnt|opt)/[\w.-]"), "an absolute path"),
    (re.compile(r"shared/papers"), "the team's copy of the papers (cite them by title instead)"),
]


def shipped_files() -> list[Path]:
    out: list[Path] = []
    for name in SHIPPED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT_SUFFIXES
                    and "_build" not in f.parts and "__pycache__" not in f.parts]
    return out


def outside_references(text: str) -> list[tuple[int, str, str]]:
    """``(line number, line, why)`` for every reference to a path outside the repository."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for pattern, why in OUTSIDE:
            if pattern.search(line):
                hits.append((i, line.strip(), why))
    return hits


def test_nothing_shipped_points_outside_the_repository() -> None:
    bad = []
    for f in shipped_files():
        for i, line, why in outside_references(f.read_text(encoding="utf-8", errors="replace")):
            bad.append(f"{f.relative_to(ROOT)}:{i}: {why}: {line[:120]}")
    assert not bad, "cite docs/theory.md §n (written by the project) instead:\n" + "\n".join(bad)


def test_outside_reference_check_can_fail() -> None:
    assert outside_references('hint="see MATH §3"')
    assert outside_references("The spec is in `../shared/MATH.md`.")
    assert outside_references("data = open('/work/shared/papers/x.txt')")
    assert not outside_references("hint='see docs/theory.md §3'; x = a/work/b")


# ---------------------------------------------------------------------------------- links
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


#: a fenced code block
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


#: a path in backquotes that names a file of the repository (``examples/models.py``)
CODE_PATH = re.compile(r"`((?:convex_eq|lowering|verify|examples|benchmarks|docs|tests)/[\w./-]*)`")


def broken_links(md: Path, text: str) -> list[str]:
    """Relative Markdown links and backquoted repository paths of ``md`` that do not exist (or leave
    the repository)."""
    bad = []
    text = FENCE.sub("", text)  # code blocks hold code and program output, not links
    targets = [a or b for a, b in MD_LINK.findall(text)]
    for t in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", t) or t.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        path = (md.parent / t.split("#", 1)[0]).resolve()
        if not path.exists() or ROOT not in (path, *path.parents):
            bad.append(f"{md.relative_to(ROOT)}: link ({t})")
    for t in CODE_PATH.findall(text):
        if not (ROOT / t).exists():
            bad.append(f"{md.relative_to(ROOT)}: `{t}`")
    return bad


def test_relative_links_of_readme_and_docs_exist() -> None:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
    bad = [b for p in pages if p.exists() for b in broken_links(p, p.read_text(encoding="utf-8"))]
    assert not bad, "links to files that do not exist in the repository:\n" + "\n".join(bad)


def test_link_check_can_fail() -> None:
    readme = ROOT / "README.md"
    assert broken_links(readme, "see [the theory](docs/no_such_page.md)")
    assert broken_links(readme, "see [outside](../shared/MATH.md)")
    assert broken_links(readme, "run `examples/no_such_example.py`")
    assert not broken_links(readme, "```text\nprox_{M¹[0.05·||z||₁]}(z)\n```\n")
    assert not broken_links(readme, "see [the theory](docs/theory.md#notation), [pypi](https://pypi.org)")


# ------------------------------------------------------------------------- theory citations
CITATION = re.compile(r"docs/theory\.md §(\d+(?:\.\d+)?)")


SPLIT_CITATION = re.compile(r"docs/theory\.md\s*$")


def theory_sections() -> set[str]:
    text = (DOCS / "theory.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def test_every_theory_citation_names_an_existing_section() -> None:
    sections = theory_sections()
    assert {"1", "2", "3", "4", "5", "6", "7", "8", "9", "9.1", "9.2", "9.3"} <= sections
    bad = []
    for f in [*shipped_files(), *sorted((ROOT / "tests").rglob("*.py"))]:
        lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines, 1):
            for sec in CITATION.findall(line):
                if sec not in sections:
                    bad.append(f"{f.relative_to(ROOT)}:{i}: docs/theory.md §{sec}")
            if SPLIT_CITATION.search(line) and i < len(lines) and \
                    re.match(r"\s*(#:?\s*)?\(?§", lines[i]):
                bad.append(f"{f.relative_to(ROOT)}:{i}: citation split across lines (not found "
                           "by a search for 'docs/theory.md §n')")
    assert not bad, (f"citations of sections docs/theory.md does not have ({sorted(sections)}):\n"
                     + "\n".join(bad))


# ----------------------------------------------------------------------------- API reference
API = DOCS / "api"


def reference_targets() -> dict[str, str]:
    """``{qualified name: page}`` of every object the API pages document (``auto*`` and
    ``py:*`` directives, resolved against ``currentmodule``)."""
    out = {}
    for page in sorted(API.glob("*.rst")):
        current = ""
        for line in page.read_text(encoding="utf-8").splitlines():
            m = re.match(r"\.\. (?:currentmodule|automodule):: ([\w.]+)", line)
            if m:
                current = m.group(1)
                continue
            m = re.match(r"\.\. (?:autoclass|autofunction|autodata|py:data|py:class|"
                         r"py:function):: ([\w.]+)", line)
            if m:
                name = m.group(1)
                out[name if "." in name else f"{current}.{name}"] = page.stem
    return out


def _resolve(qualified: str) -> object:
    module, _, attr = qualified.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_api_reference_documents_every_exported_name() -> None:
    """Each name of the four packages' ``__all__`` is documented on an API page (once: a name
    ``lowering.runtime`` re-exports from ``lowering`` is the same object), and listed in an
    autosummary table."""
    from tests.docs.api_names import PACKAGES

    targets = {id(_resolve(q)): q for q in reference_targets()}
    text = "\n".join(p.read_text(encoding="utf-8") for p in API.glob("*.rst"))
    missing = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if name == "models":  # the seed models' module has its own section
                ok = ".. automodule:: convex_eq.models" in text
            else:
                ok = id(obj) in targets
            if not ok or not re.search(rf"(^|[\s.:`]){re.escape(name)}\b", text):
                missing.append(f"{pkg}.{name}")
    assert not missing, f"document these in docs/api/*.rst: {missing}"


def test_api_reference_shows_no_internal_module() -> None:
    """The user reference is the exported names: no automodule dump of internal modules."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in API.glob("*.rst"))
    assert re.findall(r"^\.\. automodule:: ([\w.]+)", text, flags=re.M) == ["convex_eq.models"]
    for name in reference_targets():
        assert name.count(".") <= 2, name  # convex_eq.X, lowering.runtime.X, models.f


def test_every_public_name_is_documented() -> None:
    """Zero undocumented public names: every exported object, every public member of an
    exported class (fields by their ``#:`` comments), every seed model; exported values are
    documented by hand on the pages."""
    from tests.docs.api_names import exported_data, undocumented

    assert undocumented() == []
    targets = reference_targets()
    for qual in exported_data():
        obj = _resolve(qual)
        assert any(_resolve(t) is obj for t in targets), qual


def test_undocumented_count_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import lowering
    from tests.docs.api_names import undocumented

    monkeypatch.setattr(lowering.DerivedLayer.formula, "__doc__", None)
    assert undocumented() == ["lowering.DerivedLayer.formula"]


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sphinx-build -W (sphinx and myst-parser come with the test extra)."""
    tmp = tmp_path_factory.mktemp("docs")
    out = tmp / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp / "doctrees"), str(DOCS), str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, \
        f"sphinx-build -W failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def test_docs_build_with_warnings_as_errors(built_docs: Path) -> None:
    for page in ("index", "theory", "guide", "results", "performance", "contributing",
                 "api/convex_eq", "api/lowering", "api/runtime", "api/verify"):
        assert (built_docs / f"{page}.html").exists(), f"{page}.html was not built"


def test_api_pages_render_every_exported_name_with_types(built_docs: Path) -> None:
    """Autodoc really imported every object (a failed import leaves no anchor), and the types
    are in the descriptions."""
    html = {p: (built_docs / "api" / f"{p}.html").read_text(encoding="utf-8")
            for p in ("convex_eq", "lowering", "runtime", "verify")}
    for qual, page in reference_targets().items():
        assert f'id="{qual}"' in html[page], qual
    assert html["lowering"].count("Return type") >= 5
    assert "Parameters" in html["verify"]


def test_module_config_renders_every_torch_module_option(built_docs: Path) -> None:
    """The options table under ModuleConfig is rendered from FLAT_OPTIONS and the fields'
    documentation: every keyword appears with its field and a non-empty meaning."""
    from lowering.runtime.config import FLAT_OPTIONS

    page = (built_docs / "api" / "runtime.html").read_text(encoding="utf-8")
    start = page.index('id="lowering.ModuleConfig"')
    table = page[start:page.index("</table>", start)]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table, flags=re.S)
    cells = [[re.sub(r"<[^>]+>", "", c).strip()
              for c in re.findall(r"<td[^>]*>(.*?)</td>", r, flags=re.S)] for r in rows]
    by_keyword = {c[0]: c for c in cells if c}
    assert set(by_keyword) == set(FLAT_OPTIONS)
    for keyword, (group, field) in FLAT_OPTIONS.items():
        row = by_keyword[keyword]
        assert row[1] == (f"{group}.{field}" if group else field)
        assert len(row[3]) > 10, keyword


def test_guide_examples_run_in_order() -> None:
    """The guide's Python blocks run as written, one session (declare → … → export)."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "guide.md").read_text(encoding="utf-8"),
                        re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, code in enumerate(blocks):
            exec(compile(code, f"docs/guide.md block {i + 1}", "exec"), namespace)
    text = out.getvalue()
    assert "convex if ||W||₂ ≤ 1 (now 0.9)" in text
    assert namespace["report"].passed
    assert "optimal" in text


def test_docs_saddle_example_runs_and_prints_what_the_page_shows():
    """docs/monotone.md's saddle example runs and prints the lines the page shows."""
    page = (DOCS / "monotone.md").read_text()
    code = re.findall(r"```python\n(.*?)```", page, re.S)
    shown = re.findall(r"prints\n\n```text\n(.*?)```", page, re.S)
    assert len(code) == 1 and len(shown) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code[0], "docs/monotone.md", "exec"), {})
    got = out.getvalue().splitlines()
    want = shown[0].splitlines()
    # structure lines (rules, layer, claim) verbatim; the last line: PASS and a gap far below
    # the tolerance (its digits are the solver's round-off, not stable across BLAS builds)
    keep = [i for i, ln in enumerate(want) if ln.startswith(("[", "layer", "  ", "claim"))]
    assert [got[i] for i in keep] == [want[i] for i in keep]
    passed, gap = got[-1].split()
    assert passed == "True" and abs(float(gap)) < 1e-8
