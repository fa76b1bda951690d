"""The per-call hot path after its fixed costs were cut (lowering/solvers.py, lowering/plan.py,
lowering/module.py): the first record's scale check read from the residual's own norms, the
in-place activation on a fused pre-activation, the input finiteness check by a norm, and the
solve contexts that are no-ops when nothing changes.  Each shortcut must decide exactly what
the slower form it replaced decided."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import lowering
from benchmarks.common import qp_objective, qp_weight
from convex_eq.errors import NonFiniteError
from lowering import plan as pl
from lowering import solvers
from lowering.solvers import Tracker, _extreme_scale, _scale_ok, compiled_steps

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _edges(dtype: torch.dtype, tol: float) -> tuple[float, float]:
    """The safe range of a sample's largest entry (``_scale_ok``'s bounds)."""
    fi = torch.finfo(torch.float32 if dtype == torch.float16 else dtype)
    return 10 * fi.tiny ** 0.5 / max(tol, fi.eps), fi.max ** 0.5 / 1e3


def _state(scales: list[float | None], n: int, shape: str, dtype: torch.dtype,
           seed: int) -> torch.Tensor:
    """One sample per scale: ``scale`` times a pattern whose largest entry is either the whole
    norm (one nonzero entry) or ``norm/√n`` (all entries equal) — the two ends of the bound
    ``den/√n ≤ max|x| ≤ den`` the check relies on — or random; ``None``: a zero sample."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for sc in scales:
        if shape == "one":
            row = torch.zeros(n, dtype=torch.float64)
            row[0] = 1.0
        elif shape == "flat":
            row = torch.ones(n, dtype=torch.float64)
        else:
            row = torch.randn(n, generator=g, dtype=torch.float64)
        rows.append(row * sc if sc is not None else torch.zeros(n, dtype=torch.float64))
    return torch.stack(rows).to(dtype)


def _first_record_exact(fz: torch.Tensor, tol: float) -> bool:
    """Whether the tracker's first record switches to exact residuals (``_exact``)."""
    tr = Tracker("plain", torch.zeros_like(fz), tol)
    tr.record(torch.zeros_like(fz), fz)
    return tr._exact


@given(where=st.lists(st.one_of(st.none(), st.tuples(st.sampled_from(["lo", "hi", "any"]),
                                                       st.floats(-3.0, 3.0))),
                      min_size=1, max_size=4),
       n=st.sampled_from([1, 2, 7, 64, 1000]),
       shape=st.sampled_from(["one", "flat", "random"]),
       dtype=st.sampled_from(DTYPES),
       tol=st.sampled_from([1e-2, 1e-6, 1e-9]),
       seed=st.integers(0, 3))
# the ends of the bound, always run: a flat state just below the lower edge (its norm is √n
# above it) and one just above the upper edge with its norm √n above that
@example(where=[("lo", -0.3)], n=1000, shape="flat", dtype=torch.float32, tol=1e-6, seed=0)
@example(where=[("hi", 0.1), None], n=64, shape="flat", dtype=torch.float64, tol=1e-9, seed=0)
@example(where=[("hi", -1.0)], n=1000, shape="flat", dtype=torch.float32, tol=1e-6, seed=0)
def test_first_record_scale_check_decides_as_the_exact_check(where, n, shape, dtype, tol, seed):
    """The norm-based sufficient test only ever skips the exact check where that check says
    "safe": the decision equals ``_extreme_scale`` on every state (both are exact predicates
    on the same floats, no tolerance involved).  Sample scales are drawn within three decades
    of either edge of the safe range (where a wrong bound would show), or anywhere."""
    lo, hi = _edges(dtype, tol)
    scales = [None if w is None else
              (lo if w[0] == "lo" else hi if w[0] == "hi" else 1.0) * 10.0 ** (
                  w[1] * (1 if w[0] != "any" else 12)) for w in where]
    fz = _state(scales, n, shape, dtype, seed)
    if not bool(torch.isfinite(fz).all()):  # overflowed in this dtype: a non-finite iterate
        return
    assert _first_record_exact(fz, tol) == _extreme_scale(fz, tol)


@pytest.mark.parametrize("dtype, e", [(torch.float32, -13), (torch.float32, 17),
                                      (torch.bfloat16, -17), (torch.float64, -150)])
def test_first_record_scale_check_catches_the_edges(dtype: torch.dtype, e: int) -> None:
    """States just past the safe range, flat (largest entry = norm/√n: the end of the bound the
    check divides by) — exact mode is switched on.  (float16 never needs it: its norms run in
    float32, whose range holds every float16 square.)"""
    fz = _state([1.0, 10.0 ** e], 64, "flat", dtype, 0)
    assert _extreme_scale(fz, 1e-6)
    assert _first_record_exact(fz, 1e-6)


def test_a_broken_scale_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property above can fail: a check that forgets the ``√n`` of the lower bound (reads
    ``min den`` as the smallest largest entry) skips exact mode on a flat state whose entries
    sit below the safe range while its norm, √n times larger, does not."""
    def broken(den: torch.Tensor, n: int, dtype: torch.dtype, tol: float,
               least: float = 0.0) -> bool:
        return float(den.min()) >= least and _scale_ok(float(den.min()), float(den.max()),
                                                        dtype, tol)

    fi = torch.finfo(torch.float32)
    edge = 10 * fi.tiny ** 0.5 / 1e-6  # the smallest safe largest entry at tol 1e-6
    fz = torch.full((1, 1000), 0.5 * edge)  # below it; its norm is √1000/2 ≈ 16× above
    assert _extreme_scale(fz, 1e-6) and _first_record_exact(fz, 1e-6)
    monkeypatch.setattr(solvers, "_norms_in_range", broken)
    assert not _first_record_exact(fz, 1e-6)


def test_non_finite_first_image_goes_exact() -> None:
    """A NaN in the first image makes the norms NaN: the check falls back to the exact one."""
    fz = torch.ones(3, 5)
    fz[1, 2] = math.nan
    assert _first_record_exact(fz, 1e-6) == _extreme_scale(fz, 1e-6)


# ---------------------------------------------------------------- in-place activation
def _fused(c: torch.Tensor, m: torch.Tensor) -> pl.Sum:
    return pl.Sum([(1.0, pl.Constant(c)), (1.0, pl.Matrix(m))])


def test_in_place_activation_only_on_a_fresh_pre_activation() -> None:
    """``relu_`` is applied to the fused ``c + zM`` (a new tensor each call): ``z``, ``c`` and
    ``M`` are unchanged and the value is ``relu(c + zM)``.  On an inner value that may alias
    ``z`` (the identity) the out-of-place ``relu`` is kept."""
    g = torch.Generator().manual_seed(0)
    z, c, m = (torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g),
               torch.randn(6, 6, generator=g))
    z0, c0, m0 = z.clone(), c.clone(), m.clone()
    fused = pl.Elementwise(torch.relu, _fused(c, m), f_inplace=torch.relu_)
    out = fused.fn(z)
    assert torch.equal(out, torch.relu(torch.addmm(c0, z0, m0)))  # same kernel: bitwise
    assert torch.equal(z, z0) and torch.equal(c, c0) and torch.equal(m, m0)
    ident = pl.Elementwise(torch.relu, pl.Identity(), f_inplace=torch.relu_)
    out = ident.fn(z)
    assert torch.equal(z, z0) and out is not z


def test_in_place_activation_keeps_gradients() -> None:
    """Under autograd the in-place ``relu_`` on the fused pre-activation gives the gradient of
    the out-of-place form (the pre-activation is not needed by ``addmm``'s backward)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    m = torch.randn(5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    fused = pl.Elementwise(torch.relu, _fused(c, m), f_inplace=torch.relu_)
    a = torch.autograd.grad(fused.fn(z).sum(), (z, c, m))
    b = torch.autograd.grad(torch.relu(c + z @ m).sum(), (z, c, m))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- input finiteness
def _qp_module() -> torch.nn.Module:
    layer = lowering.lower(qp_objective(qp_weight(16, d=8)))
    return layer.torch_module(weight_control=None, dtype=torch.float32)


def test_large_finite_inputs_pass_the_finiteness_check() -> None:
    """An input whose norm overflows float32 (entries 1e30) is finite: the norm test falls back
    to the entrywise one instead of refusing it."""
    mod = _qp_module()
    x = torch.full((2, 8), 1e30)
    assert mod._nonfinite_inputs({"q": x}, 2, x.device) is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_are_named(bad: float) -> None:
    """NaN / ±Inf inputs are refused with the offending sample named."""
    mod = _qp_module()
    x = torch.randn(4, 8)
    x[2, 5] = bad
    with pytest.raises(NonFiniteError, match=r"samples 2\b"):
        mod(x)


# ---------------------------------------------------------------- contexts
def test_compiled_steps_context_restores_the_outer_setting() -> None:
    """Entering with the value already set changes nothing; entering with another one sets it
    and restores the outer value on exit, also when the body raises."""
    from lowering import solvers

    outer = solvers.CompiledSteps(4)
    assert solvers._COMPILED.get() is None
    with compiled_steps(outer):
        assert solvers._COMPILED.get() is outer
        with compiled_steps(outer):
            assert solvers._COMPILED.get() is outer
        assert solvers._COMPILED.get() is outer
        with pytest.raises(RuntimeError), compiled_steps(None):
            assert solvers._COMPILED.get() is None
            raise RuntimeError
        assert solvers._COMPILED.get() is outer
    assert solvers._COMPILED.get() is None


# ---------------------------------------------------------------- the lean record
@pytest.mark.parametrize("solver", ["plain", "auto", "anderson"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_lean_record_keeps_the_general_records_history(
        monkeypatch: pytest.MonkeyPatch, solver: str, dtype: torch.dtype) -> None:
    """The lean path of :meth:`Tracker.record` (later iterations of a finite (B, N) solve)
    records bit for bit what the general path records: same residual history, same returned
    iterate, same statistics — it is the same arithmetic, fewer Python steps."""
    from lowering.solvers import solve

    g = torch.Generator().manual_seed(5)
    a = 0.9 * torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))[0]
    a, b = a.to(dtype), torch.randn(6, 12, generator=g).to(dtype)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(z @ a + b)

    general = Tracker.record

    def no_lean(self, *args, **kw):  # type: ignore[no-untyped-def]
        self._lean = False
        return general(self, *args, **kw)

    runs = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(Tracker, "record", no_lean)
        z, st = solve(f, torch.zeros_like(b), solver=solver, tol=1e-5, max_iter=300)
        runs.append((z, st))
    (z1, s1), (z2, s2) = runs
    assert torch.equal(z1, z2)
    assert torch.equal(s1.residuals, s2.residuals)
    assert torch.equal(s1.converged, s2.converged) and s1.solver == s2.solver


def test_lean_record_hands_a_non_finite_iterate_to_the_general_path() -> None:
    """A sample that turns NaN after the lean path has taken over is still marked non-finite
    (its residual reads inf, never a pass), the others converge."""
    from lowering.solvers import solve

    def f(z: torch.Tensor) -> torch.Tensor:
        out = 0.5 * z + 1.0
        if bool((z[1] > 1.5).any()):  # sample 1 blows up after a few iterations
            out = out.clone()
            out[1] = math.nan
        return out

    _, st = solve(f, torch.zeros(3, 4), solver="plain", tol=1e-6, max_iter=100)
    assert st.nonfinite.tolist() == [False, True, False]
    assert st.converged.tolist() == [True, False, True]


@pytest.mark.parametrize("base", ["relu", "tanh", "sigmoid"])
def test_a_subclass_with_its_own_sigma_is_not_given_the_parents_torch_op(base: str) -> None:
    """An activation derived from ReLU / tanh / sigmoid that overrides only ``sigma`` is
    evaluated by its own ``σ``: the parent's torch op (``torch.relu``, ``torch.relu_``, …) is
    offered only to classes that keep the parent's ``sigma``."""
    from convex_eq.activations.relu import ReLU
    from convex_eq.activations.sigmoid import Sigmoid
    from convex_eq.activations.tanh import Tanh

    parent = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid}[base]

    class Halved(parent):  # type: ignore[misc, valid-type]
        name = f"halved_{base}_test"

        def sigma(self, t):  # type: ignore[no-untyped-def]
            return 0.5 * parent.sigma(self, t)

    act, plain = Halved(), parent()
    t = torch.linspace(-3, 3, 13)
    assert torch.equal(act.torch_sigma(t), 0.5 * plain.sigma(t))
    assert act.torch_sigma_ is None
    assert plain.torch_sigma_ is (torch.relu_ if base == "relu" else None)
