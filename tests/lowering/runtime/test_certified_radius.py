"""The certified ℓ2 radius of an equilibrium classifier and the Lipschitz target kept by weight
control (docs/theory.md §9.6), against independent references: the pooling constants against
dense SVDs of the pooling maps and the pairs that attain them, the radius against a numpy
transcription of its formula, the controlled Lipschitz bound against dense SVDs of the trained
weights' operators."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import lowering
from convex_eq import models
from convex_eq.errors import CertificateError
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings
from lowering.runtime.robustness import (
    injection_weights,
    lipschitz_weight_bounds,
    pool_lipschitz,
)

F64 = torch.float64


def _pool_matrix(layer: nn.Module, n: int) -> np.ndarray:
    """The (linear) pooling of one channel of length ``n`` as a dense matrix."""
    eye = torch.eye(n, dtype=F64)[:, None, :]
    return layer(eye)[:, 0, :].T.numpy()


@pytest.mark.parametrize(("n", "out"), [(40, 4), (40, 8), (10, 4), (7, 3), (5, 5)])
def test_max_pool_constant_is_attained_and_never_exceeded(n: int, out: int) -> None:
    layer = nn.AdaptiveMaxPool1d(out)
    lip = pool_lipschitz(nn.Sequential(layer, nn.Flatten()), (1, n))
    # attained: a unit spike at the most covered position moves every window that holds it
    best = max(float(torch.linalg.vector_norm(layer(torch.eye(n, dtype=F64)[i][None, None])))
               for i in range(n))
    # (square roots of small integers in float64: equal to the last bits)
    assert best == pytest.approx(lip, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2000, 1, n, generator=g, dtype=F64) for _ in range(2))
    ratio = (torch.linalg.vector_norm((layer(a) - layer(b)).flatten(1), dim=1)
             / torch.linalg.vector_norm((a - b).flatten(1), dim=1))
    assert float(ratio.max()) <= lip * (1 + 1e-12)
    assert (lip == 1.0) == (n % out == 0)  # non-overlapping windows: 1-Lipschitz


@pytest.mark.parametrize(("n", "out"), [(40, 4), (10, 4), (7, 3)])
def test_average_pool_constant_bounds_its_dense_svd(n: int, out: int) -> None:
    layer = nn.AdaptiveAvgPool1d(out)
    lip = pool_lipschitz(layer, (1, n))
    exact = np.linalg.svd(_pool_matrix(layer, n), compute_uv=False)[0]
    assert exact <= lip * (1 + 1e-12)  # (a 40-column SVD: round-off ~1e-15)
    if n % out == 0:
        assert lip == pytest.approx(exact, rel=1e-12) == pytest.approx(1 / math.sqrt(n // out))


def test_two_dimensional_pooling_multiplies_the_axes() -> None:
    layer = nn.AdaptiveMaxPool2d((2, 3))
    lip = pool_lipschitz(layer, (3, 5, 7))  # 5 → 2 and 7 → 3 overlap once each
    spike = torch.zeros(1, 1, 5, 7, dtype=F64)
    spike[0, 0, 2, 2] = 1.0  # covered by 2 windows per axis
    assert lip == pytest.approx(2.0) == pytest.approx(float(torch.linalg.vector_norm(
        layer(spike))))


def test_unknown_pooling_is_refused() -> None:
    with pytest.raises(CertificateError, match="no Lipschitz constant"):
        pool_lipschitz(nn.ReLU(), (1, 4))


def _classifier(obj: object, target: float | None = None, pool: str = "none"
                ) -> EquilibriumClassifier:
    s = TrainingSettings(dtype=F64, tol=1e-8, max_iter=200, lipschitz_target=target)
    return EquilibriumClassifier(lowering.lower(obj), s, pool=pool, pooled=4, classes=5)


def test_radius_is_the_margin_formula_transcribed() -> None:
    torch.manual_seed(0)
    clf = _classifier(models.opteq(n=12, m=12, d=6))
    x = torch.randn(40, 6, dtype=F64)
    cert = clf.certified_radius(x)
    with torch.no_grad():
        logits = clf(x).numpy()
    a = clf.fc.weight.detach().numpy()
    lip = clf.eq.lipschitz_bound()
    eps = clf.eq.error_bound().numpy()
    for i in range(len(x)):
        k = int(logits[i].argmax())
        r = min((logits[i, k] - logits[i, j] - np.linalg.norm(a[k] - a[j]) * eps[i])
                / (np.linalg.norm(a[k] - a[j]) * lip) for j in range(5) if j != k)
        # the same float64 arithmetic in another order: equal to round-off (~1e-15 relative)
        assert cert.radius[i].item() == pytest.approx(max(r, 0.0), rel=1e-9, abs=1e-15)
        assert cert.prediction[i].item() == k
    assert cert.lipschitz == lip and cert.pool_lipschitz == 1.0


def test_predictions_of_the_exact_classifier_hold_inside_the_radius() -> None:
    # the exact equilibrium (tight float64 solves) at random points of the certified ball
    from verify.bounds import tight_outputs

    torch.manual_seed(1)
    clf = _classifier(models.opteq(n=12, m=12, d=6))
    x = torch.randn(30, 6, dtype=F64)
    cert = clf.certified_radius(x)
    assert bool((cert.radius > 0).any())
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        d = torch.randn(x.shape, generator=g, dtype=F64)
        d = d / torch.linalg.vector_norm(d, dim=1, keepdim=True) * cert.radius[:, None]
        z, _ = tight_outputs(clf.eq, x + d)
        with torch.no_grad():
            pred = clf.fc(z).argmax(1)
        assert bool((pred == cert.prediction).all())


def _dense_norm(op: object, env: dict[str, torch.Tensor]) -> float:
    return float(np.linalg.svd(op.matrix(env), compute_uv=False)[0])  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["conv OptEq", "MON"])
def test_lipschitz_target_is_kept_through_training(kind: str) -> None:
    obj = (models.opteq(conv=(4, 3), image=(1, 12)) if kind == "conv OptEq"
           else models.mon(conv=(4, 3), image=(1, 12)))
    target = 0.7
    clf = _classifier(obj, target, pool="max")
    opt = torch.optim.SGD(clf.parameters(), lr=5.0)  # large steps push the norms up
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 12, generator=g, dtype=F64), torch.randint(0, 5, (32,), generator=g)
    for _ in range(3):
        loss = nn.functional.cross_entropy(clf(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    d, env = clf.eq.derived, {k: v.detach() for k, v in clf.eq.env().items()}
    ops = {n: op for op, n in injection_weights(d)}
    u = _dense_norm(ops["U"], env)
    if kind == "conv OptEq":
        w_op = next(t for t in d.source.terms if "W" in str(t)).args[0].entries[0].op
        w = _dense_norm(w_op, env)
        reference = u / (1 - w * w)  # L_σ = 1: ||U||/(1 − ||W||²)
    else:
        reference = u / 0.5  # ||U||/m with the MON's margin m = 0.5
    # the certified norms are the dense SVDs raised by 8·max(m, n)·2⁻⁵³ (≤ 1e-12 here)
    assert reference <= clf.eq.lipschitz_bound() * (1 + 1e-9)
    assert clf.eq.lipschitz_bound() <= target


def test_lipschitz_weight_bounds_meet_the_target_at_the_bounds() -> None:
    d = lowering.lower(models.opteq(conv=(4, 3), image=(1, 12)))
    b = lipschitz_weight_bounds(d, target=2.0, contraction_target=0.25)
    # transcription: ||W||² = 0.25 and ||U||/(1 − 0.25) = 2
    assert b["W"] ** 2 == pytest.approx(0.25, rel=1e-6)
    assert b["U"] == pytest.approx(1.5, rel=1e-6)
    with pytest.raises(CertificateError, match="must be > 0"):
        lipschitz_weight_bounds(d, target=-1.0)


def test_a_target_no_weight_control_can_keep_is_refused() -> None:
    # GEQ's kernel weight W moves Lip(T) with no norm condition of its own to bound it
    with pytest.raises(CertificateError, match=r"\['W'\] move the layer's Lipschitz"):
        lipschitz_weight_bounds(lowering.lower(models.geq()), target=1.0)


def test_contraction_target_without_a_lipschitz_target_is_refused() -> None:
    from convex_eq.errors import OptionError

    s = TrainingSettings(contraction_target=0.3)
    with pytest.raises(OptionError, match="only together with a lipschitz_target"):
        s.module_options(lowering.lower(models.opteq()))


def test_a_stem_without_a_derived_constant_is_refused() -> None:
    s = TrainingSettings(dtype=F64)
    clf = EquilibriumClassifier(lowering.lower(models.opteq(n=12, m=12, d=6)), s, pool="none",
                                classes=5, stem=nn.Linear(6, 6, dtype=F64))
    with pytest.raises(CertificateError, match="a stem before the layer"):
        clf.certified_radius(torch.randn(3, 6, dtype=F64))
