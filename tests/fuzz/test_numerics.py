"""Fuzz: numerical stress on emitted modules.

Inputs of huge (1e8, 1e20) and tiny (1e-12, 1e-30) magnitude, float32 near its tolerance limit
(tol 1e-7), ||W||₂ = 0.999, batches of 1 and 4096, NaN/Inf injected into inputs or weights: the
outcome is a correct result (a fixed point to the tolerance, checked in float64), a clear error
(``NonFiniteError``, ``ConvergenceError``) or a flagged non-convergence (``ConvergenceWarning`` in
warn mode) — never a silent NaN/Inf in the output or in the gradients.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import convex_eq as ce
from tests.fuzz.modules import ModuleCase, build_derived, f64_residual, inject_weights, module_cases
from tests.fuzz.stats import fuzz_stats, record  # noqa: F401  (autouse: writes the outcome counts)

CLEAR_ERRORS = (ce.NonFiniteError, ce.ConvergenceError)


def _forward(module, case: ModuleCase):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, stats = module(case.x, return_stats=True)
        except CLEAR_ERRORS as err:
            assert str(err).strip() and err.term, "error without a message / term"
            return None, None, type(err).__name__
    warned = any(issubclass(w.category, ce.ConvergenceWarning) for w in caught)
    return out, stats, "warned" if warned else "ok"


@given(module_cases(), st.integers(0, 10**6))
def test_module_under_stress_never_returns_silent_nan(case: ModuleCase, k: int) -> None:
    note(repr(case))
    module = case.module()
    if case.inject.startswith("weight"):
        case.notes["weight"] = inject_weights(module, case, k)
    # the weights of this forward (weight control updates its power-iteration vector per call)
    twin = copy.deepcopy(module)
    out, stats, how = _forward(module, case)
    if out is None:
        mag = "" if case.inject != "none" else f"(|x|~{case.magnitude:g})"
        record("stress-forward", f"{case.inject}/{how}{mag}")
        return
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:  # the property: never a silent NaN / Inf
        assert torch.isfinite(o).all(), f"non-finite output ({how}): {o}"
    assert case.inject == "none", f"NaN/Inf injected ({case.inject}) but a finite result came back"
    converged = bool(stats.converged.all())
    if case.options["backward"] == "unroll":
        # unrolled K steps is the declared forward of this mode; the residual is in the stats
        record("stress-forward", f"unroll/{'converged' if converged else 'K-steps(reported)'}")
        return
    if how == "warned":
        assert not converged, "ConvergenceWarning although every sample converged"
        record("stress-forward", "flagged-non-convergence")
        return
    assert converged, "not converged, no error, no warning"
    # a correct result: a fixed point to the tolerance, recomputed in float64
    res, tz = f64_residual(twin, case.x, out)
    eps = torch.finfo(case.options["dtype"]).eps
    scale = tz + case.x.to(torch.float64).reshape(case.x.shape[0], -1).norm(dim=1).numpy() + 1.0
    tol = case.options["sam"].tol if "sam" in case.options else case.options["tol"]
    bound = 10 * tol * tz + 1e3 * eps * scale
    assert np.all(res <= bound), f"returned z is not a fixed point: residual {res} > {bound}"
    record("stress-forward", "converged-correct")
    if case.x.shape[0] <= 3 and case.magnitude <= 1e8:
        _check_backward(module, case)


def _check_backward(module, case: ModuleCase) -> None:
    """Gradients of a loss are finite, or a clear error / flagged non-convergence."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = module(case.x)
            outs = out if isinstance(out, tuple) else (out,)
            loss = sum((o * o).sum() for o in outs)
            loss.backward()
        except CLEAR_ERRORS as err:
            record("stress-backward", type(err).__name__)
            return
    for name, p in module.weights.items():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"non-finite gradient of {name}: {p.grad}"
    warned = any(issubclass(w.category, ce.ConvergenceWarning) for w in caught)
    record("stress-backward", "warned" if warned else "finite-gradients")


@pytest.mark.parametrize("control", [None, "project", "spectral_norm"])
def test_eval_forward_is_deterministic(control: str | None) -> None:
    """In eval mode the same input gives bit-identical outputs, call after call."""
    d = build_derived("opteq", "relu", 0.999, 0)[0]
    m = d.torch_module(dtype=torch.float64, tol=1e-12, weight_control=control).eval()
    x = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = [m(x) for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs)
