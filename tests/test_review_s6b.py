"""Adversarial review of the eager plain loop (``Tracker.plain_loop``), the solver flags made
on first read, ``compile_disabled``'s nested calls and the boxed equilibrium.

1. ``SolverStats`` pickled before its lazily made flags (``converged``, ``nonfinite``) were
   read carries neither: a reader without the new ``__getattr__`` (the previous release, or
   anything reading the pickled state itself) finds no ``converged`` and a ``nonfinite`` of
   None, so ``failed_indices``/``str`` raise and ``final_residual`` fails.  The state pickled
   must hold the flags.
2. (pins, passing) every way out of the inlined plain loop leaves the tracker describing the
   returned iterate: a stop refused by its exact residual (extreme scale) at any iteration,
   ``auto``'s switch at the last iteration.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from lowering.solvers import get_solver


def _solve(solver: str = "plain", max_iter: int = 100):
    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.float64) * 0.1
    q = torch.randn(3, 8, dtype=torch.float64)
    return get_solver(solver)(lambda z: torch.relu(z @ w + q), torch.zeros(3, 8,
                              dtype=torch.float64), tol=1e-8, max_iter=max_iter)


@pytest.mark.parametrize("max_iter", [100, 3])
def test_pickled_stats_hold_their_flags(max_iter: int) -> None:
    """The pickled state of fresh statistics (no flag read yet) holds ``converged`` and
    ``nonfinite`` as tensors equal to what the object reports (booleans: exact)."""
    _, st = _solve(max_iter=max_iter)
    state = pickle.loads(pickle.dumps(st)).__dict__  # what any reader of the pickle gets
    # (an older SolverStats without __getattr__ reads exactly these attributes)
    assert isinstance(state.get("converged"), torch.Tensor)
    assert isinstance(state.get("nonfinite"), torch.Tensor)
    assert torch.equal(state["converged"], st.converged)
    assert torch.equal(state["nonfinite"], st.nonfinite)


@pytest.mark.parametrize("solver", ["plain", "auto"])
@pytest.mark.parametrize("max_iter", list(range(14, 24)))
def test_refused_stop_leaves_a_consistent_tracker(solver: str, max_iter: int) -> None:
    """A float32 state whose scale falls to ~1e-19 (``||fz − z||`` squares underflow, the
    plain residual reads 0 while the exact one is ~1e-5): the plain stop is refused and the
    solve goes on exactly.  Wherever it ends (``max_iter`` around the refusal, ``auto``'s
    switch), ``converged``/``final_residual`` describe the returned point: recomputed in
    float64 from it (1e-3 relative: float32 iterates, float64 norms on both sides; the
    residual is 1e-8..1, the flags are booleans at tol 1e-6, far from 1e-3 of tol)."""
    a = 0.1
    g = torch.Generator().manual_seed(0)
    c = (1 - a) * 1e-19 * (1 + torch.rand(3, 8, generator=g))

    def f(z: torch.Tensor) -> torch.Tensor:
        return a * z + c

    z, st = get_solver(solver)(f, torch.ones(3, 8), tol=1e-6, max_iter=max_iter)
    fz = f(z).double()
    r = (fz - z.double()).norm(dim=1) / fz.norm(dim=1).clamp_min(1e-30)
    torch.testing.assert_close(st.final_residual.double(), r, rtol=1e-3, atol=0)
    assert torch.equal(st.converged, r <= 1e-6)
    assert st.residuals.shape[1] <= max_iter


# ------------------------------------------------------------------ 3. compile_disabled nesting
def test_a_disabled_function_stays_untraced_under_a_compile_inside_another() -> None:
    """Inside one ``compile_disabled`` function's region a user's ``torch.compile``-d function
    (a parametrisation, a term's helper) re-enables dynamo for its own frames; a
    ``compile_disabled`` function it calls (another layer's forward) must still run untraced
    (``is_compiling()`` False inside, as when the compiled function is called at top level),
    not be inlined into the user's graph because the thread's flag says "inside"."""
    import torch._dynamo  # what torch.compile imports (the wrapper then disables)

    from lowering._compile import compile_disabled

    seen: list[bool] = []

    @compile_disabled
    def inner(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x * 2

    g = torch.compile(lambda x: inner(x) + 1, backend="eager")

    @compile_disabled
    def outer(x: torch.Tensor) -> torch.Tensor:
        return g(x)

    x = torch.ones(3)
    torch.testing.assert_close(outer(x), torch.full((3,), 3.0), rtol=0, atol=0)  # exact: 1·2+1
    assert seen and not any(seen), seen


# ------------------------------------------------------------------ 4. the boxed equilibrium
@pytest.mark.parametrize("backward", ["implicit", "phantom"])
def test_the_output_shares_no_storage_with_a_warm_start(backward: str) -> None:
    """The output is now the solver's iterate itself (no copy).  Warm-started at the
    equilibrium, the solve stops at its first record, whose iterate is ``z0``: the output must
    still be a tensor of its own, so that an in-place change of it (here under no_grad) leaves
    the caller's ``z0`` and input untouched (exact comparisons: nothing is computed)."""
    import lowering
    from benchmarks.common import qp_objective, qp_weight

    layer = lowering.lower(qp_objective(qp_weight(8, 8, norm=0.8, seed=0)))
    mod = layer.torch_module(weight_control=None, tol=1e-8, max_iter=300, backward_tol=1e-8,
                             backward_max_iter=300, dtype=torch.float64, backward=backward)
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
