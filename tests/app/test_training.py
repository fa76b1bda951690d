"""The shared training loop (``convex_eq_app.training.fit``): when the held-out accuracy is
measured and that the measured number is the model's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from convex_eq.errors import OptionError
from convex_eq_app.data import Dataset
from convex_eq_app.training import TrainConfig, fit


def _data() -> Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 1, 8, generator=g)
    y = (x.sum((1, 2)) > 0).long()
    return Dataset("toy", x[:64], y[:64], x[64:], y[64:])


def test_eval_every_measures_every_nth_epoch_and_the_last() -> None:
    data = _data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 2))
    res = fit(model, data, TrainConfig(epochs=5, batch=16, eval_every=2), "linear")
    measured = [not math.isnan(h["test_acc"]) for h in res.history]
    assert measured == [False, True, False, True, True]
    # the final accuracy is the trained model's, counted here by hand
    with torch.no_grad():
        hand = (model(data.x_test).argmax(1) == data.y_test).double().mean().item()
    assert res.accuracy == pytest.approx(hand, abs=0.0)  # the same 32 predictions, counted


def test_eval_every_below_one_is_refused() -> None:
    with pytest.raises(OptionError, match="eval_every"):
        fit(nn.Linear(8, 2), _data(), TrainConfig(epochs=1, eval_every=0), "linear")
