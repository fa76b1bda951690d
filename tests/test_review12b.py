"""Review 12b: regression tests for defects found in commits 10c0344 and 4b0231e."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from lowering.nodes import GradSum


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


def test_node_tree_pickled_before_the_recipe_held_functions_still_plans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 10c0344, ``GradSum.__getstate__`` kept ``_recipe_cache`` and a bilinear entry's
    5th slot was None; since then ``plan()`` calls that slot (``off(ctx.values, env)``).  A node
    tree pickled by the previous version (the way tests/test_review_s7b.py persists a layer's
    nodes) is restored by ``__setstate__`` with the old cache as is, and the first plan raises
    ``TypeError: 'NoneType' object is not callable``.  The old pickle is reproduced exactly: the
    old instance dictionary (the old recipe, the old ``__getstate__`` that did not drop it)."""
    layer = lowering.lower(qp_objective(qp_weight(64, norm=0.9, seed=0)))
    mod = layer.torch_module(weight_control=None)
    x = torch.randn(8, 64)
    ref = mod(x)  # fills the recipe cache
    sums = _grad_sums(layer.nodes)
    assert sums and all("_recipe_cache" in s.__dict__ for s in sums)
    for s in sums:  # the previous version's recipe: no function for a bilinear term
        s._recipe_cache = [(k, t, c, a, None if k == "bilinear" else off)
                           for k, t, c, a, off in s._recipe_cache]

    def old_getstate(self: GradSum) -> dict:
        state = self.__dict__.copy()
        for key in ("_zero_args", "_gram_facts", "_gram"):
            state.pop(key, None)
        return state

    monkeypatch.setattr(GradSum, "__getstate__", old_getstate)
    blob = pickle.dumps(layer.nodes)
    monkeypatch.undo()

    other = copy.copy(layer)
    other.nodes = pickle.loads(blob)
    mod2 = other.torch_module(weight_control=None)
    mod2.load_state_dict(mod.state_dict())
    torch.testing.assert_close(mod2(x), ref)


def test_train_replay_runs_with_the_other_methods_models_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/train.py (4b0231e) says the replay runs "with the other methods' models and
    optimizers dropped first (the module alone)": ``models``/``opts`` are cleared, but the
    locals ``m`` (the ``m.train()`` loop), ``deq`` and ``fn`` (the last step's closure) still
    hold torchdeq classifiers (and an optimizer) while ``_replay`` runs."""
    pytest.importorskip("torchdeq")
    from benchmarks import common, train

    alive: list[int] = []
    orig = train._replay

    def probe(*a, **k):
        gc.collect()
        alive.append(sum(type(o) is train.TorchDEQClassifier for o in gc.get_objects()))
        return orig(*a, **k)

    monkeypatch.setattr(train, "_replay", probe)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cfg = common.Config.make(True)
        cfg.train_steps, cfg.train_window = 2, 1
        train.run(cfg, lambda msg: None)
    finally:
        torch.set_num_threads(threads)
    assert alive == [0], f"torchdeq classifiers alive during the replay: {alive}"
