"""Objectives for the command line: ``convex-eq derive examples/models.py:NAME`` and
``convex-eq verify examples/models.py:NAME``.

    convex-eq derive examples/models.py:opteq_l1
    convex-eq verify examples/models.py:opteq_relu --gradients
    convex-eq verify examples/models.py:geq --batch 3
"""

from __future__ import annotations

import convex_eq as ce
from convex_eq import models


def opteq_relu() -> ce.Objective:
    """OptEq, Theorem 1 (conjugate form), ReLU."""
    return models.opteq(n=8, m=10, d=4, form="conjugate", seed=0)


def opteq_l1() -> ce.Objective:
    """OptEq + 0.05·||z||₁ (prox variant: minimizer of φ + M¹[0.05·||z||₁])."""
    phi = opteq_relu()
    return phi + 0.05 * ce.L1(phi.states[0])


def opteq_tanh() -> ce.Objective:
    """Canonical tanh OptEq: convex by curvature, verified with the numeric reference."""
    return models.opteq(n=8, m=8, d=4, activation="tanh", seed=0)


def deep2() -> ce.DeepComposition:
    """Deep OptEq, L = 2 (Corollary 1)."""
    return models.deep_opteq(L=2, n=6, m=8, d=3, seed=0)


def geq() -> ce.Objective:
    """GEQ (Gaussian kernel): non-convex, verified as a stationary point."""
    return models.geq(n=8, p=8, d=4, seed=0)
