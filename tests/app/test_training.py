"""The shared training loop (``convex_eq_app.training.fit``): when the held-out accuracy is
measured and that the measured number is the model's."""

from __future__ import annotations

import math
import warnings

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


def _equilibrium_model(**settings: object) -> nn.Module:
    import lowering
    from convex_eq import models
    from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

    torch.manual_seed(0)
    return EquilibriumClassifier(lowering.lower(models.opteq(conv=(2, 3), image=(1, 1, 8))),
                                 TrainingSettings(**settings), pooled=2, classes=2,
                                 input_shape=(1, 1, 8))


def test_tol_schedule_sets_each_epochs_tolerance_geometrically() -> None:
    res = fit(_equilibrium_model(), _data(),
              TrainConfig(epochs=3, batch=32, tol_schedule=(1e-2, 1e-4)), "opteq")
    # start·(end/start)^(e/(E−1)), e = 0, 1, 2: 1e-2, 1e-3, 1e-4
    assert [h["tol"] for h in res.history] == pytest.approx([1e-2, 1e-3, 1e-4], rel=1e-12)


def test_jacobian_regularisation_reports_its_penalty_and_trains() -> None:
    model = _equilibrium_model()
    res = fit(model, _data(), TrainConfig(epochs=2, batch=32, jacobian_reg=0.5), "opteq")
    pens = [h["jacobian"] for h in res.history]
    assert all(math.isfinite(p) and p > 0 for p in pens)
    plain = fit(_equilibrium_model(), _data(), TrainConfig(epochs=1, batch=32), "opteq")
    assert "jacobian" not in plain.history[0]


@pytest.mark.parametrize("bad, match", [
    ({"jacobian_reg": -1.0}, "jacobian_reg"), ({"jacobian_reg": float("nan")}, "jacobian_reg"),
    ({"tol_schedule": (1e-2,)}, "tol_schedule"), ({"tol_schedule": (0.0, 1e-4)}, "tol_schedule"),
])
def test_bad_speed_options_are_refused(bad: dict, match: str) -> None:
    with pytest.raises(OptionError, match=match):
        fit(_equilibrium_model(), _data(), TrainConfig(epochs=1, **bad), "opteq")


@pytest.mark.parametrize("option", [{"jacobian_reg": 0.1}, {"tol_schedule": (1e-2, 1e-4)}])
def test_speed_options_are_refused_for_a_model_without_a_solve(option: dict) -> None:
    with pytest.raises(OptionError, match="applies to an EquilibriumClassifier"):
        fit(nn.Sequential(nn.Flatten(), nn.Linear(8, 2)), _data(),
            TrainConfig(epochs=1, **option), "linear")


def test_the_tolerance_schedule_leaves_the_module_its_own_tolerance() -> None:
    import lowering
    from convex_eq import models
    from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings

    torch.manual_seed(0)
    model = EquilibriumClassifier(lowering.lower(models.opteq(conv=(2, 3), image=(1, 1, 8))),
                                  TrainingSettings(tol=1e-6), pooled=2, classes=2,
                                  input_shape=(1, 1, 8))
    res = fit(model, _data(), TrainConfig(epochs=2, batch=32, tol_schedule=(1e-2, 1e-3)), "opteq")
    assert [h["tol"] for h in res.history] == pytest.approx([1e-2, 1e-3], rel=1e-12)
    assert model.eq.tol == 1e-6


def test_unconverged_held_out_samples_are_counted_per_epoch_and_warned_once() -> None:
    """One iteration cannot reach a relative residual of 1e-12 from z = 0, so every one of the
    32 held-out samples is unconverged in every evaluation: counted over all four batches of 8
    (not per batch, not the last batch only) and reported by one warning, not one per batch."""
    from convex_eq.errors import ConvergenceWarning

    model = _equilibrium_model(max_iter=1, tol=1e-12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fit(model, _data(), TrainConfig(epochs=2, batch=32, eval_batch=8), "capped")
    assert [h["test_unconverged"] for h in res.history] == [32, 32]
    assert all(h["test_max_residual"] > 1e-12 for h in res.history)
    conv = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert len(conv) == 1 and "32/32 held-out samples" in str(conv[0].message)
    assert "max_iter (now 1)" in str(conv[0].message)


def test_a_converged_evaluation_counts_no_unconverged_sample_and_warns_nothing() -> None:
    from convex_eq.errors import ConvergenceWarning

    model = _equilibrium_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fit(model, _data(), TrainConfig(epochs=1, batch=32, eval_batch=8), "opteq")
    assert res.history[-1]["test_unconverged"] == 0
    assert res.history[-1]["test_max_residual"] <= model.eq.tol
    assert not [w for w in caught if issubclass(w.category, ConvergenceWarning)]


def test_an_unrolled_layer_is_warned_about_its_k_steps_not_an_iteration_cap() -> None:
    """backward='unroll' runs exactly K plain steps: 2 steps cannot reach tol = 1e-12 from
    z = 0, and the one warning names K, never max_iter (which does not apply)."""
    from convex_eq.errors import ConvergenceWarning

    model = _equilibrium_model(backward="unroll", tol=1e-12)
    model.eq.config.backward.unroll_steps = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fit(model, _data(), TrainConfig(epochs=1, batch=32, eval_batch=8), "unrolled")
    assert res.history[-1]["test_unconverged"] == 32
    conv = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)
            and "held-out" in str(w.message)]
    assert len(conv) == 1 and "K = 2 unrolled steps" in conv[0] and "max_iter" not in conv[0]
