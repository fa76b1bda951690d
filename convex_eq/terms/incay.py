"""Feature incay regularizer ``R(z) = 2 / (||z||² + 2ε)`` (docs/theory.md §4): smooth, NOT convex.

Derivation (``s = ||u||²``, ``a = s + 2ε``):

* gradient: ``∇R = -2·a⁻²·∇s = -4u / (||u||² + 2ε)²``.  It points towards the origin, so a
  gradient step ``u - γ∇R = (1 + 4γ/a²) u`` *enlarges* the feature norm (which is what incay is
  for).  The table printed in the paper has the opposite sign; this is the derived one.
* Hessian: ``∇²R = -(4/a²) I + (16/a³) u uᵀ``.  Its eigenvalues are ``-4/a²`` (on ``u^⊥``) and
  ``(12s - 8ε)/a³`` (along ``u``).  ``4/a² ≤ 4/(2ε)² = 1/ε²``; ``g(s) = (12s - 8ε)/(s + 2ε)³``
  has ``|g(0)| = 1/ε²`` and its only positive stationary point at ``s = 2ε`` with
  ``g(2ε) = 1/(4ε²)``, ``g → 0`` as ``s → ∞``.  Hence ``sup ||∇²R||₂ = 1/ε²`` (attained at
  ``u = 0``), a global Lipschitz constant of ``∇R``.
* curvature: ``∇²R(0) = -(1/ε²) I ≺ 0`` while along ``u`` the curvature is positive for
  ``||u||² > 2ε/3``: neither convex nor concave.
"""

from __future__ import annotations

import math
from typing import Any

from .._lazy import torch
from ..errors import NotDCPError, ScaleError
from ..export import ExportContext
from ..symbols import Env, Scalar, Symbol
from .base import Curvature, Term, require_states, single_arg


class FeatureIncay(Term):
    """``R(u) = 2/(||u||² + 2ε)`` per sample; ``ε > 0`` a float or :class:`Scalar`.

    Gradient ``-4u/(||u||²+2ε)²``, gradient Lipschitz bound ``1/ε²`` (module docstring).
    Gradient step only (no prox); not DCP (export refused)."""

    label = "feature incay"
    base_curvature = "unknown"
    smooth = True

    def __init__(self, z: Any, eps: float | Scalar = 1.0):
        self.eps = eps
        super().__init__(z)
        self.eps_value(None)

    def grad_text(self, latex: bool = False) -> list[str | None]:
        """Printable gradient ``−4u/(||u||² + 2ε)²`` (for derivations)."""
        u = self.args[0]
        e = self.eps.name if isinstance(self.eps, Scalar) else f"{self.eps:g}"
        if latex:
            return [f"-\\frac{{4 {u.latex()}}}{{(\\|{u.latex()}\\|^2 + 2 \\cdot {e})^2}}"]
        return [f"-4({u})/(||{u}||² + 2·{e})²"]

    def check_shapes(self) -> None:
        """The argument must involve a state."""
        require_states(self.args, str(self))

    def symbols(self) -> list[Symbol]:
        """The argument's symbols and ``ε`` when it is a ``Scalar``."""
        out = super().symbols()
        if isinstance(self.eps, Scalar) and all(self.eps is not o for o in out):
            out.append(self.eps)
        return out

    def eps_value(self, env: Env | None = None) -> float:
        """Current ``ε`` (must be positive and finite; ScaleError naming the term otherwise)."""
        e = (self.eps.check(float(self.eps.numpy(env)), term=str(self))
             if isinstance(self.eps, Scalar) else float(self.eps))
        if not (math.isfinite(e) and e > 0):
            raise ScaleError(f"ε = {e:g} must be positive", term=str(self),
                             hint="feature incay needs ε > 0 (2/(||z||²+2ε) blows up at ε = 0)")
        return e

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``R(u) = 2/(||u||² + 2ε)`` per sample."""
        u = us[0]
        return 2.0 / ((u * u).sum(dim=-1) + 2.0 * self.eps_value(env))

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇R(u) = −4u/(||u||² + 2ε)²`` (docs/theory.md §4: the step enlarges ``u``)."""
        u = us[0]
        a = (u * u).sum(dim=-1, keepdim=True) + 2.0 * self.eps_value(env)
        return [-4.0 * u / (a * a)]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``1/ε²``, a bound on ``Lip(∇R)`` (the Hessian norm is largest at ``u = 0``: ``1/ε²``)."""
        return [1.0 / self.eps_value(env) ** 2]

    def raw_curvature(self) -> Curvature:
        """Unknown: concave near ``u = 0``, convex along ``u`` far out (docs/theory.md §4)."""
        return Curvature(
            "unknown",
            reason="feature incay 2/(||z||²+2ε) is neither convex nor concave "
            "(concave near z = 0, convex along z for ||z||² > 2ε/3)",
        )

    def export(self, ctx: ExportContext) -> None:
        """Refused with a ``NotDCPError``: feature incay is not convex (local reference)."""
        raise NotDCPError(
            "the feature incay term is not convex, so it has no CVXPY (DCP) form", term=str(self),
            hint="verify objectives with feature incay with the local reference (stationary "
            "points, verify.check)",
        )

    def _eps_str(self, latex: bool) -> str:
        if isinstance(self.eps, Scalar):
            return self.eps.latex() if latex else self.eps.name
        return f"{float(self.eps):g}"

    def raw_latex(self) -> str:
        """LaTeX of ``2/(||u||² + 2ε)`` (without the coefficient)."""
        e = self._eps_str(True)
        e = f"2 \\cdot {e}" if not isinstance(self.eps, Scalar) else f"2{e}"
        return f"\\frac{{2}}{{\\|{single_arg(self).latex()}\\|^2 + {e}}}"

    def raw_str(self) -> str:
        """Plain-text formula ``2/(||u||² + 2ε)`` (without the coefficient)."""
        e = self._eps_str(False)
        e = f"2·{e}" if not isinstance(self.eps, Scalar) else f"2{e}"
        return f"2/(||{single_arg(self)}||² + {e})"
