"""The module's configuration (lowering/config.py ``ModuleConfig``): its fields are plain
mutable dataclasses, and an option changed in place on ``module.config`` (or a config replaced
whole) takes effect on the next call, on the general and on the express path alike; what the
layer refuses at construction it refuses when set in place."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq.errors import ConvergenceWarning, OptionError
from convex_eq.models import opteq
from tests.lowering.runtime.helpers import relu_layer

T64 = F64 = torch.float64


def _grad(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    xx = x.detach().clone().requires_grad_()
    (mod(xx) * torch.linspace(-1, 1, x.shape[1], dtype=x.dtype)).sum().backward()
    return xx.grad


def test_backward_mode_set_in_place_takes_effect() -> None:
    """``module.config.backward.mode`` changed after construction is the strategy of the next
    call: 'phantom' set in place gives what a module built with 'phantom' gives.

    Pins: the mode was fixed at construction (the implicit gradient came back under
    'phantom')."""
    d = relu_layer()
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((5, 8)), dtype=T64)
    kw = dict(weight_control=None, dtype=T64, tol=1e-12, max_iter=500)
    mod = d.torch_module(**kw)
    implicit = _grad(mod, x)
    mod.config.backward.mode = "phantom"
    phantom = _grad(mod, x)
    fresh = _grad(d.torch_module(backward="phantom", **kw), x)
    # both are the same float64 operations on the same equilibrium (tol 1e-12): equal to
    # round-off; one phantom step differs from the exact gradient by O(||J||) ≈ 0.6 here
    torch.testing.assert_close(phantom, fresh, rtol=1e-9, atol=1e-12)
    assert float((phantom - implicit).abs().max()) > 1e-3
    mod.config.backward.mode = "implicit"
    torch.testing.assert_close(_grad(mod, x), implicit, rtol=1e-9, atol=1e-12)


def test_unknown_backward_mode_set_in_place_is_a_typed_error() -> None:
    d = relu_layer()
    mod = d.torch_module(weight_control=None, dtype=T64)
    mod.config.backward.mode = "implict"
    x = torch.randn(3, 8, dtype=T64, requires_grad=True)
    with pytest.raises(Exception, match="unknown backward mode 'implict'"):
        mod(x)


def test_adjoint_settings_match_the_properties() -> None:
    d = relu_layer()
    for kw in ({}, {"backward_solver": "plain", "backward_tol": 1e-9, "backward_max_iter": 7}):
        cfg = d.torch_module(weight_control=None, **kw).config
        assert cfg.adjoint_settings() == (cfg.adjoint_solver, cfg.adjoint_tol,
                                          cfg.adjoint_max_iter)
        assert cfg.adjoint_settings() == (kw.get("backward_solver", cfg.forward.solver),
                                          kw.get("backward_tol", cfg.forward.tol),
                                          kw.get("backward_max_iter", cfg.forward.max_iter))


def _module(**kw):
    layer = lowering.lower(opteq(n=8, m=8, d=4, activation="tanh", seed=0))
    return layer.torch_module(dtype=F64, tol=1e-10, max_iter=500, **kw)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _call_and_backward(m) -> torch.Tensor:
    x = _x().requires_grad_()
    z = m(x)
    z.sum().backward()
    return z


def test_adjoint_options_changed_in_place_reach_the_backward() -> None:
    """``config.backward.tol`` / ``max_iter`` and ``config.on_nonconvergence`` changed in
    place are what the next backward uses (the express path's too).  Exact comparisons: the
    tolerance is the configured number itself, and one iteration cannot meet 1e-15 in this tanh
    layer (its first adjoint residual is ~0.2).

    Pins: the express path cached the adjoint's configuration per config object and kept the
    old tolerance and cap, and raised where 'warn' was asked for."""
    m = _module(backward_adjoint="iterative", backward_tol=1e-8)
    _call_and_backward(m)
    assert m.last_backward_stats.tol == 1e-8
    m.config.backward.tol = 1e-12
    _call_and_backward(m)
    assert m.last_backward_stats.tol == 1e-12
    m.config.backward.tol, m.config.backward.max_iter = 1e-15, 1
    m.config.on_nonconvergence = "warn"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _call_and_backward(m)  # 'warn': a warning, not a ConvergenceError
    assert m.last_backward_stats.residuals.shape[1] == 1
    assert any(issubclass(w.category, ConvergenceWarning) and "adjoint" in str(w.message)
               for w in caught)


def test_unroll_set_in_place_is_not_bypassed() -> None:
    """``config.backward.mode = "unroll"`` set in place after a call: the next call unrolls.

    Pins: the express path's cached decision sent the call through the planned solve and the
    implicit gradient."""
    m = _module()
    _call_and_backward(m)
    m.config.backward.mode = "unroll"
    z = _call_and_backward(m)
    assert m.last_stats.solver == "unroll"
    assert "Implicit" not in type(z.grad_fn).__name__


def test_sam_set_in_place_is_not_bypassed() -> None:
    """``config.sam`` set in place after a call: the next call runs the SAM iteration.

    Pins: the express path's cached decision ran the plain forward solve and returned its
    equilibrium as if SAM had selected it."""
    m = _module()
    with torch.no_grad():
        m(_x())
    z = m.derived.blocks[0]
    m.config.sam = lowering.SAMConfig(R=ce.SqNorm(z), max_iter=200, tol=1e-1)
    m.config.on_nonconvergence = "warn"  # (the test reads which solve ran, not how far it got)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(_x())
    assert m.last_stats.solver == "sam"


@pytest.mark.parametrize("change", ["replace", "in_place"])
def test_express_path_is_taken_again_after_the_change_is_undone(
        change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-call check must not switch the express path off for good: back at the
    original options the common call takes it again (the solve is then ``express_call``'s)."""
    import lowering.runtime.module as runtime_module

    m = _module()
    original = m.config
    calls = []
    real = runtime_module.express_call
    monkeypatch.setattr(runtime_module, "express_call",
                        lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        m(_x())
        assert calls == [1]
        if change == "replace":
            m.config = lowering.ModuleConfig(backward=lowering.BackwardConfig(mode="unroll"),
                                             dtype=F64)
        else:
            m.config.backward.mode = "unroll"
        m(_x())
        assert calls == [1]
        if change == "replace":
            m.config = original
        else:
            m.config.backward.mode = "implicit"
        m(_x())
    assert calls == [1, 1]


def _coupled_module() -> torch.nn.Module:
    base = opteq(n=6, m=6, d=3, activation="tanh")
    obj = 0.6 * ce.moreau(base + 0.05 * ce.BatchDecorrelation(base.states[0]), 0.4)
    return lowering.lower(obj).torch_module(dtype=torch.float64, weight_control=None)


def test_mask_set_in_place_on_a_coupled_layer_is_refused() -> None:
    """Mask mode is refused at construction for a layer that couples its batch; set in place on
    the config afterwards it is refused when it would act: for a NaN input, a failed forward
    sample and a failed adjoint.

    Pins: set in place, mask dropped NaN inputs, failed samples and failed adjoints from a
    coupled system, changing the kept samples' values."""
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


@pytest.mark.parametrize("mode", ["phantom", "unroll"])
@pytest.mark.parametrize("option", [{"backward_solver": "plain"}, {"backward_tol": 1e-3},
                                    {"backward_max_iter": 10}, {"backward_adjoint": "direct"}])
def test_adjoint_options_for_a_backward_without_an_adjoint_solve_are_refused(
        mode: str, option: dict) -> None:
    """Phantom and unrolled gradients solve no adjoint system: its options would be ignored,
    so they are refused at construction and when set in place (the next call)."""
    d = relu_layer()
    (key, value), = option.items()
    with pytest.raises(OptionError, match=f"{key} configures the adjoint solve.*{mode}"):
        d.torch_module(weight_control=None, dtype=T64, backward=mode, **option)
    mod = d.torch_module(weight_control=None, dtype=T64, backward=mode)
    field = {"backward_solver": "solver", "backward_tol": "tol", "backward_max_iter": "max_iter",
             "backward_adjoint": "adjoint"}[key]
    setattr(mod.config.backward, field, value)
    x = torch.randn(3, 8, dtype=T64, requires_grad=True)
    with pytest.raises(OptionError, match=f"{key} configures the adjoint solve"):
        mod(x)
    mod.config.backward.mode = "implicit"  # the implicit backward uses them
    mod(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_solver_options_the_solver_does_not_take_are_refused_naming_its_options() -> None:
    """An option the forward solver has no parameter for would fail (or be ignored) at the
    first call: refused at construction, with the solver's own options in the hint."""
    d = relu_layer()
    with pytest.raises(OptionError, match=r"solver 'plain' takes no option\(s\) \['m'\]") as err:
        d.torch_module(solver="plain", solver_options={"m": 3})
    assert "damping" in str(err.value)
    with pytest.raises(OptionError, match=r"\['mm'\]"):
        d.torch_module(solver="anderson", solver_options={"mm": 3})
    mod = d.torch_module(solver="anderson", solver_options={"m": 3, "beta": 0.5},
                         weight_control=None, dtype=T64, tol=1e-10, max_iter=500)
    x = torch.randn(3, 8, dtype=T64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = mod(x).numpy()
    # the layer's equation relu(WᵀWz + q) in numpy, with relu_layer's W (seed 0, norm 0.8)
    w = np.random.default_rng(0).standard_normal((12, 8))
    w *= 0.8 / np.linalg.norm(w, 2)
    tz = np.maximum(z @ w.T @ w + x.numpy(), 0.0)
    # tol 1e-10 on a contraction of modulus ≤ ||W||₂² = 0.64: the state error stays below
    # 1e-8 relative in float64 on any BLAS
    assert np.linalg.norm(tz - z) / np.linalg.norm(tz) < 1e-8


def test_solver_options_set_in_place_are_checked_on_the_next_call() -> None:
    """An option written into ``module.config.forward.options`` after construction is refused
    by the next call as at construction (a typed error, not a TypeError from the solver)."""
    d = relu_layer()
    mod = d.torch_module(solver="anderson", weight_control=None, dtype=T64)
    x = torch.randn(3, 8, dtype=T64)
    mod.config.forward.options["mm"] = 3
    with pytest.raises(OptionError, match=r"solver 'anderson' takes no option\(s\) \['mm'\]"):
        mod(x)
    with torch.no_grad(), pytest.raises(OptionError, match=r"\['mm'\]"):
        mod(x)
    del mod.config.forward.options["mm"]
    mod.config.forward.options["m"] = 2
    assert torch.isfinite(mod(x)).all()
