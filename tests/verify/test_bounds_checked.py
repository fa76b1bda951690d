"""verify checks the certified bounds (docs/theory.md §9.6): the error bound against tight float64
solves, the Lipschitz bound against pairs of nearby inputs (random and the Jacobian's top
direction), the certified radius against a projected-gradient attack — and each check fails
when the bound it checks is made wrong (a halved contraction factor, a halved Lipschitz
constant, an attack allowed beyond the radius)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowering
from convex_eq import models
from lowering.runtime import bounds
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings
from verify.bounds import attack_certified, check_error_bound, check_lipschitz

F64 = torch.float64


def _x(m: lowering.EquilibriumModule, b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, m.derived.inputs[0].size, dtype=F64, generator=g)


@pytest.mark.parametrize("obj", [models.opteq(), models.deep_opteq(), models.mon()],
                         ids=["opteq", "deep", "mon"])
def test_error_and_lipschitz_bounds_pass_their_checks(obj: object) -> None:
    m = lowering.lower(obj).torch_module(dtype=F64)
    rep = check_error_bound(m, _x(m, 100))
    assert rep.passed, rep.summary()
    assert rep.ratios().size >= 30 and float(torch.tensor(rep.ratios()).median()) <= 10.0
    lip = check_lipschitz(m, _x(m, 8, seed=1), directions=2, power_iters=4)
    assert lip.passed, lip.summary()
    assert lip.observed.max() > 0.1 * lip.bound[0]  # the pairs probe the bound


def test_a_halved_contraction_factor_fails_the_error_check(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    m = lowering.lower(models.opteq()).torch_module(dtype=F64)
    x = _x(m, 100)
    declared = bounds.declared_contraction

    def halved(derived: object, env: object) -> bounds.Factor:
        f = declared(derived, env)
        return bounds.Factor(0.5 * f.value, f.formula)

    monkeypatch.setattr(bounds, "declared_contraction", halved)
    bounds._CACHE.clear()  # (constants are cached per weight version)
    rep = check_error_bound(m, x)
    assert not rep.passed and len(rep.failures) >= 10, rep.summary()


def test_a_halved_contraction_factor_fails_the_lipschitz_check(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    # Lip(x ↦ z*) = Lip_x(T)/(1 − L): with L halved the bound drops ~3× at L = 0.81
    m = lowering.lower(models.opteq(conv=(4, 3), image=(1, 12))).torch_module(dtype=F64)
    x = _x(m, 6, seed=2)
    assert check_lipschitz(m, x, directions=2, power_iters=6).passed
    bounds._CACHE.clear()
    declared = bounds.declared_contraction
    monkeypatch.setattr(bounds, "declared_contraction", lambda d, env: bounds.Factor(
        0.5 * declared(d, env).value, "halved"))
    rep = check_lipschitz(m, x, directions=2, power_iters=6)
    assert not rep.passed, rep.summary()


def _trained_classifier() -> tuple[EquilibriumClassifier, torch.Tensor]:
    """A small conv OptEq classifier fitted for a few steps to a separable toy problem (two
    Gaussian clusters per class of 12-sample signals), so that radii are not all 0."""
    g = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(3, 1, 12, generator=g, dtype=F64)
    y = torch.arange(90) % 3
    x = centers[y] + 0.3 * torch.randn(90, 1, 12, generator=g, dtype=F64)
    torch.manual_seed(0)
    s = TrainingSettings(dtype=F64, tol=1e-8, max_iter=100, lipschitz_target=2.0)
    clf = EquilibriumClassifier(lowering.lower(models.opteq(conv=(4, 3), image=(1, 12))), s,
                                pool="max", pooled=4, classes=3)
    opt = torch.optim.Adam(clf.parameters(), lr=2e-2)
    for _ in range(30):
        loss = nn.functional.cross_entropy(clf(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return clf, x[:40]


def test_attack_inside_the_certified_radius_changes_no_prediction() -> None:
    clf, x = _trained_classifier()
    rep = attack_certified(clf, x, steps=50, restarts=3)
    assert rep.attacked >= 20, rep.summary()
    assert int(rep.changed.sum()) == 0, rep.summary()
    # the same attack beyond the certificate (30× each radius) does change predictions: it
    # is strong enough for its silence inside the radius to mean something
    far = attack_certified(clf, x, steps=50, restarts=3, scale=30.0)
    assert int(far.changed.sum()) > 0, far.summary()

