"""The main demo through the command line (``convex-eq demo --quick``): every stage runs and
writes its report, plots, JSON and checkpoints; the options reach the run; the report says where
its numbers come from and what each column means; training is the same in worker processes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

from convex_eq_app import demo
from convex_eq_app.cli import main
from convex_eq_app.demo import run


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``convex-eq demo --quick --epochs 2 --seed 1 --workers 1``, its stderr captured."""
    out = tmp_path_factory.mktemp("demo") / "out"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", "--quick", "--epochs", "2", "--seed", "1", "--workers", "1",
                     "--out", str(out)]) == 0
    return out, err.getvalue()


def test_quick_demo_writes_report_plots_and_checkpoints(cli_run: tuple[Path, str]) -> None:
    out, _ = cli_run
    data = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in data["results"]]
    assert names[:4] == ["OptEq", "OptEq + ℓ1", "OptEq Moreau skip",
                         "GEQ (multi-branch, paper's γ)"]
    assert names[-1] == "MLP (same #params)"
    for f in ("report.md", "training_curves.png", "residuals.png", "sparsity.png"):
        assert (out / f).stat().st_size > 0
    assert data["config"]["epochs"] == 2 and data["config"]["seed"] == 1  # the options arrive
    for r in data["results"]:
        assert 0.0 <= r["accuracy"] <= 1.0 and len(r["history"]) == 2
        assert (out / r["checkpoint"]).is_file()
    # every derived model was verified against its docs/theory.md §9 reference, and its
    # forward and adjoint solver statistics are logged per epoch
    # (the convex edits against CVXPY; the GEQ with the paper's γ, whose claim is a fixed point
    # of its iteration, by the iteration reference)
    reference = {"OptEq": "cvxpy", "OptEq + ℓ1": "cvxpy", "OptEq Moreau skip": "cvxpy",
                 "GEQ (multi-branch, paper's γ)": "iteration: fixed point of the iteration"}
    for r in data["results"][:4]:
        assert f"({reference[r['name']]}" in r["verification"] and "pass" in r["verification"]
        h = r["history"][0]
        assert h["fwd_iters"] >= 1
        if r["name"].startswith("GEQ"):  # phantom gradients: no adjoint solve to count
            assert math.isnan(h["bwd_iters"])
        else:
            assert h["bwd_iters"] >= 1


def test_checkpoint_reproduces_the_reported_accuracy(cli_run: tuple[Path, str]) -> None:
    """The saved ``state_dict`` loaded into a freshly built model classifies the test signals
    as the report says (recomputed here from the checkpoint alone: eval mode, one thread, the
    same deterministic kernels, so the count is exact)."""
    out, _ = cli_run
    data = json.loads((out / "results.json").read_text())
    cfg = demo.DemoConfig.quick_config()
    cfg.seed, cfg.epochs = 1, 2
    import lowering

    row = data["results"][0]
    model = demo.classifier("OptEq", lowering.lower(demo.objectives(cfg)["OptEq"]), cfg)
    model.load_state_dict(torch.load(out / row["checkpoint"]))
    test = demo.load_data(cfg)
    model.eval()
    with torch.no_grad():
        correct = int((model(test.x_test).argmax(1) == test.y_test).sum())
    assert correct / len(test.y_test) == row["accuracy"]


def test_report_states_provenance_columns_and_smoke(cli_run: tuple[Path, str]) -> None:
    out, _ = cli_run
    text = (out / "report.md").read_text()
    head = text.split("## Derived layers")[0]
    assert "Smoke run (`--quick`)" in head and "not results" in head
    for field in ("- date: ", "- commit: ", "- versions: ", "- machine: ", "- command: "):
        assert field in head, field
    assert "`convex-eq demo --quick --epochs 2 --seed 1 --workers 1 --out" in head
    assert "{" not in head  # no raw JSON configuration line
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    defined = re.findall(r"^- \*\*(.+?)\*\*:", text, flags=re.M)
    assert set(columns) <= set(defined)  # a line defines every column of the table


def test_progress_is_shown(cli_run: tuple[Path, str]) -> None:
    _, err = cli_run
    for name in ("OptEq", "GEQ (multi-branch, paper's γ)", "MLP (same #params)"):
        assert re.search(rf"{re.escape(name)}\s*: 100%", err), err[-2000:]


def _untimed(h: dict) -> dict:
    """The history row without its timing; NaN (not measured) as None, so rows compare."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in h.items() if k != "seconds"}


def test_parallel_training_reproduces_in_process_training(cli_run: tuple[Path, str],
                                                          tmp_path: Path) -> None:
    """Workers are spawned processes seeded like the in-process path: identical histories."""
    one = json.loads((cli_run[0] / "results.json").read_text())["results"]
    two = run(out=tmp_path / "two", quick=True, progress=False, workers=2, seed=1, epochs=2)
    for a, b in zip(one, two["results"]):
        assert a["name"] == b.name
        # bit-identical: same seeds, same single-threaded kernels (wall times aside)
        assert [_untimed(h) for h in a["history"]] == [_untimed(h) for h in b.history]
        assert a["accuracy"] == b.accuracy
