"""Helpers shared by the lowering tests: seeded float64 draws, the closed-form comparison, and
objectives and inclusions several files use."""

from __future__ import annotations

import numpy as np
import torch

from convex_eq import (
    Antiderivative,
    Input,
    Linear,
    Objective,
    Potential,
    SqNorm,
    State,
    Weight,
    models,
)
from convex_eq.inclusion import Inclusion
from convex_eq.operators import Dense
from convex_eq.operators.monotone import MonotoneMatrix

T64 = torch.float64


GEN = torch.Generator().manual_seed(7)


def W(obj, name: str) -> torch.Tensor:
    """The declared value of symbol ``name`` of ``obj``."""
    return obj.symbol(name).value


def randn(*shape: int) -> torch.Tensor:
    """float64 standard normal draws from the shared seeded generator ``GEN``."""
    return torch.randn(*shape, generator=GEN, dtype=T64)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    # both sides are closed-form float64 expressions of the same formula: rounding only
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def relu_phi():
    """Conjugate-form ReLU OptEq ``φ`` (6 states, 8 rows, 3 inputs)."""
    return models.opteq(n=6, m=8, d=3, activation="relu", form="conjugate", seed=5)


def prox_relu_phi(phi, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``prox_φ(v) = Wᵀrelu(Wv + Ux + b)`` written out from docs/theory.md (the reference)."""
    w, u, b = W(phi, "W"), W(phi, "U"), W(phi, "b")
    return torch.relu(v @ w.T + x @ u.T + b) @ w


class _MarginIgnored(MonotoneMatrix):
    """Deliberately broken: the layer drops ``mI`` while the certificate still claims it."""

    def apply(self, v, env=None):
        return super().apply(v, env) - self.margin * v

    def adjoint(self, w, env=None):
        return super().adjoint(w, env) - self.margin * w


def decoupled_inclusion(seed: int, scale: float, broken: bool) -> Inclusion:
    """Random A (k×n) and B with coordinate 0 decoupled (zero row/column, no input there):
    only the margin pins z₀, so uniqueness rests on it."""
    g = np.random.default_rng(seed)
    n, k, d = 6, 3, 3
    a = scale * g.standard_normal((k, n)) / np.sqrt(n)
    b = scale * g.standard_normal((n, n)) / np.sqrt(n)
    u = g.standard_normal((n, d))
    a[:, 0] = 0.0
    b[0, :] = b[:, 0] = 0.0
    u[0] = 0.0
    z, x = State("z", n), Input("x", d)
    A, B, U = Weight("A", (k, n), a), Weight("B", (n, n), b), Weight("U", (n, d), u)
    op = (_MarginIgnored if broken else MonotoneMatrix)(A, B, 0.5)
    return Inclusion(Potential("relu", z), grad=[-Linear(U @ x, z)], linear=[op])


def theorem1(n: int = 3, act: str = "relu", w: np.ndarray | None = None, name: str = "z",
              seed: int = 0) -> tuple[Objective, State, Input]:
    """Theorem 1's objective ``φ = ψ* − ½||z||²``, ``ψ = Σσ̃(Wz + Ux)``, with its state and input."""
    rng = np.random.default_rng(seed)
    z, x = State(name, n), Input("x", 2)
    W = Weight(f"W_{name}", (n, n), 0.6 * np.eye(n) if w is None else w)
    U = Weight(f"U_{name}", (n, 2), rng.standard_normal((n, 2)))
    psi = Antiderivative(act, Dense(W) @ z + Dense(U) @ x)
    return Objective([psi.conjugate(), -SqNorm(z)], name="phi"), z, x
