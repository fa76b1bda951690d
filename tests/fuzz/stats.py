"""Outcome counting for the fuzz tests.

Every drawn case records one outcome per property (``record(test, outcome)``): a
``hypothesis.event`` (shown by ``pytest --hypothesis-show-statistics``) and a process-wide
counter dumped to ``/tmp/convex_eq_fuzz_stats_<profile>.json`` when each fuzz module finishes
(the file then holds the counts of every fuzz module run so far in the session).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch
from hypothesis import event, settings

COUNTS: dict[str, Counter] = defaultdict(Counter)
_STARTED = time.time()


def profile_name() -> str:
    """Name of the loaded hypothesis profile (``ci`` / ``dev`` / ``thorough``)."""
    name = getattr(settings, "_current_profile", None)
    if name:
        return str(name)
    return os.environ.get("HYPOTHESIS_PROFILE", "default")


def stats_path() -> str:
    return os.environ.get("CONVEX_EQ_FUZZ_STATS",
                          f"/tmp/convex_eq_fuzz_stats_{profile_name()}.json")


def record(test: str, outcome: str) -> None:
    """Count one outcome of one drawn case (and tell hypothesis about it)."""
    COUNTS[test][outcome] += 1
    event(f"{test}: {outcome}")


#: the cases (repr and report) of unconfirmed verify FAILs (suspected false alarms) and of
#: confirmed ones (real violations of the claim), for the stats file (first 50 of each)
UNCONFIRMED: list[str] = []
CONFIRMED: list[str] = []


def keep_case(cls: str, text: str) -> None:
    """Keep the case of an ``unconfirmed`` or ``confirmed`` verify FAIL for the stats file."""
    kept = CONFIRMED if cls == "confirmed" else UNCONFIRMED
    if len(kept) < 50:
        kept.append(text)


def fail_classes(counts: Counter) -> dict[str, int]:
    """verify FAILs by the adjudicator's class (``verify:failed[<class>](…)`` outcomes)."""
    out: Counter = Counter()
    for outcome, k in counts.items():
        m = re.search(r"verify:failed\[([a-z-]+)\]", outcome)
        if m:
            out[m.group(1)] += k
    return {c: out.get(c, 0) for c in ("confirmed", "reference-failure", "ill-posed",
                                        "unconfirmed")}


def summary() -> dict[str, Any]:
    tests = {t: dict(sorted(c.items())) for t, c in sorted(COUNTS.items())}
    return {
        "profile": profile_name(),
        "max_examples": settings().max_examples,
        "elapsed_s": round(time.time() - _STARTED, 1),
        "cases_per_test": {t: sum(c.values()) for t, c in tests.items()},
        "verify_fail_classes": fail_classes(COUNTS.get("verify", Counter())),
        "unconfirmed_cases": UNCONFIRMED,
        "confirmed_cases": CONFIRMED,
        "outcomes": tests,
    }


def dump() -> str:
    path = stats_path()
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(summary(), fh, indent=2, ensure_ascii=False)
    return path


@pytest.fixture(scope="module", autouse=True)
def fuzz_stats() -> Any:
    """Module-scoped: write the counts collected so far when the module finishes.  The fuzz
    tensors are tiny: torch runs single-threaded meanwhile (with 2 intra-op threads on a loaded
    2-core machine a 4×4 ``conv2d`` takes ~30 ms instead of ~5 µs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield COUNTS
    finally:
        torch.set_num_threads(threads)
        dump()
