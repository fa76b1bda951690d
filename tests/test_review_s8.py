"""Review s8: the express call path (lowering/module.py ``_express``) must behave as the general
path in everything but speed — also after the module's configuration is changed in place.

``module.config`` is a set of plain (mutable) dataclasses, and changing a field in place
(``module.config.forward.max_iter = 5``) is honoured by every later call.  The express path
cached two decisions keyed on the identity of the config object: whether a call may take the
express path (which leaves out SAM and the unrolled backward) and the adjoint solve's
configuration.  A field changed in place kept the same object, so both caches went stale."""

from __future__ import annotations

import warnings

import pytest
import torch

import convex_eq as ce
import lowering
from convex_eq.errors import ConvergenceWarning
from convex_eq.models import opteq

F64 = torch.float64


def _module(**kw):
    layer = lowering.lower(opteq(n=8, m=8, d=4, activation="tanh", seed=0))
    return layer.torch_module(dtype=F64, tol=1e-10, max_iter=500, **kw)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _call_and_backward(m) -> torch.Tensor:
    x = _x().requires_grad_()
    z = m(x)
    z.sum().backward()
    return z


def test_adjoint_options_changed_in_place_reach_the_backward() -> None:
    """The express path cached the adjoint's configuration per config *object*: after
    ``config.backward.tol`` / ``max_iter`` / ``on_nonconvergence`` were changed in place, the
    backward kept solving with the old tolerance and cap, and raised where 'warn' was asked
    for (the general path reads them on every call).  Exact comparisons: the tolerance is the
    configured number itself, and one iteration cannot meet 1e-15 in this tanh layer (its
    first adjoint residual is ~0.2)."""
    m = _module(backward_adjoint="iterative", backward_tol=1e-8)
    _call_and_backward(m)
    assert m.last_backward_stats.tol == 1e-8
    m.config.backward.tol = 1e-12
    _call_and_backward(m)
    assert m.last_backward_stats.tol == 1e-12
    m.config.backward.tol, m.config.backward.max_iter = 1e-15, 1
    m.config.on_nonconvergence = "warn"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _call_and_backward(m)  # raised ConvergenceError with the stale 'raise'
    assert m.last_backward_stats.residuals.shape[1] == 1
    assert any(issubclass(w.category, ConvergenceWarning) and "adjoint" in str(w.message)
               for w in caught)


def test_unroll_set_in_place_is_not_bypassed() -> None:
    """``config.backward.mode = "unroll"`` set in place after a call: the express path's
    cached decision still sent the call through the planned solve and the implicit gradient
    (the general path unrolls, as it did before the express path)."""
    m = _module()
    _call_and_backward(m)
    m.config.backward.mode = "unroll"
    z = _call_and_backward(m)
    assert m.last_stats.solver == "unroll"
    assert "Implicit" not in type(z.grad_fn).__name__


def test_sam_set_in_place_is_not_bypassed() -> None:
    """``config.sam`` set in place after a call: the express path's cached decision ran the
    plain forward solve and returned its equilibrium as if SAM had selected it."""
    m = _module()
    with torch.no_grad():
        m(_x())
    z = m.derived.blocks[0]
    m.config.sam = lowering.SAMConfig(R=ce.SqNorm(z), max_iter=200, tol=1e-1)
    m.config.on_nonconvergence = "warn"  # (the test reads which solve ran, not how far it got)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(_x())
    assert m.last_stats.solver == "sam"


@pytest.mark.parametrize("change", ["replace", "in_place"])
def test_express_path_is_taken_again_after_the_change_is_undone(change: str) -> None:
    """The per-call check must not switch the express path off for good: back at the
    original options the common call takes it again (the solve is then ``_express``'s)."""
    m = _module()
    original = m.config
    calls = []
    real = m._express
    m._express = lambda *a: calls.append(1) or real(*a)
    with torch.no_grad():
        m(_x())
        assert calls == [1]
        if change == "replace":
            m.config = lowering.ModuleConfig(backward=lowering.BackwardConfig(mode="unroll"),
                                             dtype=F64)
        else:
            m.config.backward.mode = "unroll"
        m(_x())
        assert calls == [1]
        if change == "replace":
            m.config = original
        else:
            m.config.backward.mode = "implicit"
        m(_x())
    assert calls == [1, 1]
