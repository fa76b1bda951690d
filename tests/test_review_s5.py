"""Review of the hot-path commits 3486223..f54aeae (lean Tracker.record, first-record scale check
from the plain norms, in-place activation on the fused pre-activation, Root without its
broadcast check for batch-shaped plans, Transpose.plus_fn / scaled_plus_fn, the adjoint report
trusting ``all_converged``).

Each test documents a property checked on f54aeae and since.  Two found defects, fixed after
the review: ``test_in_place_activation_follows_an_overridden_sigma`` (introduced by 6329ad7:
a subclass of ReLU with its own σ inherited ``torch.relu_``) and
``test_mask_mode_backward_when_every_sample_failed`` (older: an empty batch crashed the
iterative adjoint).  The lean-record test also runs Anderson and auto on (B, C, H, W) states,
which the solvers now flatten (a bare ValueError before)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.errors import ConvergenceError
from lowering import plan as pl
from lowering.solvers import Tracker, _extreme_scale, exact_rel_residual, solve

TOL = 1e-5


def _first_record_exact(fz: torch.Tensor, tol: float) -> bool:
    tr = Tracker("plain", torch.zeros_like(fz), tol)
    tr.record(torch.zeros_like(fz), fz)
    return tr._exact


def _edges(dtype: torch.dtype, tol: float) -> tuple[float, float]:
    fi = torch.finfo(torch.float32 if dtype == torch.float16 else dtype)
    return 10 * fi.tiny ** 0.5 / max(tol, fi.eps), fi.max ** 0.5 / 1e3


# ---------------------------------------------------------------- first-record scale check
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_scale_check_on_shapes_the_property_test_does_not_draw(dtype: torch.dtype) -> None:
    """PASSES on f54aeae (checked property).  ``_first_scale`` decides as ``_extreme_scale`` on
    states tests/test_hot_path.py does not generate: (B, C, H, W) and (B, 1) states (torch's
    norm of a single entry is ``|x|`` itself, not a square root of a square), and samples whose
    entries spread over many decades (the norm is the largest entry's, so the ``den/√N`` lower
    bound is far from tight), scaled within two decades of either edge of the safe range.
    Both are exact predicates on the same floats: no tolerance."""
    g = torch.Generator().manual_seed(7)
    checked = 0
    for i in range(240):
        tol = (1e-2, 1e-6, 1e-9)[i % 3]
        lo, hi = _edges(dtype, tol)
        shape = ((2, 1), (3, 2, 2, 2), (1, 3, 5), (2, 300))[i % 4]
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        spread = (0.0, 1.0, 4.0, 10.0)[(i // 4) % 4]
        x = x * 10.0 ** (spread * torch.randn(shape, generator=g, dtype=torch.float64))
        for b in range(shape[0]):
            edge = (lo, hi, 1.0)[(i + b) % 3]
            u = float(torch.rand((), generator=g, dtype=torch.float64)) * 4 - 2
            x[b] = x[b] / x[b].abs().max() * edge * 10.0 ** u
        fz = x.to(dtype)
        if not bool(torch.isfinite(fz).all()):
            continue
        checked += 1
        assert _first_record_exact(fz, tol) == _extreme_scale(fz, tol), (shape, tol)
    # float16 cannot hold the upper edge (1.8e16 > 65504): a third of its draws overflow
    assert checked >= 60


# ---------------------------------------------------------------- lean record
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", ["plain", "auto", "anderson"])
@pytest.mark.parametrize("shape", [(1, 6), (4, 6), (3, 2, 2, 2)])
def test_lean_record_flags_rest_on_exact_residuals_when_scales_change_mid_solve(
        dtype: torch.dtype, solver: str, shape: tuple[int, ...]) -> None:
    """PASSES on f54aeae (checked property).  Iterates start at 1 and shrink towards a fixed
    point of size 1e-18 in sample 0 (its difference's squares underflow in float32 late in the
    solve, when the lean path measures it) while the others stay O(1): every sample flagged
    converged meets tol by an exact residual of the returned point, the warm start is left
    unchanged and not returned.  (Tolerance: the exact residual is recomputed in float64 from
    the returned tensors; 1.01 absorbs the float32 rounding of the stored residual.)"""
    g = torch.Generator().manual_seed(1)
    b = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    scale = torch.ones((shape[0],) + (1,) * (len(shape) - 1), dtype=dtype)
    scale[0] = 1e-18

    def f(z: torch.Tensor) -> torch.Tensor:
        return 0.5 * z + scale * b

    z0 = torch.ones(shape, dtype=dtype)
    z0c = z0.clone()
    z, st = solve(f, z0, solver=solver, tol=TOL, max_iter=80)
    fz = f(z)
    exact = exact_rel_residual((fz - z).double(), fz.double())
    assert bool(st.converged.all())
    assert bool((exact <= TOL * 1.01).all()), exact
    assert torch.equal(z0, z0c) and z.data_ptr() != z0.data_ptr()


# ---------------------------------------------------------------- in-place activation
def test_in_place_relu_leaves_input_warm_start_and_plan_constants_alone() -> None:
    """PASSES on f54aeae (checked property).  The module's planned ReLU layer (``relu_`` on
    ``addmm(q, z, M)``) never writes into the user's input ``q``, the warm start ``z0`` or the
    plan's state-free tensors: a second identical call gives bitwise the same output and
    gradient (same kernels, same order)."""
    layer = lowering.lower(qp_objective(qp_weight(16, d=8)))
    mod = layer.torch_module(weight_control=None, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, generator=g).requires_grad_()
    z0 = torch.rand(3, 8, generator=g)
    q0, z00 = q.detach().clone(), z0.clone()
    outs = []
    for _ in range(2):
        z = mod(q, z0=z0)
        (gq,) = torch.autograd.grad(z.pow(2).sum(), q)
        outs.append((z.detach(), gq))
        assert torch.equal(q.detach(), q0) and torch.equal(z0, z00)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ---------------------------------------------------------------- Root and plus_fn
def test_root_still_broadcasts_a_batch_independent_value() -> None:
    """PASSES on f54aeae (checked property).  Only the fused ``c + zM`` (and an elementwise map
    of it) is batch-shaped; a plan whose value is ``(1, N)`` keeps Root's broadcast."""
    c = torch.randn(1, 5)
    root = pl.Root(pl.Elementwise(torch.relu, pl.Constant(c)))
    z = torch.zeros(4, 5)
    out = root.fn(z)
    assert out.shape == (4, 5) and torch.equal(out, torch.relu(c).expand(4, 5))
    fused = pl.Root(pl.Elementwise(torch.relu, pl.Sum([(1.0, pl.Constant(c)),
                                                       (1.0, pl.Matrix(torch.eye(5)))]),
                                   f_inplace=torch.relu_))
    assert fused.fn(z).shape == (4, 5)


@pytest.mark.parametrize("b_shape", [(4, 5), (1, 5), (5,)])
def test_plus_fn_equals_plus(b_shape: tuple[int, ...]) -> None:
    """PASSES on f54aeae (checked property).  ``plus_fn(b)(v) == plus(v, b)`` for a matrix, a
    diagonal-then-matrix, a nested diagonal, and a composition, with ``b`` batched, shared
    ``(1, N)`` or 1-D (the 1-D case takes the unfused fallback).  float64; the fused and the
    unfused forms are the same ``addmm`` or a product-then-add of the same numbers (≤ a few
    ulps apart: 1e-12 relative is safe on any BLAS)."""
    g = torch.Generator().manual_seed(2)
    mt = torch.randn(5, 5, generator=g, dtype=torch.float64)
    d1, d2 = (torch.rand(4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    b = torch.randn(b_shape, generator=g, dtype=torch.float64)
    v = torch.randn(4, 5, generator=g, dtype=torch.float64)
    m = pl.MatrixT(mt)
    for t in (m, pl.DiagonalThenT(d1, m), pl.DiagonalThenT(d2, pl.DiagonalThenT(d1, m)),
              pl.ComposeT(m, pl.DiagonalThenT(d1, m))):
        ref = t(v) + b
        got = t.plus_fn(b)(v)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
        ref_s = t(d2 * v) + b
        assert torch.allclose(t.scaled_plus_fn(d2, b)(v), ref_s, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- adjoint report
@pytest.mark.parametrize("adjoint", ["iterative", "auto"])
def test_unconverged_adjoint_is_still_reported(adjoint: str) -> None:
    """PASSES on f54aeae (checked property).  ``_report`` trusts ``all_converged`` only as a
    shortcut: an adjoint solve cut off after 3 iterations (ρ(J) ≈ 0.97, far from tol) still
    raises, with the samples named."""
    layer = lowering.lower(qp_objective(qp_weight(16, d=8, norm=0.97)))
    mod = layer.torch_module(weight_control=None, dtype=torch.float64, tol=1e-6,
                             backward_adjoint=adjoint, backward_max_iter=3)
    q = torch.randn(4, 8, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64).requires_grad_()
    z = mod(q)
    with pytest.raises(ConvergenceError, match="adjoint fixed point did not reach"):
        torch.autograd.grad((z * torch.arange(z.numel()).reshape(z.shape)).sum(), q,
                            create_graph=adjoint == "auto")


# ---------------------------------------------------------------- defect (pre-existing)
@pytest.mark.parametrize("create_graph", [False, True])
def test_mask_mode_backward_when_every_sample_failed(create_graph: bool) -> None:
    """Failed on f54aeae (defect, pre-existing: 7fa4d22 failed the same way in
    ``_extreme_scale``); solves of an empty batch now return at once.  on_nonconvergence='mask'
    with every sample of the batch unconverged:
    the forward returns all-NaN rows as documented, but the backward runs the iterative adjoint
    on an empty (0, N) batch and dies in ``Tracker.record`` with a bare RuntimeError
    ("max(): Expected reduction dim ...") instead of giving the masked samples no gradient (as
    the direct adjoint, and a batch with one surviving sample, do)."""
    layer = lowering.lower(qp_objective(qp_weight(16, d=8, norm=0.97)))
    mod = layer.torch_module(weight_control=None, solver="plain", tol=1e-6, max_iter=6,
                             on_nonconvergence="mask", backward_adjoint="iterative")
    q = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z, st = mod(q, return_stats=True)
    assert not bool(st.converged.any()) and bool(z.isnan().all())
    (gq,) = torch.autograd.grad(z.nan_to_num().sum(), q, create_graph=create_graph)
    assert torch.equal(gq, torch.zeros_like(gq))
    assert not math.isnan(float(gq.detach().sum()))


# ---------------------------------------------------------------- defect (introduced: 6329ad7)
def test_in_place_activation_follows_an_overridden_sigma() -> None:
    """Failed on f54aeae (defect introduced by 6329ad7; 7fa4d22 passed); ReLU now offers
    ``torch.relu_`` (and ``torch.relu``) only where a subclass keeps its σ.  An activation derived
    from ``ReLU`` that overrides ``sigma`` and ``torch_sigma`` (here ``min(max(t, 0), 1)``) but
    not the new ``torch_sigma_`` inherits ``torch.relu_``: the planned ``T`` then applies a
    plain ReLU on the fused ``c + zM`` — a different map, whose fixed point the solver reports
    as converged.  The plan must evaluate the activation's own ``σ``."""
    from convex_eq.activations.relu import ReLU
    from lowering.nodes import Sigma

    class ClippedReLU(ReLU):
        name = "clipped_relu_review"

        @property
        def torch_sigma(self):  # type: ignore[no-untyped-def]
            return lambda t: torch.clamp(t, 0.0, 1.0)

        def sigma(self, t):  # type: ignore[no-untyped-def]
            return torch.clamp(torch.as_tensor(t), 0.0, 1.0)

    g = torch.Generator().manual_seed(0)
    c, m = 3 * torch.randn(4, 6, generator=g), torch.randn(6, 6, generator=g)
    fused = pl.Sum([(1.0, pl.Constant(c)), (1.0, pl.Matrix(m))])

    class Inner:  # a node whose plan is the fused c + zM
        def plan(self, ctx: object) -> pl.Sum:
            return fused

    act = ClippedReLU()
    plan = Sigma(act, Inner()).plan(None)  # type: ignore[arg-type]
    z = torch.randn(4, 6, generator=g)
    assert torch.equal(plan.fn(z), act.sigma(torch.addmm(c, z, m)))
