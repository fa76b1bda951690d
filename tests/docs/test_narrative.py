"""The README and the documentation speak to users: no development history (review rounds,
machine loads, clock times, commit hashes, internal targets) outside the changelog and the
provenance headers of the generated results page; the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: (pattern, what it is) — case-insensitive
NARRATIVE = [
    (r"\breview(s|ed|er|ers)?\b", "a review"),
    (r"\b(\d+(st|nd|rd|th)|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
     r"this|that|last|previous|next|earlier|later|a|one|each) rounds?\b(?![-‐])",
     "a development round"),
    (r"\bround \d+\b", "a development round"),
    (r"\bload( average|avg|s? of \d|\s+\d+(\.\d+)?\b)", "a machine load"),
    (r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}", "a timestamp"),
    (r"\b\d{1,2}:\d{2}(:\d{2})?\s*(UTC|GMT)\b|\bUTC\b", "a clock time"),
    (r"\bcommit [0-9a-f]{7,40}\b|(?<![\w.#/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
     "a commit hash"),
    (r"\btargets? (not )?met\b|\bmet: (yes|no)\b|\binternal targets?\b", "an internal target"),
    (r"\bearlier (version|session|run|code)s?\b|\bolder code\b|\bthis session\b",
     "development history"),
]

#: phrases that contain a pattern's words without being history
ALLOWED = ["double-blind review"]

#: lines of the generated results page that state a run's provenance
PROVENANCE = re.compile(r"^- (date|commit|versions|machine|command): ")


def narrative(text: str, skip: re.Pattern[str] | None = None) -> list[tuple[int, str, str]]:
    """``(line number, what, line)`` for every line telling development history."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        if skip is not None and skip.search(line):
            continue
        clean = line
        for phrase in ALLOWED:
            clean = clean.replace(phrase, "")
        for pattern, what in NARRATIVE:
            if re.search(pattern, clean, flags=re.I):
                hits.append((i, what, line.strip()[:140]))
    return hits


def pages() -> list[Path]:
    """The README and every page of docs/ (the generated results page included; the run
    folders under docs/results/ hold machine-written reports and are not pages)."""
    out = [README, *sorted(DOCS.glob("*.md")), *sorted((DOCS / "api").glob("*.rst"))]
    return [p for p in out if p.is_file()]


def test_readme_and_docs_tell_no_development_history() -> None:
    bad = []
    for page in pages():
        skip = PROVENANCE if page.name == "results.md" else None
        for i, what, line in narrative(page.read_text(encoding="utf-8"), skip):
            bad.append(f"{page.relative_to(ROOT)}:{i}: {what}: {line}")
    assert not bad, "history belongs in CHANGELOG.md:\n" + "\n".join(bad)


def test_narrative_check_can_fail() -> None:
    for line in ["This round changed Anderson's arithmetic.",
                 "(docs/theory.md §8, sixth round)", "found by a review of the backward",
                 "load average about 1 on the 2-core machine", "at load 5–13",
                 "2026-11-24 01:29 UTC", "(19:28–20:12 UTC, three invocations)",
                 "four full runs at commit 85af3f4", "measured at 3cfdfaf5",
                 "300× over cvxpylayers … met: no", "the AMD EPYC VM of earlier sessions"]:
        assert narrative(line), line
    for line in ["rounding to float32", "the unit round-off u", "a round-off error",
                 "Anonymous submission under double-blind review", "tol 1e-8, dtype float64",
                 "spectral norm 0.9 (now 0.9)", "see docs/theory.md §8", "`examples/models.py`",
                 "PE ε = 0.05, seeds [0]"]:
        assert not narrative(line), line
    assert not narrative("- date: 2026-11-27T08:40:13+00:00", PROVENANCE)


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, len(lines)
