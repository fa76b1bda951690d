"""Smoke test of ``convex-eq bench --quick``: outputs written and well-formed (no timing checks)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cvxpylayers")
pytest.importorskip("torchdeq")
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.run import CASES, add_parser, build_parser, main  # noqa: E402

REQUIRED = {
    "qp": ("module", "hand", "cvxpylayers"),
    "solvers": ("plain", "anderson", "broyden", "torchdeq-anderson"),
    "train": ("module", "torchdeq", "torchdeq m=5 lam=1e-8"),
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """One ``--quick`` run (single thread: immune to OpenMP stalls on a busy 2-core machine)."""
    out = tmp_path_factory.mktemp("bench")
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    try:
        rc = main(["--quick", "--threads", "1", "--out", str(out), "--quiet"])
    finally:
        torch.set_num_threads(threads)
    return rc, out


def _finite_or_none(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and (not isinstance(x, float)
                                                          or math.isfinite(x)))


def test_quick_run_succeeds(quick_run: tuple[int, Path]) -> None:
    rc, out = quick_run
    data = json.loads((out / "bench.json").read_text())
    errors = {k: data[k] for k in data if k.endswith("_error")}
    assert rc == 0, errors
    assert not errors


def test_json_is_complete(quick_run: tuple[int, Path]) -> None:
    _, out = quick_run
    data = json.loads((out / "bench.json").read_text())  # strict JSON: NaN would be rejected
    for case in CASES:
        assert case in data, case
    info = data["machine"]
    for key in ("date", "versions", "torch_threads", "cpu_count", "calibration"):
        assert key in info
    assert info["versions"]["torch"] and info["versions"]["cvxpy"]
    rows = data["qp"]["rows"]
    assert rows and all(r["batch"] in data["config"]["batches"] for r in rows)
    for r in rows:
        for method in REQUIRED["qp"]:
            m = r[method]
            assert len(m["fwd_times"]) >= 1 and len(m["fwdbwd_times"]) >= 1
            assert all(t > 0 for t in m["fwd_times"] + m["fwdbwd_times"])
            assert m["z_err"] < 1e-3 and m["grad_err"] < 1e-3
        assert r["module"]["converged"] and r["ref_kkt_failures"] == 0
        assert r["speedup_fwdbwd"] > 0 and r["overhead_fwdbwd"] > 0
    solvers = {r["solver"] for r in data["solvers"]["rows"]}
    assert set(REQUIRED["solvers"]) <= solvers
    assert data["solvers"]["deq"]
    assert {r["model"] for r in data["cost"]["rows"]} >= {"opteq (canonical)", "mopteq"}
    assert all("lower_s" in r for r in data["cost"]["rows"])
    mem = {r["method"]: r for r in data["memory"]["rows"]}
    assert "implicit" in mem and any(k.startswith("unroll") for k in mem)
    assert all(r["graph_bytes"] > 0 and r["peak_bytes"] > 0 for r in mem.values())
    lim = data["limit"]["rows"]
    assert lim and all(min(r["times_s"].values()) > 0 for r in lim)
    # every method solves the same float32 QP to tol 1e-6 (condition ≤ 1/(1 − 0.81)): its z and
    # ∂ℓ/∂q agree with the plain hand loop far inside 1e-3
    assert all(max(r["rel_diff_vs_hand_plain"].values()) < 1e-3 for r in lim)
    tr = data["train"]
    assert tr["device"] == "cpu" and tr["threads"] == 1 and tr["have_torchdeq"]
    assert set(tr["methods"]) == set(REQUIRED["train"])
    for m in tr["methods"].values():
        assert len(m["times"]) == len(m["losses"]) == len(m["rows"]) == tr["steps"] >= 2
        assert all(t > 0 for t in m["times"]) and m["first_s"] > 0 and m["last_s"] > 0
        assert all(r["fwd_iters"] >= 1 and r["bwd_iters"] >= 1 for r in m["rows"])
    # same initial weights and the same first batch, both solved to relative residual 1e-4 on a
    # layer whose weight control keeps ||W||₂ ≤ 0.98 (state error ≤ 1e-4 / 0.02 = 5e-3
    # relative): the cross-entropy of 10 classes at the start moves far less than 1e-2 (measured
    # ~2e-6); a torchdeq side on another layer or other weights differs by O(0.1) or more
    assert tr["first_loss_diff"] < 1e-2
    # quick mode has no B = 256 cell: the eleven targets (the compiled-module, fixed-cost and
    # weight-control ones included) without the B = 256 one, and the grid's information row
    # (module plain / hand plain)
    assert len(data["targets"]) == 12
    assert any("weight_control=None per training step" in t["target"] for t in data["targets"])
    assert sum(t["met"] is None and t["target"].startswith("(information)")
               for t in data["targets"]) == 1
    assert any("torch.compile" in t["target"] for t in data["targets"])
    for t in data["targets"]:
        assert t["met"] in (True, False, None)

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)):
            assert _finite_or_none(x)

    walk(data)


def test_markdown_tables(quick_run: tuple[int, Path]) -> None:
    _, out = quick_run
    md = (out / "bench.md").read_text()
    for title in ("## Targets", "## 1. OptEq hidden QP", "## 2. Overhead", "## 3. Solvers",
                  "## 4. Lowering and verify cost", "## 5. Memory", "## 6. Training"):
        assert title in md
    lines = md.splitlines()
    pipe = re.compile(r"(?<!\\)\|")
    tables = 0
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            ncol = len(pipe.findall(lines[i]))
            j = i + 2
            assert j < len(lines) and lines[j].startswith("|"), "table without rows"
            while j < len(lines) and lines[j].startswith("|"):
                assert len(pipe.findall(lines[j])) == ncol, lines[j]
                j += 1
            tables += 1
            i = j
        else:
            i += 1
    assert tables >= 7


def test_subcommand_parser() -> None:
    import argparse

    p = argparse.ArgumentParser(prog="convex-eq")
    sub = p.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = p.parse_args(["bench", "--quick", "--out", "x", "--only", "qp"])
    assert args.quick and args.out == "x" and args.only == ["qp"] and callable(args.func)
    assert build_parser().parse_args([]).threads == 1
    assert build_parser().parse_args([]).device == "cpu"


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "tpu", "meta"])
def test_device_error(device: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A device torch cannot run the benchmarks on stops the run before any case, with a
    message naming the device and what to use instead (exit status 2, nothing written)."""
    torch = pytest.importorskip("torch")
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = main(["--quick", "--device", device, "--out", str(tmp_path / "out"), "--only", "train"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--device {device!r}" in err and "cpu" in err
    if device.startswith("cuda"):
        assert "no CUDA device" in err
    assert not (tmp_path / "out").exists()


def test_train_without_torchdeq(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchdeq the training case times the module alone and says so."""
    import torch

    from benchmarks import common, train
    from benchmarks.report import markdown, targets

    monkeypatch.setitem(sys.modules, "torchdeq", None)  # ``import torchdeq`` raises ImportError
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cfg = common.Config.make(True)
        cfg.train_steps, cfg.train_window = 2, 1
        res = train.run(cfg, lambda msg: None)
    finally:
        torch.set_num_threads(threads)
    assert not res["have_torchdeq"] and set(res["methods"]) == {"module"}
    assert "not installed" in res["torchdeq_note"]
    assert len(res["methods"]["module"]["times"]) == 2
    full = {"machine": common.machine_info(1), "config": {"quick": True}, "train": res}
    vs = [t for t in targets(full) if "steps/s of torchdeq" in t["target"]]
    assert vs and vs[0]["met"] is None and "not installed" in vs[0]["measured"]
    assert "torchdeq is not installed" in markdown(full)


@pytest.mark.parametrize("use_plan", [True, False])
def test_torchdeq_side_is_the_same_layer(use_plan: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training case's torchdeq classifier computes the module's logits and weight
    gradients (float64, both solved far below the compared tolerance), with the layer's plan and
    with the node tree's T."""
    import copy

    import torch

    import lowering
    from benchmarks.train import TorchDEQClassifier
    from convex_eq_app.demo import DemoConfig, objectives
    from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

    demo = DemoConfig.quick_config()
    derived = lowering.lower(objectives(demo)["OptEq"])
    settings = TrainingSettings(tol=1e-10, max_iter=400, dtype=torch.float64)
    torch.manual_seed(0)
    model = EquilibriumClassifier(derived, settings, pool=demo.pool, pooled=demo.pooled)
    deq = TorchDEQClassifier(copy.deepcopy(model), 1e-10, 400, 1e-10, 800)
    if not use_plan:
        from lowering.runtime.plan import PLANNERS

        monkeypatch.setitem(PLANNERS, type(derived.nodes["z"]), lambda node, ctx: None)
    x = torch.randn(8, 1, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(8) % 10
    grads = []
    for m in (model, deq):
        m.train()
        m.zero_grad()
        logits = m(x)
        torch.nn.functional.cross_entropy(logits, y).backward()
        grads.append((logits.detach(), {n.removeprefix("model."): p.grad.clone()
                                        for n, p in m.named_parameters()}))
    assert deq.used == ("plan" if use_plan else "T")
    (lm, gm), (ld, gd) = grads
    assert set(gm) == set(gd)
    # both solve the same contraction (‖W‖₂ ≤ 0.98 under weight control) to relative residual
    # 1e-10 in float64, forward and adjoint: states agree to ~1e-8 relative, far inside 1e-6 on
    # any CPU/BLAS; a torchdeq side on another map or other weights would differ at O(1)
    assert torch.allclose(lm, ld, rtol=1e-6, atol=1e-9)
    for n in gm:
        assert torch.allclose(gm[n], gd[n], rtol=1e-6, atol=1e-9), n


def test_select_device() -> None:
    import torch

    from benchmarks.common import select_device

    assert select_device("cpu") == torch.device("cpu")
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_case_process_that_fails_is_reported(tmp_path: Path) -> None:
    """A case runs in its own interpreter; when that process dies before writing its result,
    the case is reported as failed with the exit status (not silently missing)."""
    import argparse

    from benchmarks.run import _run_case_isolated

    args = argparse.Namespace(threads=1, seed=0, quick=True, quiet=True)
    got = _run_case_isolated("no-such-case", args, "cpu")  # the child's parser exits with 2
    assert "result" not in got
    assert "exited with status 2" in got["error"]
