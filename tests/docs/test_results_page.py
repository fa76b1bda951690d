"""docs/results.md is generated from the committed run records by ``convex-eq results``, each
section headed by its run's provenance; the README's headline numbers are the demo record's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from convex_eq_app.cli import main
from convex_eq_app.results import images_of, load, render

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results.md"


def sources() -> list[str]:
    line = next(ln for ln in PAGE.read_text(encoding="utf-8").splitlines()
                if ln.startswith("Sources: "))
    return re.findall(r"`([^`]+)`", line)


def test_results_page_is_what_the_generator_renders_from_the_committed_json() -> None:
    srcs = sources()
    assert {"demo", "train-table", "reproduce"} <= {load(ROOT / s)["kind"] for s in srcs}
    images = [images_of(s, PAGE.relative_to(ROOT), ROOT) for s in srcs]
    assert images[0] and all(img.endswith(".png") for img in images[0])  # the demo's plots
    page = render([load(ROOT / s) for s in srcs], srcs, images)
    assert page == PAGE.read_text(encoding="utf-8")
    for img in images[0]:
        assert f"]({img})" in page and (PAGE.parent / img).is_file()


def test_every_section_is_headed_by_its_provenance() -> None:
    text = PAGE.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == len(sources())
    for sec in sections:
        head = sec.split("| ")[0]
        for field in ("- date: ", "- commit: ", "- versions: ", "- machine: ", "- command: "):
            assert field in head, (sec.splitlines()[0], field)
    for s in sources():  # a smoke run's section says so in its title and its banner
        doc = load(ROOT / s)
        quick = doc.get("config", doc.get("budget", {})).get("quick")
        title = next(sec for sec in sections if doc["provenance"]["command"] in sec)
        assert ("smoke run" in title.splitlines()[0]) == bool(quick)


def test_cli_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.md"
    srcs = sources()
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["results", "--from", *srcs, "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    written = out.read_text(encoding="utf-8")
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", written)
    assert links and all((out.parent / link).is_file() for link in links)  # relative to it

    def text(page: str) -> str:
        return re.sub(r"!\[[^\]]*\]\([^)]+\)", "", page)

    assert text(written) == text(PAGE.read_text(encoding="utf-8"))


def test_a_record_without_provenance_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"results": []}))
    assert main(["results", "--from", str(tmp_path), "--out", str(tmp_path / "r.md")]) == 2
    assert "provenance" in capsys.readouterr().err


def test_readme_headline_numbers_are_the_demo_record() -> None:
    """Every accuracy and verdict in the README's results table is the committed demo run's."""
    demo = next(load(ROOT / s) for s in sources() if load(ROOT / s)["kind"] == "demo")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
    by_name = {r["name"]: r for r in demo["results"]}
    assert len(rows) == len(by_name)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        rec = by_name[cells[0]]
        assert cells[1] == f"{100 * rec['accuracy']:.1f} %"
        verdict = rec["verification"] or "—"
        assert cells[2] == (verdict.split("(", 1)[1].rstrip(")") if "(" in verdict else "—")
