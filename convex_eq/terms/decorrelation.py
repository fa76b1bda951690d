"""Batch decorrelation ``R(Z) = ½||D Z Zᵀ D - I||_F²`` (docs/theory.md §4): batch-coupled,
non-convex.

``Z`` is the ``m × B`` matrix whose columns are the batch samples ``u_b`` (the term's argument,
carried as the flat batch ``(B, m)``, i.e. ``Z = Uᵀ``), and ``D = diag(1/||row_i||)`` normalises
each feature row ``Z_i ∈ R^B``.  With ``Ẑ = D Z`` (unit rows) and ``C = Ẑ Ẑᵀ`` (cosine similarity
between feature rows, ``C_ii = 1``), ``R = ½ Σ_{i≠j} C_ij²``.

Per-sample values: the objective sums per-sample values over the batch, so every sample gets
``R / B`` (the values sum to ``R``).  ``grad`` then returns, for sample ``b``, ``∂R/∂u_b`` — the
gradient of the batch sum, which is what the autograd of ``value(...).sum()`` gives.

Closed-form gradient (no autograd):  ``∂R/∂Ẑ = 2 (C - diag C) Ẑ``; through the row normalisation
``ẑ_i = z_i/||z_i||``:  ``∂R/∂z_i = (g_i - ẑ_i <ẑ_i, g_i>) / ||z_i||`` with ``g_i`` the i-th row of
``∂R/∂Ẑ``; the gradient w.r.t. the flat batch is the transpose.

Zero rows (a feature that vanishes on the whole batch, e.g. a dead ReLU unit): ``D`` is undefined
there.  Such a row is given ``ẑ_i = 0`` — it is excluded from the sum (``R`` uses the off-diagonal
form ``½ Σ_{i≠j} C_ij²``, equal to ``½||C - I||_F²`` whenever no row vanishes) and gets gradient 0.
``R`` is not continuous at such points, and ``∇R`` is unbounded near them (it scales like
``1/||z_i||``), so no global gradient Lipschitz constant exists: ``raw_grad_lipschitz`` is ``inf``.
"""

from __future__ import annotations

import math
from typing import Any

from .._lazy import torch
from ..errors import NotDCPError, ShapeError
from ..export import ExportContext
from ..symbols import Env
from .base import Curvature, Term, require_states, single_arg


def _normalized_rows(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Ẑ, safe norms)`` for ``Z = uᵀ`` (``m × B``); zero rows stay zero."""
    z = u.transpose(0, 1)
    norms = torch.linalg.vector_norm(z, dim=1, keepdim=True)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    return z / safe, safe


def _off_diagonal(c: torch.Tensor) -> torch.Tensor:
    return c - torch.diag_embed(torch.diagonal(c))


class BatchDecorrelation(Term):
    """``½||D Z Zᵀ D - I||_F²`` over the batch (columns of ``Z`` = samples): see module docstring.

    Smooth where every feature row is non-zero; non-convex; batch-coupled; per-sample values are
    ``R/B``; gradient step only (no prox), export refused."""

    label = "batch decorrelation"
    base_curvature = "unknown"
    smooth = True
    batch_coupled = True

    def __init__(self, z: Any):
        super().__init__(z)

    def check_shapes(self) -> None:
        """At least 2 features (a ``ShapeError`` otherwise)."""
        require_states(self.args, str(self))
        if single_arg(self).size < 2:
            raise ShapeError(
                f"decorrelation needs at least 2 features, {single_arg(self)} has size "
                f"{single_arg(self).size}", term=str(self),
            )

    def batch_value(self, u: torch.Tensor) -> torch.Tensor:
        """``R`` for the flat batch ``u`` of shape ``(B, m)`` (a 0-d tensor)."""
        if u.shape[0] == 1:
            # one sample: D Z = sign(uᵀ), so R = ½k(k − 1) with k the non-zero features, locally
            # constant; autograd through the normalization would return round-off magnified by
            # 1/|u_i| near a zero feature instead of the exact gradient 0
            k = (u != 0).sum().to(u.dtype)
            return 0.5 * k * (k - 1) + 0.0 * u.sum()
        zh, _ = _normalized_rows(u)
        off = _off_diagonal(zh @ zh.transpose(0, 1))
        return 0.5 * (off * off).sum()

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``½||D Z Zᵀ D − I||_F²`` of the batch, shared equally by the ``B`` samples."""
        u = us[0]
        b = u.shape[0]
        return (self.batch_value(u) / b).expand(b)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∂R/∂Z`` through the row normalization ``Ẑ = D Z`` (batch-coupled)."""
        zh, safe = _normalized_rows(us[0])
        off = _off_diagonal(zh @ zh.transpose(0, 1))
        g = 2.0 * off @ zh  # ∂R/∂Ẑ, (m, B)
        gz = (g - zh * (zh * g).sum(dim=1, keepdim=True)) / safe
        return [gz.transpose(0, 1)]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``inf``: the gradient has no global Lipschitz bound (row normalization)."""
        return [math.inf]

    def raw_curvature(self) -> Curvature:
        """Unknown: batch decorrelation is not convex (docs/theory.md §4)."""
        return Curvature("unknown", reason="batch decorrelation is not convex")

    def export(self, ctx: ExportContext) -> None:
        """Refused with a ``NotDCPError``: not convex and batch-coupled (local reference)."""
        raise NotDCPError(
            "the batch decorrelation term is not convex (and couples the samples of a batch), "
            "so it has no CVXPY (DCP) form", term=str(self),
            hint="verify with the local reference (stationary points, verify.check)",
        )

    def raw_latex(self) -> str:
        """LaTeX of ``½||D Z Zᵀ D − I||_F²`` (without the coefficient)."""
        z = single_arg(self).latex()
        return (f"\\tfrac12\\big\\|D Z Z^\\top D - I\\big\\|_F^2\\Big|"
                f"_{{Z = [{z}]_{{\\mathrm{{batch}}}}}}")

    def raw_str(self) -> str:
        """Plain-text formula ``½||D Z Zᵀ D − I||_F²`` (without the coefficient)."""
        z = single_arg(self)
        return f"½||D Z Zᵀ D - I||_F²[Z = batch of {z}]"
