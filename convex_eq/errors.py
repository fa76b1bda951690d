"""Project exception types: every user-facing failure names the offending term and a hint."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any


class ConvexEqError(Exception):
    """Base class of every error convex-eq raises.

    Its message reads ``<term>: <what went wrong>. Hint: <what to do>``."""

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
    """A term (or the collected quadratic form) is not DCP-representable.

    Also a ``cvxpy.error.DCPError`` (``except cp.error.DCPError`` catches it) as soon as cvxpy is
    imported, by anyone: cvxpy is not imported with convex_eq, so the base is added when the
    ``cvxpy.error`` module is loaded (see ``_adopt_dcp_base``).
    """


class LoweringError(ConvexEqError):
    """No lowering rule applies to the objective."""


class ConvergenceError(ConvexEqError, RuntimeError):
    """A fixed-point iteration did not reach its tolerance."""


class NonFiniteError(ConvexEqError, FloatingPointError):
    """NaN or Inf in inputs, weights or iterates."""


class OptionError(ConvexEqError, TypeError):
    """An unknown or invalid option was passed."""


class InputTypeError(ConvexEqError, TypeError):
    """An input of the wrong kind: not a torch tensor, or a tensor without values (meta)."""


class SolverError(ConvexEqError, RuntimeError):
    """A reference solver failed or returned an inaccurate status."""


class CertificateError(ConvexEqError):
    """A certified bound was asked for where no certificate supports it (no contraction, a
    Lipschitz constant of ``T`` that is not below 1, a rule with no derived bound): the bound
    is refused, never guessed (docs/theory.md §9.6)."""


class ConvergenceWarning(UserWarning):
    """A fixed-point iteration stopped before reaching its tolerance (warn mode)."""


def _adopt_dcp_base(cvxpy_error: ModuleType) -> None:
    """Make ``NotDCPError`` a subclass of ``cvxpy.error.DCPError`` as well (idempotent)."""
    dcp = cvxpy_error.DCPError
    if not issubclass(NotDCPError, dcp):
        NotDCPError.__bases__ = (*NotDCPError.__bases__, dcp)


class _AdoptingLoader(importlib.abc.Loader):
    """The loader of ``cvxpy.error``, followed by ``_adopt_dcp_base`` (other attributes, e.g.
    ``get_source`` for tracebacks, are the wrapped loader's)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _adopt_dcp_base(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _OnCvxpyError(importlib.abc.MetaPathFinder):
    """Runs ``_adopt_dcp_base`` right after ``cvxpy.error`` is first imported (one shot), so
    the subclass relation holds without importing cvxpy with convex_eq."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "cvxpy.error":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # an unusual install: leave the import to the other finders
        spec.loader = _AdoptingLoader(spec.loader)
        return spec


if "cvxpy.error" in sys.modules:
    _adopt_dcp_base(sys.modules["cvxpy.error"])
else:
    sys.meta_path.insert(0, _OnCvxpyError())
