"""``convex-eq reproduce``: the quick mode runs every claim end to end and writes its table
(with the power columns), plots and JSON; ``--from-table`` reuses a finished table's runs and
refuses one trained differently; the claims' models are the table's, at its size; the
objective-derived perturbation is checked on its own.  The power rule: test_reproduce_power.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from convex_eq.errors import OptionError
from convex_eq_app import reproduce
from convex_eq_app.cli import main
from convex_eq_app.configs import Budget, TableConfig
from convex_eq_app.errors import CLIError
from convex_eq_app.reproduce import from_table
from convex_eq_app.reproduce.models import build
from convex_eq_app.reproduce.power import VERDICTS, Verdict
from convex_eq_app.reproduce.registry import CLAIMS, EXPERIMENTS, Claim, register_claim, run
from convex_eq_app.training import n_params

POWER_HEADER = ("| claim | paper, table/figure | paper's number | paper effect | measured here | "
                "difference | SE | MDD | verdict |")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("reproduce")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        res = reproduce.run(out, quick=True, log=lambda s: None,
                            argv=["reproduce", "--quick"])
    res["stderr"] = err.getvalue()
    return res, out


def test_quick_report_says_its_verdicts_are_not_evidence_and_states_provenance(
        quick: tuple) -> None:
    _, out = quick
    md = (out / "reproduce.md").read_text()
    head = md.split("| claim |")[0]
    assert "Smoke run (`--quick`)" in head and "its verdicts are not evidence" in head
    for field in ("- date: ", "- commit: ", "- versions: ", "- machine: ",
                  "- command: `convex-eq reproduce --quick`"):
        assert field in head, field
    assert re.search(r"Seeds: 0 .*1 epochs.*1 torch thread\(s\).*wall time \d+ s", head), head
    # the machine's load at the start is in the provenance header, not in the setup paragraph
    assert re.search(r"^- machine: .*load average [0-9.]+ at the start", head, flags=re.M), head
    defined = re.findall(r"^- \*\*(.+?)\*\*:", md, flags=re.M)
    assert set(reproduce.COLUMNS) <= set(defined)


def test_quick_json_records_seeds_wall_time_load_threads_and_command(quick: tuple) -> None:
    _, out = quick
    data = json.loads((out / "results.json").read_text())
    assert data["kind"] == "reproduce" and data["budget"]["quick"] is True
    assert data["budget"]["seeds"] == [0] and data["budget"]["epochs"] == 1
    env = data["environment"]
    assert env["seconds"] > 0 and env["torch_threads"] == 1 and len(env["load_start"]) == 3
    assert data["provenance"]["command"] == "convex-eq reproduce --quick"
    assert data["power"] == {"alpha": 0.05, "power": 0.8}


def test_quick_run_shows_progress_and_saves_every_trained_model(quick: tuple) -> None:
    res, out = quick
    data = json.loads((out / "results.json").read_text())
    assert len(list((out / "checkpoints").glob("*.pt"))) == len(data["runs"])
    assert re.search(r"reproduce: 100%.* (\d+)/\1 \[", res["stderr"]), res["stderr"][-1500:]


def test_quick_run_verifies_every_trained_equilibrium_layer(quick: tuple) -> None:
    _, out = quick
    data = json.loads((out / "results.json").read_text())
    ver = data["environment"]["verification"]
    assert set(ver) == set(data["runs"])
    # only the CNN has no equilibrium layer; each other run names its reference and verdict
    checked = {k: v for k, v in ver.items() if "CNN" not in k}
    assert checked and all(re.search(r"\((cvxpy|local|[^:]+): .+\)$", v) for v in
                           checked.values()), checked
    assert "Verification of the trained layers:" in (out / "reproduce.md").read_text()


def test_quick_mode_judges_every_claim_with_the_power_columns(quick: tuple) -> None:
    res, out = quick
    assert set(res["verdicts"]) == set(CLAIMS)
    for key, v in res["verdicts"].items():
        assert v.holds in VERDICTS, key
        # one seed: no spread, so nothing is decided (never a yes or no from one seed)
        assert v.holds == "not resolvable here (one seed)", key
        assert v.measured.strip() and v.difference != "—", key
    md = (out / "reproduce.md").read_text()
    assert POWER_HEADER in md
    table = md.split(POWER_HEADER)[1].split("\n\n")[0].strip().splitlines()[1:]
    assert len(table) == len(CLAIMS)
    for row in table:  # nine cells: pipes inside a cell (||z||) must be escaped
        assert len(re.split(r"(?<!\\)\|", row)) == 11, row
    for png in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_gamma_curve_is_scaled_to_the_measured_patch_norm_and_has_the_papers_rule(
        quick: tuple) -> None:
    from convex_eq_app.reproduce.geq import C_GRID, GEQ

    res, _ = quick
    ms = res["measurements"]["kerdeq_gamma"]
    m = ms["median_M"]
    assert m > 0 and ms["c"] == list(C_GRID) == [0.02, 0.2, 2.0, 20.0]
    # γ is stored to 4 significant digits: 5e-4 relative
    assert ms["gamma"] == pytest.approx([c / m for c in C_GRID], rel=5e-4)
    runs = EXPERIMENTS["kerdeq_gamma"].runs(Budget.quick_budget())
    assert {r.model for r in runs} == {"GEQ (multi-branch, fixed γ)", GEQ}


# ----------------------------------------------------------------------------- models
def _same(a: object, b: object) -> bool:
    """Equal state: tensors bit for bit, dicts (extra state) key by key, the rest by ==."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_a_table_model_name_builds_the_tables_model() -> None:
    from convex_eq_app import table

    cfg = Budget.quick_budget().table_config()
    for name in ("conv OptEq", "POptEq", "CNN (same #params)"):
        ours, _ = build(name, cfg, (1, 40), 1)
        torch.manual_seed(1)
        theirs = table.build(name, cfg, (1, 40), 1)
        assert _same(dict(ours.state_dict()), dict(theirs.state_dict())), name


def test_every_full_run_has_the_conv_opteqs_parameter_count() -> None:
    """Every model the full reproduction trains (the table's and the claims' variants) has
    the conv OptEq's parameter count to within 5 %: channels are integers, and one channel per
    branch moves the multi-branch models by about 3 % at this size (POptEq: 8930 against 9130)."""
    from convex_eq_app.reproduce.geq import GEQ

    budget = Budget.full()
    cfg = budget.table_config()
    target = n_params(build("conv OptEq", cfg, (1, 40), 0)[0])
    seen = {}
    # the γ curve's runs differ only in γ, which sets no parameter: one γ stands for them (its
    # runs() measures M on every training signal, minutes on a busy machine)
    curve = [run("GEQ (multi-branch, fixed γ)", 0, gamma=0.5), run(GEQ, 0)]
    for spec in curve + [s for k, exp in EXPERIMENTS.items() if k != "kerdeq_gamma"
                         for s in exp.runs(budget)]:
        if (spec.model, spec.params) not in seen:
            seen[spec.model, spec.params] = n_params(build(spec.model, cfg, (1, 40), 0,
                                                           **spec.kwargs)[0])
    assert len(seen) > 20
    off = {k: v for k, v in seen.items() if abs(v - target) > 0.05 * target}
    assert not off, (target, off)


def test_bad_model_parameters_are_typed_errors_naming_the_option() -> None:
    cfg = Budget.quick_budget().table_config()
    with pytest.raises(OptionError, match="reg='l1'"):
        build("conv OptEq + R*_z", cfg, (1, 40), 0, reg="l3", reg_lambda=0.1)
    with pytest.raises(OptionError, match="takes no parameter"):
        build("conv OptEq", cfg, (1, 40), 0, widht=3)
    with pytest.raises(OptionError, match="unknown model"):
        build("ResNet", cfg, (1, 40), 0)


# ----------------------------------------------------------------------------- --from-table
def _record(folder: Path, cfg: TableConfig, rows: tuple[tuple[str, int], ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "checkpoints").mkdir(exist_ok=True)
    out = []
    for name, seed in rows:
        ckpt = f"checkpoints/{name}-seed{seed}.pt"
        (folder / ckpt).write_text(f"{folder.name}")  # which folder the reader opened
        out.append({"name": name, "seed": seed, "checkpoint": ckpt})
    (folder / "results.json").write_text(json.dumps(
        {"kind": "train-table", "config": asdict(cfg), "rows": out}))
    return folder


def test_from_table_refuses_a_table_trained_with_other_epochs(tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    folder = _record(tmp_path / "t", replace(cfg, epochs=30))
    with pytest.raises(CLIError) as err:
        from_table.load(folder, cfg)
    text = str(err.value)
    assert "epochs=30" in text and "epochs=10" in text and "--epochs 30" in text


def test_from_table_refuses_other_sizes_and_data_naming_each_field(tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    folder = _record(tmp_path / "t", replace(cfg, channels=16, dataset="mnist1d"))
    with pytest.raises(CLIError, match=r"channels=16.*dataset='mnist1d'") as err:
        from_table.load(folder, cfg)
    assert "train the table with the reproduction's config" in str(err.value)


def test_from_table_refuses_a_table_without_the_reproductions_seeds(tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    folder = _record(tmp_path / "t", replace(cfg, seeds=(0, 1)))
    with pytest.raises(CLIError, match=r"none of \[2\]") as err:
        from_table.load(folder, cfg)
    assert "--seed 0 1" in str(err.value)


def test_from_table_accepts_a_table_that_only_logged_its_test_accuracy_less_often(
        tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    folder = _record(tmp_path / "t", cfg)
    doc = json.loads((folder / "results.json").read_text())
    doc["config"]["eval_every"] = 5  # when the held-out accuracy is logged: not training
    (folder / "results.json").write_text(json.dumps(doc))
    assert from_table.load(folder, cfg).rows == {}


def test_from_table_reads_several_tables_as_one_and_opens_each_checkpoint_in_its_folder(
        tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    a = _record(tmp_path / "a", replace(cfg, seeds=(0, 1)), (("POptEq", 0), ("POptEq", 1)))
    b = _record(tmp_path / "b", replace(cfg, seeds=(2,), models=("POptEq",)),
                (("POptEq", 2),))
    runs = from_table.load([a, b], cfg)
    assert sorted(runs.rows) == [("POptEq", 0), ("POptEq", 1), ("POptEq", 2)]
    opened = {seed: runs.checkpoint(runs.row("POptEq", seed, cfg)).read_text()
              for seed in (0, 1, 2)}
    assert opened == {0: "a", 1: "a", 2: "b"}


def test_from_table_refuses_a_model_and_seed_trained_by_two_tables(tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    a = _record(tmp_path / "a", cfg, (("POptEq", 1),))
    b = _record(tmp_path / "b", replace(cfg, seeds=(1,)), (("POptEq", 1),))
    with pytest.raises(CLIError, match="POptEq seed 1 was trained by the tables in both") as err:
        from_table.load([a, b], cfg)
    assert str(a) in str(err.value) and str(b) in str(err.value)


def test_from_table_refuses_tables_that_together_lack_a_seed(tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    a = _record(tmp_path / "a", replace(cfg, seeds=(0,)))
    b = _record(tmp_path / "b", replace(cfg, seeds=(1,)))
    with pytest.raises(CLIError, match=r"the tables were trained with seeds \[0, 1\].*none of "
                       r"\[2\]"):
        from_table.load([a, b], cfg)


def test_from_table_refuses_a_second_table_trained_differently(tmp_path: Path) -> None:
    cfg = Budget.full().table_config()
    a = _record(tmp_path / "a", cfg)
    b = _record(tmp_path / "b", replace(cfg, lam=0.05))
    with pytest.raises(CLIError, match=rf"the table in {re.escape(str(b))} was trained with "
                       r"lam=0.05"):
        from_table.load([a, b], cfg)


def test_a_table_recorded_before_a_training_field_existed_reads_as_its_earlier_training(
        tmp_path: Path) -> None:
    """A record without ``anderson_m`` trained with the solver's own memory: it is the same
    training as ``anderson_m=None``, and not the same as a memory of 3."""
    cfg = Budget.full().table_config()
    folder = _record(tmp_path / "t", cfg)
    doc = json.loads((folder / "results.json").read_text())
    del doc["config"]["anderson_m"]
    (folder / "results.json").write_text(json.dumps(doc))
    assert from_table.load(folder, cfg).rows == {}
    with pytest.raises(CLIError, match="anderson_m=None.*anderson_m=3"):
        from_table.load(folder, replace(cfg, anderson_m=3))


def test_cli_takes_several_table_folders(tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    """Both folders reach the loader: the second one's missing record is the error."""
    _record(tmp_path / "a", Budget.quick_budget().table_config())
    assert main(["reproduce", "--quick", "--from-table", str(tmp_path / "a"),
                 str(tmp_path / "b"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"no results.json in {tmp_path / 'b'}" in err and "Traceback" not in err


def test_from_table_refuses_an_unfinished_table(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("")
    with pytest.raises(CLIError, match="did not finish"):
        from_table.load(tmp_path, Budget.full().table_config())


def test_cli_reports_a_bad_table_folder_in_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["reproduce", "--quick", "--from-table", str(tmp_path), "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--from-table" in err and "results.json" in err and "Traceback" not in err


def test_from_table_reuses_the_tables_runs_and_trains_only_the_rest(tmp_path: Path) -> None:
    """The quick table trains the four multi-branch rows; the fusion claims then train only the
    H-only variant and evaluate the table's checkpoints where a claim measures robustness."""
    from convex_eq_app import table

    models = ("POptEq", "MOptEq (H&D, paper's D)", "MOptEq (H&D, smoothed D)",
              "MOptEq (smoothed D) + PE")
    cfg = replace(Budget.quick_budget().table_config(), models=models)
    with contextlib.redirect_stderr(io.StringIO()):
        table.run(tmp_path / "table", cfg, progress=False, argv=["train-table", "--quick"])
        res = reproduce.run(tmp_path / "repro", quick=True, log=lambda s: None,
                            only=["mopteq_vs_popteq"], from_table=tmp_path / "table",
                            progress=False)
    data = json.loads((tmp_path / "repro" / "results.json").read_text())
    env = data["environment"]
    assert env["table_runs"] == 4 and env["trained_runs"] == 1
    rows = {r["name"]: r for r in json.loads((tmp_path / "table" / "results.json")
                                             .read_text())["rows"]}
    for key, metrics in data["runs"].items():
        name = next((m for m in models if f"'{m}'" in key), None)
        if name is not None:  # the table's accuracy and checkpoint, not a retrained one
            assert metrics["accuracy"] == rows[name]["accuracy"], key
            assert metrics["checkpoint"].endswith(rows[name]["checkpoint"]), key
    assert res["verdicts"]["mopteq_vs_popteq"].holds in VERDICTS


def test_a_resumed_run_keeps_the_checkpoint_its_first_invocation_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume`` reads a finished run from runs.jsonl: its metrics must still name the
    checkpoint the first invocation wrote, or results.json loses the trained weights' path."""
    from convex_eq_app.reproduce import runs

    def fake_train(spec: object, budget: object, state: dict) -> dict:
        state["w"] = torch.ones(2)  # the run's "trained weights"
        return {"accuracy": 0.5}

    monkeypatch.setattr(runs, "train_one", fake_train)
    budget = Budget.quick_budget()
    spec = run("MLP (same #params)", 0)
    first = runs.execute([spec], budget, log=lambda s: None, progress=False,
                         cache=runs.RunCache(tmp_path / "runs.jsonl", budget),
                         checkpoints=tmp_path)
    saved = first.by_key[spec.key]["checkpoint"]
    assert torch.equal(torch.load(tmp_path / saved)["w"], torch.ones(2))
    again = runs.execute([spec], budget, log=lambda s: None, progress=False,
                         cache=runs.RunCache(tmp_path / "runs.jsonl", budget),
                         checkpoints=tmp_path)
    assert again.origin[spec.key] == "resumed"
    assert again.by_key[spec.key]["checkpoint"] == saved


# ----------------------------------------------------------------------------- registry, CLI
def test_registering_a_claim_of_an_unknown_experiment_fails() -> None:
    with pytest.raises(OptionError, match="unknown experiment"):
        register_claim(Claim("x", "s", "p", "n", "c", "no_such_experiment",
                             lambda m: Verdict("", "yes")))


def test_derived_perturbation_is_the_worst_case_of_the_objective() -> None:
    """For the conv OptEq's linear injection, ``u + δ`` maximises ``G(z*; ·)`` over the ℓ∞ ball
    of radius ε around the layer input u, with ``z*`` held fixed: no random sign pattern of the
    same size gives a larger G (G is affine in u there, so its maximum is at the vertex the
    derivation picks)."""
    from convex_eq_app.reproduce.evaluators import derived_attack
    from lowering.perturbation import perturbation

    cfg = Budget.quick_budget().table_config()
    model, _ = build("conv OptEq", cfg, (1, 40), 0)
    model.eval()
    x = torch.randn(16, 1, 40, generator=torch.Generator().manual_seed(0))
    eps = 0.1
    eq = model.eq
    with torch.no_grad():
        u = model.prepare(x)
        up = derived_attack(model, x, eps)
        # |u' − u| = ε where ∇_u G ≠ 0 and 0 where it vanishes (no active unit reaches the
        # position); float32 rounding of u ± 0.1: 1e-6
        step = (up - u).abs()
        at_eps = (step - eps).abs() <= 1e-6
        assert bool((at_eps | (step <= 1e-6)).all()) and at_eps.float().mean() > 0.5
        z = eq(u).flatten(1)
        terms = perturbation(eq.derived.source, eps).terms
        block, inp = eq.blocks[0].name, eq.input_syms[0].name

        def g(v: torch.Tensor) -> torch.Tensor:
            return sum(t.value({block: z, inp: v.flatten(1)}, eq.env()) for t in terms)

        best = g(up)
        assert bool(torch.isfinite(best).all()) and bool((best > g(u)).all())
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            sign = torch.randint(0, 2, u.shape, generator=gen).float() * 2 - 1
            # G is affine in u: a random vertex is never above the derived one (1e-5
            # relative: float32 sums over the layer's entries)
            assert bool((g(u + eps * sign) <= best + 1e-5 * best.abs().clamp(min=1)).all())


def test_cli_lists_claims_and_rejects_an_unknown_one(capsys: pytest.CaptureFixture) -> None:
    assert main(["reproduce", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(k in listed for k in CLAIMS)
    assert main(["reproduce", "--only", "no_such_claim", "--out", "unused"]) == 2
    assert "no claim matches" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture,
                                              tmp_path: Path) -> None:
    assert main(["reproduce", "--quick", "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err
