"""Adversarial review of the per-call cuts (the plan linearised in the forward, the cheap
gradient switch, the symmetric Gram matrix, the joined residual history).

1. The implicit backward's plan linearisation held the layer's *output tensor itself*
   (a forward linearisation in ``problem.linear``, and, through ``Elementwise._point``, the
   plan's cached point).  The output holds its ``grad_fn``, whose context holds ``problem``: a
   reference cycle.  An output dropped (after a backward, or without one) then kept its whole
   graph — the problem's tensors, the plan, the upstream graph of the inputs — alive until
   Python's cyclic collector happened to run, instead of being freed when the last reference
   went.  The linearisation must be taken at an alias of the output, not at the output object.
   (The forward linearisation was later dropped: it measured 0.7 % slower fwd+bwd than the
   backward's; the backward linearises at an alias.)
2. ``GradSum._gram`` (the Gram forms of ``½||Az||²`` terms) is keyed by ``id(term)`` and was
   copied as is by ``copy.deepcopy``/pickle of the node tree: a copied layer's terms are new
   objects, so its keys were stale — the Gram plan silently dropped (``Aᵀ(A·)`` per iteration),
   and an object that reuses a freed term's address could be handed another term's operator.
   (A whole module is safe: its derived layer holds closures, so a copy re-lowers it.)
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
    out = weakref.ref(z)
    if backward:
        z.sum().backward()
    del z
    assert out() is None, "the output is kept alive by a reference cycle"
    assert problems[-1]() is None, "the backward's problem is kept alive by a reference cycle"


# ------------------------------------------- 2. the Gram forms keyed by the terms' own ids
def _grad_sums(layer) -> list:  # type: ignore[no-untyped-def]
    from lowering.nodes import GradSum

    out: list = []
    seen: set[int] = set()

    def walk(o: object) -> None:
        if id(o) in seen or not type(o).__module__.startswith(("lowering", "convex_eq")):
            return
        seen.add(id(o))
        if isinstance(o, GradSum):
            out.append(o)
        for v in getattr(o, "__dict__", {}).values():
            for x in (v if isinstance(v, (list, tuple)) else
                      v.values() if isinstance(v, dict) else [v]):
                walk(x)

    for n in layer.nodes.values():
        walk(n)
    return out


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_layer_keeps_its_gram_forms(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GradSum._gram`` is keyed by ``id(term)``.  A copy of the derived layer (``copy.deepcopy``,
    or a pickle of the node tree) has new term objects: its keys must be theirs.  With the
    original's ids the copy silently lost the Gram plan (``Aᵀ(A·)`` at every iteration instead
    of the ``n×n`` matrix), and a later object reusing a freed term's id would have been given
    another term's operator."""
    import copy
    import pickle

    from lowering import plan as pl

    layer = lowering.lower(qp_objective(qp_weight(128, norm=0.9, seed=0)))
    if how == "deepcopy":
        other = copy.deepcopy(layer)
    else:  # the node tree itself (a whole layer holds closures: a module re-lowers it)
        other = copy.copy(layer)
        other.nodes = pickle.loads(pickle.dumps(layer.nodes))
    sums = _grad_sums(other)
    assert sums and any(s._gram for s in _grad_sums(layer))
    for s in sums:
        assert set(s._gram) <= {id(t) for t in s.terms}
        assert len(s._gram) == len(next(o for o in _grad_sums(layer)
                                        if o.block.name == s.block.name)._gram)
    made: list[str] = []
    orig = pl.Matrix.__init__

    def init(self, m, *args, **kw):  # type: ignore[no-untyped-def]
        made.append("Matrix")
        orig(self, m, *args, **kw)

    monkeypatch.setattr(pl.Matrix, "__init__", init)
    x = torch.randn(8, 64, dtype=torch.float64)
    mods = [lay.torch_module(weight_control=None, dtype=torch.float64, tol=1e-10)
            for lay in (layer, other)]
    outs = []
    for mod in mods:
        made.clear()
        outs.append(mod(x))
        # the Gram plan, in the original and in the copy (on the first call twice: the express
        # call's plan builder is checked against the plan it rebuilds; once on later calls)
        assert made == ["Matrix", "Matrix"]
        made.clear()
        mod(x)
        assert made == ["Matrix"]
    # the same layer: the same output (the Gram applied to the same weights; 1e-12 relative
    # leaves room for nothing but a BLAS whose reductions are not run-to-run deterministic)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=0.0)
