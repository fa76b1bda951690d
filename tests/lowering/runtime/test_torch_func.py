"""``torch.func`` transforms, batched (vmapped) backward passes and forward-mode AD over the
emitted module: what cannot run correctly (vmap, transformed weights, the implicit backward's
autograd.Function) is refused first with a typed error that names what to do; what can
(``functional_call``, ``backward="unroll"`` without weight control) runs and matches
``torch.autograd``."""

from __future__ import annotations

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq import models
from convex_eq.errors import OptionError
from lowering import lower
from tests.lowering.runtime.helpers import gen, qp_module

T64 = torch.float64


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_torch_func_transforms_are_refused_with_a_typed_error(transform: str) -> None:
    """vmap, grad and jacrev over the module would fail deep inside (an `.item()` under vmap, a
    `requires_grad_` under grad), untyped; the module refuses them first, naming what to do."""
    mod = qp_module(m=16, dtype=torch.float32, tol=1e-5, backward_tol=1e-5)
    x = torch.randn(3, 64)
    fns = {"vmap": lambda: torch.func.vmap(lambda xi: mod(xi[None])[0])(x),
           "grad": lambda: torch.func.grad(lambda xi: mod(xi).sum())(x),
           "jacrev": lambda: torch.func.jacrev(lambda xi: mod(xi).sum())(x)}
    with pytest.raises(OptionError, match="torch.func transforms") as err:
        fns[transform]()
    assert "loss.backward()" in str(err.value.hint)


def test_functional_call_is_not_refused() -> None:
    """`torch.func.functional_call` is not a transform: it runs the module with substituted
    parameters and gives the module's own output (the same call, the same operations)."""
    mod = qp_module(m=16, dtype=torch.float32, tol=1e-5, backward_tol=1e-5)
    x = torch.randn(3, 64)
    ref = mod(x)
    out = torch.func.functional_call(mod, dict(mod.named_parameters()), (x,))
    assert torch.equal(out, ref)


def _unrolled(**kw):
    layer = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0)))
    return layer.torch_module(weight_control=None, tol=1e-10, max_iter=500, dtype=torch.float64,
                              backward="unroll", unroll_steps=30, **kw)


def test_unrolled_layer_under_torch_func_grad_and_jvp_matches_autograd() -> None:
    """``torch.func.grad`` and ``jvp`` of an unrolled layer give what ``loss.backward()`` and
    ``1ᵀJ1`` give.  1e-10 relative: the same float64 operations in another order (functorch's
    wrappers), a few roundings of ~1e-16 over 30 iterations of a 0.9-contraction.

    Pins: the refusal of torch.func transforms covered this path, which runs correctly."""
    mod = _unrolled()
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xx = x.clone().requires_grad_()
    mod(xx).sum().backward()
    g = torch.func.grad(lambda xi: mod(xi).sum())(x)
    assert torch.allclose(g, xx.grad, rtol=1e-10, atol=1e-12)
    _, t = torch.func.jvp(lambda xi: mod(xi), (x,), (torch.ones_like(x),))
    assert abs(float(t.sum()) - float(xx.grad.sum())) <= 1e-10 * abs(float(xx.grad.sum()))


@pytest.mark.parametrize("case", ["vmap", "functional_call", "implicit"])
def test_what_cannot_run_under_torch_func_is_refused(case: str) -> None:
    """vmap (a host read per iteration), transformed weights (the env cache reads storage) and
    the implicit backward (an autograd.Function) keep the typed refusal."""
    x = torch.randn(3, 64, dtype=torch.float64)
    if case == "implicit":
        layer = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0)))
        mod = layer.torch_module(weight_control=None, dtype=torch.float64)
        fn = lambda: torch.func.grad(lambda xi: mod(xi).sum())(x)  # noqa: E731
    elif case == "vmap":
        mod = _unrolled()
        fn = lambda: torch.func.vmap(lambda xi: mod(xi[None])[0])(x)  # noqa: E731
    else:
        mod = _unrolled()
        ps = {k: v.detach() for k, v in mod.named_parameters()}
        fn = lambda: torch.func.grad(  # noqa: E731
            lambda p: torch.func.functional_call(mod, p, (x,)).sum())(ps)
    with pytest.raises(OptionError, match="torch.func transforms"):
        fn()


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian_vectorize", "vmap_vjp"])
def test_batched_backward_through_the_implicit_gradient_is_a_typed_error(how: str) -> None:
    """A vmapped backward through the implicit gradient is refused with a typed error naming
    what to do (``vectorize=False``), and the row-by-row Jacobian works.

    Pins: it reached the adjoint solve's host reads and failed untyped ("Batching rule not
    implemented for aten::item")."""
    layer = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0)))
    mod = layer.torch_module(weight_control=None, dtype=torch.float64, tol=1e-10,
                             backward_tol=1e-10)
    x = torch.randn(1, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    eye = torch.eye(64, dtype=torch.float64)[:, None]

    def batched() -> None:
        if how == "jacobian_vectorize":
            torch.autograd.functional.jacobian(mod, x, vectorize=True)
            return
        xx = x.clone().requires_grad_()
        z = mod(xx)
        if how == "is_grads_batched":
            torch.autograd.grad(z, xx, eye, is_grads_batched=True)
        else:
            torch.func.vmap(lambda v: torch.autograd.grad(z, xx, v, retain_graph=True))(eye)

    with pytest.raises(OptionError, match="batched gradients") as err:
        batched()
    assert "vectorize=False" in str(err.value.hint)
    assert torch.autograd.functional.jacobian(mod, x).shape == (1, 64, 1, 64)


@pytest.mark.parametrize("backward", ["implicit", "phantom"])
def test_forward_mode_ad_is_a_typed_error_and_unroll_still_runs(backward: str) -> None:
    """Dual tensors through the implicit or phantom backward are refused first, naming what to
    do.  ``unroll`` (plain autograd) keeps forward-mode AD: its tangent is ``J·1``, matching
    ``1ᵀJ`` summed (the same float64 operations: 1e-10 relative).

    Pins: dual tensors reached an autograd.Function without ``jvp`` (an untyped
    NotImplementedError from torch)."""
    import torch.autograd.forward_ad as fwad

    layer = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0)))
    mod = layer.torch_module(weight_control=None, dtype=torch.float64, backward=backward)
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with fwad.dual_level():
        with pytest.raises(OptionError, match="forward-mode AD") as err:
            mod(fwad.make_dual(x, torch.ones_like(x)))
    assert "backward='unroll'" in str(err.value.hint)
    unr = _unrolled()
    with fwad.dual_level():
        t = fwad.unpack_dual(unr(fwad.make_dual(x, torch.ones_like(x)))).tangent
    xx = x.clone().requires_grad_()
    unr(xx).sum().backward()
    assert abs(float(t.sum()) - float(xx.grad.sum())) <= 1e-10 * abs(float(xx.grad.sum()))


@pytest.mark.parametrize("splitting", ["forward-backward", "peaceman-rachford"])
def test_mon_unroll_under_torch_func_grad(splitting: str) -> None:
    """``torch.func.grad`` over the inputs of an unrolled monotone-operator layer equals
    ``torch.autograd.grad`` of the same unrolled loop.  The same float64 operations in the same
    order on one machine: 1e-12 relative is only slack.

    Pins: the splitting's step sizes, computed with ``.numpy()`` from functorch wrappers, raised
    "Cannot access data pointer of Tensor that doesn't have storage"."""
    m = lower(models.mon(n=4, d=2, seed=1, splitting=splitting)).torch_module(
        dtype=T64, backward="unroll", unroll_steps=50)
    x = torch.randn(2, 2, dtype=T64, generator=gen(0))
    g = torch.func.grad(lambda x: (m(x) ** 2).sum())(x)
    xs = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad((m(xs) ** 2).sum(), xs)
    assert float(ref.abs().max()) > 1e-3
    assert torch.allclose(g, ref, rtol=1e-12, atol=0.0)
