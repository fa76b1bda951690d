"""Command line: derive / verify / errors (one line naming the step, a hint, exit 2)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from convex_eq_app.cli import main

ROOT = Path(__file__).resolve().parents[2]
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
    (["derive", "missing.py"], "convex-eq derive failed at step 'load': no such file: missing.py"),
    (["verify", "missing.py"], "convex-eq verify failed at step 'load': no such file: missing.py"),
    (["derive", f"{MODELS}:nope"], "models.py defines no 'nope'. Hint: name one of: opteq_relu"),
    (["derive", MODELS], "objectives"),
    (["verify", f"{MODELS}:opteq_relu", "--batch", "0"], "step 'random inputs': --batch must"),
])
def test_user_mistakes_are_one_line(argv: list[str], needle: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_console_script_help_and_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import convex_eq as ce\nz = ce.State('z', 3)\nobj = ce.L1(z) + 1/0\n")
    r = subprocess.run([sys.executable, "-m", "convex_eq_app", "derive", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ZeroDivisionError" in r.stderr and "Traceback" not in r.stderr
    assert "step 'load'" in r.stderr
    for cmd in ("derive", "verify", "demo", "bench", "tour"):
        h = subprocess.run([sys.executable, "-m", "convex_eq_app", cmd, "--help"],
                           capture_output=True, text=True, timeout=120)
        assert h.returncode == 0 and "usage" in h.stdout
        if cmd == "bench":  # forwarded to the benchmarks script of the source checkout
            assert "python -m benchmarks.run" in h.stdout


def test_verify_help_states_the_whole_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "verify its equilibrium at random" not in text  # the old first-line cut
    assert "CVXPY for DCP-exportable objectives" in text
    assert "exit code 0 if it passed, 1 otherwise." in text


def test_verbose_logs_each_step(caplog: pytest.LogCaptureFixture) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        assert main(["-v", "derive", f"{MODELS}:opteq_relu"]) == 0
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        caplog.clear()
        assert main(["derive", f"{MODELS}:opteq_relu"]) == 0
        quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    finally:
        root.setLevel(level)
    for name in ("load", "lower", "print"):
        assert any(m.startswith(f"step '{name}' done") for m in logged), logged
    assert quiet == []


def test_unknown_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["derive", MODELS, "--bogus"])
    assert e.value.code == 2 and "--bogus" in capsys.readouterr().err


def test_verify_markdown_embeds_its_plots(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "out" / "report.md"
    assert main(["verify", f"{MODELS}:opteq_relu", "--batch", "2", "--markdown", str(md)]) == 0
    assert f"markdown report written to {md}" in capsys.readouterr().out
    images = [line[line.index("(") + 1:-1] for line in md.read_text().splitlines()
              if line.startswith("![")]
    assert len(images) == 2  # residual history and layer-vs-reference scatter
    for name in images:  # relative links to PNGs written beside the report
        assert (md.parent / name).stat().st_size > 10_000


def test_bench_outside_a_source_checkout_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from convex_eq_app import cli

    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path / "benchmarks")  # as in a wheel install
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "failed at step 'find benchmarks'" in err and "not installed with the package" in err
