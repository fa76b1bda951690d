"""The training case's interleaved replay (benchmarks/train.py ``_replay``) with several
repetitions: the drift target's ratio is the ratio of the medians over every replayed step of
both windows, each repetition starts from fresh copies of the snapshots (so it repeats the
run's iteration counts), and each repetition's own ratio is reported."""

from __future__ import annotations

import statistics

import torch


def test_replay_repetitions_pool_their_steps_and_repeat_the_run() -> None:
    from benchmarks import common, train

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cfg = common.Config.make(True)
        cfg.train_steps, cfg.train_window, cfg.train_replays = 4, 2, 3
        res = train.run(cfg, lambda msg: None)
    finally:
        torch.set_num_threads(threads)
    rp = res["replay"]
    assert rp["reps"] == 3 and len(rp["rep_ratios"]) == 3
    assert len(rp["first_times"]) == len(rp["last_times"]) == 2 * 3
    # a repetition that went on from the previous one's weights would not repeat the run's
    # forward/adjoint iteration counts (Adam moved the weights): every step must
    assert rp["iters_match"] == 1.0
    assert rp["starts"] == [0, 2]
    # exact: the same floats divided the same way
    assert rp["last_over_first"] == (statistics.median(rp["last_times"])
                                     / statistics.median(rp["first_times"]))
