"""The references of ``verify.check`` and ``verify.check_inclusion``, one unit per file
(docs/theory.md §9, docs/monotone.md §6); :mod:`verify.selection` registers and chooses them."""

from ..conic import CLARABEL_TIGHT, cvxpy_reference, reference_solver_options
from .deep import envelope_gradient, inclusion_residuals, wide_solution
from .sam import sam_reference

__all__ = ["CLARABEL_TIGHT", "cvxpy_reference", "envelope_gradient", "inclusion_residuals",
           "reference_solver_options", "sam_reference", "wide_solution"]
