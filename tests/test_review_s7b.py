"""Adversarial review of the per-call cuts (the plan linearised in the forward, the cheap
gradient switch, the symmetric Gram matrix, the joined residual history).

1. The implicit backward's forward linearisation stored the layer's *output tensor itself* in
   ``problem.linear`` (and, through ``Elementwise._point``, in the plan).  The output holds its
   ``grad_fn``, whose context holds ``problem``: a reference cycle.  An output dropped without
   a backward (an evaluation with gradients on, a loss never differentiated) then kept its
   whole graph — the problem's tensors, the plan, the upstream graph of the inputs — alive
   until Python's cyclic collector happened to run, instead of being freed when the last
   reference went.  The linearisation must be taken at an alias of the output, not at the
   output object.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from lowering import backward as bw


def _module(m: int = 128, dtype: torch.dtype = torch.float64, **kw: object):
    layer = lowering.lower(qp_objective(qp_weight(m, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-8, max_iter=300, backward_tol=1e-8,
                backward_max_iter=300, dtype=dtype)
    opts.update(kw)
    return layer.torch_module(**opts)


@pytest.fixture
def problems(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every ``FixedPointProblem`` the implicit backward attaches."""
    seen: list[weakref.ref] = []
    orig = bw.ImplicitBackward.attach

    def attach(self, problem, *args, **kw):
        seen.append(weakref.ref(problem))
        return orig(self, problem, *args, **kw)

    monkeypatch.setattr(bw.ImplicitBackward, "attach", attach)
    return seen


@pytest.fixture
def no_cyclic_gc():
    """Reference counting only: what a cycle keeps alive stays alive (restored afterwards)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ----------------------------------------------------------- 1. no cycle through the output
@pytest.mark.parametrize("batch", [1, 40])  # 1: the direct adjoint; 40: the iterative one
@pytest.mark.parametrize("backward", [False, True])
def test_output_and_problem_freed_without_the_cyclic_collector(
        batch: int, backward: bool, problems: list, no_cyclic_gc: None) -> None:
    """With the cyclic collector off, dropping the output (after a backward or without one)
    frees it and the backward's problem at once (reference counts reach zero: no cycle)."""
    mod = _module()
    x = torch.randn(batch, 64, dtype=torch.float64, requires_grad=True)
    z = mod(x)
    assert problems and problems[-1]() is not None
    assert problems[-1]().linear is not None  # the path under review: linearised in forward
    out = weakref.ref(z)
    if backward:
        z.sum().backward()
    del z
    assert out() is None, "the output is kept alive by a reference cycle"
    assert problems[-1]() is None, "the backward's problem is kept alive by a reference cycle"


def test_forward_linearisation_still_used_and_exact(problems: list) -> None:
    """The alias the linearisation is taken at is the output's point: the backward uses it
    (no second linearisation) and the gradient equals the backward-linearised one exactly
    (same operations on the same values)."""
    mod = _module()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g, dtype=torch.float64)
    c = torch.randn(40, 64, generator=g, dtype=torch.float64)
    xx = x.clone().requires_grad_()
    z = mod(xx)
    lin_z = problems[-1]().linear[0]
    assert lin_z.data_ptr() == z.data_ptr() and torch.equal(lin_z, z)
    (z * c).sum().backward()
    ref_x = x.clone().requires_grad_()
    zr = mod(ref_x)
    problems[-1]().linear = None  # the backward linearises (as before the forward did)
    (zr * c).sum().backward()
    assert torch.equal(xx.grad, ref_x.grad)
