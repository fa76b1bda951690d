"""``convex-eq train-table`` (quick mode): every model of the MNIST-1D table builds, trains, is
verified after training, and the baselines match the equilibrium model's parameter count."""

from __future__ import annotations

import json
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


def test_quick_table_trains_and_verifies_every_model(tmp_path: Path) -> None:
    cfg = T.TableConfig.quick_config()
    cfg.workers = 1
    out = T.run(tmp_path, cfg, progress=False)
    names = [r.name for r in out["rows"]]
    assert names == [*T.EQ_MODELS, T.MLP, T.CNN]
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
    for name in ("conv OptEq", "MOptEq (PE)", "GEQ (patch, channel split)"):
        model = T.build(name, cfg, data.shape, 0)
        res = fit(model, data, TrainConfig(epochs=1, device="cuda", shift=2), name)
        assert next(model.parameters()).device.type == "cuda"
        assert res.history[0]["fwd_iters"] >= 1
        assert verify_layer(model, data.x_test, 1).endswith("pass)")
