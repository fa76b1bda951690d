"""``convex-eq train-table`` (quick mode): every model of the MNIST-1D table builds, trains, is
verified after training, and the baselines match the equilibrium model's parameter count."""

from __future__ import annotations

import contextlib
import io
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from convex_eq_app import table as T
from convex_eq_app.training import n_params


@pytest.mark.parametrize("target", [400, 3000, 20000])
def test_baselines_match_the_parameter_count(target: int) -> None:
    # 10 %: the widths are integers; near 400 parameters one channel more changes the count by
    # about 10 %
    assert abs(n_params(T.mlp_with(target)) - target) <= 0.1 * target
    assert abs(n_params(T.cnn_with(target)) - target) <= 0.1 * target


@pytest.fixture(scope="module")
def quick_table(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    """The smoke run in this process, its progress bar captured."""
    cfg = T.TableConfig.quick_config()
    cfg.workers = 1
    out = tmp_path_factory.mktemp("table")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        res = T.run(out, cfg, progress=True, argv=["train-table", "--quick"])
    return res, out, err.getvalue()


def test_quick_table_trains_and_verifies_every_model(quick_table: tuple) -> None:
    out, tmp_path = quick_table[0], quick_table[1]
    cfg = T.TableConfig.quick_config()
    names = [r.name for r in out["rows"]]
    assert names == list(T.DEFAULT_MODELS)
    for r in out["rows"]:
        assert 0.0 <= r.result.accuracy <= 1.0 and len(r.result.history) == cfg.epochs
        if r.name in T.EQ_MODELS:
            assert r.result.history[0]["fwd_iters"] >= 1
            assert r.result.verification.endswith("pass)"), (r.name, r.result.verification)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["quick"] and len(data["rows"]) == len(names)
    text = (tmp_path / "table.md").read_text()
    assert "CNN (published by the MNIST-1D authors) | 94" in text
    assert len((tmp_path / "epochs.jsonl").read_text().splitlines()) == len(names) * cfg.epochs


def test_quick_table_report_says_smoke_run_and_defines_its_columns(quick_table: tuple) -> None:
    text = (quick_table[1] / "table.md").read_text()
    head = text.split("| model |")[0]
    assert "Smoke run (`--quick`)" in head and "must not be compared with published" in head
    for field in ("- date: ", "- commit: ", "- versions: ", "- machine: ",
                  "- command: `convex-eq train-table --quick`"):
        assert field in head, field
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    defined = re.findall(r"^- \*\*(.+?)\*\*:", text, flags=re.M)
    for c in columns:  # "test acc. (%)" is defined as "acc. (%)" (test or validation)
        assert any(c.endswith(d) for d in defined), c


def test_quick_table_shows_progress(quick_table: tuple) -> None:
    err = quick_table[2]
    epochs = len(quick_table[0]["rows"]) * T.TableConfig.quick_config().epochs
    assert re.search(rf"train-table: 100%.*{epochs}/{epochs} \[", err), err[-1500:]


def test_checkpoints_reproduce_the_reported_accuracies(quick_table: tuple) -> None:
    """Each saved ``state_dict`` loaded into a freshly built model gives the reported test
    accuracy (recomputed here from the checkpoint alone; eval mode on one thread is
    deterministic, so the count is exact)."""
    res, out, _ = quick_table
    cfg = T.TableConfig.quick_config()
    data = T.table_data(cfg)
    for r in res["rows"]:
        model = T.build(r.name, cfg, data.shape, r.seed)
        model.load_state_dict(torch.load(out / res["checkpoints"][(r.name, r.seed)]))
        model.eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            correct = int((model(data.x_test).argmax(1) == data.y_test).sum())
        assert correct / len(data.y_test) == r.result.accuracy, r.name


def test_device_resolution() -> None:
    from convex_eq.errors import OptionError
    from convex_eq_app.training import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_and_verification_on_cuda() -> None:
    from convex_eq_app.training import TrainConfig, fit, verify_layer

    cfg = T.TableConfig.quick_config()
    data = T.table_data(cfg)
    for name in ("conv OptEq", "MOptEq (smoothed D) + PE", "GEQ (multi-branch, paper's γ)"):
        model = T.build(name, cfg, data.shape, 0)
        res = fit(model, data, TrainConfig(epochs=1, device="cuda", shift=2), name)
        assert next(model.parameters()).device.type == "cuda"
        assert res.history[0]["fwd_iters"] >= 1
        assert verify_layer(model, data.x_test, 1).endswith("pass)")


@pytest.mark.parametrize(("every", "epochs", "said"), [
    (1, 3, "after every epoch"),
    (6, 6, "after the last epoch only"),
    (5, 12, "after epoch(s) 5, 10, 12 only"),
])
def test_the_table_says_when_the_held_out_accuracy_was_measured(every: int, epochs: int,
                                                                 said: str) -> None:
    from convex_eq_app.configs import TableConfig
    from convex_eq_app.results import mnist1d_table

    cfg = {**TableConfig(epochs=epochs, eval_every=every).__dict__, "workers": 2}
    row = {"name": "MLP (same #params)", "seed": 0, "accuracy": 0.5, "params": 100,
           "mean_iterations": float("nan"), "nonconvergence": [0, 0], "train_time": 1.0,
           "verification": "—", "history": []}
    assert said in mnist1d_table([row], cfg, 10.0, 2)


def test_the_table_shows_iterations_per_training_step_and_the_levers_used() -> None:
    from convex_eq_app.configs import TableConfig
    from convex_eq_app.results import mnist1d_table

    cfg = {**TableConfig(epochs=2, jacobian_reg=0.25, tol_schedule=(1e-2, 1e-4),
                         warm_start=True).__dict__, "workers": 1}

    def row(seed: int, fwd: float, bwd: float) -> dict:
        last = {"epoch": 2, "fwd_iters": fwd, "bwd_iters": bwd}
        return {"name": "conv OptEq", "seed": seed, "accuracy": 0.5, "params": 100,
                "mean_iterations": 9.0, "nonconvergence": [0, 0], "train_time": 1.0,
                "verification": "—", "history": [{"epoch": 1, "fwd_iters": 99.0,
                                                   "bwd_iters": 99.0}, last]}

    text = mnist1d_table([row(0, 8.0, 6.0), row(1, 10.0, 7.0)], cfg, 10.0, 2)
    line = next(t for t in text.splitlines() if t.startswith("| conv OptEq |"))
    assert "| 9.0 / 6.5 |" in line  # the last epoch's means (8, 10) and (6, 7), over the seeds
    assert ("trained with warm starts from each signal's equilibrium of the epoch before; "
            "Jacobian regularisation γ = 0.25; tolerance schedule 0.01 → 0.0001") in text
    plain = mnist1d_table([row(0, 8.0, 6.0)], {**TableConfig(epochs=2).__dict__,
                                                "workers": 1}, 10.0, 2)
    assert "trained with" not in plain


def test_a_table_run_with_levers_is_titled_by_them() -> None:
    from convex_eq_app.configs import TableConfig
    from convex_eq_app.results import section

    def doc(**levers: object) -> dict:
        cfg = {**TableConfig(epochs=1, **levers).__dict__, "workers": 1}
        return {"kind": "train-table", "config": cfg, "rows": [], "wall_seconds": 1.0,
                "cpus": 2, "columns": {}, "provenance": {"date": "d", "commit": "c",
                                                         "versions": {}, "machine": {},
                                                         "command": "convex-eq train-table"}}

    assert section(doc())[0] == "## The seed models on MNIST-1D (`convex-eq train-table`), 1 epoch"
    assert section(doc(warm_start=True, tol_schedule=(1e-2, 1e-4)))[0].endswith(
        "— with warm starts, tolerance schedule 0.01 → 0.0001")


def test_levers_a_row_cannot_take_are_refused_before_training() -> None:
    from convex_eq.errors import OptionError

    cfg = T.TableConfig.quick_config()
    cfg.models, cfg.warm_start = ("conv OptEq", "GEQ (multi-branch, fixed γ)"), True
    with pytest.raises(OptionError, match=r"GEQ \(multi-branch, fixed γ\): .*not certified "
                                          "convex") as err:
        T.check_levers(cfg)
    assert "conv OptEq:" not in str(err.value)  # its equilibrium is certified unique
    cfg.models = ("conv OptEq",)
    T.check_levers(cfg)
    cfg.warm_start, cfg.backward_solver = False, "no-such-solver"
    with pytest.raises(OptionError, match="unknown solver 'no-such-solver'"):
        T.check_levers(cfg)
    cfg.backward, cfg.backward_solver = "phantom", "auto"  # no adjoint solve to configure
    with pytest.raises(OptionError, match="applies to the implicit gradient"):
        T.check_levers(cfg)


def test_the_anderson_memory_reaches_every_equilibrium_row_and_names_the_run() -> None:
    """``--anderson-m`` is the forward solver's memory in every equilibrium row of the loop
    (the convex rows and GEQ, built apart), none in the CNN, and the run's title says so."""
    from convex_eq_app.results import _lever_names

    cfg = T.TableConfig.quick_config()
    cfg.anderson_m = 3
    shape = T.table_data(cfg).shape
    for name in ("conv OptEq", "POptEq", "GEQ (multi-branch, paper's γ)"):
        model = T.build(name, cfg, shape, 0)
        assert model.eq.config.forward.solver == "anderson"
        assert model.eq.config.forward.options == {"m": 3}, name
    assert not hasattr(T.build("CNN (same #params)", cfg, shape, 0), "eq")
    assert _lever_names(cfg.__dict__) == " — with Anderson memory m = 3"
    cfg.anderson_m = None
    assert T.build("conv OptEq", cfg, shape, 0).eq.config.forward.options == {}


def test_the_lever_summary_compares_the_conv_opteq_rows_of_the_runs() -> None:
    from convex_eq_app.configs import TableConfig
    from convex_eq_app.results import lever_summary

    def hist(secs: list[float], fwd: float, bwd: float) -> list[dict]:
        return [{"epoch": e + 1, "seconds": s, "fwd_iters": fwd, "bwd_iters": bwd}
                for e, s in enumerate(secs)]

    def doc(rows: list[dict], **levers: object) -> dict:
        return {"kind": "train-table", "rows": rows,
                "config": {**TableConfig(epochs=3, eval_every=2, **levers).__dict__}}

    def row(name: str, acc: float, secs: list[float], fwd: float = 0.0, bwd: float = 0.0) -> dict:
        return {"name": name, "seed": 0, "accuracy": acc, "history": hist(secs, fwd, bwd)}

    # epochs 2 and 3 are evaluated (every 2, and the last): only epoch 1's seconds count
    base = doc([row("conv OptEq", 0.5, [3.0, 9.0, 9.0], 10.0, 8.0),
                row("CNN (same #params)", 0.7, [0.2, 5.0, 5.0])])
    fast = doc([row("conv OptEq", 0.6, [1.5, 9.0, 9.0], 5.0, 4.0)], tol_schedule=(1e-2, 1e-4))
    lines = lever_summary([base, fast], ["runs/a", "runs/b"])
    text = "\n".join(lines)
    assert "| `runs/a` | none (baseline) | 50.0 ± 0.0 | 10.00 / 8.00 | 3.00 | 15.0 |" in text
    assert "| `runs/b` | tolerance schedule 0.01 → 0.0001 | 60.0 ± 0.0 | 5.00 / 4.00 | 1.50 | — |" \
        in text
    assert lever_summary([base], ["runs/a"]) == []  # one run: nothing to compare
    other = doc([row("conv OptEq", 0.6, [1.5, 9.0, 9.0])])
    other["config"]["epochs"] = 4  # a different budget is not compared
    assert lever_summary([base, other], ["runs/a", "runs/c"]) == []
    # runs of two budgets: one table per budget, each with its own runs
    other_fast = doc([row("conv OptEq", 0.7, [1.0, 9.0, 9.0, 9.0])], warm_start=True)
    other_fast["config"]["epochs"] = 4
    text = "\n".join(lever_summary([base, other, fast, other_fast],
                                   ["runs/a", "runs/c", "runs/b", "runs/d"]))
    assert text.count("### Iteration levers") == 2
    first, second = text.split("### Iteration levers")[1:]
    assert "3 epochs" in first and "`runs/a`" in first and "`runs/b`" in first
    assert "4 epochs" in second and "`runs/c`" in second and "`runs/d`" in second
    assert "`runs/a`" not in second and "`runs/c`" not in first
