"""The certificate's conditions during training: ``EquilibriumModule.certificate_status()``
evaluates every condition at the current (controlled) weights and says how training keeps it;
a condition that no weight control can keep (here ``λ_min(Q) ≥ 0`` over two trained weights) is
named by an :class:`~lowering.weight_control.UncontrolledConditionWarning` when the module is
built, so that a certificate made false by training is never silent."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
from lowering.weight_control import UncontrolledConditionWarning


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
    status = lowering.module.EquilibriumModule.certificate_status
    monkeypatch.setattr(lowering.module.EquilibriumModule, "certificate_status",
                        lambda self: [type(s)(s.text, s.value, s.bound, s.sense, True, s.kept)
                                      for s in status(self)])
    with pytest.raises(AssertionError):
        test_a_condition_no_control_can_keep_is_named_and_evaluated()


# ------------------------------------------------------- mask mode: an unconverged adjoint
def _mask_case() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The QP layer in mask mode with an adjoint capped at 20 plain iterations: inputs shifted
    down leave few ReLUs on, and the adjoint (a contraction on the active units only) converges
    in 1–17 iterations (samples 1–5: 13, 0, 2, 0, 0 units on); samples 0, 6, 7 (28, 45, 49 on)
    need 30, 34 and 57 and fail (float64, tol 1e-10: each count is several factors of the rate
    away from the cap, whatever the BLAS)."""
    layer = lowering.lower(qp_objective(qp_weight(16, norm=0.9, seed=0)))
    mod = layer.torch_module(dtype=torch.float64, weight_control=None, tol=1e-12, max_iter=500,
                             backward_tol=1e-10, backward_max_iter=20, backward_solver="plain",
                             backward_adjoint="iterative", on_nonconvergence="mask")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, dtype=torch.float64, generator=g)
    x = x + torch.tensor([0, -1, -1.5, -2, -2.5, -3, 0.5, 1.0], dtype=torch.float64)[:, None]
    c = torch.randn(8, 64, dtype=torch.float64, generator=g)
    return mod, x, c


def test_mask_leaves_an_unconverged_adjoint_out_of_the_gradient() -> None:
    """Under on_nonconvergence='mask' the samples whose adjoint solve failed are named in a
    warning and left out of the gradient, as the forward's failed samples are: their input
    gradient rows are zero and the weights' gradient equals that of the converged samples
    alone (the reference: the same module on that subset, where every adjoint converges).
    Before, they only warned, and their unconverged rows entered the weights' gradient."""
    mod, x, c = _mask_case()
    xx = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match=r"indices 0, 6, 7.*left out of the gradient"):
        (mod(xx) * c).sum().backward()
    ok = mod.last_backward_stats.converged
    assert ok.tolist() == [False, True, True, True, True, True, False, False]
    assert float(xx.grad[~ok].abs().max()) == 0.0
    w_grad = mod.weights["W"].grad.clone()
    assert float(w_grad.abs().max()) > 0.0  # (the converged samples have units on)
    mod.zero_grad()
    sub = x[ok].clone().requires_grad_()
    (mod(sub) * c[ok]).sum().backward()
    assert bool(mod.last_backward_stats.converged.all())
    # the converged samples' adjoints in the two runs both meet the relative residual 1e-10 of
    # the same contraction (‖DM‖ ≤ ‖W‖₂² = 0.81), so each is within 1e-10/(1 − 0.81) ≈ 5e-10
    # relative of the exact one (the full batch iterates them longer: its stop waits for the
    # worst sample); 1e-8 bounds their difference on any BLAS, while the unconverged samples'
    # rows that entered the weights' gradient before were O(1) of it
    ref = mod.weights["W"].grad
    assert float((w_grad - ref).abs().max()) <= 1e-8 * float(ref.abs().max())
    assert float((xx.grad[ok] - sub.grad).abs().max()) <= 1e-8 * float(sub.grad.abs().max())


# ------------------------------------------------- a NaN weight written through ``.data``
@pytest.mark.parametrize("weight_control", ["auto", None])
@pytest.mark.parametrize("mode", ["raise", "mask"])
def test_a_nan_weight_written_through_data_is_named(weight_control: str | None,
                                                    mode: str) -> None:
    """A write through ``.data`` makes no version change, so the finiteness check of a weight
    (once per version) did not see it: with weight control the SVD of the NaN weight failed with
    torch's untyped LinAlgError; without, the solve reported diverged samples (raise) or NaN
    outputs (mask). Every mode now names the parameter."""
    from convex_eq.errors import NonFiniteError

    mod = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0))).torch_module(
        dtype=torch.float64, on_nonconvergence=mode, weight_control=weight_control)
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mod(x)  # (the weight's version is now marked as checked)
    mod.weights["W"].data[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the mask mode's own warning, if any, comes first)
        with pytest.raises(NonFiniteError, match="parameter 'W' contains NaN or Inf"):
            mod(x)



# -------------------------------------- mask set in place on a batch-coupled layer's config
def _coupled_module() -> torch.nn.Module:
    import convex_eq as ce
    from convex_eq.models import opteq

    base = opteq(n=6, m=6, d=3, activation="tanh")
    obj = 0.6 * ce.moreau(base + 0.05 * ce.BatchDecorrelation(base.states[0]), 0.4)
    return lowering.lower(obj).torch_module(dtype=torch.float64, weight_control=None)


def test_mask_set_in_place_on_a_coupled_layer_is_refused() -> None:
    """Mask mode is refused at construction for a layer that couples its batch; set in place on
    the config afterwards it went through: NaN inputs, failed samples and failed adjoints were
    dropped from a coupled system, changing the kept samples' values. Each is refused now."""
    from convex_eq.errors import OptionError

    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mod = _coupled_module()
    mod.config.on_nonconvergence = "mask"
    bad = x.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(OptionError, match="couples the batch"):
        mod(bad)  # a NaN input sample would be dropped from the batch
    mod.config.forward.max_iter = 2  # forward samples fail
    with pytest.raises(OptionError, match="couples the batch"):
        mod(x)
    mod = _coupled_module()
    mod.config.on_nonconvergence = "mask"
    mod.config.backward.max_iter = 1  # the adjoint fails
    xx = x.clone().requires_grad_()
    out = mod(xx)  # (the forward converges)
    with pytest.raises(OptionError, match="adjoint fixed point did not reach.*couples the batch"):
        out.sum().backward()
