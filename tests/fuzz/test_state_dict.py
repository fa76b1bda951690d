"""Fuzz: ``state_dict`` round trips of emitted modules.

A saved module's ``state_dict`` (through ``torch.save`` / ``torch.load``) loads into a fresh module
of the same derived layer bit-exactly: every tensor and the forward outputs are ``torch.equal``.
Loading a tensor of the wrong shape raises: ``load_state_dict``'s own ``RuntimeError`` names the
parameter; putting a wrongly shaped tensor into ``module.weights`` or a buffer makes ``forward``
raise a ``ShapeError`` naming it (not a torch broadcasting error deep inside ``T``).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch import nn

import convex_eq as ce
from tests.fuzz.modules import ModuleCase, module_cases
from tests.fuzz.stats import fuzz_stats, record  # noqa: F401  (autouse: writes the outcome counts)


def _run(module, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = module(x)
        except (ce.ConvergenceError, ce.NonFiniteError) as err:
            return type(err).__name__
    return out if isinstance(out, tuple) else (out,)


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@given(module_cases(stress=False), st.integers(0, 2**31 - 1))
def test_state_dict_round_trips_bit_exactly(case: ModuleCase, seed: int) -> None:
    note(repr(case))
    case.options["on_nonconvergence"] = "warn"
    m1 = case.module()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m1.weights.values():
            p.add_(1e-2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    buf = io.BytesIO()
    torch.save(m1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    m2 = case.module()
    moved = any(not torch.equal(p, m2.weights[k]) for k, p in m1.weights.items())
    m2.load_state_dict(sd)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        if not torch.is_tensor(s1[k]):  # _extra_state: the derivation fingerprint, targets
            assert s1[k] == s2[k], f"{k} differs"
            continue
        assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), f"{k} differs"
    o1, o2 = _run(m1, case.x), _run(m2, case.x)
    assert _same(o1, o2), f"outputs differ after the round trip: {o1} vs {o2}"
    record("state_dict", f"round-trip:{'bit-exact' if not isinstance(o1, str) else o1}"
           f"{'' if moved else '(unperturbed)'}")


def _wrong(t: torch.Tensor, how: int) -> torch.Tensor:
    if t.ndim == 0 or how % 3 == 0:
        return torch.zeros(*t.shape, 2, dtype=t.dtype)
    shape = list(t.shape)
    shape[how % t.ndim] += 1 if how % 2 else -1 if shape[how % t.ndim] > 1 else 1
    return torch.zeros(*shape, dtype=t.dtype)


@given(module_cases(stress=False), st.integers(0, 10**6))
def test_loading_weights_of_the_wrong_shape_raises_naming_the_parameter(case: ModuleCase,
                                                                       k: int) -> None:
    note(repr(case))
    m = case.module()
    sd = m.state_dict()
    tensors = sorted(n for n in sd if torch.is_tensor(sd[n]))  # not the _extra_state entry
    key = tensors[k % len(tensors)]
    bad = dict(sd)
    bad[key] = _wrong(sd[key], k)
    note(f"{key}: {tuple(sd[key].shape)} -> {tuple(bad[key].shape)}")
    for strict in (True, False):
        with pytest.raises(RuntimeError) as info:
            m.load_state_dict(bad, strict=strict)
        assert key in str(info.value), f"load_state_dict error does not name {key}: {info.value}"
    # the module is unchanged by the failed load
    for name, t in m.state_dict().items():
        assert torch.equal(t, sd[name]) if torch.is_tensor(t) else t == sd[name]
    if key.startswith("wc_"):  # weight control's own power-iteration state, not a layer weight
        setattr(m, key, bad[key])  # put in place directly: forward names the buffer
        with pytest.raises(ce.ShapeError) as err:
            m(case.x)
        assert key in str(err.value), f"forward error does not name {key}: {err.value}"
        record("state_dict", "wrong-shape:wc:raises-naming")
        return
    # a wrongly shaped tensor put in place directly: forward names the parameter
    name = key.split(".", 1)[1] if key.startswith("weights.") else key
    if key.startswith("weights."):
        m.weights[name] = nn.Parameter(bad[key])
        sym = name
    else:  # buffers: const_<C>, scalar_<s>
        setattr(m, key, bad[key])
        sym = key.split("_", 1)[1]
    with pytest.raises(ce.ShapeError) as err:
        m(case.x)
    assert sym in str(err.value), f"forward error does not name {sym}: {err.value}"
    record("state_dict", f"wrong-shape:{key.split('.')[0].split('_')[0]}:raises-naming")
