"""``convex-eq certified --quick``: the MNIST-1D certified-accuracy row in its smoke version —
the certificate holds against the attack (no prediction inside a certified radius changes),
certified accuracy is clean accuracy at radius 0 and falls with the radius, and the Lipschitz
target declared for training holds at the trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from convex_eq_app.cli import main


def test_certified_row_smoke(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    assert main(["certified", "--quick", "--out", str(tmp_path), "--radii", "0", "0.1",
                 "0.3"]) == 0
    assert torch.get_num_threads() == threads  # the run restores the caller's setting
    res = json.loads((tmp_path / "certified.json").read_text())
    assert "attack success in radius" in (tmp_path / "certified.md").read_text()
    names = [r["name"] for r in res["rows"]]
    assert names == ["conv OptEq", "MON"]
    for r in res["rows"]:
        assert r["attack_changed"] == 0 and r["attacked"] > 0
        cert = [r["certified"][k] for k in ("0", "0.1", "0.3")]
        # radius 0 certifies every correct prediction whose margin beats its solve's error
        assert cert[0] <= r["clean"] and cert[0] >= r["clean"] - 0.05
        assert cert[0] >= cert[1] >= cert[2]
        assert 0.0 < r["lipschitz"] <= res["config"]["lipschitz_target"]
