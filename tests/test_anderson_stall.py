"""Anderson's stall guard (lowering/solvers.py, ``_StallGuard``; docs/theory.md §8).

Slow contractions on which Anderson (history 5, restarts after 2m iterations without progress)
stayed far from the fixed point for its whole budget while plain iteration converged: the
inclusion layers the uniqueness property found (tests/test_inclusions.py), a non-normal linear
map, and a batch that mixes such a map with one on which plain iteration diverges.  Each of
these tests fails without the guard; the last two check that solves which do not stall never
start one (so they run as before, bit for bit), and that Anderson stays fast where it was."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from lowering import solvers

T64 = torch.float64
N = 24

#: (seed, scale, warm start) of tests/test_inclusions.py's decoupled inclusion where Anderson
#: stalled at a relative residual of 6e-3 to 7e-2 for 3000 iterations (tol 1e-13; 341 is the one
#: the property found, the others a sweep of seeds 0–2999 at scales in [4, 6], warm and cold);
#: each is a certified contraction, Lip(T) ≤ 0.9917–0.9937, where plain iteration needs
#: 343–2251 iterations
INCLUSION_STALLS = [(341, 5.796875, True), (1837, 5.727665081148051, True),
                    (2084, 5.290001297828633, True), (812, 4.410944514086375, False)]


@pytest.mark.parametrize(("seed", "scale", "warm"), INCLUSION_STALLS)
def test_anderson_converges_on_the_inclusion_layers_where_it_stalled(seed: int, scale: float,
                                                                    warm: bool) -> None:
    import lowering
    from tests.test_inclusions import _decoupled_inclusion

    d = lowering.lower(_decoupled_inclusion(seed, scale, False))
    x = torch.as_tensor(np.random.default_rng(seed).standard_normal((2, 3)), dtype=T64)
    z0 = torch.as_tensor(np.random.default_rng(seed + 1).uniform(0.5, 5.0, (2, 6)), dtype=T64)
    mod = d.torch_module(dtype=T64, solver="anderson", tol=1e-13, max_iter=3000)
    with torch.no_grad():
        za, st = mod(x, z0=z0 if warm else None, return_stats=True)
    # (the guard converges in 77–165 iterations here; 3000 is the budget it stalled in)
    assert bool(st.converged.all()), (st.solver, st.returned_residual)
    mod.config.forward.solver = "plain"
    with torch.no_grad():
        zp, sp = mod(x, z0=z0 if warm else None, return_stats=True)
    assert bool(sp.converged.all())
    # both stop at relative residual 1e-13 of a contraction with factor ≤ 0.994 and entries
    # ≤ 2, so each lies within ~1e-13·||T(z)||/0.006 ≈ 1e-10 of the unique fixed point whatever
    # the CPU/BLAS rounding; distinct points would differ by O(1)
    assert torch.allclose(za, zp, atol=1e-8, rtol=0)


def _jordan() -> torch.Tensor:
    """``0.9·I + 0.12·S`` (S the shift): spectral radius 0.9, ``||·||₂ = 1.02``; its powers
    peak at 16.6 (k = 196), so plain iteration's residual grows before it falls."""
    return 0.9 * torch.eye(N, dtype=T64) + 0.12 * torch.diag(torch.ones(N - 1, dtype=T64), 1)


def _linear(W: torch.Tensor, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``z ↦ Wz + b`` per sample (``W``: one ``(N, N)`` map, or ``(B, N, N)``, one per sample)."""
    if W.ndim == 2:
        return lambda z: z @ W.T + b
    return lambda z: torch.einsum("bij,bj->bi", W, z) + b


def _check_solution(z: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> None:
    """``z`` against ``(I − W)⁻¹ b`` (per sample for a batch of maps): a relative residual of
    1e-12 puts ``z`` within ``||(I − W)⁻¹||₂ · 1e-12`` (≤ 2166e-12 for these maps) of it,
    relative to ``||f(z)||``, on any CPU/BLAS; 1e-6 leaves 400× room and still fails any
    iterate that is not the fixed point (a stalled one is off by O(1))."""
    exact = torch.linalg.solve(torch.eye(N, dtype=T64) - W, (b.T if W.ndim == 2 else b[..., None]))
    exact = exact.T if W.ndim == 2 else exact[..., 0]
    err = (z - exact).norm(dim=1) / exact.norm(dim=1)
    assert bool((err < 1e-6).all()), err


def test_anderson_converges_on_a_nonnormal_linear_map_where_it_stalled() -> None:
    """Anderson stayed at 4e-2 for 3000 iterations on ``0.9·I + 0.12·S``; plain iteration
    converges in ~700 (its residual first grows, up to 2.7× from zero)."""
    W = _jordan()
    b = torch.randn(4, N, generator=torch.Generator().manual_seed(0), dtype=T64)
    with torch.no_grad():
        z, st = solvers.solve(_linear(W, b), torch.zeros(4, N, dtype=T64), "anderson",
                              tol=1e-12, max_iter=3000)
    # (the guard needs ~1240 iterations here: plain iteration's ~700 plus its trials; 3000
    # leaves room for a trajectory that another rounding sends elsewhere)
    assert bool(st.converged.all()), st.returned_residual
    _check_solution(z, W, b)


def test_a_batch_of_a_stall_and_a_diverging_plain_iteration_converges() -> None:
    """Per sample: samples 0 and 2 are the non-normal map above (Anderson stalls, plain
    iteration converges), samples 1 and 3 a symmetric map with spectral radius 1.1 (plain
    iteration diverges, Anderson converges in ~300).  Without the guard samples 0 and 2 end at
    1.6e-2 and 3.7e-2; with it each sample gets what works for it: the plain phases give the
    diverging samples up (they keep to Anderson)."""
    g = torch.Generator().manual_seed(0)
    R = torch.randn(N, N, generator=g, dtype=T64)
    R = R + R.T
    R = R / torch.linalg.eigvalsh(R).abs().max() * 1.1
    J = _jordan()
    W = torch.stack([J, R, J, R])
    b = torch.randn(4, N, generator=g, dtype=T64)
    with torch.no_grad():
        z, st = solvers.solve(_linear(W, b), torch.zeros(4, N, dtype=T64), "anderson",
                              tol=1e-12, max_iter=3000)
        _, sp = solvers.solve(_linear(W, b), torch.zeros(4, N, dtype=T64), "plain",
                              tol=1e-12, max_iter=3000)
    # (the guard needs ~1100 here; as above, 3000 leaves room for another rounding)
    assert bool(st.converged.all()), st.returned_residual
    assert bool(torch.isfinite(z).all())
    _check_solution(z, W, b)
    # plain iteration alone diverges on samples 1 and 3 (||z|| ~1e60 after 3000 iterations)
    assert sp.converged.tolist() == [True, False, True, False]


def _sym(rho: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, N, generator=g, dtype=T64)
    W = W + W.T
    return W / torch.linalg.eigvalsh(W).abs().max() * rho


def test_solves_that_do_not_stall_start_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard starts only after ``ANDERSON_FRUITLESS`` fruitless restarts: a solve that
    converges without them runs the unguarded iteration (the same operations as before the
    guard existed).  Slow contractions with spectral radius 0.99 (plain iteration needs ~2400
    iterations at tol 1e-12; Anderson 83 and 125 here), a ReLU and a tanh layer in float64 and
    float32, and an inclusion layer of the uniqueness property (seed 2) whose solve restarts
    three times, one of them fruitless (its worst residual since the restart before: 3.4e-2,
    4.2e-2, then 7.4e-8: far from three fruitless ones in a row on any rounding)."""

    class NoGuard:
        def __init__(self, *args: object) -> None:
            raise AssertionError("a stall guard started")

    monkeypatch.setattr(solvers, "_StallGuard", NoGuard, raising=False)
    g = torch.Generator().manual_seed(3)
    W = torch.randn(N, N, generator=g, dtype=T64)
    b = torch.randn(4, N, generator=g, dtype=T64)
    spec = W / torch.linalg.eigvals(W).abs().max() * 0.99
    sym = _sym(0.99, 2)
    rel = W / torch.linalg.matrix_norm(W, 2) * 0.99
    maps = {
        "sym 0.99": (_linear(sym, b), T64, 1e-12),
        "spectral radius 0.99": (_linear(spec, b), T64, 1e-12),
        "relu": (lambda z: torch.relu(z @ rel.T + b), T64, 1e-12),
        "tanh float32": (lambda z: torch.tanh(z @ rel.T.float() + b.float()), torch.float32,
                         1e-5),
    }
    for name, (f, dt, tol) in maps.items():
        with torch.no_grad():
            _, st = solvers.solve(f, torch.zeros(4, N, dtype=dt), "anderson", tol=tol,
                                  max_iter=3000)
        assert bool(st.converged.all()), name
        # Anderson's count on these is 85–125 (linear) and under 40 (ReLU, tanh) on any
        # rounding seen; 400 only fails a solve that has lost its acceleration
        assert int(st.iterations.max()) <= 400, (name, int(st.iterations.max()))

    import lowering
    from tests.test_inclusions import _decoupled_inclusion

    seed = 2
    d = lowering.lower(_decoupled_inclusion(seed, 5.270371798858698, False))
    x = torch.as_tensor(np.random.default_rng(seed).standard_normal((2, 3)), dtype=T64)
    z0 = torch.as_tensor(np.random.default_rng(seed + 1).uniform(0.5, 5.0, (2, 6)), dtype=T64)
    mod = d.torch_module(dtype=T64, solver="anderson", tol=1e-13, max_iter=3000)
    with torch.no_grad():
        _, st = mod(x, z0=z0, return_stats=True)
    assert bool(st.converged.all())
