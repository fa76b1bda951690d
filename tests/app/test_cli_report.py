"""Console reports fit 100 columns: ``convex-eq verify`` tables wrap long cells and notes."""

from __future__ import annotations

from pathlib import Path

import pytest

from convex_eq_app.cli import main
from verify.report import TABLE_WIDTH, console_table

ROOT = Path(__file__).resolve().parents[2]
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


def test_to_cvxpy_names_the_variable_after_the_user_symbols() -> None:
    import convex_eq as ce
    from convex_eq import models

    phi = models.opteq(n=3, m=3, d=2, activation="relu", form="canonical", seed=0)
    ex = phi.to_cvxpy(x=[0.1, 0.2])
    assert [v.name() for v in ex.problem.variables()] == ["z"]
    assert "@ z" in str(ex.problem) and "@ f" not in str(ex.problem)
    z, w = ce.State("z", 3), ce.State("w", 2)
    ex = (ce.SqNorm(z) + ce.L1(z) + ce.SqNorm(w)).to_cvxpy()
    assert ex.variable.name() == "[z; w]" and set(ex.blocks) == {"z", "w"}
