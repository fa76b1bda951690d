"""Adversarial review of the per-call fixed-cost cuts: wrong results that look right.

1. A weight reparametrised with ``torch.nn.utils.parametrize`` (orthogonal, spectral norm, a
   user's map) is no longer read: ``_raw_env``/``dtype`` read ``weights._parameters``, where a
   parametrised entry is absent, so the layer silently falls back to the symbol's stored value.
2. A call under ``torch.inference_mode()`` caches an inference tensor as the bilinear
   placeholder (``GradSum._zeros``); its ``_version`` cannot be read, so every later call of
   the layer (inference or training) raises.
3. With ``torch.set_flush_denormal(True)`` the plain float32 norms lose the squares below
   ``tiny`` that the range check assumed kept, so a stop can be accepted on its plain residual
   while the residual of the same vectors is above ``tol``.
4. A float64 state with ``||T(z)|| < 1e-30`` accepted on its plain residual reports
   ``||d||/||fz||`` instead of the documented ``||d||/max(||fz||, 1e-30)``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.utils.parametrize as parametrize

import lowering
from benchmarks.common import qp_objective, qp_weight
from lowering.solvers import Tracker


def _module(**kw: object) -> lowering.EquilibriumModule:
    layer = lowering.lower(qp_objective(qp_weight(16, 16, norm=0.9, seed=0)))
    opts = dict(weight_control=None, tol=1e-8, max_iter=300, backward_tol=1e-8,
                backward_max_iter=300, dtype=torch.float64)
    opts.update(kw)
    return layer.torch_module(**opts)


class _Half(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 0.5 * w


# ------------------------------------------------------------------ 1. parametrised weights
def test_a_parametrised_weight_is_the_one_the_layer_uses() -> None:
    """``register_parametrization(mod.weights, name, m)`` makes ``mod.weights[name]`` read
    ``m(original)``; the layer must solve with that value (as with a plain weight set to it)
    and send gradients to ``original``.  Both layers converge to 1e-8 in float64 from the same
    inputs with the same operations: 1e-10 absolute is far above their float64 round-off and
    far below the 0.5·W change (outputs differ by O(1))."""
    torch.manual_seed(0)
    q = torch.randn(3, 16, dtype=torch.float64)
    mod, ref = _module(), _module()
    name = next(iter(mod.weights.keys()))
    parametrize.register_parametrization(mod.weights, name, _Half())
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
    mod = _module().to(torch.float32)
    name = next(iter(mod.weights.keys()))
    parametrize.register_parametrization(mod.weights, name, _Half())
    assert mod.dtype == torch.float32


# ------------------------------------------------------------------ 2. inference mode
def test_a_call_under_inference_mode_does_not_break_later_calls() -> None:
    """Evaluating under ``torch.inference_mode()`` and then training (or evaluating again) is
    ordinary use; the second call must run (and match the first: same inputs, same ops)."""
    torch.manual_seed(1)
    mod = _module()
    q = torch.randn(2, 16, dtype=torch.float64)
    with torch.inference_mode():
        a = mod(q)
        b = mod(q)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    qq = q.clone().requires_grad_()
    z = mod(qq)
    z.sum().backward()
    assert qq.grad is not None
    torch.testing.assert_close(z.detach(), a, rtol=0, atol=0)


# ------------------------------------------------------------------ 3. flush-denormal mode
def _ftz_case() -> tuple[torch.Tensor, torch.Tensor, float]:
    """One float32 sample near the low end of the plain-norm range whose difference has eight
    entries just below ``√tiny`` (their squares are subnormal, flushed to 0 in FTZ mode: the
    first product of each SIMD lane has no accumulator to land in) and the rest of its norm on
    entries where ``T(z)`` is small (fine-grained differences).  ``tol·k`` is the target."""
    tiny = torch.finfo(torch.float32).tiny
    tol, n, k = 1e-6, 32, 1.0
    s = 2 * math.sqrt(n) * 10 * math.sqrt(tiny) / tol * 1.05  # just inside the range check
    fz = torch.zeros(1, n, dtype=torch.float32)
    fz[0, 8] = s
    fz[0, 9:] = s * 1e-3
    den = float(fz.double().norm())
    small = 0.99 * math.sqrt(tiny)
    z = fz.clone()
    z[0, :8] = -small
    dd = math.sqrt((tol * k * den) ** 2 - 8 * small ** 2) / math.sqrt(n - 9)
    z[0, 9:] = fz[0, 9:] - dd
    return z, fz, tol


def test_flush_denormal_does_not_let_a_plain_stop_pass_above_tol() -> None:
    """The stop is accepted only if the float64 residual of the very float32 vectors meets
    ``tol`` (float64 squares of these entries are far from under- or overflow; no tolerance
    is involved: the flag must agree with the exact residual's side of ``tol``)."""
    z, fz, tol = _ftz_case()
    d = (fz - z).double()
    exact = float(d.norm() / fz.double().norm())
    assert exact > tol  # the case is what it claims: above tol by ~1e-4 relative
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        tr = Tracker("t", z, tol)
        done = tr.record(z, fz)
        st = tr.stats()
    finally:
        torch.set_flush_denormal(False)
    assert not done
    assert not bool(st.converged.any())
    assert float(st.final_residual[0]) > tol


# ------------------------------------------------------------------ 4. the 1e-30 floor
def test_a_plain_stop_reports_the_floored_residual() -> None:
    """float64 state at ~1e-40: ``||d|| / max(||fz||, 1e-30)`` is the documented residual;
    the reported one must be it (float64 rounding: 1e-12 relative is ~10⁴ ulps)."""
    fz = torch.full((1, 4), 1e-40, dtype=torch.float64)
    z = fz * (1 - 1e-8)
    tr = Tracker("t", z, 1e-6)
    assert tr.record(z, fz)
    d = fz - z
    want = float(d.norm() / max(float(fz.norm()), 1e-30))
    got = float(tr.stats().final_residual[0])
    assert math.isclose(got, want, rel_tol=1e-12), (got, want)
