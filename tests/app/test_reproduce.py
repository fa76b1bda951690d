"""``convex-eq reproduce``: the quick mode runs every claim end to end and writes its table,
plots and JSON; the verdict rules and the objective-derived perturbation are checked on their
own (both can fail: see the crafted cases)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from convex_eq_app import reproduce
from convex_eq_app.cli import main
from convex_eq_app.reproduce.registry import (
    CLAIMS,
    NO,
    NOT_MEASURED,
    WITHIN,
    YES,
    Claim,
    Stat,
    Verdict,
    decreasing,
    greater,
    register_claim,
)

VERDICTS = {YES, NO, WITHIN, NOT_MEASURED}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("reproduce")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        res = reproduce.run(out, quick=True, log=lambda s: None, seeds=[0], epochs=1,
                            argv=["reproduce", "--quick", "--seed", "0", "--epochs", "1"])
    res["stderr"] = err.getvalue()
    return res, out


def test_quick_report_states_provenance_smoke_and_columns(quick: tuple) -> None:
    _, out = quick
    md = (out / "reproduce.md").read_text()
    head = md.split("| claim |")[0]
    assert "Smoke run (`--quick`)" in head
    for field in ("- date: ", "- commit: ", "- versions: ", "- machine: ",
                  "- command: `convex-eq reproduce --quick --seed 0 --epochs 1`"):
        assert field in head, field
    defined = re.findall(r"^- \*\*(.+?)\*\*:", md, flags=re.M)
    assert {"claim", "paper, table/figure", "paper's number", "measured here",
            "holds?"} <= set(defined)
    data = json.loads((out / "results.json").read_text())
    assert data["kind"] == "reproduce" and data["provenance"]["command"].endswith("--epochs 1")


def test_quick_run_shows_progress_and_saves_every_trained_model(quick: tuple) -> None:
    res, out = quick
    data = json.loads((out / "results.json").read_text())
    trained = len(data["runs"])
    assert len(list((out / "checkpoints").glob("*.pt"))) == trained
    assert re.search(r"reproduce: 100%.* (\d+)/\1 \[", res["stderr"]), res["stderr"][-1500:]


def test_quick_mode_judges_every_claim_and_writes_the_report(quick: tuple) -> None:
    res, out = quick
    assert set(res["verdicts"]) == set(CLAIMS)
    for key, v in res["verdicts"].items():
        assert v.holds in VERDICTS, key
        assert v.measured.strip(), key
    md = (out / "reproduce.md").read_text()
    header = "| claim | paper, table/figure | paper's number | measured here | holds? |"
    assert header in md
    table = md.split(header)[1].split("\n\n")[0].strip().splitlines()[1:]
    assert len(table) == len(CLAIMS)
    for row in table:  # five cells: pipes inside a cell (||z||) must be escaped
        assert len(re.split(r"(?<!\\)\|", row)) == 7, row
    for png in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "results.json").read_text())
    assert data["budget"]["quick"] is True
    assert set(data["verdicts"]) == set(CLAIMS)


def test_greater_counts_a_difference_only_beyond_the_seed_spread() -> None:
    a, b = Stat.of([0.80, 0.82, 0.84]), Stat.of([0.70, 0.71, 0.72])
    assert greater(a, b) == YES
    assert greater(b, a) == NO
    close = Stat.of([0.79, 0.83, 0.87])  # mean 0.83, std 0.04: a − close = −0.01 within spread
    assert greater(a, close) == WITHIN
    one, other = Stat.of([0.5]), Stat.of([0.5])
    assert greater(one, other) == NO  # equal with one seed: not greater


def test_decreasing_needs_every_step() -> None:
    s = [Stat.of([v, v + 0.01, v - 0.01]) for v in (1.0, 0.5, 0.2)]
    assert decreasing(s) == YES
    assert decreasing([s[0], s[2], s[1]]) == NO


def test_registering_a_claim_of_an_unknown_experiment_fails() -> None:
    from convex_eq.errors import OptionError

    with pytest.raises(OptionError, match="unknown experiment"):
        register_claim(Claim("x", "s", "p", "n", "c", "no_such_experiment",
                             lambda m: Verdict("", YES)))


def test_reconstructed_perturbation_is_the_worst_case_of_the_objective() -> None:
    """For OptEq's linear injection, ``x − δ`` maximises ``G(z*; ·)`` over the ℓ∞ ball of
    radius ε around x, with ``z*`` held fixed: no random sign pattern of the same size gives a
    larger G (G is affine in x there, so the maximum is at the vertex the derivation picks)."""
    from convex_eq_app.reproduce.registry import Budget
    from convex_eq_app.reproduce.runs import MODELS, reconstructed_input
    from lowering.perturbation import perturbation

    torch.manual_seed(0)
    model = MODELS["opteq"]({}, Budget.quick_budget(), 0)
    model.eval()
    x = torch.randn(16, 40)
    eps = 0.1
    xp = reconstructed_input(model, x, eps)
    # |x' − x| = ε on every coordinate where ∇_x G ≠ 0 (float32 rounding of x ± 0.1: 1e-6)
    assert torch.allclose((xp - x).abs(), torch.full_like(x, eps), atol=1e-6)
    eq = model.eq
    # the terms of G that depend on x (the rest is constant in x at fixed z*)
    terms = perturbation(eq.derived.source, eps).terms
    with torch.no_grad():
        z = eq(x)

        def g(inp: torch.Tensor) -> torch.Tensor:
            return sum(t.value({"z": z, "x": inp}, eq.env()) for t in terms)

        best = g(xp)
        assert bool(torch.isfinite(best).all()) and bool((best > g(x)).all())
        for _ in range(20):
            sign = torch.randint(0, 2, x.shape).float() * 2 - 1
            # G is affine in x: a random vertex of the ball is never above the derived one
            # (1e-5 relative: float32 sums of 12 terms)
            assert bool((g(x + eps * sign) <= best + 1e-5 * best.abs().clamp(min=1)).all())


def test_cli_lists_claims_and_rejects_an_unknown_one(capsys: pytest.CaptureFixture) -> None:
    assert main(["reproduce", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(k in listed for k in CLAIMS)
    assert main(["reproduce", "--only", "no_such_claim", "--out", "unused"]) == 2
    assert "no claim matches" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture,
                                              tmp_path: object) -> None:
    assert main(["reproduce", "--quick", "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err
