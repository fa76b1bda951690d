"""Verify: the equilibrium a derived layer finds is what its derivation claims (MATH §9).

``check(layer_or_module, x)`` picks the reference by MATH §9 — CVXPY for DCP-exportable
objectives, a certified-convex numeric reference, or a multi-start local reference for
non-convex objectives (labelled "stationary point" / "local minimizer", never "minimizer") —
and returns a ``Report``.  ``verify.properties`` ships the theorems as hypothesis properties.
"""

from .check import check
from .families import convex_families, markdown_table, nonconvex_families, run_family
from .report import Report, Tolerances

__all__ = ["Report", "Tolerances", "check", "convex_families", "markdown_table",
           "nonconvex_families", "run_family"]
