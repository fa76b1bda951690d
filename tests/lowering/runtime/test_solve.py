"""The solve entry (lowering/solvers.py ``solve`` and the registry's solvers): the gradient switch
around the iterations (``grad_off``) and a zero tolerance.  The test that guards the switch is
shown to fail on a broken one (``test_grad_off_mutation``)."""

from __future__ import annotations

import pytest
import torch

from lowering.runtime.grad_mode import grad_off, set_grad_enabled
from lowering.runtime.solvers import solve


@pytest.mark.parametrize("start", [True, False])
def test_grad_off_switches_off_and_restores(start: bool) -> None:
    """Inside: gradients off; after: the mode it found, also when the body raises; a region
    entered with gradients off leaves them off (it must not switch them on at exit)."""
    with torch.set_grad_enabled(start):
        with grad_off():
            assert not torch.is_grad_enabled()
        assert torch.is_grad_enabled() is start
        with pytest.raises(ZeroDivisionError):
            with grad_off():
                raise ZeroDivisionError
        assert torch.is_grad_enabled() is start
        with grad_off():
            with torch.enable_grad():  # an inner switch is the inner region's business
                assert torch.is_grad_enabled()
            assert not torch.is_grad_enabled()
        assert torch.is_grad_enabled() is start


def test_grad_off_mutation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch that restores "on" unconditionally breaks the test above (it can fail)."""

    class Broken(grad_off):
        __slots__ = ()

        def __exit__(self, *exc: object) -> None:
            set_grad_enabled(True)

    monkeypatch.setitem(globals(), "grad_off", Broken)
    with pytest.raises(AssertionError):
        test_grad_off_switches_off_and_restores(False)


@pytest.mark.parametrize("solver", ["plain", "anderson", "broyden"])
def test_tol_zero_runs_max_iter(solver: str) -> None:
    """``solve(..., tol=0)``: no stop on the residual, ``max_iter`` iterations (or fewer at an
    exact fixed point).  Exact comparisons: iteration counts.

    Pins: the first-image scale check divided by ``tol`` and raised a bare
    ZeroDivisionError."""
    z, st = solve(lambda z: 0.5 * torch.tanh(z) + 1.0, torch.zeros(2, 3), solver, tol=0.0,
                  max_iter=5)
    assert z.shape == (2, 3) and 1 <= st.residuals.shape[1] <= 5
