"""Review s8c: auto's watch after a failed short-tail prediction; nested-tensor inputs."""

from __future__ import annotations

import pytest
import torch

import lowering
from convex_eq.errors import ShapeError
from convex_eq.models import opteq
from lowering.solvers import solve

F64 = torch.float64


def test_auto_measures_the_rate_again_when_a_short_tail_fails() -> None:
    """A fast transient then a slow mode: ``z ↦ zA + c`` with ``A = diag(0.5, 0.92)``, the slow
    component 0.03 of the fast one.  The first test sees the transient's rate and predicts a
    short tail (≤ AUTO_TAIL); the test past its end measured the rate over that whole span,
    the fast start included, and predicted 34 iterations (budget 60), then fewer and fewer:
    the solve never switched and ran 89 plain iterations (the rule before: switch after 18,
    21 in all).  Measuring the rate again over AUTO_WINDOW there predicts 66 > 60 and switches
    (25 in all).

    Tolerance: the decisions are float64 arithmetic on a 2-D diagonal map (rounding ~1e-15
    relative); the switching test is 10 % above the budget and the rule without the re-measure
    stays ≥ 7 % below it at every test, so no BLAS or CPU can move either side; ``≤ 40``
    separates 25 from 89."""
    a = torch.diag(torch.tensor([0.5, 0.92], dtype=F64))
    c = torch.tensor([[1.0, 0.03]], dtype=F64)
    _, st = solve(lambda z: torch.addmm(c, z, a), torch.zeros(1, 2, dtype=F64), "auto",
                  tol=1e-5, max_iter=150)
    assert st.solver == "plain→anderson", (st.solver, int(st.iterations.max()))
    assert bool(st.converged.all())
    assert int(st.iterations.max()) <= 40


def test_auto_switches_a_tanh_layers_slowing_adjoint_solve() -> None:
    """The same on an emitted layer: a canonical tanh OptEq at ‖W‖₂ = 0.99 (tol 1e-4,
    max_iter 100, B = 32): the adjoint solve's short-tail test came 19 iterations after the
    previous one and its averaged rate predicted 34 further iterations against a budget of 38;
    it ran 67 plain iterations where the rule before switched after 29 (32 in all).  With the
    rate measured again over AUTO_WINDOW it predicts 38 > 36 and switches (31 in all).

    Tolerance: float64 solves of a 32-wide state; rounding moves the residuals by ~1e-14
    relative, against a 5 % margin of the switching test and ≥ 10 % below the budget for the
    rule without the re-measure; ``< 50`` separates 31 from 67."""
    # (backward_adjoint="iterative": the adjoint by the solver ``auto`` whose rule this tests;
    # the default method takes conjugate gradients on this symmetric system, 13 iterations)
    mod = lowering.lower(opteq(n=32, m=32, d=32, activation="tanh", weight_norm=0.99, seed=3)
                         ).torch_module(dtype=F64, tol=1e-4, max_iter=100, weight_control=None,
                                        backward_adjoint="iterative")
    x = (0.2 * torch.randn(32, 32, generator=torch.Generator().manual_seed(0))).to(F64)
    z = mod(x.requires_grad_())
    (z * torch.linspace(-1, 1, 32, dtype=F64)).sum().backward()
    st = mod.last_backward_stats
    assert st.solver == "plain→anderson", (st.solver, int(st.iterations.max()))
    assert bool(st.converged.all())
    assert int(st.iterations.max()) < 50


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_input_is_a_typed_error_with_a_working_hint(layout) -> None:  # type: ignore[no-untyped-def]
    """A nested tensor (strided: ``.shape`` raised torch's untyped "Internal error:
    NestedTensorImpl doesn't support sizes"; jagged: a ShapeError whose hint, ``.to_dense()``,
    fails on it) is a ShapeError naming the input; the hint (stack the samples) gives the
    dense call's result.  (Exact equality: the same dense tensor, the same solve.)"""
    mod = lowering.lower(opteq(n=6, m=6, d=4, activation="relu", seed=2)).torch_module(dtype=F64)
    x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    nested = torch.nested.nested_tensor(list(x.unbind()), layout=layout)
    for given in (nested, {"x": nested}):
        with pytest.raises(ShapeError, match="'x' is a nested tensor") as info:
            mod(given)
        assert "torch.stack(x.unbind())" in str(info.value)
    with torch.no_grad():
        assert torch.equal(mod(torch.stack(nested.unbind())), mod(x))
