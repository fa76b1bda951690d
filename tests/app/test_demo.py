"""Smoke test of the main demo (``convex-eq demo --quick``): every stage runs and writes output,
trains on MNIST-1D and logs solver statistics per epoch."""

from __future__ import annotations

import json
from pathlib import Path

from convex_eq_app.demo import run


def test_quick_demo_writes_report_and_plots(tmp_path: Path) -> None:
    out = run(out=tmp_path, quick=True, progress=False)
    names = [r.name for r in out["results"]]
    assert names[:4] == ["OptEq", "OptEq + ℓ1", "OptEq Moreau skip", "GEQ (Gaussian kernel)"]
    assert names[-1] == "MLP (same #params)"
    for f in ("report.md", "results.json", "training_curves.png", "residuals.png",
              "sparsity.png"):
        assert (tmp_path / f).stat().st_size > 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in data["results"])
    # every derived model was verified against its docs/theory.md §9 reference
    for r in out["results"][:4]:
        assert "cvxpy" in r.verification or "local" in r.verification
        # forward and adjoint solver statistics are logged per epoch
        assert {"fwd_iters", "bwd_iters", "fwd_capped", "bwd_capped"} <= set(r.history[0])
        assert r.history[0]["fwd_iters"] >= 1 and r.history[0]["bwd_iters"] >= 1
    assert "MNIST-1D" in (tmp_path / "report.md").read_text()
    print(f"quick demo: {out['total_seconds']:.1f} s")


def _untimed(h: dict) -> dict:
    return {k: v for k, v in h.items() if k != "seconds"}


def test_parallel_training_reproduces_in_process_training(tmp_path: Path) -> None:
    """Workers are spawned processes seeded like the in-process path: identical histories."""
    one = run(out=tmp_path / "one", quick=True, progress=False, workers=1)
    two = run(out=tmp_path / "two", quick=True, progress=False, workers=2)
    for a, b in zip(one["results"], two["results"]):
        assert a.name == b.name
        # bit-identical: same seeds, same single-threaded kernels (wall times aside)
        assert [_untimed(h) for h in a.history] == [_untimed(h) for h in b.history]
        assert a.accuracy == b.accuracy
