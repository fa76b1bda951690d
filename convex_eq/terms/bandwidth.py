"""Bandwidth rules of the Gaussian-kernel terms: ``γ = c / max(stat_i n_i, floor)`` over the
per-patch squared norms ``n_i`` of one of the kernel's vectors (docs/theory.md §3.1, §3.2).

* :class:`InputBandwidth` reads the input part ``q = Ux + b`` only, ``n_i = ||q̃_i W_h||²``:
  ``γ(x)`` is a constant of the sample, ``G(·; x, γ(x))`` one fixed objective, and the layer's
  equilibrium a stationary point of it.
* :class:`ResidualBandwidth` is GEQ's own rule, read from the residual ``r = q − Wz`` at the
  current state, ``n_i = ||(x̃_i − z̃_i)W_h||²``, and recomputed at every application of ``T``:
  the layer is GEQ's iteration ``z ← σ(∇_z S(z; γ)|_{γ = γ(x, z)})``.  A fixed point ``z*`` is
  a stationary point of ``G(·; x, γ̄)`` at its own bandwidth ``γ̄ = γ(x, z*)`` (``∇_z S`` at a
  frozen ``γ̄`` is what ``T`` evaluates), and not a stationary point of
  ``z ↦ G(z; x, γ(x, z))``, whose gradient has the extra term ``(∂S/∂γ)∇_z γ``.

Both are per sample (a batch-wide statistic would make one sample's output depend on the
others in its batch), and both are differentiated through (no stop-gradient): the training
gradient of ``z*`` then includes ``∂γ/∂θ`` (and, for the residual rule, ``∂γ/∂z`` in ``∂T/∂z``),
which the implicit function theorem needs for the derivative of the fixed point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from .._lazy import torch
from ..errors import OptionError, ScaleError

STATISTICS = ("min", "median", "mean")


@dataclass(frozen=True)
class _PatchStatistic:
    """``γ = c / max(stat_i n_i, floor)`` (shared validation and evaluation)."""

    c: float = 0.2
    statistic: str = "min"
    floor: float = 1e-12

    #: the arguments of ``γ`` (printed as ``γ(x)`` or ``γ(x, z)``)
    arguments: ClassVar[str] = "x"

    def _validate(self, term: str) -> None:
        if self.statistic not in STATISTICS:
            raise OptionError(f"statistic {self.statistic!r} is not one of {STATISTICS}",
                              term=term, hint="statistic='min' (GEQ's rule) or 'median'")
        if not (math.isfinite(self.c) and self.c > 0 and math.isfinite(self.floor)
                and self.floor > 0):
            raise ScaleError(f"c = {self.c:g} and floor = {self.floor:g} must be positive and "
                             "finite", term=term)

    def gamma(self, m: torch.Tensor) -> torch.Tensor:
        """``γ = c / max(m, floor)`` from the per-sample statistic ``m`` ``(B,)``."""
        return self.c / m.clamp_min(self.floor)

    def statistic_of(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, ∂m/∂n)`` for per-patch squared norms ``n`` ``(B, P)``: the statistic and its
        (a.e.) derivative weights over the patches."""
        if self.statistic == "mean":
            return n.mean(dim=-1), torch.full_like(n, 1.0 / n.shape[-1])
        m, idx = (n.min(dim=-1) if self.statistic == "min" else n.median(dim=-1))
        return m, torch.zeros_like(n).scatter_(-1, idx[:, None], 1.0)

    def of_norms(self, n: torch.Tensor) -> torch.Tensor:
        """``γ`` ``(B,)`` from the per-patch squared norms ``n`` ``(B, P)``."""
        return self.gamma(self.statistic_of(n)[0])

    def text(self, v: Any, wh: str | None) -> str:
        """``γ(·) = c/max(stat_i ||[v]_i W_h||², floor)`` as text."""
        pw = "" if wh is None else f" {wh}"
        arg = f"||[{v}]_i{pw}||²" if wh is not None else f"||{v}||²"
        stat = f"{self.statistic}_i " if wh is not None else ""
        return f"γ({self.arguments}) = {self.c:g}/max({stat}{arg}, {self.floor:g})"

    def latex(self, v: Any, wh: str | None) -> str:
        """LaTeX of :meth:`text`."""
        pw = "" if wh is None else f"\\, {wh}"
        arg = f"\\|[{v}]_i{pw}\\|^2" if wh is not None else f"\\|{v}\\|^2"
        stat = f"\\operatorname{{{self.statistic}}}_i " if wh is not None else ""
        return (f"\\gamma({self.arguments}) = \\frac{{{self.c:g}}}{{\\max({stat}{arg},\\ "
                f"{self.floor:g})}}")

    @property
    def symbol_text(self) -> str:
        """``γ(x)`` or ``γ(x, z)``."""
        return f"γ({self.arguments})"

    @property
    def symbol_latex(self) -> str:
        """LaTeX of :attr:`symbol_text`."""
        return f"\\gamma({self.arguments})"


@dataclass(frozen=True)
class InputBandwidth(_PatchStatistic):
    """``γ(x) = c / max(stat_i ||q̃_i W_h||², floor)``: a bandwidth from the input part ``q``
    of the kernel's argument, per sample (module docstring; docs/theory.md §3.1).

    ``statistic="min"`` is GEQ's rule evaluated at ``z = 0`` (where the solvers start);
    ``"median"`` the median heuristic over the patches.  ``of="residual"`` is refused: GEQ's rule
    on ``q − Wz`` is :class:`ResidualBandwidth`, whose claim differs."""

    of: str = "input"

    def __post_init__(self) -> None:
        if self.of == "residual":
            raise OptionError(
                "a bandwidth γ(z) computed from the residual q − Wz depends on the state: "
                "σ(e^{−γ||r||²}Wᵀr) is then not ∇ of (1/(2γ(z)))e^{−γ(z)||r||²} (the ∇γ(z) terms "
                "are missing), so the equilibrium is a stationary point of no stated objective",
                term="InputBandwidth", hint="use ResidualBandwidth for GEQ's iteration (its "
                "claim: a fixed point of that iteration), or of='input' (GEQ's rule at z = 0: "
                "one fixed objective per sample)")
        if self.of != "input":
            raise OptionError(f"of={self.of!r} is not a bandwidth source", term="InputBandwidth",
                              hint="of='input', or ResidualBandwidth for the residual")
        self._validate("InputBandwidth")


@dataclass(frozen=True)
class ResidualBandwidth(_PatchStatistic):
    """GEQ's rule ``γ(x, z) = c / max(stat_i ||(x̃_i − z̃_i)W_h||², floor)`` on the residual
    ``r = q − Wz`` at the current state, recomputed at every application of ``T`` (module
    docstring; docs/theory.md §3.2).  The claim of a layer with it is "fixed point of the
    iteration", never "stationary point"."""

    arguments: ClassVar[str] = "x, z"

    def __post_init__(self) -> None:
        self._validate("ResidualBandwidth")


#: what a kernel's ``gamma`` may be besides a number or a Scalar
BANDWIDTH_RULES = (InputBandwidth, ResidualBandwidth)

__all__ = ["BANDWIDTH_RULES", "STATISTICS", "InputBandwidth", "ResidualBandwidth"]
