"""The module's call entry (lowering/module.py ``forward`` / ``_express``): options changed in
place on ``module.config`` take effect on the next call, a subclass's own ``_forward`` is
honoured, and grad mode is restored when a solve raises."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import lowering
from convex_eq import Input, Linear, Objective, Potential, SqNorm, State, Weight
from convex_eq.errors import ConvergenceError, OptionError
from lowering.module import EquilibriumModule

T64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("raises_in", ["solver", "after"])
def test_grad_mode_restored_when_the_solve_raises(raises_in: str) -> None:
    """Inside the solver (an option it refuses: raised in the region where gradients are off)
    and after it (an unconverged solve judged on return)."""
    d = _layer(norm=0.95)
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
        from lowering.module import EquilibriumModule
        from tests.test_entry_path import _layer
        seen = []
        class Logged(EquilibriumModule):
            def _forward(self, x, z0, return_stats, steps):
                seen.append(x.shape[0])
                return super()._forward(x, z0, return_stats, steps)
        Logged(_layer(), weight_control=None, dtype=torch.float64)(
            torch.randn(4, 8, dtype=torch.float64))
        print("torch._dynamo" in sys.modules, seen)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "[4]"], r.stdout


def test_adjoint_settings_match_the_properties() -> None:
    d = _layer()
    for kw in ({}, {"backward_solver": "plain", "backward_tol": 1e-9, "backward_max_iter": 7}):
        cfg = d.torch_module(weight_control=None, **kw).config
        assert cfg.adjoint_settings() == (cfg.adjoint_solver, cfg.adjoint_tol,
                                          cfg.adjoint_max_iter)
        assert cfg.adjoint_settings() == (kw.get("backward_solver", cfg.forward.solver),
                                          kw.get("backward_tol", cfg.forward.tol),
                                          kw.get("backward_max_iter", cfg.forward.max_iter))
