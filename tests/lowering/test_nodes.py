"""The node tree (lowering/nodes.py): input injections and Gram forms are computed once per
forward solve, not in every evaluation of ``T`` (``partial_evaluation``), with exact gradients;
per-node caches (the bilinear placeholder, the Gram forms keyed by their terms) survive writes,
copies and pickles, also pickles of an older cache layout."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.models import opteq
from lowering.nodes import GradSum
from lowering.runtime.plan import plans as pl
from lowering.runtime.plan.gradsum import recipe_of
from tests.lowering.runtime.helpers import qp_module_64


def _count_applications(module: torch.nn.Module, name: str) -> list[int]:
    """Count the uses of the operator of weight ``name``: ``apply`` calls and Gram-matrix
    formations ``AᵀA`` (instance-level patches)."""
    ops = [e.op for t in module.derived.source.terms for a in t.args for e in a.entries
           if e.op is not None and any(s.name == name for s in e.op.symbols())]
    calls = [0]
    for op in {id(o): o for o in ops}.values():
        for method in ("apply", "gram"):
            orig = getattr(op, method)

            def counted(v, env=None, orig=orig):
                calls[0] += 1
                return orig(v, env)

            setattr(op, method, counted)
    return calls


def test_injection_once_per_solve_and_gradients_unchanged() -> None:
    torch.manual_seed(0)
    obj = opteq(n=8, m=8, d=4)
    module = lowering.lower(obj).torch_module(dtype=torch.float64, tol=1e-10)
    calls = _count_applications(module, "U")
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x, return_stats=True)
    assert int(st.iterations.max()) > 3
    assert calls[0] == 1, calls  # one U x for the whole solve, not one per iteration
    # the differentiable pass evaluates T without the cache: U and b get their gradients
    out = module(x)
    out.sum().backward()
    g_u = module.weights["U"].grad.clone()
    unrolled = lowering.lower(opteq(n=8, m=8, d=4)).torch_module(
        dtype=torch.float64, backward="unroll", unroll_steps=400)
    unrolled.load_state_dict(module.state_dict())
    unrolled(x).sum().backward()
    # 400 contraction steps (Lip ≤ 0.81) from 0 reach the fixed point to ~1e-36; the implicit
    # gradient is solved to 1e-10 relative, so 1e-8 is a safe agreement bound
    assert torch.allclose(g_u, unrolled.weights["U"].grad, rtol=1e-8, atol=1e-10)


def test_gram_form_once_per_solve_and_exact_weight_gradients() -> None:
    """``-½||Wz||²`` with ``W: 16×8`` at batch 4: ``WᵀW`` is formed once per solve (one use of
    ``W`` instead of two applications per iteration) and in the backward's graph, through which
    ``∂ℓ/∂W`` flows; the gradients equal those of an unrolled layer (no partial evaluation)."""
    torch.manual_seed(2)
    obj = opteq(n=8, m=16, d=4)
    module = lowering.lower(obj).torch_module(dtype=torch.float64, tol=1e-12,
                                              backward_tol=1e-12, weight_control=None)
    x = torch.randn(4, 4, dtype=torch.float64)
    calls = _count_applications(module, "W")
    with torch.no_grad():
        _, st = module(x, return_stats=True)
    assert int(st.iterations.max()) > 3 and calls[0] == 1, (calls, st.iterations)
    (module(x) ** 2).sum().backward()
    unrolled = lowering.lower(opteq(n=8, m=16, d=4)).torch_module(
        dtype=torch.float64, backward="unroll", unroll_steps=400, weight_control=None)
    unrolled.load_state_dict(module.state_dict())
    (unrolled(x) ** 2).sum().backward()
    # the unrolled layer is at the fixed point to round-off after 400 contraction steps; the
    # implicit gradient is solved to 1e-12 relative: 1e-8 leaves a wide margin
    for name in ("W", "U", "b"):
        assert torch.allclose(module.weights[name].grad, unrolled.weights[name].grad,
                              rtol=1e-8, atol=1e-10), name


def test_a_term_that_writes_into_the_placeholder_does_not_poison_the_next_call() -> None:
    """The cached zero passed for a bilinear term's state argument is replaced once anything
    wrote into it (its version counter moved)."""
    mod = qp_module_64()
    node = mod.derived.nodes["z"].inner
    like = torch.zeros(1, dtype=torch.float64)
    recipe = recipe_of(node)
    zero = recipe.zero_arg(64, like)
    assert recipe.zero_arg(64, like) is zero
    zero.add_(1.0)
    fresh = recipe.zero_arg(64, like)
    assert fresh is not zero and not bool(fresh.any())


def _grad_sums(nodes: dict) -> list[GradSum]:
    out, seen = [], set()

    def walk(o: object) -> None:
        if id(o) in seen or not type(o).__module__.startswith("lowering.nodes"):
            return
        seen.add(id(o))
        if isinstance(o, GradSum):
            out.append(o)
        for v in getattr(o, "__dict__", {}).values():
            walk(v)

    for n in nodes.values():
        walk(n)
    return out


def test_a_node_tree_pickled_with_planning_state_still_plans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node tree pickled with planning caches in its instances (a ``_recipe_cache`` whose
    bilinear entries hold no function, ``_zero_args``, ``_gram_facts``, the former name
    ``_plan`` of the evaluation plan), as a pickle made before planning moved to the runtime's
    planner table holds them, is restored and plans: the module built on it gives the
    original's output.

    Pins: the first plan of such a tree raised ``TypeError: 'NoneType' object is not
    callable``."""
    layer = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0)))
    mod = layer.torch_module(weight_control=None)
    x = torch.randn(8, 64)
    ref = mod(x)
    sums = _grad_sums(layer.nodes)
    assert sums

    def old_getstate(self: GradSum) -> dict:
        state = self.__dict__.copy()
        state["_plan"] = state.pop("eval_plan")
        state["_recipe_cache"] = [("bilinear", None, None, 0, None)]
        state["_zero_args"] = {}
        state.pop("gram_forms", None)
        return state

    monkeypatch.setattr(GradSum, "__getstate__", old_getstate)
    blob = pickle.dumps(layer.nodes)
    monkeypatch.undo()

    other = copy.copy(layer)
    other.nodes = pickle.loads(blob)
    assert all(not hasattr(s, "_recipe_cache") and hasattr(s, "eval_plan")
               for s in _grad_sums(other.nodes))
    mod2 = other.torch_module(weight_control=None)
    mod2.load_state_dict(mod.state_dict())
    torch.testing.assert_close(mod2(x), ref)


def _grad_sums_of_layer(layer) -> list:  # type: ignore[no-untyped-def]
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
    """``GradSum.gram_forms`` is keyed by ``id(term)``.  A copy of the derived layer
    (``copy.deepcopy``, or a pickle of the node tree) has new term objects: its keys must be
    theirs, and the copy plans the Gram matrix as the original does.

    Pins: with the original's ids the copy silently lost the Gram plan (``Aᵀ(A·)`` at every
    iteration instead of the ``n×n`` matrix); a later object reusing a freed term's id could
    have been given another term's operator."""
    layer = lowering.lower(qp_objective(qp_weight(128, norm=0.9, seed=0)))
    if how == "deepcopy":
        other = copy.deepcopy(layer)
    else:  # the node tree itself (a whole layer holds closures: a module re-lowers it)
        other = copy.copy(layer)
        other.nodes = pickle.loads(pickle.dumps(layer.nodes))
    sums = _grad_sums_of_layer(other)
    assert sums and any(s.gram_forms for s in _grad_sums_of_layer(layer))
    for s in sums:
        assert set(s.gram_forms) <= {id(t) for t in s.terms}
        assert len(s.gram_forms) == len(next(o for o in _grad_sums_of_layer(layer)
                                             if o.block.name == s.block.name).gram_forms)
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
