"""The results page (``convex_eq_app/results.py``): the combined table gathers the rows of
train-table runs that share one training per model over the seeds, only where no single run holds
them all; a reproduction's section links its plots."""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from pathlib import Path

from convex_eq_app.configs import TableConfig
from convex_eq_app.results import combined_tables, load, section

CFG = TableConfig(epochs=30)
PASS = "1e-9 (cvxpy: minimizer, pass)"  # a verification cell as verify_layer writes it


def _doc(rows: list[tuple[str, int, float, int, str]], cfg: TableConfig = CFG) -> dict:
    return {"kind": "train-table", "config": asdict(cfg),
            "rows": [{"name": n, "seed": s, "accuracy": a, "params": 9000,
                      "mean_iterations": 12.0 if v != "—" else float("nan"),
                      "nonconvergence": [c, 0], "verification": v}
                     for n, s, a, c, v in rows]}


def _row(text: str, model: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {model} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_rows_spread_over_runs_are_gathered_per_model_with_mean_and_sample_std() -> None:
    fast = _doc([("POptEq", s, a, 0, "1e-10 (cvxpy: minimizer, pass)")
                 for s, a in ((0, 0.965), (1, 0.967), (2, 0.961))]
                + [("D", 0, 0.959, 63, "6e-4 (none: equilibrium not found, FAIL: ...)")],
                replace(CFG, seeds=(0, 1, 2), models=("POptEq", "D")))
    slow = _doc([("D", 1, 0.962, 60, "2e-4 (local: local minimizer, pass)"),
                 ("D", 2, 0.950, 61, "1e-3 (none: equilibrium not found, FAIL: ...)"),
                 ("CNN", 1, 0.96, 0, "—")], replace(CFG, seeds=(1, 2), workers=1))
    text = "\n".join(combined_tables([fast, slow], ["runs/fast", "runs/slow"]))
    accs = [95.9, 96.2, 95.0]
    d = _row(text, "D")
    assert d[1] == f"{statistics.mean(accs):.1f} ± {statistics.stdev(accs):.1f}"
    assert d[2] == "95.9 / 96.2 / 95.0 (seeds 0, 1, 2)"
    assert d[4] == "184" and d[5] == "pass ×1, FAIL ×2"
    assert d[6] == "`runs/fast` (seed 0), `runs/slow` (seeds 1, 2)"
    unverified = _doc([("E", 0, 0.9, 0, "not verified: SolverError: clarabel failed")])
    assert _row("\n".join(combined_tables([unverified, _doc([("E", 1, 0.9, 0, "1e-9 (cvxpy: "
                                            "minimizer, pass)")])], ["a", "b"])), "E")[5] \
        == "pass ×1, not verified ×1"  # a reference that did not run is no pass
    cnn = _row(text, "CNN")
    assert cnn[1] == "96.0" and cnn[4] == "—" and cnn[5] == "—"
    assert _row(text, "POptEq")[1] == f"{statistics.mean([96.5, 96.7, 96.1]):.1f} ± " \
        f"{statistics.stdev([96.5, 96.7, 96.1]):.1f}"


def test_a_model_and_seed_in_two_runs_is_taken_from_the_first_run_on_the_page() -> None:
    a = _doc([("POptEq", 0, 0.90, 0, PASS)])
    b = _doc([("POptEq", 0, 0.50, 0, PASS), ("POptEq", 1, 0.70, 0, PASS)])
    c = _doc([("MLP", 0, 0.6, 0, "—")])
    text = "\n".join(combined_tables([a, b, c], ["runs/a", "runs/b", "runs/c"]))
    row = _row(text, "POptEq")
    assert row[2] == "90.0 / 70.0 (seeds 0, 1)"
    assert row[6] == "`runs/a` (seed 0), `runs/b` (seed 1)"


def test_no_combined_table_where_one_run_holds_every_row_or_the_trainings_differ() -> None:
    whole = _doc([("POptEq", s, 0.9, 0, PASS) for s in (0, 1, 2)])
    part = _doc([("POptEq", 1, 0.9, 0, PASS)], replace(CFG, seeds=(1,)))
    assert combined_tables([whole, part], ["runs/a", "runs/b"]) == []
    other = _doc([("MLP", 0, 0.6, 0, "—")], replace(CFG, lam=0.05))  # another training
    assert combined_tables([whole, other], ["runs/a", "runs/c"]) == []
    quick = _doc([("MLP", 0, 0.6, 0, "—")], replace(TableConfig.quick_config()))
    quick2 = _doc([("CNN", 0, 0.6, 0, "—")], replace(TableConfig.quick_config()))
    assert combined_tables([quick, quick2], ["q/a", "q/b"]) == []  # smoke runs: no evidence


def test_a_reproduction_section_shows_its_plots() -> None:
    root = Path(__file__).resolve().parents[2]
    doc = load(root / "docs" / "results" / "reproduce-30")
    lines = section(doc, ["results/reproduce-30/geq_compare.png"])
    assert "![geq compare](results/reproduce-30/geq_compare.png)\n" in lines
