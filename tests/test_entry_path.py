"""The module's call entry (lowering/module.py ``forward`` / ``_express``): options changed in
place on ``module.config`` take effect on the next call, a subclass's own ``_forward`` is
honoured, and grad mode is restored when a solve raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
from convex_eq.errors import ConvergenceError
from lowering.module import EquilibriumModule

T64 = torch.float64


def _layer(m: int = 12, n: int = 8, norm: float = 0.8, seed: int = 0) -> lowering.DerivedLayer:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, n))
    w *= norm / np.linalg.norm(w, 2)
    z, q = State("z", n), Input("q", n)
    return lowering.lower(Objective([Potential("relu", z), SqNorm(z), -Linear(q, z),
                                     -SqNorm(Weight("W", (m, n), w) @ z)], name="entry"))


def _grad(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    xx = x.detach().clone().requires_grad_()
    (mod(xx) * torch.linspace(-1, 1, x.shape[1], dtype=x.dtype)).sum().backward()
    return xx.grad


def test_backward_mode_set_in_place_takes_effect() -> None:
    """``module.config.backward.mode`` changed after construction is the strategy of the next
    call (it was fixed at construction: the implicit gradient came back under 'phantom')."""
    d = _layer()
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
    d = _layer()
    mod = d.torch_module(weight_control=None, dtype=T64)
    mod.config.backward.mode = "implict"
    x = torch.randn(3, 8, dtype=T64, requires_grad=True)
    with pytest.raises(Exception, match="unknown backward mode 'implict'"):
        mod(x)


def test_a_subclass_forward_is_honoured() -> None:
    """The entry calls the class's ``_forward`` directly only when it is the module's own."""
    seen: list[int] = []

    class Logged(EquilibriumModule):
        def _forward(self, x, z0, return_stats, steps):  # type: ignore[override]
            seen.append(x.shape[0])
            return super()._forward(x, z0, return_stats, steps)

    d = _layer()
    mod = Logged(d, weight_control=None, dtype=T64)
    mod(torch.randn(4, 8, dtype=T64))
    assert seen == [4]


def test_grad_mode_restored_when_the_solve_raises() -> None:
    d = _layer(norm=0.95)
    mod = d.torch_module(weight_control=None, dtype=T64, tol=1e-14, max_iter=2)
    x = torch.randn(6, 8, dtype=T64, requires_grad=True)
    assert torch.is_grad_enabled()
    with pytest.raises(ConvergenceError):
        mod(x)
    assert torch.is_grad_enabled()


def test_adjoint_settings_match_the_properties() -> None:
    d = _layer()
    for kw in ({}, {"backward_solver": "plain", "backward_tol": 1e-9, "backward_max_iter": 7}):
        cfg = d.torch_module(weight_control=None, **kw).config
        assert cfg.adjoint_settings() == (cfg.adjoint_solver, cfg.adjoint_tol,
                                          cfg.adjoint_max_iter)
        assert cfg.adjoint_settings() == (kw.get("backward_solver", cfg.forward.solver),
                                          kw.get("backward_tol", cfg.forward.tol),
                                          kw.get("backward_max_iter", cfg.forward.max_iter))
