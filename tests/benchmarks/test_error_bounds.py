"""``python -m benchmarks.error_bounds``: the error bound's distribution on random samples of every
certified seed layer, each against a tight float64 solve (verify.bounds.check_error_bound)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.error_bounds import SEEDS, run, table  # noqa: E402


def test_every_certified_seed_is_reported_and_its_bound_holds() -> None:
    rows = run(samples=40)
    assert [r["layer"] for r in rows] == list(SEEDS)
    # a bound is never below the distance it bounds: bound/true ≥ 1 wherever compared
    assert all(r["failures"] == 0 and r["compared"] > 0 and 1.0 <= r["min"] <= r["median"]
               for r in rows)
    assert table(rows).count("\n") == len(rows) + 1
