"""Review of the compiled chunks of plain iterations (``lowering.solvers.CompiledSteps``):
defects found, each pinned by a test that fails before its fix.

Tiny float64 states; one compiled chunk length per test (compiling costs seconds per graph)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lowering.solvers import CompiledSteps, compiled_steps, solve

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def test_a_zero_fixed_point_has_no_nan_residuals_in_compiled_chunks() -> None:
    """Sample 0's iterates are exactly 0 from the start (``relu(0.9·z − c)``, ``c > 0``): a
    finite fixed point.  ``SolverStats.residuals`` is documented NaN only where the iterate
    was not finite, and the eager loop records 0 there (its 0/0 goes to the exact form); the
    compiled chunks measured ``||0|| / ||0||`` = NaN for every iteration inside a chunk.

    No tolerance: the checks are NaN-ness and exact zeros (0 − 0 and ||0|| are exact in any
    arithmetic)."""
    c = torch.tensor([[-1.0, -2.0], [1.0, 2.0]], dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.relu(0.9 * z + c)

    with compiled_steps(CompiledSteps(4)):
        z, st = solve(f, torch.zeros(2, 2, dtype=F64), "plain", tol=1e-10, max_iter=400)
    assert st.solver == "plain[compiled×4]"
    assert bool(st.converged.all()) and not bool(st.nonfinite.any())
    assert bool((z[0] == 0).all())
    assert not bool(torch.isnan(st.residuals).any()), (
        f"{int(torch.isnan(st.residuals).sum())} NaN residuals for finite iterates")
    assert bool((st.residuals[0] == 0).all())


_NO_CXX = textwrap.dedent("""
    import torch, warnings
    torch.set_num_threads(1)
    import torch._inductor.config as ic
    ic.cpp.cxx = ("/nonexistent/c++",)   # a machine without a working C++ compiler
    import lowering
    from convex_eq.models import opteq
    m = lowering.lower(opteq(n=4, m=4, d=2, weight_norm=0.5, seed=1)).torch_module(
        dtype=torch.float64, tol=1e-10, solver="plain")
    x = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(x)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = torch.compile(m, backend="eager")(x)
    print("WARNED", any("compile_steps=0" in str(w.message) for w in seen))
    print("SOLVER", m.last_stats.solver)
    print("MAXDIFF", float((out - ref).abs().max()))
""")


def test_torch_compile_with_the_eager_backend_runs_without_a_cxx_compiler() -> None:
    """``torch.compile(module, backend="eager")`` needs no C++ compiler (nothing is compiled
    to C++) and ran before compiled chunks existed; the module's own ``torch.compile`` of its
    chunks (inductor, whatever backend the caller chose) then raised ``InductorError``.  With
    the compiler unusable the chunks must fall back to eager steps, saying so (a warning that
    names the switch, ``compile_steps=0``) and statistics that say plain.  Run in a subprocess:
    inductor caches compiler probes per process.

    Tolerance: the plain iterates of a 0.5-contraction at tol 1e-10, eager vs eager-fallback
    (the same float64 operations): 1e-8 absolute on entries of order 1 is far above both
    solves' error (≤ 2·1e-10·||z||/(1 − 0.5))."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CI="true")
    run = subprocess.run([sys.executable, "-c", _NO_CXX], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "WARNED True" in run.stdout, run.stdout
    # the statistics say what ran: eager plain iterations, not compiled chunks
    assert "SOLVER plain\n" in run.stdout, run.stdout
    diff = float(run.stdout.split("MAXDIFF")[1])
    assert math.isfinite(diff) and diff <= 1e-8, run.stdout


@pytest.mark.parametrize("scale", [1e20, 1e-19])
def test_an_overflowed_plain_norm_leaves_no_false_zero_in_the_history(scale: float) -> None:
    """Float32 states near 1e20: ``||f(z)||²`` overflows in float32 while ``||f(z) − z||``
    does not, so the plain residual reads 0; near 1e-19 the squares of a difference at
    relative size 1e-3 underflow, with the same result.  The stop is confirmed exactly (the
    solve goes on), but that 0 stayed in ``SolverStats.residuals``, and ``iterations``
    reported the sample as meeting ``tol`` at that iteration, long before any iterate did
    (eager loop, and the compiled chunks).  Every recorded residual at or below ``tol`` must
    belong to an iterate whose exact residual meets it.  (Fails with the tracker's first-image
    scale check, ``_extreme_scale``, disabled: checked at both scales.)

    Tolerance: the iterates are recomputed by the same float32 ``addmm`` in the same order
    (deterministic on one machine); a residual recorded with float32 plain norms and the
    exact float64 one of the same iterate differ by ~1e-6 relative when nothing overflows,
    so 1.001·tol separates a true claim from a false 0 (exact residual ≫ tol) on any BLAS."""
    from lowering.solvers import exact_rel_residual

    g = torch.Generator().manual_seed(0)
    n, tol = 8, 1e-5
    a = torch.randn(n, n, generator=g)
    a = 0.8 * a / torch.linalg.matrix_norm(a, 2)
    c = torch.randn(3, n, generator=g) * scale
    c[0] /= scale  # sample 0 at ordinary scale

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, z, a)

    for ctx in (None, CompiledSteps(4)):
        with compiled_steps(ctx):
            _, st = solve(f, torch.zeros(3, n), "plain", tol=tol, max_iter=200)
        z, exact = torch.zeros(3, n), []
        for _ in range(st.residuals.shape[1]):
            fz = f(z)
            exact.append(exact_rel_residual(fz - z, fz))
            z = fz
        true = torch.stack(exact, 1)
        claimed = st.residuals <= tol
        assert bool(st.converged.all())
        assert bool((true[claimed] <= 1.001 * tol).all()), (
            st.solver, st.iterations.tolist(), (claimed & (true > 1.001 * tol)).nonzero()[:4])
