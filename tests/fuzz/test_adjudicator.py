"""The fuzz adjudicator (``tests/fuzz/adjudicate.py``) classifies verify FAILs correctly: a
broken layer is ``confirmed``, a correct layer with a FAIL is ``unconfirmed`` (a false alarm
is never silently counted as real), and the honest non-verdicts keep their classes.

Tolerances: the descent test needs a slope ≥ 1e-6·max(1, |G|) at steps ≥ 1e-5·scale; the
broken layers here are off their claim by ≥ 1e-3 (a slope ~1e-3), the correct ones by
float64 round-off (~1e-15): both far from the threshold whatever the BLAS or CPU.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch

import convex_eq as ce
import lowering
import verify
from convex_eq import models
from lowering.nodes import Combo, Var
from tests.fuzz.adjudicate import classify

T64 = torch.float64


def _x(b: int = 2) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(0).normal(size=(b, 4)), dtype=T64)


def _check(d, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify.check(d, x, starts=2, **kw)


def _perturbed(d, eps: float = 1e-3):
    (b,) = d.blocks
    return dataclasses.replace(d, nodes={b.name: Combo([(1.0, d.nodes[b.name]), (eps, Var(b))])})


def test_a_broken_layer_is_a_confirmed_violation() -> None:
    for act in ("relu", "tanh"):  # CVXPY and numeric references
        d = _perturbed(lowering.lower(models.opteq(n=6, m=6, d=4, activation=act, seed=0)))
        rep = _check(d, _x())
        assert not rep.passed
        assert classify(d, rep, {"x": _x()}) == "confirmed", rep


def test_a_false_alarm_on_a_correct_layer_is_unconfirmed() -> None:
    d = lowering.lower(models.opteq(n=6, m=6, d=4, activation="relu", seed=0))
    rep = _check(d, _x())
    assert rep.passed
    fake = dataclasses.replace(rep, failures=["relative error 3.6e-04 > 1e-06 (layer vs "
                                              "reference)"])
    assert classify(d, fake, {"x": _x()}) == "unconfirmed"


def test_honest_non_verdicts_keep_their_classes() -> None:
    d = lowering.lower(models.opteq(n=6, m=6, d=4, activation="relu", seed=0))
    rep = _check(d, _x(), solver_options={"solver": "CLARABEL", "max_iter": 2})
    assert classify(d, rep, {"x": _x()}) == "reference-failure", rep
    nc = lowering.lower(models.opteq(n=6, m=6, d=4, form="conjugate", weight_norm=1.3, seed=0))
    rep = _check(nc, _x())
    assert classify(nc, rep, {"x": _x()}) == "ill-posed", rep


def test_no_fixed_point_is_ill_posed_and_a_diverging_contraction_confirmed() -> None:
    z = ce.State("z", 3)
    one = ce.Constant("one", np.ones(3))
    obj = ce.Objective([ce.Potential("relu", z), ce.SqNorm(z), -ce.Linear(one, z),
                        -ce.SqNorm(z) * 10.0])  # z ← relu(1 + 10z): no fixed point
    d = lowering.lower(obj)
    rep = _check(d, {})
    assert rep.label == "equilibrium not found"
    assert classify(d, rep, {}) == "ill-posed"
    lying = dataclasses.replace(d, contraction=dataclasses.replace(
        d.contraction, value_fn=lambda env: 0.5))  # a bound that claims a contraction
    assert classify(lying, rep, {}) == "confirmed"
