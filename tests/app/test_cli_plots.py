"""Demo and verify plots: the residual the solver returns, tolerance line, labelled zero bin."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import lowering
from convex_eq import models
from convex_eq_app import demo


def test_residual_trace_is_that_of_the_returned_iterate() -> None:
    phi = models.opteq(n=8, m=8, d=3, activation="relu", form="canonical", seed=0)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    traces = demo.residual_traces(lowering.lower(phi), {}, x)
    assert set(traces) == {"plain", "anderson", "broyden"}
    for tr in traces.values():
        assert tr.batch == 5 and len(tr.returned) == len(tr.last) >= 1
        # a running minimum per sample: never increases, never above the k-th iterate's mean
        assert np.all(np.diff(tr.returned) <= 0) and np.all(tr.returned <= tr.last)
        assert 0.0 <= tr.converged <= 1.0


def test_write_plots_and_report_sections(tmp_path: Path) -> None:
    one_epoch = demo.Result("OptEq", history=[{"epoch": 1, "loss": 1.5, "test_acc": 0.8}])
    returned = np.array([1.0, 1e-3, 1e-7])
    traces = {"broyden": demo.ResidualTrace(returned=returned, last=np.array([1.0, 1e-3, 1e-2]),
                                            iterations=3.0, converged=1.0, batch=4)}
    rng = np.random.default_rng(0)
    feats = np.where(rng.random(500) < 0.4, 0.0, rng.standard_normal(500)).astype(np.float32)
    files = demo.write_plots(tmp_path, [one_epoch], traces, {"OptEq": feats})
    assert files == ["training_curves.png", "residuals.png", "sparsity.png"]
    assert all((tmp_path / f).stat().st_size > 10_000 for f in files)
    text = demo._report(demo.DemoConfig.quick_config(), {}, [one_epoch], files, traces,
                        {"OptEq": feats}, 1.0)
    assert "| broyden | 3.0 | 100 % | 1.00e-07 |" in text  # the returned, not the last (1e-2)
    assert f"exactly zero {float((feats == 0).mean()):.3f}" in text
