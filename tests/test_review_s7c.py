"""Review s7c: torch.func transforms over the module (lowering/module.py ``_functorch_ok``).

The refusal of torch.func transforms must not cover the one path that ran correctly under them:
``backward="unroll"`` (plain autograd through K iterations, no autograd.Function) without weight
control, differentiated by ``torch.func.grad`` / ``jvp`` with respect to its inputs."""

from __future__ import annotations

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.errors import OptionError


def _unrolled(**kw):
    layer = lowering.lower(qp_objective(qp_weight(8, norm=0.9, seed=0)))
    return layer.torch_module(weight_control=None, tol=1e-10, max_iter=500, dtype=torch.float64,
                              backward="unroll", unroll_steps=30, **kw)


def test_unrolled_layer_under_torch_func_grad_and_jvp_matches_autograd() -> None:
    """``torch.func.grad`` and ``jvp`` of an unrolled layer give what ``loss.backward()`` and
    ``1ᵀJ1`` give.  1e-10 relative: the same float64 operations in another order (functorch's
    wrappers), a few roundings of ~1e-16 over 30 iterations of a 0.9-contraction."""
    mod = _unrolled()
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xx = x.clone().requires_grad_()
    mod(xx).sum().backward()
    g = torch.func.grad(lambda xi: mod(xi).sum())(x)
    assert torch.allclose(g, xx.grad, rtol=1e-10, atol=1e-12)
    _, t = torch.func.jvp(lambda xi: mod(xi), (x,), (torch.ones_like(x),))
    assert abs(float(t.sum()) - float(xx.grad.sum())) <= 1e-10 * abs(float(xx.grad.sum()))


@pytest.mark.parametrize("case", ["vmap", "functional_call", "implicit"])
def test_what_cannot_run_under_torch_func_is_still_refused(case: str) -> None:
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
