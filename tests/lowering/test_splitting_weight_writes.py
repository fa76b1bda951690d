"""Splitting layers after a write through ``.data``: the cached factorisation of ``I + αM``
(Peaceman–Rachford, Douglas–Rachford) and the cached step sizes (every splitting) follow the
weights' contents, not their pointers and version counters, which such a write keeps.

Reference: the MON inclusion ``0 ∈ Mz − (Ux + b) + ∂f_tanh(z)``, ``M = mI + AᵀA − (B − Bᵀ)``,
solved by ``scipy.optimize.root`` in float64 from the weights as numpy arrays (with
``z = tanh s`` the condition reads ``M tanh(s) − q + s − tanh(s) = 0``, since
``∂f_tanh(z) = atanh(z) − z``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import root

from convex_eq import Dense, Input, Linear, Potential, SqNorm, State, Weight, models
from convex_eq.inclusion import Saddle
from lowering import lower

T64 = torch.float64
MARGIN = 0.5  # models.mon's default m
SETTINGS = dict(dtype=T64, tol=1e-12, max_iter=5000)


def _mon_reference(m: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    w = {k: v.detach().numpy().astype(np.float64) for k, v in m.weights.items()}
    a, b = w["A"], w["B"]
    mat = MARGIN * np.eye(len(b)) + a.T @ a - (b - b.T)
    out = []
    for xi in x.numpy():
        q = w["U"] @ xi + w["b"]

        def fun(s: np.ndarray, q: np.ndarray = q) -> np.ndarray:
            return mat @ np.tanh(s) - q + s - np.tanh(s)

        def jac(s: np.ndarray) -> np.ndarray:
            d = 1 - np.tanh(s) ** 2
            return mat * d[None, :] + np.diag(1 - d)

        sol = root(fun, np.zeros(len(b)), jac=jac, tol=1e-14)
        assert np.abs(fun(sol.x)).max() < 1e-12  # (hybr may report "no further improvement")
        out.append(np.tanh(sol.x))
    return np.array(out)


def _mon_matrix(m: torch.nn.Module) -> np.ndarray:
    a, b = (m.weights[k].detach().numpy() for k in ("A", "B"))
    return MARGIN * np.eye(len(b)) + a.T @ a - (b - b.T)


# Tolerance 1e-9: the module solves to a relative residual of 1e-12 on a problem with
# strong-monotonicity margin 0.5 (error ≤ residual/margin, ~1e-11), the reference to ~1e-14;
# the answer with the factorisation of the old weights is 0.3 away.
@pytest.mark.parametrize("splitting", ["peaceman-rachford", "douglas-rachford"])
def test_mon_output_follows_a_data_write_to_its_weights(splitting: str) -> None:
    m = lower(models.mon(n=6, d=3, seed=1, activation="tanh",
                         splitting=splitting)).torch_module(**SETTINGS)
    x = torch.randn(4, 3, dtype=T64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(x)
        assert np.abs(before.numpy() - _mon_reference(m, x)).max() <= 1e-9  # the transcription
        m.weights["A"].data.mul_(2)
        m.weights["B"].data.mul_(1.5)
        after = m(x)
    ref = _mon_reference(m, x)
    assert np.abs(ref - before.numpy()).max() > 0.1  # the write moves the equilibrium
    assert np.abs(after.numpy() - ref).max() <= 1e-9


def test_forward_backward_step_follows_a_data_write() -> None:
    """Forward–backward's step α = m/L² and its contraction bound √(1 − m²/L²) come from the
    current weights: after ``A.data`` is doubled the bound the layer reports is the one of the
    new ``L = ||M||₂`` (a dense SVD here; m = 0.5 holds for every A, B), not the cached 0.954.
    Tolerance 1e-12: both sides are one SVD of the same 6×6 float64 matrix."""
    m = lower(models.mon(n=6, d=3, seed=1, activation="tanh",
                         splitting="forward-backward")).torch_module(**SETTINGS, solver="plain")
    x = torch.randn(4, 3, dtype=T64, generator=torch.Generator().manual_seed(0))
    env = dict(m.weights.items())

    def bound() -> float:
        return float(np.sqrt(1 - (MARGIN / np.linalg.norm(_mon_matrix(m), 2)) ** 2))

    with torch.no_grad():
        m(x)
        assert abs(m.derived.contraction.value(env) - bound()) <= 1e-12
        old = bound()
        m.weights["A"].data.mul_(2)
        assert abs(m.derived.contraction.value(env) - bound()) <= 1e-12
        assert bound() - old > 0.03
        after = m(x)
    assert np.abs(after.numpy() - _mon_reference(m, x)).max() <= 1e-9


def test_saddle_steps_follow_a_data_write_to_the_coupling() -> None:
    """Chambolle–Pock's steps τ = σ = 0.9/||K||₂ are cached per weights; after ``K.data`` is
    tripled, steps kept from the old K break τσ||K||² < 1 and plain iterations diverge.
    Reference: the saddle point of ``f_relu(z) + ¼||z||² − ⟨Ux, z⟩ + ⟨Kz, w⟩ − ½||w||²`` as
    the minimiser of the convex ``¼||z||² − ⟨Ux, z⟩ + ½||Kz||²`` over ``z ≥ 0`` (``w = Kz``),
    by scipy ``nnls`` on the equivalent least-squares form; tolerance as above."""
    from scipy.optimize import nnls

    g = torch.Generator().manual_seed(0)
    z, w, xi = State("z", 6), State("w", 4), Input("x", 3)
    u = Weight("U", (6, 3), torch.randn(6, 3, dtype=T64, generator=g).numpy())
    k = Weight("K", (4, 6), torch.randn(4, 6, dtype=T64, generator=g).numpy())
    sad = Saddle([Potential("relu", z), 0.5 * SqNorm(z), -Linear(u @ xi, z)],
                 [SqNorm(w)], Dense(k), name="robust")
    m = lower(sad).torch_module(**SETTINGS, solver="plain")
    x = torch.randn(3, 3, dtype=T64, generator=torch.Generator().manual_seed(1))

    def reference() -> np.ndarray:
        kk, uu = m.weights["K"].detach().numpy(), m.weights["U"].detach().numpy()
        # ¼||z||² − ⟨c, z⟩ + ½||Kz||² = ½||Lz − L⁻ᵀc||² + const, LᵀL = ½I + KᵀK
        chol = np.linalg.cholesky(0.5 * np.eye(6) + kk.T @ kk).T
        return np.array([nnls(chol, np.linalg.solve(chol.T, uu @ xi))[0] for xi in x.numpy()])

    with torch.no_grad():
        before = m(x)[0]
        assert np.abs(before.numpy() - reference()).max() <= 1e-9  # the transcription
        m.weights["K"].data.mul_(3)
        after = m(x)[0]
    ref = reference()
    assert np.abs(ref - before.numpy()).max() > 0.1
    assert np.abs(after.numpy() - ref).max() <= 1e-9
