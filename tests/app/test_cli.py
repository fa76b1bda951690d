"""Command line: derive / verify / errors (one line naming the step, a hint, exit 2), defaults
shown in every --help, output paths checked before any work, FILE without NAME listed."""

from __future__ import annotations

import argparse
import ast
import logging
import re
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
    (["verify", MODELS], "defines 0 objectives or models and no NAME was given"),
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
    md = tmp_path / "report.md"
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


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from convex_eq_app.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _option_help(help_text: str, flag: str) -> str:
    """The help entry of option ``flag`` (its flags and text), whitespace collapsed."""
    section = help_text.split("\noptions:\n", 1)[1]
    for entry in re.split(r"\n(?=  -)", section):
        flags = entry.strip().splitlines()[0].split("  ")[0]
        if re.search(rf"(?<![\w-]){re.escape(flag)}\b", flags):
            return " ".join(entry.split())
    raise AssertionError(f"{flag} not in the help")


@pytest.mark.parametrize("command", ["derive", "verify", "tour", "demo", "train-table",
                                     "reproduce", "results"])
def test_help_shows_every_default(command: str) -> None:
    """Every option that takes a value says its default in --help: argparse's "(default: X)"
    or, where the default depends on --quick, the text states both."""
    sub = _subparsers()[command]
    text = sub.format_help()
    for action in sub._actions:
        if not action.option_strings or action.nargs == 0 or action.dest == "help":
            continue  # flags (store_true) are off unless given
        if action.required:
            continue
        para = _option_help(text, action.option_strings[-1])
        assert "default" in para, f"{command} {action.option_strings}: {para!r}"


def test_help_defaults_are_the_configurations() -> None:
    """What --help states is what runs: the values come from the configurations the commands
    build (an independent read of the dataclasses here)."""
    from convex_eq_app.configs import Budget, DemoConfig, TableConfig

    subs = _subparsers()
    table = subs["train-table"].format_help()
    assert (f"(default {TableConfig().epochs}; --quick: {TableConfig.quick_config().epochs})"
            in _option_help(table, "--epochs"))
    assert f"(default: {TableConfig().workers})" in _option_help(table, "--workers")
    assert f"--quick: {TableConfig.quick_config().channels}" in _option_help(table, "--channels")
    demo = subs["demo"].format_help()
    assert f"(default {DemoConfig().epochs};" in _option_help(demo, "--epochs")
    assert f"(default: {DemoConfig().seed})" in _option_help(demo, "--seed")
    assert "(default: convex_eq_out)" in _option_help(demo, "--out")
    repro = subs["reproduce"].format_help()
    assert f"(default {Budget.full().epochs}; --quick: {Budget.quick_budget().epochs})" in \
        _option_help(repro, "--epochs")
    assert "(default 0 1 2;" in _option_help(repro, "--seed")
    assert "(default: cpu)" in _option_help(repro, "--device")


@pytest.mark.parametrize("command", ["demo", "train-table", "reproduce"])
def test_commands_that_train_take_the_pytorch_options(command: str) -> None:
    sub = _subparsers()[command]
    flags = {f for a in sub._actions for f in a.option_strings}
    assert {"--seed", "--epochs", "--out", "--device", "--quick", "--no-progress"} <= flags


def test_derive_file_without_name_lists_its_factories(capsys: pytest.CaptureFixture[str]) -> None:
    """The listing names exactly the file's public top-level functions (read from its syntax
    tree here, independently of the loader), each with its docstring's first line."""
    tree = ast.parse(Path(MODELS).read_text())
    expected = {n.name: ast.get_docstring(n).splitlines()[0] for n in tree.body
                if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    assert len(expected) == 5
    assert main(["derive", MODELS]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert set(listed) == set(expected)
    for name, summary in expected.items():
        assert "factory" in listed[name] and summary in listed[name]
    assert f"convex-eq derive {MODELS}:NAME" in out


def test_listing_loads_neither_torch_nor_the_lowering_pass() -> None:
    code = ("import sys; from convex_eq_app.cli import main; main(['derive', sys.argv[1]]); "
            "print(sorted(m for m in ('torch', 'lowering', 'cvxpy', 'sympy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, MODELS], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_derive_file_with_one_objective_derives_it(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    one = tmp_path / "one.py"
    one.write_text("from convex_eq import models\nphi = models.opteq(n=4, m=4, d=2, seed=0)\n")
    assert main(["derive", str(one)]) == 0
    assert "derivation:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["verify", f"{MODELS}:opteq_relu", "--markdown", "{missing}/r.md"],
    ["demo", "--quick", "--out", "{missing}/out"],
    ["train-table", "--quick", "--out", "{missing}/out"],
    ["reproduce", "--quick", "--out", "{missing}/out"],
    ["results", "--from", "{missing}", "--out", "{missing}/results.md"],
])
def test_output_path_in_a_missing_folder_is_a_typed_error(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before any work: one line naming the option, exit 2, nothing created."""
    missing = tmp_path / "no" / "such"
    args = [a.replace("{missing}", str(missing)) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "no").exists()


def test_output_path_errors_are_typed(tmp_path: Path) -> None:
    from convex_eq.errors import ConvexEqError
    from convex_eq_app.errors import OutputPathError, output_dir, output_file

    with pytest.raises(OutputPathError, match="does not exist") as e:
        output_dir(tmp_path / "a" / "b")
    assert isinstance(e.value, ConvexEqError) and e.value.term == "--out"
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputPathError, match="is a file"):
        output_dir(tmp_path / "f")
    with pytest.raises(OutputPathError, match="is a folder"):
        output_file(tmp_path, "--markdown")
    assert output_dir(tmp_path / "new").is_dir()  # one level is made, like mkdir


def test_verify_markdown_states_provenance_and_columns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "r.md"
    assert main(["verify", f"{MODELS}:opteq_relu", "--markdown", str(md)]) == 0
    text = md.read_text()
    head = text.split("| quantity |")[0]
    for field in ("- date: ", "- commit: ", "- versions: ", "- machine: ", "- command: "):
        assert field in head, field
    assert f"`convex-eq verify {MODELS}:opteq_relu --markdown {md}`" in head
    cols = re.findall(r"^- \*\*(.+?)\*\*:", head, flags=re.M)
    table_heads = [h.strip() for line in text.splitlines() if line.startswith("| # ")
                   for h in line.strip("|").split("|")]
    for h in ("rel. error", "gap", "residual", "stationarity", "ref. status"):
        assert h in table_heads and h in cols


@pytest.mark.parametrize("value", ["0", "-2", "three"])
def test_an_anderson_memory_below_one_is_a_usage_error(value: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train-table", "--quick", "--anderson-m", value])
    assert e.value.code == 2
    assert "--anderson-m" in capsys.readouterr().err
