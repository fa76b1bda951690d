"""The per-call path after the cuts of this round (lowering/solvers.py, module.py, backward.py,
plan.py, nodes.py): the cheap gradient switch, the plan linearised at an alias of the output,
the Gram matrix applied without a transpose, ``auto``'s inline prediction, and the
benchmark's hand-loop stop test.  Each shortcut must give what the slower form gave; the tests
that guard one are shown to fail on a broken rule (``test_*_mutation``)."""

from __future__ import annotations

import pytest
import torch

from lowering import solvers
from lowering.solvers import grad_off, solve


# ------------------------------------------------------------------------- grad_off
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
            solvers._set_grad_enabled(True)

    monkeypatch.setattr(solvers, "grad_off", Broken)
    monkeypatch.setitem(globals(), "grad_off", Broken)
    with pytest.raises(AssertionError):
        test_grad_off_switches_off_and_restores(False)


@pytest.mark.parametrize("solver", ["plain", "anderson", "broyden"])
def test_tol_zero_runs_max_iter_as_before(solver: str) -> None:
    """``solve(..., tol=0)`` (no stop on the residual: ``max_iter`` iterations, or an exact
    fixed point) ran before 38cf7a1; the first-image scale check divides by ``tol`` and raises
    a bare ZeroDivisionError.  Exact comparisons: iteration counts."""
    z, st = solve(lambda z: 0.5 * torch.tanh(z) + 1.0, torch.zeros(2, 3), solver, tol=0.0,
                  max_iter=5)
    assert z.shape == (2, 3) and 1 <= st.residuals.shape[1] <= 5
