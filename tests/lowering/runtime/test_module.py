"""The emitted module's call (lowering/module.py ``EquilibriumModule.forward``): the entry and
the subclass and instance overrides it honours, grad mode around a raising solve, outputs that
own their storage, the statistics of every call, per-sample failures (raise, warn, mask) and
the messages that name what to change."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import convex_eq as ce
import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight, models
from convex_eq.errors import ConvergenceError, NonFiniteError, OptionError
from convex_eq.models import opteq
from lowering.runtime.guards import inputs_of
from lowering.runtime.module import EquilibriumModule
from tests.lowering.helpers import randn
from tests.lowering.runtime.helpers import (
    nan_batch,
    qp_module_16,
    qp_module_64,
    relu_layer,
    uneven_inputs,
    uneven_relu_layer,
)

T64 = F64 = torch.float64
ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------ the call entry
def test_a_subclass_forward_is_honoured() -> None:
    """The entry calls the class's ``_forward`` directly only when it is the module's own."""
    seen: list[int] = []

    class Logged(EquilibriumModule):
        def _forward(self, x, z0, return_stats, steps):  # type: ignore[override]
            seen.append(x.shape[0])
            return super()._forward(x, z0, return_stats, steps)

    d = relu_layer()
    mod = Logged(d, weight_control=None, dtype=T64)
    mod(torch.randn(4, 8, dtype=T64))
    assert seen == [4]


@pytest.mark.parametrize("raises_in", ["solver", "after"])
def test_grad_mode_restored_when_the_solve_raises(raises_in: str) -> None:
    """Inside the solver (an option it refuses: raised in the region where gradients are off)
    and after it (an unconverged solve judged on return)."""
    d = relu_layer(norm=0.95)
    if raises_in == "solver":
        mod = d.torch_module(weight_control=None, dtype=T64, solver="anderson",
                             solver_options={"m": 0})
        err: type = OptionError
    else:
        mod = d.torch_module(weight_control=None, dtype=T64, tol=1e-14, max_iter=2)
        err = ConvergenceError
    x = torch.randn(6, 8, dtype=T64, requires_grad=True)
    assert torch.is_grad_enabled()
    with pytest.raises(err):
        mod(x)
    assert torch.is_grad_enabled()


def test_the_entry_without_dynamo_honours_subclasses() -> None:
    """The call entry's direct path (taken while ``torch._dynamo`` is not loaded, which this
    test process may have loaded already: a fresh interpreter) runs a subclass's ``_forward``."""
    code = textwrap.dedent("""
        import sys, torch
        from lowering.runtime.module import EquilibriumModule
        from tests.lowering.runtime.helpers import relu_layer
        seen = []
        class Logged(EquilibriumModule):
            def _forward(self, x, z0, return_stats, steps):
                seen.append(x.shape[0])
                return super()._forward(x, z0, return_stats, steps)
        Logged(relu_layer(), weight_control=None, dtype=torch.float64)(
            torch.randn(4, 8, dtype=torch.float64))
        print("torch._dynamo" in sys.modules, seen)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "[4]"], r.stdout


def test_instance_forward_override_is_honoured_without_dynamo() -> None:
    """An instance's own ``_forward`` (a spy, ``mock.patch.object(module, "_forward")``) is
    called by ``forward``, also in a fresh interpreter where ``torch._dynamo`` is not loaded
    (run in a subprocess: this test process may have loaded dynamo already).

    Pins: without dynamo the entry checked the class only and skipped the instance's spy."""
    code = textwrap.dedent("""
        import sys
        import numpy as np, torch, lowering
        from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
        rng = np.random.default_rng(0)
        w = rng.standard_normal((12, 8)); w *= 0.8 / np.linalg.norm(w, 2)
        z, q = State("z", 8), Input("q", 8)
        mod = lowering.lower(Objective([Potential("relu", z), SqNorm(z), -Linear(q, z),
                                        -SqNorm(Weight("W", (12, 8), w) @ z)])).torch_module(
            weight_control=None, dtype=torch.float64)
        calls = []
        inner = mod._forward
        def spy(*a, **k):
            calls.append(1)
            return inner(*a, **k)
        mod._forward = spy
        mod(torch.randn(3, 8, dtype=torch.float64))
        print("torch._dynamo" in sys.modules, len(calls))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    dynamo, calls = r.stdout.split()
    assert dynamo == "False"
    assert calls == "1", "the instance's _forward was skipped"


def test_unrolled_call_keeps_no_image_in_last_stats() -> None:
    """The solver's last image serves the implicit backward's express path only: an unrolled
    call's statistics do not hold it.

    Pins: an unrolled call left the image in ``last_stats``."""
    mod = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0))).torch_module(
        weight_control=None, dtype=F64, backward="unroll")
    mod(torch.randn(8, 64, dtype=F64, requires_grad=True))
    assert mod.last_stats.__dict__.get("image") is None


def test_output_keeps_its_graph_when_only_an_unreached_parameter_needs_grad() -> None:
    """``W`` frozen, and the only trainable parameter ``V`` enters a term of the input alone
    (``½||Vq||²``, which ``T`` never reads): the output still carries a graph and the backward
    runs.

    Pins: the output came back without a graph there."""
    w = qp_weight(64, norm=0.9, seed=0)
    m, d = w.shape
    z, q = State("z", d), Input("q", d)
    obj = Objective([Potential("relu", z), SqNorm(z), -Linear(q, z),
                     -SqNorm(Weight("W", (m, d), w) @ z),
                     SqNorm(Weight("V", (d, d), np.eye(d)) @ q)])
    mod = lowering.lower(obj).torch_module(weight_control=None, dtype=F64)
    mod.weights.W.requires_grad_(False)
    out = mod(torch.randn(8, d, dtype=F64))
    assert out.requires_grad  # (V's gradient itself is None: T does not read V)
    out.sum().backward()


# ------------------------------------------------------------------ outputs and warm starts
def test_in_place_relu_leaves_input_warm_start_and_plan_constants_alone() -> None:
    """The module's planned ReLU layer (``relu_`` on ``addmm(q, z, M)``) never writes into the
    user's input ``q``, the warm start ``z0`` or the plan's state-free tensors: a second
    identical call gives bitwise the same output and gradient (same kernels, same order)."""
    layer = lowering.lower(qp_objective(qp_weight(16, d=8)))
    mod = layer.torch_module(weight_control=None, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, generator=g).requires_grad_()
    z0 = torch.rand(3, 8, generator=g)
    q0, z00 = q.detach().clone(), z0.clone()
    outs = []
    for _ in range(2):
        z = mod(q, z0=z0)
        (gq,) = torch.autograd.grad(z.pow(2).sum(), q)
        outs.append((z.detach(), gq))
        assert torch.equal(q.detach(), q0) and torch.equal(z0, z00)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_mask_mode_keeps_every_sample_that_reached_tol() -> None:
    """A non-contractive layer (||W|| = 1.3, no weight control): samples whose recorded
    residual went below tol/10 must come back converged and finite (mask mode NaNs only the
    others).  tol/10: the recorded (plain) and returned (exact) residuals of one iterate differ
    by rounding (~1e-16 relative), far below that margin on any BLAS."""
    obj = opteq(n=8, m=8, d=4, activation="relu", weight_norm=1.3, seed=2)
    m = lowering.lower(obj).torch_module(dtype=F64, weight_control=None, solver="anderson",
                                         max_iter=40, tol=1e-6, on_nonconvergence="mask")
    x = 3 * torch.randn(64, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out, stats = m(x, return_stats=True)
    reached = stats.residuals.nan_to_num(float("inf")).min(dim=1).values <= 1e-7
    assert bool(reached.any()) and not bool(reached.all()), "scenario needs both kinds"
    kept = stats.converged & torch.isfinite(out).all(dim=1)
    assert bool(kept[reached].all()), (int(reached.sum()), int(kept.sum()))


def test_warm_started_output_does_not_alias_z0() -> None:
    """``z0`` already an equilibrium (a warm start): the output is a new tensor, so the caller
    may reuse its warm-start buffer."""
    m = lowering.lower(opteq(n=6, m=6, d=3)).torch_module(dtype=F64, tol=1e-6)
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        warm = m(x).clone()
        out = m(x, z0=warm)
        before = out.clone()
        warm.zero_()
    assert torch.equal(out, before)


@pytest.mark.parametrize("backward", ["implicit", "phantom"])
def test_the_output_shares_no_storage_with_a_warm_start(backward: str) -> None:
    """The output is the solver's iterate itself (no copy).  Warm-started at the equilibrium,
    the solve stops at its first record, whose iterate is ``z0``: the output is still a tensor
    of its own, so that an in-place change of it (here under no_grad) leaves the caller's
    ``z0`` and input untouched (exact comparisons: nothing is computed)."""
    layer = lowering.lower(qp_objective(qp_weight(8, 8, norm=0.8, seed=0)))
    adjoint = {"backward_tol": 1e-8, "backward_max_iter": 300} if backward == "implicit" else {}
    mod = layer.torch_module(weight_control=None, tol=1e-8, max_iter=300, dtype=torch.float64,
                             backward=backward, **adjoint)
    torch.manual_seed(0)
    q = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    z0 = mod(q).detach()
    keep_z0, keep_q = z0.clone(), q.detach().clone()
    out = mod(q, z0=z0)
    assert mod.last_stats.residuals.shape[1] == 1  # stopped at its first record: best is z0
    assert out.untyped_storage().data_ptr() != z0.untyped_storage().data_ptr()
    assert out.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    with torch.no_grad():
        out.add_(1.0)
    assert torch.equal(z0, keep_z0) and torch.equal(q.detach(), keep_q)


# ------------------------------------------------------------------ statistics of every call
def test_a_call_under_inference_mode_does_not_break_later_calls() -> None:
    """Evaluating under ``torch.inference_mode()`` and then training (or evaluating again) is
    ordinary use; the second call must run (and match the first: same inputs, same ops).

    Pins: an inference tensor cached as the bilinear placeholder (``GradSum._zeros``) made
    every later call of the layer raise."""
    torch.manual_seed(1)
    mod = qp_module_16()
    q = torch.randn(2, 16, dtype=torch.float64)
    with torch.inference_mode():
        a = mod(q)
        b = mod(q)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    qq = q.clone().requires_grad_()
    z = mod(qq)
    z.sum().backward()
    assert qq.grad is not None
    torch.testing.assert_close(z.detach(), a, rtol=0, atol=0)


def test_last_stats_describe_the_call_that_raised() -> None:
    """After a ``ConvergenceError`` ``last_stats`` describes the failed call (its failed
    samples are the ones the error names); after a ``NonFiniteError`` for NaN inputs nothing
    was solved and ``last_stats`` is None.

    Pins: ``last_stats`` was written only when a call returned, so whoever caught the error
    read the previous call's "all converged"."""
    layer = uneven_relu_layer()
    x = uneven_inputs()
    m = layer.torch_module(dtype=F64, solver="plain", tol=1e-8, max_iter=500)
    m(x[:3])  # a converged call first
    assert bool(m.last_stats.converged.all())
    m.config.forward.max_iter = 5  # the same module, made to fail
    with pytest.raises(ConvergenceError) as err:
        m(x)
    st = m.last_stats
    assert st is not None and st.converged.shape == (8,)
    named = [int(i) for i in re.search(r"indices ([0-9, ]+)", str(err.value)).group(1).split(", ")]
    assert st.failed_indices == named
    x[2] = float("nan")
    with pytest.raises(NonFiniteError):
        m(x)
    assert m.last_stats is None  # nothing was solved in that call


def test_flat_and_shaped_inputs_take_the_same_route() -> None:
    """The fast path for one flat ``(B, size)`` input returns what the general one does (the
    dtype cast included)."""
    mod = qp_module_64()
    q = torch.randn(5, 64, dtype=torch.float32)
    fast = inputs_of(mod, q)
    assert fast["q"].dtype == torch.float64 and torch.equal(fast["q"], q.double())
    general = inputs_of(mod, {"q": q})
    assert torch.equal(general["q"], fast["q"])


def _scaled_residual(module: nn.Module, x: torch.Tensor, z: torch.Tensor) -> np.ndarray:
    """||T(z) − z|| / ||T(z)|| per sample, computed here in float64 after dividing by the largest
    magnitude (independent of the solvers' own residual code)."""
    with torch.no_grad():
        env = {k: v.detach().double() for k, v in module.env().items()}
        inputs = {module.input_syms[0].name: x.double().reshape(x.shape[0], -1)}
        zf = z.detach().double().reshape(z.shape[0], -1)
        tz = module.T(zf, inputs, env)
    out = []
    for a, b in zip(tz.numpy(), zf.numpy()):
        s = max(np.abs(a).max(), np.abs(a - b).max(), 1e-300)
        out.append(np.linalg.norm((a - b) / s) / max(np.linalg.norm(a / s), 1e-300))
    return np.array(out)


# ------------------------------------------------------------------ per-sample failures
@pytest.mark.parametrize("dtype", [torch.float32, T64])
@pytest.mark.parametrize("solver", ["plain", "anderson", "broyden"])
def test_expansive_layer_never_reports_a_non_fixed_point_as_converged(solver, dtype):
    """||W||₂ = 1.5, canonical ReLU OptEq, no weight control: every sample flagged converged is
    a fixed point (scaled residual computed here ≤ tol); the others raise or are flagged."""
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="canonical", weight_norm=1.5, seed=0))
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    for max_iter in (300, 1000, 10000):
        m = d.torch_module(dtype=dtype, solver=solver, max_iter=max_iter, tol=1e-6,
                           weight_control=None)
        with pytest.raises((ConvergenceError, NonFiniteError)):
            m(x)
        # mask: the only mode that returns (NaN for failed samples) instead of raising on a
        # diverged sample, so the flags of every sample can be inspected
        m = d.torch_module(dtype=dtype, solver=solver, max_iter=max_iter, tol=1e-6,
                           weight_control=None, on_nonconvergence="mask")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z, st = m(x, return_stats=True)
        conv = st.converged.numpy()
        if conv.any():
            r = _scaled_residual(m, x, z)[conv]
            # float32: the module's residual is measured in float32 (rounding 1e-7 ≪ tol)
            assert np.all(r <= 1e-6 * 1.01), r


def test_mask_mode_drops_only_the_failing_sample():
    """A NaN input in sample 3 under mask mode: that row is NaN, the others equal the clean
    batch's (to 1e-6), only sample 3 is reported failed, and the gradient of the kept samples is
    finite."""
    d, x, bad = nan_batch()
    m = d.torch_module(on_nonconvergence="mask")
    ref = m(x).detach()
    with pytest.warns(UserWarning, match="3"):
        out, st = m(bad, return_stats=True)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[[0, 1, 2, 4]]).all()
    assert torch.allclose(out[[0, 1, 2, 4]], ref[[0, 1, 2, 4]], atol=1e-6)
    assert st.failed_indices == [3]
    loss = out[st.converged].pow(2).sum()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


# ------------------------------------------------------------------ failure messages
def test_hint_never_suggests_what_is_set():
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="canonical", weight_norm=1.5, seed=0))
    m = d.torch_module(weight_control=None, max_iter=5)
    with pytest.raises((ConvergenceError, NonFiniteError)) as err:
        m(torch.randn(4, 3) * 3)
    assert "solver='anderson'" not in str(err.value)  # anderson is the solver here
    assert "weight_control='spectral_norm'" in str(err.value)


def test_divergent_configuration_raises_helpfully() -> None:
    d = lowering.lower(models.opteq(n=8, m=8, d=3, form="conjugate", weight_norm=1.5,
                                    activation="identity", seed=0))
    m = d.torch_module(solver="plain", max_iter=50, dtype=T64)
    with pytest.raises((ce.ConvergenceError, ce.NonFiniteError)) as err:
        m(randn(2, 3))
    msg = str(err.value)
    assert "Lip(T)" in msg or "diverged" in msg
    with pytest.warns(ce.ConvergenceWarning, match="Lip"):
        d.torch_module(solver="plain", max_iter=3, on_nonconvergence="warn",
                       dtype=T64)(randn(2, 3))
