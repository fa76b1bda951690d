"""Console reports fit 100 columns: ``convex-eq verify`` tables wrap long cells and notes."""

from __future__ import annotations

from pathlib import Path

import pytest

from convex_eq_app.cli import main
from verify.report import TABLE_WIDTH, console_table

ROOT = Path(__file__).resolve().parents[1]
MODELS = str(ROOT / "examples" / "models.py")


def test_console_table_wraps_every_cell_and_note() -> None:
    long_word = "Z" * 250  # no space to break at: split inside the word
    text = console_table(
        [("quantity", "value", "tolerance", "verdict"),
         ("a quantity with a rather long descriptive name", "word " * 60, "≤ 1e-8", "ok"),
         ("short", long_word, "(approximate by design)", "info")],
        caps=(32, None, 14, 7), notes=["note: " + "long note " * 40])
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= TABLE_WIDTH
    joined = "".join(lines)
    assert joined.count("Z") == 250 and "approximate" in joined and "(local" not in joined
    assert lines[1].startswith("-" * 32 + "  ")  # header rule under the capped first column


@pytest.mark.parametrize("spec,extra", [
    (f"{MODELS}:opteq_l1", ["--gradients"]),  # gradient rows, a modified-minimizer note
    (f"{MODELS}:geq", []),                     # local reference: the longest provenance
    (f"{MODELS}:deep2", []),                   # Theorem 2/3 rows
])
def test_verify_output_fits_100_columns(spec: str, extra: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", spec, "--batch", "2", *extra]) == 0
    lines = capsys.readouterr().out.splitlines()
    too_wide = [line for line in lines if len(line) > TABLE_WIDTH]
    assert not too_wide, too_wide
    assert any(line.startswith("passed") for line in lines)
