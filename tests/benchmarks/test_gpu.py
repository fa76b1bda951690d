"""The GPU command (``python -m benchmarks.gpu``): on a machine without CUDA it says so and
measures nothing; its report's header names the versions the run recorded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_says_so_and_measures_nothing(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu"
    assert gpu.main(["--out", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not out.exists()


def test_report_header_names_date_commit_device_and_torch_version() -> None:
    times = {"module": 0.012, "hand-plain": 0.015, "hand-anderson": 0.02, "torchdeq": 0.26}
    res = {"quick": False, "device": "NVIDIA H200", "command": "python -m benchmarks.gpu",
           "machine": {"date": "2026-11-27T08:30:27+00:00", "git": {"commit": "abc123"},
                       "versions": {"torch": "2.13.0"}},
           "module_vs_hand": {"m": 1024, "batch": 256, "times_s": times,
                              "module_over_hand": 0.8, "torchdeq_over_module": 21.6},
           "compiled": {"rows": []},
           "mnist1d": {"conv OptEq": {"epoch_s": 2.0}, "ratio": 10.5}}
    head = gpu.markdown(res).splitlines()[2]
    assert head.startswith("2026-11-27T08:30:27+00:00 · commit abc123 · NVIDIA H200")
    assert "torch 2.13.0" in head
