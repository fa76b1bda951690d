"""``lowering.runtime.classifier``: the pooling head fits 1-row and 1-D states, branch features are
concatenated, the training settings reach the module (and choose weight control only where a
weight needs it), solver statistics are reported honestly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lowering
from convex_eq import Antiderivative, Constant, Input, SqNorm, State, Weight, models
from convex_eq.errors import ConvergenceWarning, OptionError
from convex_eq.models import opteq
from lowering.runtime.classifier import EquilibriumClassifier, StatsMeter, TrainingSettings


def _clf(image: tuple[int, ...], channels: int = 3, **kw) -> EquilibriumClassifier:
    return EquilibriumClassifier(lowering.lower(models.opteq(conv=(channels, 3), image=image)),
                                 **kw)


@pytest.mark.parametrize("image", [(1, 1, 12), (1, 12), (1, 6, 6)])
def test_head_fits_one_row_and_one_dimensional_states(image: tuple[int, ...]) -> None:
    clf = _clf(image, pooled=4)
    spatial = image[1:]
    expect = 3 * 4 ** sum(s > 1 for s in spatial)  # pooling never enlarges a 1-row axis
    assert clf.features_dim == expect
    out = clf(torch.randn(5, *image, generator=torch.Generator().manual_seed(0)))
    assert out.shape == (5, 10) and torch.isfinite(out).all()


def test_adaptive_max_pool_matches_2x2_max_pool_on_8x8() -> None:
    clf = _clf((1, 8, 8), pooled=4)
    with torch.no_grad():
        z = clf.features(torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)))
        assert torch.equal(clf.pooled_features(z), nn.MaxPool2d(2)(z).flatten(1))


def test_branch_features_are_concatenated() -> None:
    obj = models.mopteq(shapes=((2, 4, 4), (2, 2, 2)), d=8)
    clf = EquilibriumClassifier(lowering.lower(obj), pool="max", pooled=2)
    assert clf.features_dim == 2 * 2 * 2 + 2 * 2 * 2
    out = clf(torch.randn(3, 8, generator=torch.Generator().manual_seed(0)))
    assert out.shape == (3, 10)
    with pytest.raises(OptionError, match="unknown pool"):
        EquilibriumClassifier(lowering.lower(obj), pool="median")


def test_settings_reach_the_module() -> None:
    s = TrainingSettings(tol=3e-4, max_iter=7, backward_factor=3)
    clf = _clf((1, 6, 6), settings=s)
    assert clf.eq.tol == 3e-4 and clf.eq.max_iter == 7
    assert clf.eq.config.backward.max_iter == 21
    assert clf.eq.on_nonconvergence == "warn"
    # the conv OptEq certificate is conditional on ||W||₂ ≤ 1: weight control is on
    assert clf.eq.weight_control is not None


def test_solver_stats_of_forward_and_backward() -> None:
    clf = _clf((1, 6, 6))
    x = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(2))
    clf.reset_stats()
    loss = clf(x).square().sum()
    st = clf.solver_stats()
    assert st.forward is not None and st.backward is None  # no adjoint solve yet
    loss.backward()
    st = clf.solver_stats()
    assert st.backward is not None and st.backward.batch == 4
    fwd = clf.eq.last_stats
    assert st.forward.iterations == pytest.approx(float(fwd.iterations.double().mean()))
    assert st.forward.unconverged == 0 and st.forward.max_residual <= clf.eq.tol


def test_meter_counts_steps_stopped_at_the_cap() -> None:
    clf = _clf((1, 6, 6), settings=TrainingSettings(tol=1e-12, max_iter=2))
    meter = StatsMeter()
    x = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for _ in range(3):
            clf.reset_stats()
            clf(x).sum().backward()
            meter.update(clf.solver_stats())
    s = meter.summary()
    assert s["fwd_capped"] == 3 and s["bwd_capped"] == 3
    assert s["fwd_iters"] == 2 and s["fwd_max_residual"] > 1e-12


def test_classifier_settings_on_a_constant_condition() -> None:
    """A norm condition on a fixed ``Constant``: the classifier's training settings choose no
    weight control and the module builds; OptEq's weight-bearing condition is controlled.

    Pins: the settings chose spectral-norm control for the constant and refused to build."""
    z, x = State("z", 6), Input("x", 4)
    c0 = np.random.default_rng(0).normal(size=(6, 6))
    cmat = Constant("C", c0 / np.linalg.norm(c0, 2) * 0.9)
    u, b = Weight("U", (6, 4), seed=0), Weight("b", 6, np.zeros(6) + 0.1)
    fixed = lowering.lower(Antiderivative("relu", cmat @ z + u @ x + b).conjugate() - SqNorm(z))
    assert TrainingSettings().module_options(fixed)["weight_control"] is None
    fixed.torch_module(**TrainingSettings().module_options(fixed))
    trained = lowering.lower(opteq(n=6, m=6, d=3))
    assert TrainingSettings().module_options(trained)["weight_control"] == "spectral_norm"


def test_training_settings_pass_adjoint_options_only_to_a_backward_that_solves_one() -> None:
    """Phantom gradients get no adjoint cap (it would be refused as an ignored option) and an
    explicit adjoint solver with them is refused; the implicit backward gets both."""
    d = lowering.lower(models.opteq())
    opts = TrainingSettings(backward="phantom").module_options(d)
    assert "backward_max_iter" not in opts and "backward_solver" not in opts
    assert d.torch_module(**opts).config.backward.mode == "phantom"
    with pytest.raises(OptionError, match="backward_solver='plain' configures the adjoint"):
        TrainingSettings(backward="phantom", backward_solver="plain").module_options(d)
    opts = TrainingSettings(backward="implicit", backward_solver="plain",
                            max_iter=7).module_options(d)
    m = d.torch_module(**opts)
    assert (m.config.backward.solver, m.config.backward.max_iter) == ("plain", 14)
    opts = TrainingSettings(solver_options={"m": 2}).module_options(d)
    assert d.torch_module(**opts).config.forward.options == {"m": 2}
