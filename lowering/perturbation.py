"""Worst-case input perturbations derived from the objective (docs/theory.md §7, MOptEq Proposition
2).

When ``G(z; x)`` is affine in the injected input, ``argmax_{||δ||∞ ≤ ε} G(z; x - δ) =
-ε·sign(∇_x G(z; x))``; for the linear kernel ``-<Ux + b, z>`` this is ``δ = ε·sign(Uᵀz)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import LoweringError, ScaleError
from convex_eq.objective import Objective
from convex_eq.symbols import Env
from convex_eq.terms.base import Term
from convex_eq.terms.quadratic import Linear


@dataclass
class Perturbation:
    """``δ(z, x) = -ε·sign(∇_x G(z; x))`` with its derivation; ``exact`` iff G is affine in x."""

    objective: Objective
    eps: float
    terms: list[Term]
    exact: bool
    formula: str

    def delta(self, values: dict[str, torch.Tensor], env: Env | None = None
              ) -> dict[str, torch.Tensor]:
        """Per-input perturbation for flat batched ``values`` (states and inputs)."""
        out: dict[str, torch.Tensor] = {}
        for t in self.terms:
            for k, g in t.grad(values, env, wrt="input").items():
                out[k] = out[k] + g if k in out else g
        return {k: -self.eps * torch.sign(g) for k, g in out.items()}

    def __str__(self) -> str:
        kind = "exact (G affine in x)" if self.exact else "first-order (G not affine in x)"
        return f"δ = {self.formula}, ||δ||∞ ≤ {self.eps:g} — {kind}"


def _formula(terms: list[Term], eps: float) -> str:
    parts = []
    for t in terms:
        if isinstance(t, Linear):
            w, u = t.args
            for e in w.entries:
                if e.symbol.kind != "input":
                    continue
                sign = -t.scale * e.coef  # δ = -ε sign(∇_x G); ∇_x <c·A x, u> = c Aᵀu
                op = f"{e.op}ᵀ" if e.op is not None else ""
                pre = "" if sign > 0 else "-"
                parts.append(f"{pre}{op}({u})")
        else:
            parts.append(f"-∇_x[{t}]")
    return f"{eps:g}·sign({' + '.join(parts)})"


def perturbation(objective: Any, eps: float) -> Perturbation:
    """Derive the worst-case ℓ∞ input perturbation of size ``eps`` from ``objective``."""
    if eps < 0:
        raise ScaleError(f"ε = {eps} must be ≥ 0", term="perturbation")
    if not isinstance(objective, Objective):
        raise LoweringError("perturbation needs an Objective", term="perturbation")
    terms = [t for t in objective.terms
             if any(s.kind == "input" for a in t.args for s in a.symbols())]
    if not terms:
        raise LoweringError("the objective does not depend on an input", term="perturbation")
    exact = all(isinstance(t, Linear) and not t.args[1].symbols("input") for t in terms)
    return Perturbation(objective, float(eps), terms, exact, _formula(terms, eps))
