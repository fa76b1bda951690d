"""Random instance families for the Must-show checks (tests and ``benchmarks/verify_table.py``).

Each family builds, from an integer seed, a derived layer with random weights (spectral norm
drawn in [0.5, 0.95]) and a random input; ``run_family`` verifies N instances with
``verify.check`` and aggregates the worst numbers.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import convex_eq as ce
from convex_eq import models
from lowering import DerivedLayer, lower

from .check import check
from .report import Report

T64 = torch.float64
Builder = Callable[[int], tuple[DerivedLayer, torch.Tensor]]


@dataclass
class Family:
    """A named instance generator with the reference docs/theory.md §9 prescribes for it."""

    name: str
    reference: str
    convex: bool
    build: Builder
    note: str = ""


@dataclass
class FamilyResult:
    """Aggregated verification numbers over the instances of one family."""

    family: Family
    instances: int
    passed: int
    max_rel_error: float
    max_residual: float
    max_stationarity: float | None
    no_equilibrium: int = 0
    labels: Counter = field(default_factory=Counter)
    references: Counter = field(default_factory=Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0
    reports: list[Report] = field(default_factory=list)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(10_000 + seed)


def _x(seed: int, d: int = 4) -> torch.Tensor:
    return torch.randn(1, d, generator=torch.Generator().manual_seed(seed), dtype=T64)


def _norm(seed: int) -> float:
    return float(_rng(seed).uniform(0.5, 0.95))


def opteq_family(act: str, form: str) -> Builder:
    """OptEq (``form`` conjugate: docs/theory.md §2; canonical: §3 row 1) with activation ``act``, n
    = 8."""
    def build(seed: int) -> tuple[DerivedLayer, torch.Tensor]:
        phi = models.opteq(n=8, m=8, d=4, activation=act, form=form, weight_norm=_norm(seed),
                           seed=seed)
        return lower(phi), _x(seed)

    return build


def regularizer_family(kind: str) -> Builder:
    """ReLU OptEq + ``γ·½||z||²`` (prox or gradient) or ``γ||z||₁`` (prox): docs/theory.md §4 rows
    3–4."""
    def build(seed: int) -> tuple[DerivedLayer, torch.Tensor]:
        phi = models.opteq(n=8, m=8, d=4, activation="relu", form="conjugate",
                           weight_norm=_norm(seed), seed=seed)
        z = phi.states[0]
        gam = float(_rng(seed).uniform(0.05, 0.5))
        if kind == "sq-prox":
            return lower(phi + gam * ce.SqNorm(z), regularizer="prox"), _x(seed)
        if kind == "sq-gradient":
            return lower(phi + gam * ce.SqNorm(z), regularizer="gradient"), _x(seed)
        return lower(phi + gam * ce.L1(z), regularizer="prox"), _x(seed)

    return build


def moreau_family(seed: int) -> tuple[DerivedLayer, torch.Tensor]:
    """ReLU OptEq edited to ``α M_φ^{1−α}``, ``α ∈ [0.2, 0.9]`` (skip connection, docs/theory.md §4
    row 1)."""
    phi = models.opteq(n=8, m=8, d=4, activation="relu", form="conjugate",
                       weight_norm=_norm(seed), seed=seed)
    a = float(_rng(seed).uniform(0.2, 0.9))
    return lower(a * ce.moreau(phi, 1.0 - a)), _x(seed)


def deep2_family(seed: int) -> tuple[DerivedLayer, torch.Tensor]:
    """Deep OptEq with ``L = 2`` (Corollary 1, a convex problem: docs/theory.md §5)."""
    a = float(_rng(seed).uniform(0.2, 0.8))
    comp = models.deep_opteq(L=2, n=8, m=8, d=4, alpha=a, weight_norm=_norm(seed), seed=seed)
    return lower(comp), _x(seed)


def geq_family(patch: bool) -> Builder:
    """GEQ, whole or patch-split Gaussian kernel (non-convex: docs/theory.md §3 rows 2–3)."""
    def build(seed: int) -> tuple[DerivedLayer, torch.Tensor]:
        gam = float(_rng(seed).uniform(0.2, 1.0))
        if patch:
            g = models.geq(n=8, p=16, d=4, gamma=gam, weight_norm=_norm(seed), patch=2,
                           image=(1, 4, 4), h=3, seed=seed)
        else:
            g = models.geq(n=8, p=8, d=4, gamma=gam, weight_norm=_norm(seed), seed=seed)
        return lower(g), _x(seed)

    return build


def mopteq_family(seed: int) -> tuple[DerivedLayer, torch.Tensor]:
    """MOptEq with H and D fusion on two branches (non-convex: docs/theory.md §3 row 4)."""
    g = models.mopteq(shapes=((2, 4, 4), (2, 2, 2)), d=4, lam=0.1, weight_norm=0.5, seed=seed)
    return lower(g), _x(seed)


def convex_families() -> list[Family]:
    """Must show 1: OptEq with each registry activation (canonical form; conjugate y-form for
    ReLU and tanh), each R_z variant, the Moreau skip edit, deep L = 2 (Corollary 1)."""
    out = []
    for act in ce.available_activations():
        ref = "cvxpy" if act in ("identity", "relu", "leaky_relu", "hardtanh", "clamp") \
            else "numeric"
        out.append(Family(f"OptEq canonical, {act}", ref, True, opteq_family(act, "canonical")))
    for act in ("relu", "tanh"):
        ref = "cvxpy" if act == "relu" else "numeric"
        out.append(Family(f"OptEq conjugate (y-form), {act}", ref, True,
                          opteq_family(act, "conjugate")))
    out += [
        Family("OptEq relu + γ·½||z||², prox variant", "cvxpy", True,
               regularizer_family("sq-prox"), "modified minimizer (φ + M¹[γR])"),
        Family("OptEq relu + γ·½||z||², gradient variant", "cvxpy", True,
               regularizer_family("sq-gradient")),
        Family("OptEq relu + γ·||z||₁, prox variant", "cvxpy", True, regularizer_family("l1"),
               "modified minimizer (φ + M¹[γ||·||₁])"),
        Family("Moreau skip α·M^{1-α}[φ]", "cvxpy", True, moreau_family),
        Family("deep OptEq L = 2 (Corollary 1)", "corollary1-cvxpy", True, deep2_family),
    ]
    return out


def nonconvex_families() -> list[Family]:
    """Must show 2: GEQ (whole, patch-split) and MOptEq: stationary points, never minimizers."""
    return [
        Family("GEQ, Gaussian kernel", "local", False, geq_family(False)),
        Family("GEQ, patch-split kernel", "local", False, geq_family(True)),
        Family("MOptEq, HH&D fusion", "local", False, mopteq_family),
    ]


def run_family(fam: Family, n: int, *, starts: int = 1, keep_reports: bool = False,
               **check_options: Any) -> FamilyResult:
    """Verify ``n`` instances (seeds 0..n-1) and aggregate."""
    t0 = time.perf_counter()
    res = FamilyResult(fam, n, 0, 0.0, 0.0, None)
    for seed in range(n):
        derived, x = fam.build(seed)
        rep = check(derived, x, starts=starts, seed=seed, **check_options)
        res.passed += int(rep.passed)
        res.labels[rep.label] += 1
        res.references[rep.reference.kind] += 1
        if rep.label == "equilibrium not found":
            res.no_equilibrium += 1
        else:
            res.max_rel_error = max(res.max_rel_error, rep.max_rel_error or 0.0)
            res.max_residual = max(res.max_residual, rep.max_residual or 0.0)
        if rep.max_stationarity is not None:
            res.max_stationarity = max(res.max_stationarity or 0.0, rep.max_stationarity)
        if not rep.passed:
            res.failures.append((seed, rep.status))
        if keep_reports:
            res.reports.append(rep)
    res.seconds = time.perf_counter() - t0
    return res


def markdown_table(results: list[FamilyResult]) -> str:
    """README table: family, reference, instances, max rel. error, max residual, label (the
    maxima are over the instances that have an equilibrium)."""
    lines = ["| family | reference | instances (passed) | max rel. error | max residual "
             "‖z − T(z)‖/max(1,‖z‖) | max stationarity | verified as |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        labels = ", ".join(f"{k} ×{v}" for k, v in r.labels.most_common())
        refs = ", ".join(sorted(k for k in r.references if k != "none"))
        rel = f"{r.max_rel_error:.1e}" if r.family.convex else f"{r.max_rel_error:.1e} (local)"
        stat = "n/a" if r.max_stationarity is None else f"{r.max_stationarity:.1e}"
        lines.append(f"| {r.family.name} | {refs} | {r.instances} ({r.passed}) | {rel} | "
                     f"{r.max_residual:.1e} | {stat} | {labels} |")
    return "\n".join(lines)
