"""The emitted module under ``torch.compile``: its solves run in compiled chunks (tested on their
own in tests/lowering/runtime/test_compiled_steps.py) and give the eager module's outputs and
gradients; a compiled module still pickles; without a C++ compiler the chunks fall back to eager
steps and say so; the module's compile-disabled regions stay untraced inside a user's compiled
function.

Float64 on tiny states (each compiled chunk costs a few seconds of compiling once)."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.lowering.helpers import close, randn
from tests.lowering.runtime.helpers import compiled_relu_module, small_module

F64 = T64 = torch.float64
ROOT = Path(__file__).resolve().parents[3]


def _close_fixed_points(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-11,
                        rate: float = 0.9) -> None:
    """Two points each with relative residual ≤ ``tol`` of the same ``rate``-contraction lie
    within ``2·tol·||z||/(1 − rate)`` of the fixed point per sample; 1.5× that for rounding."""
    diff = torch.linalg.vector_norm(a - b, dim=1)
    bound = 3 * tol / (1 - rate) * torch.linalg.vector_norm(b, dim=1) + 1e-300
    assert bool((diff <= bound).all()), (diff, bound)


def test_torch_compile_runs_the_solves_in_compiled_chunks() -> None:
    """``torch.compile(module)``: the forward and the adjoint solve run in compiled chunks
    (their statistics say so), the outputs and every gradient equal the eager module's, and
    ``compile_steps=0`` keeps the eager loop.

    Tolerance: both solves stop at relative residual 1e-11 of a 0.9-contraction (the chunk
    schedule may run a few iterations past the eager stop), so the outputs agree within the
    per-sample bound of ``_close_fixed_points``; the gradients (adjoint solves with the same
    tolerance, and ``z*`` entering them) to 1e-8 relative, with 1e-10 absolute for entries
    near zero, on any BLAS."""
    eager = compiled_relu_module()
    comp_mod = compiled_relu_module()
    comp_mod.load_state_dict(eager.state_dict())
    x = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, mod, call in (("eager", eager, eager), ("compiled", comp_mod,
                                                       torch.compile(comp_mod))):
        xx = x.clone().requires_grad_()
        z = call(xx)
        grads = torch.autograd.grad((z ** 2).sum(), [xx, *mod.parameters()])
        out[name] = (z.detach(), grads, mod.last_stats.solver, mod.last_backward_stats.solver)
    assert "compiled" not in out["eager"][2]
    assert out["compiled"][2].startswith("plain[compiled×16]"), out["compiled"][2]
    assert out["compiled"][3].startswith("plain[compiled×16]"), out["compiled"][3]
    _close_fixed_points(out["compiled"][0], out["eager"][0])
    for a, b in zip(out["compiled"][1], out["eager"][1]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)

    off = compiled_relu_module(compile_steps=0)
    torch.compile(off)(x)
    assert "compiled" not in off.last_stats.solver


def test_a_module_used_under_torch_compile_pickles() -> None:
    """The compiled chunks a module made are dropped from its pickle (made again on use); the
    unpickled module (eager) computes the same equilibrium (bound: ``_close_fixed_points``)."""
    m = compiled_relu_module(compile_steps=4)
    x = torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.compile(m)(x)
    assert "_compiled" in m.__dict__
    back = pickle.loads(pickle.dumps(m))
    assert "_compiled" not in back.__dict__
    with torch.no_grad():
        _close_fixed_points(back(x), ref)


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
    to C++).  With the compiler unusable the module's chunks fall back to eager steps, saying so
    (a warning that names the switch, ``compile_steps=0``) and with statistics that say plain.
    Run in a subprocess: inductor caches compiler probes per process.

    Tolerance: the plain iterates of a 0.5-contraction at tol 1e-10, eager vs eager-fallback
    (the same float64 operations): 1e-8 absolute on entries of order 1 is far above both
    solves' error (≤ 2·1e-10·||z||/(1 − 0.5)).

    Pins: the module's own ``torch.compile`` of its chunks (inductor, whatever backend the
    caller chose) raised ``InductorError``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CI="true")
    run = subprocess.run([sys.executable, "-c", _NO_CXX], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "WARNED True" in run.stdout, run.stdout
    # the statistics say what ran: eager plain iterations, not compiled chunks
    assert "SOLVER plain\n" in run.stdout, run.stdout
    diff = float(run.stdout.split("MAXDIFF")[1])
    assert math.isfinite(diff) and diff <= 1e-8, run.stdout


def test_torch_compile_matches_eager() -> None:
    """A small conjugate-form layer: ``torch.compile(module)`` gives the eager output and
    parameter gradients."""
    m = small_module(tol=1e-10)
    x = randn(4, 3)
    ref = m(x)
    g_ref = torch.autograd.grad(ref.sum(), list(m.parameters()))
    cm = torch.compile(m)
    out = cm(x)
    # inside torch.compile the solves run in compiled chunks, which may stop a few iterations
    # after the eager loop (docs/theory.md §8); both points have relative residual ≤ 1e-10 of
    # a contraction of this small layer, so they agree to ~1e-9 of |z| (|z| = O(1)) on any BLAS
    close(out, ref, 1e-8)
    g = torch.autograd.grad(out.sum(), list(m.parameters()))
    for a, b in zip(g, g_ref):
        close(a, b, 1e-7)


def test_a_disabled_function_stays_untraced_under_a_compile_inside_another() -> None:
    """Inside one ``compile_disabled`` function's region a user's ``torch.compile``-d function
    (a parametrisation, a term's helper) re-enables dynamo for its own frames; a
    ``compile_disabled`` function it calls (another layer's forward) must still run untraced
    (``is_compiling()`` False inside, as when the compiled function is called at top level),
    not be inlined into the user's graph because the thread's flag says "inside".

    Pins: the inner function was traced into the user's graph."""
    import torch._dynamo  # what torch.compile imports (the wrapper then disables)

    from lowering.runtime.compile import compile_disabled

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
