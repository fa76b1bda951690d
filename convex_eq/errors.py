"""Project exception types: every user-facing failure names the offending term and a hint."""

from __future__ import annotations


class ConvexEqError(Exception):
    """Base class: ``<term>: <what went wrong>. Hint: <what to do>``."""

    def __init__(self, message: str, *, term: str | None = None, hint: str | None = None):
        self.term = term
        self.hint = hint
        self.reason = message
        text = f"{term}: {message}" if term else message
        if hint:
            text = f"{text}. Hint: {hint}"
        super().__init__(text)


class ShapeError(ConvexEqError, ValueError):
    """Shapes of operands do not match the term's shape rule."""


class ActivationError(ConvexEqError, ValueError):
    """An activation is unknown, not nondecreasing, or not 1-Lipschitz."""


class ScaleError(ConvexEqError, ValueError):
    """A scale or hyper-parameter is outside the range the term needs (e.g. negative)."""


class CurvatureError(ConvexEqError):
    """A term is not convex where convexity is required."""


class ExportError(ConvexEqError):
    """An objective cannot be exported to CVXPY."""


class NotDCPError(ExportError):
    """A term (or the collected quadratic form) is not DCP-representable."""


class LoweringError(ConvexEqError):
    """No lowering rule applies to the objective."""


class ConvergenceError(ConvexEqError, RuntimeError):
    """A fixed-point iteration did not reach its tolerance."""


class NonFiniteError(ConvexEqError, FloatingPointError):
    """NaN or Inf in inputs, weights or iterates."""


class OptionError(ConvexEqError, TypeError):
    """An unknown or invalid option was passed."""


class SolverError(ConvexEqError, RuntimeError):
    """A reference solver failed or returned an inaccurate status."""


class ConvergenceWarning(UserWarning):
    """A fixed-point iteration stopped before reaching its tolerance (warn mode)."""
