"""The emitted module's state and copies: pickle, ``torch.save``, ``copy.deepcopy`` and
``state_dict`` round trips, a state dict of another layer refused by name, caches that are made
again rather than carried, and weights reparametrised with ``torch.nn.utils.parametrize``."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.utils.parametrize as parametrize

import convex_eq as ce
import lowering
from convex_eq import models
from convex_eq.errors import ShapeError
from tests.lowering.helpers import randn
from tests.lowering.runtime.helpers import (
    Half,
    conv_layer,
    qp_module_16,
    qp_module_64,
    small_module,
)


def test_pickle_torch_save_and_deepcopy_round_trip():
    d = conv_layer()
    m = d.torch_module()
    x = torch.randn(3, 1, 6, 6)
    ref = m(x).detach()
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert torch.equal(clone(x).detach(), ref)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert torch.equal(again(x).detach(), ref)


def test_state_dict_of_another_layer_is_refused_by_name():
    conj = lowering.lower(models.opteq(n=6, m=6, d=3, form="conjugate", seed=0))
    canon = lowering.lower(models.opteq(n=6, m=6, d=3, form="canonical", seed=0))
    a, b = conj.torch_module(), canon.torch_module()
    assert {k: v.shape for k, v in a.state_dict().items() if torch.is_tensor(v)} == \
        {k: v.shape for k, v in b.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ShapeError, match="another layer"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(canon.torch_module().state_dict())  # the same layer loads


T64 = torch.float64


def test_state_dict_dtypes_and_errors() -> None:
    m = small_module(tol=1e-10)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    m2 = small_module(tol=1e-10)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)
    buf.seek(0)
    m2.load_state_dict(torch.load(buf))
    x = randn(4, 3)
    assert torch.equal(m(x), m2(x))
    m32 = lowering.lower(models.opteq(n=8, m=10, d=3, form="conjugate", seed=3)).torch_module(
        dtype=torch.float32, tol=1e-5)
    out32 = m32(x.float())
    assert out32.dtype == torch.float32
    assert float((out32.double() - m(x)).abs().max()) < 1e-4  # float32 at tol 1e-5
    m64 = m32.to(T64)
    assert m64(x).dtype == T64
    with pytest.raises(ce.ShapeError, match="expected"):
        m(randn(4, 5))
    with pytest.raises(ce.NonFiniteError):
        m(torch.full((2, 3), float("nan"), dtype=T64))
    with pytest.raises(ce.OptionError, match="unknown solver"):
        small_module(solver="newton")
    with pytest.raises(TypeError):
        small_module(colour="red")


def test_module_caches_survive_pickle_deepcopy_and_moves() -> None:
    """The per-node caches (activation ops, the bilinear placeholder zero) are not pickled and
    are made again for another dtype; outputs and gradients agree bit for bit."""
    mod = qp_module_64()
    q = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    z1 = mod(q)
    (g1,) = torch.autograd.grad(z1.sum(), q)
    for other in (pickle.loads(pickle.dumps(mod)), copy.deepcopy(mod)):
        z2 = other(q)
        (g2,) = torch.autograd.grad(z2.sum(), q)
        torch.testing.assert_close(z2, z1, rtol=0, atol=0)
        torch.testing.assert_close(g2, g1, rtol=0, atol=0)
    f32 = copy.deepcopy(mod).to(torch.float32)
    torch.testing.assert_close(f32(q.float()).double(), z1, rtol=1e-4, atol=1e-5)
    sig = mod.derived.nodes["z"]
    assert "_ops" not in pickle.loads(pickle.dumps(sig)).__dict__


# ------------------------------------------------------------------ parametrised weights
def test_a_parametrised_weight_is_the_one_the_layer_uses() -> None:
    """``register_parametrization(mod.weights, name, m)`` makes ``mod.weights[name]`` read
    ``m(original)``; the layer must solve with that value (as with a plain weight set to it)
    and send gradients to ``original``.  Both layers converge to 1e-8 in float64 from the same
    inputs with the same operations: 1e-10 absolute is far above their float64 round-off and
    far below the 0.5·W change (outputs differ by O(1)).

    Pins: a parametrised weight (absent from ``weights._parameters``) was not read, and the
    layer silently used the symbol's stored value."""
    torch.manual_seed(0)
    q = torch.randn(3, 16, dtype=torch.float64)
    mod, ref = qp_module_16(), qp_module_16()
    name = next(iter(mod.weights.keys()))
    parametrize.register_parametrization(mod.weights, name, Half())
    with torch.no_grad():
        ref.weights[name].mul_(0.5)
    torch.testing.assert_close(mod.weights[name], ref.weights[name], rtol=0, atol=0)
    z = mod(q)
    torch.testing.assert_close(z, ref(q), rtol=0, atol=1e-10)
    z.square().sum().backward()
    g = mod.weights.parametrizations[name].original.grad
    assert g is not None and bool(g.abs().sum() > 0)


def test_a_parametrised_weight_sets_the_module_dtype() -> None:
    """``dtype`` is the weights' dtype, also when the only weight is parametrised."""
    mod = qp_module_16().to(torch.float32)
    name = next(iter(mod.weights.keys()))
    parametrize.register_parametrization(mod.weights, name, Half())
    assert mod.dtype == torch.float32
