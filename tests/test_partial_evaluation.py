"""Input injections are computed once per forward solve, not in every evaluation of ``T``
(``lowering.nodes.partial_evaluation``), and the gradient path is unaffected."""

from __future__ import annotations

import torch

import lowering
from convex_eq.models import opteq


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


def test_direct_adjoint_matches_iterative_and_dense_reference() -> None:
    """``backward_adjoint="direct"`` (Jacobian formed once, LU solve) gives the gradient of the
    iterative adjoint; its statistics say "direct" with a measured residual.  (The exact dense
    float64 check of the implicit gradient is in tests/test_training.py.)"""
    torch.manual_seed(1)
    obj = opteq(n=8, m=8, d=4)
    x = torch.randn(6, 4, dtype=torch.float64)
    grads = {}
    for meth in ("direct", "iterative"):
        module = lowering.lower(obj).torch_module(dtype=torch.float64, tol=1e-12,
                                                  backward_adjoint=meth, backward_tol=1e-12,
                                                  backward_solver="anderson")
        xx = x.clone().requires_grad_()
        (module(xx) ** 2).sum().backward()
        grads[meth] = xx.grad
        assert module.last_backward_stats.solver == ("direct" if meth == "direct"
                                                     else "anderson")
        assert module.last_backward_stats.max_residual <= 1e-12
    # both solve the same linear system to 1e-12 relative residual (conditioning ≤ 1/(1 − 0.81))
    assert torch.allclose(grads["direct"], grads["iterative"], rtol=1e-9, atol=1e-12)


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


def test_nested_batch_coupling_uses_the_iterative_adjoint_and_refuses_mask() -> None:
    """A batch decorrelation inside a Moreau envelope couples the samples: the direct (per-sample
    block) adjoint does not apply, mask mode is refused, and the gradient equals the unrolled
    one (it was 0.84/6.1 off, reported as a 1e-17 residual, when the coupling went unseen)."""
    import pytest

    import convex_eq as ce
    from convex_eq.errors import OptionError

    base = opteq(n=6, m=6, d=3, activation="tanh")
    z = base.states[0]
    obj = 0.6 * ce.moreau(base + 0.05 * ce.BatchDecorrelation(z), 0.4)
    layer = lowering.lower(obj)
    with pytest.raises(OptionError, match="couples the batch"):
        layer.torch_module(dtype=torch.float64, on_nonconvergence="mask")
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, kw in {"implicit": {"backward_adjoint": "direct", "backward_tol": 1e-12,
                                  "backward_solver": "anderson"},
                     "unroll": {"backward": "unroll", "unroll_steps": 400}}.items():
        module = lowering.lower(obj).torch_module(dtype=torch.float64, tol=1e-10,
                                                  max_iter=1000, **kw)
        (module(x) ** 2).sum().backward()
        grads[name] = module.weights["W"].grad
        if name == "implicit":  # coupled: the per-sample Jacobian does not apply
            assert module._batch_coupled and module.last_backward_stats.solver == "anderson"
            # even if the coupling were missed, the direct solve's residual (one true VJP)
            # fails and the adjoint is iterated
            module._batch_coupled = False
            module.zero_grad()
            (module(x) ** 2).sum().backward()
            assert module.last_backward_stats.solver == "anderson"
            grads["missed"] = module.weights["W"].grad
    # 400 contraction steps reach the fixed point to round-off; the adjoint is solved to 1e-12
    for name in ("implicit", "missed"):
        assert torch.allclose(grads[name], grads["unroll"], rtol=1e-7, atol=1e-9), name
