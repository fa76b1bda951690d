"""The certificate's conditions during training: ``EquilibriumModule.certificate_status()``
evaluates every condition at the current (controlled) weights and says how training keeps it;
a condition that no weight control can keep (here ``λ_min(Q) ≥ 0`` over two trained weights) is
named by an :class:`~lowering.runtime.weight_control.UncontrolledConditionWarning` when the
module is built, so that a certificate made false by training is never silent."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Constant, Input, Linear, Objective, Potential, SqNorm, State, Weight
from lowering.runtime.weight_control import UncontrolledConditionWarning


def _two_gram_layer() -> lowering.DerivedLayer:
    """``Σf_relu(z) + ½||z||² − <q, z> − ½||W₁z||² − ½||W₂z||²``: convex iff
    ``λ_min(I − W₁ᵀW₁ − W₂ᵀW₂) ≥ 0``, a condition on two weights together."""
    rng = np.random.default_rng(0)
    z, q = State("z", 6), Input("q", 6)
    w1 = Weight("W1", (6, 6), 0.12 * rng.standard_normal((6, 6)))
    w2 = Weight("W2", (6, 6), 0.12 * rng.standard_normal((6, 6)))
    return lowering.lower(Objective([Potential("relu", z), SqNorm(z), -Linear(q, z),
                                     -SqNorm(w1 @ z), -SqNorm(w2 @ z)]))


def _lambda_min(mod: torch.nn.Module) -> float:
    """The independent reference: numpy's eigenvalues of ``I − W₁ᵀW₁ − W₂ᵀW₂`` (float64)."""
    w1 = mod.weights["W1"].detach().double().numpy()
    w2 = mod.weights["W2"].detach().double().numpy()
    return float(np.linalg.eigvalsh(np.eye(6) - w1.T @ w1 - w2.T @ w2).min())


def test_a_condition_no_control_can_keep_is_named_and_evaluated() -> None:
    """Built: one warning naming λ_min(Q); the status reads the reference value (holds), then,
    after a training-like change that makes Q indefinite, the new value (violated)."""
    with pytest.warns(UncontrolledConditionWarning, match=r"λ_min\(Q\) ≥ 0.*certificate_status"):
        mod = _two_gram_layer().torch_module(dtype=torch.float64)
    (st,) = mod.certificate_status()
    # λ_min of a 6×6 symmetric matrix: LAPACK's eigensolvers agree to ~1e-15 on it; 1e-9 is
    # the conditions' own tolerance, far above that
    assert st.kept == "not kept" and st.holds and st.value > 0
    assert abs(st.value - _lambda_min(mod)) < 1e-9
    with torch.no_grad():
        mod.weights["W1"].mul_(4.0)
    (st,) = mod.certificate_status()
    assert not st.holds and st.value < 0 and abs(st.value - _lambda_min(mod)) < 1e-9
    assert "VIOLATED" in str(st)


def test_a_kept_norm_bound_is_not_warned_about() -> None:
    """The canonical layer's ||W||₂ ≤ 1 is kept by weight control: no warning, status says so
    (value: σ_max of the controlled W, against numpy's SVD); with weight control off, it reads
    "not kept" but is not warned about (the user's choice; a failing solve's hint names it)."""
    layer = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0)))
    for wc, kept in (("auto", "weight control"), (None, "not kept")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UncontrolledConditionWarning)
            mod = layer.torch_module(dtype=torch.float64, weight_control=wc)
        (st,) = mod.certificate_status()
        w = mod.env()["W"].detach().numpy()
        # the condition's measure of ||W||₂ against LAPACK's SVD, float64: both accurate to
        # ~1e-12 on this 8×64 matrix with a clear spectral gap; 1e-6 leaves room
        assert st.kept == kept and st.holds
        assert abs(st.value - float(np.linalg.svd(w, compute_uv=False)[0])) < 1e-6


def test_the_status_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A status that always read "holds" (e.g. one evaluated at the declared weights instead of
    the current ones) fails the first test."""
    status = lowering.runtime.module.EquilibriumModule.certificate_status
    monkeypatch.setattr(lowering.runtime.module.EquilibriumModule, "certificate_status",
                        lambda self: [type(s)(s.text, s.value, s.bound, s.sense, True, s.kept)
                                      for s in status(self)])
    with pytest.raises(AssertionError):
        test_a_condition_no_control_can_keep_is_named_and_evaluated()


def _constant_gram_layer() -> lowering.DerivedLayer:
    """``Σf_relu(z) + ½||z||² − <Ux, z> − ½||C₁z||² − ½||C₂z||²``: ``λ_min(I − C₁ᵀC₁ − C₂ᵀC₂)``
    reads the constants only; ``U`` (trained) enters no condition."""
    rng = np.random.default_rng(0)
    z, x = State("z", 6), Input("x", 4)
    u = Weight("U", (6, 4), rng.standard_normal((6, 4)))
    c1 = Constant("C1", 0.12 * rng.standard_normal((6, 6)))
    c2 = Constant("C2", 0.12 * rng.standard_normal((6, 6)))
    return lowering.lower(Objective([Potential("relu", z), SqNorm(z), -Linear(u @ x, z),
                                     -SqNorm(c1 @ z), -SqNorm(c2 @ z)]))


def _built(layer: lowering.DerivedLayer, **options: object) -> tuple[torch.nn.Module, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = layer.torch_module(dtype=torch.float64, **options)
    return mod, [w for w in caught if issubclass(w.category, UncontrolledConditionWarning)]


def test_a_condition_on_constants_alone_is_fixed_and_not_warned() -> None:
    """``Q`` of constants: "fixed", no warning; made learnable: "not kept", one warning.

    Pins: such a condition was labelled "not kept" and warned about as soon as any tensor of
    the layer trained (here the input weight ``U``, which enters no condition)."""
    layer = _constant_gram_layer()
    mod, caught = _built(layer)
    (st,) = mod.certificate_status()
    env = mod.env()
    c1, c2 = (env[n].detach().numpy() for n in ("C1", "C2"))
    ref = float(np.linalg.eigvalsh(np.eye(6) - c1.T @ c1 - c2.T @ c2).min())
    # λ_min of a 6×6 symmetric float64 matrix: LAPACK builds agree to ~1e-15; 1e-9 is the
    # conditions' own tolerance, far above that
    assert abs(st.value - ref) < 1e-9
    assert st.kept == "fixed" and not caught
    mod, caught = _built(layer, learnable_constants=True)
    (st,) = mod.certificate_status()
    assert st.kept == "not kept" and len(caught) == 1


def test_a_looser_weight_bound_does_not_keep_the_condition() -> None:
    """``||W||₂ ≤ 1`` kept by ``weight_bounds={'W': 0.5}``, not by ``{'W': 2.0}``.

    Pins: ``{'W': 2.0}`` (which keeps ``||W||₂ ≤ 2 − margin``) was labelled "weight control"."""
    rng = np.random.default_rng(1)
    z, x = State("z", 6), Input("x", 4)
    u = Weight("U", (6, 4), rng.standard_normal((6, 4)))
    w = Weight("W", (6, 6), 0.12 * rng.standard_normal((6, 6)))
    layer = lowering.lower(Objective([Potential("relu", z), SqNorm(z), -Linear(u @ x, z),
                                      -SqNorm(w @ z)]))
    for bound, kept in ((0.5, "weight control"), (2.0, "not kept")):
        mod, _ = _built(layer, weight_bounds={"W": bound})
        (st,) = mod.certificate_status()
        assert st.kept == kept, bound


def test_several_conditions_are_named_in_the_plural(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two loose conditions: "read … cannot keep them … leave them false", never "it".

    Pins: the warning for several conditions said "cannot keep it … leave it false"."""
    import lowering.runtime.weight_control as module
    from lowering.runtime.weight_control import certificate_conditions

    def twice(derived: object) -> list:
        (c,) = certificate_conditions(derived)
        return [c, dataclasses.replace(c, text="λ_min(Q') ≥ 0")]

    monkeypatch.setattr(module, "certificate_conditions", twice)
    _, caught = _built(_constant_gram_layer(), learnable_constants=True)
    (w,) = caught
    msg = str(w.message)
    assert "conditions" in msg and " read trained" in msg and "keep them" in msg
    assert " it " not in msg.replace("(it keeps", "")


def test_a_monotone_margin_measured_at_the_weights_is_a_condition() -> None:
    """An inclusion ``0 ∈ z + Wz − Ux + ∂f_relu(z)``: its strong monotonicity is measured at
    the declared ``W`` (the derivation names ``λ_min(½(M + Mᵀ)) > 0``), so the certificate has
    that condition: warned about at construction, evaluated by ``certificate_status()`` (against
    numpy's eigenvalues) before and after a change that makes ``M`` non-monotone; with ``W`` a
    constant it is "fixed" and not warned about.

    Pins: the certificate had no condition — no warning, and an empty ``certificate_status()``
    even after training made ``M`` non-monotone (the uniqueness claim false, silently)."""
    from convex_eq.inclusion import Inclusion
    from convex_eq.operators import Dense

    rng = np.random.default_rng(0)
    z, x = State("z", 6), Input("x", 4)
    u = Weight("U", (6, 4), rng.standard_normal((6, 4)))
    w = Weight("W", (6, 6), 0.2 * rng.standard_normal((6, 6)))
    layer = lowering.lower(Inclusion(Potential("relu", z), grad=[SqNorm(z), -Linear(u @ x, z)],
                                     linear=[Dense(w)]))
    mod, caught = _built(layer)
    assert len(caught) == 1 and "λ_min(½(M + Mᵀ)) > 0" in str(caught[0].message)

    def reference() -> float:
        m = np.eye(6) + mod.weights["W"].detach().numpy()
        return float(np.linalg.eigvalsh(0.5 * (m + m.T)).min())

    (st,) = mod.certificate_status()
    # λ_min of a 6×6 symmetric float64 matrix (I + sym W): LAPACK builds agree to ~1e-15;
    # 1e-9 is far above that
    assert st.kept == "not kept" and st.holds and abs(st.value - reference()) < 1e-9
    with torch.no_grad():
        mod.weights["W"].mul_(10.0)
    (st,) = mod.certificate_status()
    assert not st.holds and st.value < 0 and abs(st.value - reference()) < 1e-9
    # W a constant: fixed, no warning
    layer = lowering.lower(Inclusion(Potential("relu", z), grad=[SqNorm(z), -Linear(u @ x, z)],
                                     linear=[Dense(Constant("C", w.value.numpy()))]))
    mod, caught = _built(layer)
    (st,) = mod.certificate_status()
    assert st.kept == "fixed" and st.holds and not caught
