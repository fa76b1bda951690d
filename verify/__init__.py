"""Verify: the equilibrium a derived layer finds is what its derivation claims (docs/theory.md §9).

``check(layer_or_module, x)`` picks the reference by docs/theory.md §9 — CVXPY for DCP-exportable
objectives, a certified-convex numeric reference, or a multi-start local reference for
non-convex objectives (labelled "stationary point" / "local minimizer", never "minimizer") —
and returns a ``Report``.  ``verify.properties`` ships the theorems as hypothesis properties.
``check_error_bound``, ``check_lipschitz`` and ``attack_certified`` check a module's certified
bounds (docs/theory.md §9.6).
"""

from .bounds import AttackReport, BoundReport, attack_certified, check_error_bound, check_lipschitz
from .check import CertificateAt, certificate_at, check
from .families import convex_families, markdown_table, nonconvex_families, run_family
from .gradients import gradient_check
from .inclusion import InclusionReport, check_inclusion
from .references.deep import envelope_gradient, inclusion_residuals, wide_solution
from .report import (
    EquilibriumInfo,
    GradientReport,
    ReferenceInfo,
    Report,
    SampleResult,
    Tolerances,
)

__all__ = [
    "AttackReport", "BoundReport", "CertificateAt", "EquilibriumInfo", "GradientReport",
    "InclusionReport", "ReferenceInfo", "Report",
    "SampleResult", "Tolerances", "attack_certified", "certificate_at", "check",
    "check_error_bound", "check_inclusion", "check_lipschitz", "convex_families",
    "envelope_gradient", "gradient_check", "inclusion_residuals", "markdown_table",
    "nonconvex_families", "run_family", "wide_solution",
]
