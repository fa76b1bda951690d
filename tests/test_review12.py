"""Review 12: regression tests for defects found in commits 9931b6b, 66e292d and f81bce0."""

from __future__ import annotations

from benchmarks.report import TARGETS, _train_targets


def test_drift_target_is_not_met_by_a_replay_that_did_not_repeat_the_run() -> None:
    """benchmarks/train.py documents that the interleaved replay "must repeat the run's
    iteration counts (``replay.iters_match``)": a replay whose steps did not repeat the run's
    forward/adjoint iterations measured another computation, so its ratio cannot be the verdict
    on the drift target.  ``_train_targets`` judges the replay's ratio whatever ``iters_match``
    says (here: no replayed step repeated the run, the sequential windows miss the target, and
    the report still says met)."""
    over = TARGETS["train_drift"] * 1.2
    tr = {"window": 50,
          "methods": {"module": {"first_s": 0.010, "last_s": 0.010 * over,
                                 "last_over_first": over}},
          "replay": {"first_s": 0.010, "last_s": 0.010, "last_over_first": 1.0,
                     "iters_match": 0.0, "starts": [0, 250]}}
    drift = _train_targets(tr)[0]
    assert drift["met"] is not True, drift
