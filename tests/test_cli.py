"""Command line: derive / verify / errors (one line + hint, non-zero exit, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from convex_eq.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODELS = str(ROOT / "examples" / "models.py")


def test_derive_prints_derivation_and_latex(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["derive", f"{MODELS}:opteq_l1"]) == 0
    out = capsys.readouterr().out
    assert "soft-threshold" in out and "claim: modified minimizer" in out
    assert main(["derive", f"{MODELS}:opteq_relu", "--latex"]) == 0
    assert "\\begin{array}" in capsys.readouterr().out


def test_verify_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", f"{MODELS}:opteq_relu"]) == 0
    assert "verified: minimizer" in capsys.readouterr().out
    assert main(["verify", f"{MODELS}:geq"]) == 0
    out = capsys.readouterr().out
    assert "stationary point" in out or "local minimizer" in out


@pytest.mark.parametrize("argv,needle", [
    (["derive", "missing.py"], "no such file"),
    (["derive", f"{MODELS}:nope"], "defines no 'nope'"),
    (["derive", MODELS], "objectives"),
])
def test_user_mistakes_are_one_line(argv: list[str], needle: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_console_script_help_and_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import convex_eq as ce\nz = ce.State('z', 3)\nobj = ce.L1(z) + 1/0\n")
    r = subprocess.run([sys.executable, "-m", "convex_eq.cli", "derive", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ZeroDivisionError" in r.stderr and "Traceback" not in r.stderr
    for cmd in ("derive", "verify", "demo", "bench", "tour"):
        h = subprocess.run([sys.executable, "-m", "convex_eq.cli", cmd, "--help"],
                           capture_output=True, text=True, timeout=120)
        assert h.returncode == 0 and "usage" in h.stdout
