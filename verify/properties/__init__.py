"""The theorems of docs/theory.md as executable properties (one function per statement).

Each property is a plain function ``prop(case) -> dict`` of an instance built by
:mod:`verify.properties.strategies` (hypothesis strategies, or the public builders for fixed
examples).  It raises ``AssertionError`` (with the theorem's name and the measured quantity) when
the statement fails on that instance, returns the measured quantities otherwise, and raises
:class:`ReferenceFailure` when its reference (a CVXPY solve, an equilibrium solve) is not
accurate — an inaccurate reference is never compared as if solved.

Use with hypothesis::

    from hypothesis import given
    from verify.properties import strategies as S, theorem1_firm_nonexpansive

    @given(S.opteq_cases())
    def test_thm1(case):
        theorem1_firm_nonexpansive(case)

:data:`PROPERTIES` lists every property with its strategy and docs/theory.md section.
The properties and :mod:`verify.properties.cases` (the instance builders) need no hypothesis;
:mod:`verify.properties.strategies` (a test extra) is imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import cases
from .common import ReferenceFailure
from .converter import lemma12_converter
from .deep import corollary1_cvxpy, lemma3_theorem2_multiblock, theorem3_wide_limit
from .geq import geq_prop3_lipschitz, geq_prop3_paper, geq_stationary
from .mopteq import mopteq_prop1_stationary, mopteq_prop2_perturbation_bound
from .moreau import moreau_edit_keeps_fixed_points
from .regularizers import theorem4_gradient_variant, theorem4_prox_variant
from .sam import theorem5_sam
from .theorem1 import lemma5_prox_characterization, theorem1_firm_nonexpansive, theorem1_jacobian


@dataclass(frozen=True)
class Property:
    """A theorem property: the function, the strategy of its assumptions, where it is stated."""

    name: str
    check: Callable[[Any], dict[str, float]]
    strategy: Callable[[], Any]
    statement: str
    section: str


class _Strategies:
    """:mod:`verify.properties.strategies` (hypothesis, a test extra), imported when a
    property's strategy is first asked for."""

    def load(self) -> Any:
        """The module (imported once by Python)."""
        return importlib.import_module("verify.properties.strategies")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.load(), name)


S = _Strategies()

PROPERTIES: tuple[Property, ...] = (
    Property("theorem1_firm_nonexpansive", theorem1_firm_nonexpansive,
             lambda: S.opteq_cases(mu=(1.0, 3.0)), "Theorem 1: T = prox_φ is firmly nonexpansive",
             "docs/theory.md §2"),
    Property("theorem1_jacobian", theorem1_jacobian, lambda: S.opteq_cases(mu=(1.0, 3.0)),
             "Theorem 1: ∂T/∂z symmetric with spectrum in [0, 1]", "docs/theory.md §2"),
    Property("lemma5_prox_characterization", lemma5_prox_characterization,
             lambda: S.opteq_cases(wide=False, mu=(1.0, 3.0), min_ratio=0.05),
             "Lemma 5: prox of convex φ ⇔ gradient of convex ψ and nonexpansive",
             "NeurIPS OptEq App. E.1"),
    Property("moreau_edit_keeps_fixed_points", moreau_edit_keeps_fixed_points,
             lambda: S.moreau_cases(),
             "φ → αM_φ^(1−α): skip connection, same fixed points", "docs/theory.md §4 row 1"),
    Property("theorem4_gradient_variant", theorem4_gradient_variant,
             lambda: S.regularized_cases("sq"),
             "Theorem 4 (gradient): equilibrium = argmin φ + γR", "docs/theory.md §4 row 3"),
    Property("theorem4_prox_variant_sq", theorem4_prox_variant, lambda: S.regularized_cases("sq"),
             "Theorem 4 (prox, R = ½||z||²): argmin φ + M^1_γR, not φ + γR",
             "docs/theory.md §4 row 4"),
    Property("theorem4_prox_variant_l1", theorem4_prox_variant, lambda: S.regularized_cases("l1"),
             "Theorem 4 (prox, R = ||z||₁): argmin φ + M^1_γR, not φ + γR",
             "docs/theory.md §4 row 4"),
    Property("lemma3_theorem2_multiblock", lemma3_theorem2_multiblock, lambda: S.deep_cases(),
             "Lemma 3 / Theorem 2: composition ↔ multi-block, monotone inclusion",
             "docs/theory.md §5"),
    Property("corollary1_cvxpy", corollary1_cvxpy,
             lambda: S.deep_cases(L=(2, 2), acts=S.DCP_ACTIVATIONS),
             "Corollary 1: L = 2 equilibrium = CVXPY minimizer", "docs/theory.md §5"),
    Property("theorem3_wide_limit", theorem3_wide_limit, lambda: S.deep_cases(L=(2, 3)),
             "Theorem 3: α → 0 tends to the wide solution", "docs/theory.md §5"),
    Property("theorem5_sam", theorem5_sam, lambda: S.sam_cases(),
             "Theorem 5: SAM converges to argmin_{Fix T} R", "docs/theory.md §6"),
    Property("lemma12_converter", lemma12_converter, lambda: S.mlp_cases(),
             "Lemma 1/2: feed-forward network = prox layers, output unchanged",
             "docs/theory.md §5"),
    Property("mopteq_prop1_stationary", mopteq_prop1_stationary, lambda: S.mopteq_cases(),
             "MOptEq Prop. 1: equilibrium is a stationary point of G", "docs/theory.md §3 row 4"),
    Property("mopteq_prop2_perturbation_bound", mopteq_prop2_perturbation_bound,
             lambda: S.perturbation_cases(), "MOptEq Prop. 2: perturbation bound",
             "docs/theory.md §7"),
    Property("geq_stationary", geq_stationary, lambda: S.geq_cases(),
             "GEQ: equilibrium is a stationary point of G", "docs/theory.md §3 rows 2-3"),
    Property("geq_prop3_lipschitz", geq_prop3_lipschitz, lambda: S.geq_cases(),
             "GEQ: measured Lipschitz ratios under the derived contraction bounds (the "
             "structure behind Prop. 3, not its statement)", "docs/theory.md §3 rows 2-3"),
    Property("geq_prop3_paper", geq_prop3_paper, lambda: S.geq_prop3_cases(),
             "GEQ Prop. 3, Eq. (11): ||z*(x₁) − z*(x₂)|| ≤ κ/(1 − κ)||x₁ − x₂||, "
             "κ = β_max μ² + √γ B μ³", "GEQ paper §3.4"),
)

__all__ = [
    "PROPERTIES",
    "Property",
    "ReferenceFailure",
    "cases",
    "corollary1_cvxpy",
    "geq_prop3_lipschitz",
    "geq_prop3_paper",
    "geq_stationary",
    "lemma3_theorem2_multiblock",
    "lemma5_prox_characterization",
    "lemma12_converter",
    "mopteq_prop1_stationary",
    "mopteq_prop2_perturbation_bound",
    "moreau_edit_keeps_fixed_points",
    "strategies",
    "theorem1_firm_nonexpansive",
    "theorem1_jacobian",
    "theorem3_wide_limit",
    "theorem4_gradient_variant",
    "theorem4_prox_variant",
    "theorem5_sam",
]


def __getattr__(name: str) -> Any:
    """``strategies`` (hypothesis, a test extra) is imported on first use, not with the package."""
    if name == "strategies":
        return S.load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
