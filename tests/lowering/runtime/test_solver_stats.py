"""Solver statistics (lowering/solvers.py ``SolverStats``): flags computed on the unrounded
tolerance, and pickles that hold what a reader of the pickled state needs, also pickles of the
layout with the history in the field ``residuals``."""

from __future__ import annotations

import pickle

import pytest
import torch

from lowering.runtime import solvers
from lowering.runtime.solvers import SolverStats, get_solver, solve
from lowering.runtime.solvers.stats import meets


def _solve(solver: str = "plain", max_iter: int = 100):
    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.float64) * 0.1
    q = torch.randn(3, 8, dtype=torch.float64)
    return get_solver(solver)(lambda z: torch.relu(z @ w + q), torch.zeros(3, 8,
                              dtype=torch.float64), tol=1e-8, max_iter=max_iter)


@pytest.mark.parametrize("max_iter", [100, 3])
def test_pickled_stats_hold_their_flags(max_iter: int) -> None:
    """The pickled state of fresh statistics (no flag read yet) holds ``converged`` and
    ``nonfinite`` as tensors equal to what the object reports (booleans: exact).

    Pins: flags made lazily on first read were missing from the pickled state, so a reader of
    that state found no ``converged`` and a ``nonfinite`` of None."""
    _, st = _solve(max_iter=max_iter)
    state = pickle.loads(pickle.dumps(st)).__dict__  # what any reader of the pickle gets
    # (a reader without SolverStats.__getattr__ reads exactly these attributes)
    assert isinstance(state.get("converged"), torch.Tensor)
    assert isinstance(state.get("nonfinite"), torch.Tensor)
    assert torch.equal(state["converged"], st.converged)
    assert torch.equal(state["nonfinite"], st.nonfinite)


def test_stats_pickled_with_the_history_in_the_residuals_field_still_read() -> None:
    """Statistics pickled with their history in the field ``residuals`` (it lives in
    ``residuals_`` behind a property) read as the original: ``residuals``, ``iterations`` and
    ``str``.  Such a pickle is reproduced exactly: the same class with that instance dictionary
    (pickle stores the class name and ``__dict__``).  Exact comparisons: the tensors are pickled
    bit for bit.

    Pins: reading ``last_stats.residuals`` of such a pickle raised AttributeError."""
    _, st = solve(lambda z: 0.5 * z + 1.0, torch.zeros(2, 3, dtype=torch.float64), "plain",
                  tol=1e-6, max_iter=100)
    old = SolverStats.__new__(SolverStats)
    state = dict(st.__dict__)
    state["residuals"] = state.pop("residuals_") if isinstance(state["residuals_"], torch.Tensor) \
        else torch.cat(state.pop("residuals_"), dim=1)
    old.__dict__.update(state)
    loaded = pickle.loads(pickle.dumps(old))
    assert torch.equal(loaded.residuals, st.residuals)
    assert torch.equal(loaded.iterations, st.iterations)
    assert "converged" in str(loaded)


@pytest.mark.parametrize("tol", [0.3, 1e-3, 0.1, 1e-6 * (1 + 2**-30)])
def test_flags_compare_with_the_unrounded_tolerance(tol: float) -> None:
    """A float32 residual equal to ``tol`` rounded *up* to float32 lies above ``tol``: it is not
    converged, and ``iterations`` does not count it as a pass (torch would round the Python
    scalar to float32 in ``r <= tol`` and admit it).  The flags decide as the stop test does,
    on exact values."""
    t32 = float(torch.tensor(tol, dtype=torch.float32))
    if not t32 > tol:  # rounds down: step up to the next float32
        t32 = float(torch.nextafter(torch.tensor(tol, dtype=torch.float32),
                                    torch.tensor(1.0)))
    assert t32 > tol
    r = torch.tensor([t32, 0.5 * tol], dtype=torch.float32)
    st = solvers.SolverStats("t", r[:, None], None, None, tol, None, r)
    assert st.converged.tolist() == [False, True]
    assert st.iterations.tolist() == [1, 1]  # K = 1 for the sample that never met tol
    assert not bool(meets(r[:1], tol)[0])
