"""HSIC between the feature rows of a batch, Gaussian RBF kernels (docs/theory.md §4, loss-side).

Definition.  The argument is carried as the flat batch ``U`` of shape ``(B, m)``; ``Z = Uᵀ`` is the
``m × B`` batch matrix and its row ``x_i = Z_i ∈ R^B`` holds feature ``i`` over the batch.  For each
feature, the RBF Gram matrix over samples is

    ``(K_i)_{ab} = exp(-(x_{ia} - x_{ib})² / (2σ²))``,

``H = I - 11ᵀ/B`` is the centring matrix, and the biased empirical HSIC of two features is
``HSIC(i, j) = tr(K_i H K_j H) / (B - 1)²``.  The regularizer sums it over *unordered* pairs of
distinct feature rows:

    ``R(Z) = Σ_{i<j} tr(K_i H K_j H) / (B - 1)²``.

It is computed in ``O(m B²)`` as ``R = (⟨S, H S H⟩ - Σ_i ⟨K_i, H K_i H⟩) / (2(B-1)²)`` with
``S = Σ_i K_i`` (every ``⟨K_i, H K_j H⟩ ≥ 0``, so the subtraction only removes the diagonal pairs).

Per-sample values are ``R / B`` (they sum to ``R``, as for :class:`BatchDecorrelation`).

Closed-form gradient (no autograd): ``∂R/∂K_i = M_i = (H S H - H K_i H)/(B-1)²``; with
``A = M_i ∘ K_i`` and ``∂K_ab/∂x_c = -K_ab (x_a - x_b)(δ_ac - δ_bc)/σ²``,

    ``∂R/∂x_i = -(2/σ²) (x_i ∘ (A 1) - A x_i)``.

Smooth (a composition of exponentials and polynomials), non-convex, batch-coupled.  No global
gradient-Lipschitz bound is provided (``inf``).  Requires ``B ≥ 2`` (the ``(B-1)²``
normalisation) and ``m ≥ 2`` (at least one pair).
"""

from __future__ import annotations

import math
from typing import Any

from .._lazy import torch
from ..errors import NotDCPError, ScaleError, ShapeError
from ..export import ExportContext
from ..symbols import Env, Scalar, Symbol
from .base import Curvature, Term, require_states, single_arg


def _centre(k: torch.Tensor) -> torch.Tensor:
    """``H K H`` for a stack of ``B × B`` matrices ``(m, B, B)``."""
    return (k - k.mean(dim=1, keepdim=True) - k.mean(dim=2, keepdim=True)
            + k.mean(dim=(1, 2), keepdim=True))


class HSIC(Term):
    """``Σ_{i<j} HSIC_b(x_i, x_j)`` between feature rows with RBF width ``σ`` (module docstring).

    ``sigma_rbf`` is a positive float or :class:`Scalar`."""

    label = "HSIC"
    base_curvature = "unknown"
    smooth = True
    batch_coupled = True

    def __init__(self, z: Any, sigma_rbf: float | Scalar = 1.0):
        self.sigma_rbf = sigma_rbf
        super().__init__(z)
        self.sigma_value(None)

    def check_shapes(self) -> None:
        """At least 2 features (a ``ShapeError`` otherwise)."""
        require_states(self.args, str(self))
        if single_arg(self).size < 2:
            raise ShapeError(
                f"HSIC between feature rows needs at least 2 features, {single_arg(self)} has "
                f"size {single_arg(self).size}", term=str(self),
            )

    def symbols(self) -> list[Symbol]:
        """The argument's symbols and the RBF width ``σ`` when it is a ``Scalar``."""
        out = super().symbols()
        if isinstance(self.sigma_rbf, Scalar) and all(self.sigma_rbf is not o for o in out):
            out.append(self.sigma_rbf)
        return out

    def sigma_value(self, env: Env | None = None) -> float:
        """The RBF width ``σ > 0`` at the current values (a ``ScaleError`` otherwise)."""
        s = self.sigma_rbf
        v = s.check(float(s.numpy(env)), term=str(self)) if isinstance(s, Scalar) else float(s)
        if not (math.isfinite(v) and v > 0):
            raise ScaleError(f"RBF width σ = {v:g} must be positive", term=str(self))
        return v

    def _grams(self, u: torch.Tensor, env: Env | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        b = u.shape[0]
        if b < 2:
            raise ShapeError(f"HSIC needs a batch of at least 2 samples, got {b}", term=str(self),
                             hint="the biased estimator is normalised by (B-1)²")
        sigma = self.sigma_value(env)
        x = u.transpose(0, 1)  # (m, B)
        d = x.unsqueeze(2) - x.unsqueeze(1)  # (m, B, B)
        k = torch.exp(-(d * d) / (2.0 * sigma * sigma))
        return x, k, sigma

    def batch_value(self, u: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``R`` for the flat batch ``u`` of shape ``(B, m)`` (a 0-d tensor)."""
        _, k, _ = self._grams(u, env)
        kc = _centre(k)
        s, sc = k.sum(dim=0), kc.sum(dim=0)
        total = (s * sc).sum() - (k * kc).sum()
        return total / (2.0 * (u.shape[0] - 1) ** 2)

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_{i<j} HSIC_b(x_i, x_j)`` of the batch, shared equally by the ``B`` samples."""
        u = us[0]
        b = u.shape[0]
        return (self.batch_value(u, env) / b).expand(b)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """Gradient of the batch HSIC through the RBF Gram matrices (batch-coupled)."""
        u = us[0]
        x, k, sigma = self._grams(u, env)
        kc = _centre(k)
        m_ = (kc.sum(dim=0, keepdim=True) - kc) / float((u.shape[0] - 1) ** 2)
        a = m_ * k
        gx = -(2.0 / sigma**2) * (x * a.sum(dim=2) - (a @ x.unsqueeze(2)).squeeze(2))
        return [gx.transpose(0, 1)]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``inf``: no global Lipschitz bound is claimed."""
        return [math.inf]

    def raw_curvature(self) -> Curvature:
        """Unknown: HSIC with RBF kernels is not convex (docs/theory.md §4)."""
        return Curvature("unknown", reason="HSIC with RBF kernels is not convex")

    def export(self, ctx: ExportContext) -> None:
        """Refused with a ``NotDCPError``: HSIC is not convex and couples the batch."""
        raise NotDCPError(
            "the HSIC term is not convex (and couples the samples of a batch), so it has no "
            "CVXPY (DCP) form", term=str(self),
            hint="HSIC is a loss-side regularizer; verify with the local reference",
        )

    def _sigma_str(self, latex: bool) -> str:
        s = self.sigma_rbf
        if isinstance(s, Scalar):
            return s.latex() if latex else s.name
        return f"{float(s):g}"

    def raw_latex(self) -> str:
        """LaTeX of ``Σ_{i<j} HSIC_b(x_i, x_j)`` (without the coefficient)."""
        z = single_arg(self).latex()
        return (f"\\sum_{{i<j}} \\mathrm{{HSIC}}_{{{self._sigma_str(True)}}}"
                f"\\big(Z_i, Z_j\\big)\\Big|_{{Z = [{z}]_{{\\mathrm{{batch}}}}}}")

    def raw_str(self) -> str:
        """Plain-text formula ``Σ_{i<j} HSIC_b(x_i, x_j)`` (without the coefficient)."""
        return f"Σ_i<j HSIC_σ={self._sigma_str(False)}(rows of batch {single_arg(self)})"
