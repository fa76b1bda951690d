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

    #: the objective the perturbation is derived from
    objective: Objective
    #: the size ``ε`` of the perturbation (``||δ||∞ ≤ ε``)
    eps: float
    #: the terms of ``G`` that read an input (their input gradients give ``δ``)
    terms: list[Term]
    #: True if ``G`` is affine in ``x``: then ``δ`` is the exact worst case, otherwise first-order
    exact: bool
    #: ``δ`` as text (``ε·sign(…)``, one ``δ_name = …`` per input when there are several)
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
        lhs = "" if self.formula.startswith("δ_") else "δ = "
        return f"{lhs}{self.formula}, ||δ||∞ ≤ {self.eps:g} — {kind}"


def _formula(terms: list[Term], eps: float) -> str:
    """``ε·sign(…)`` per input (one ``δ_name = …`` each when the objective has several)."""
    parts: dict[str, list[str]] = {}
    for t in terms:
        if isinstance(t, Linear):
            w, u = t.args
            for e in w.entries:
                if e.symbol.kind != "input":
                    continue
                sign = -t.scale * e.coef  # δ = -ε sign(∇_x G); ∇_x <c·A x, u> = c Aᵀu
                op = f"{e.op}ᵀ" if e.op is not None else ""
                pre = "" if sign > 0 else "-"
                parts.setdefault(e.symbol.name, []).append(f"{pre}{op}({u})")
        else:
            for a in t.args:
                for sym in a.symbols("input"):
                    parts.setdefault(sym.name, []).append(f"-∇_{sym.name}[{t}]")
    texts = {k: f"{eps:g}·sign({' + '.join(v)})" for k, v in parts.items()}
    if len(texts) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"δ_{k} = {v}" for k, v in texts.items())


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


@dataclass
class Cascade:
    """Perturbation-enhanced (PE) cascade of a multi-branch layer (MOptEq's PE training,
    docs/theory.md §7): branch ``i`` reads ``x - δ_{i-1}``, with ``δ_0 = 0`` and ``δ_i =
    -ε·sign(∇_{x_i} G(z*; x))`` the worst-case perturbation of branch ``i`` derived from the
    objective (for the linear injection ``-<U_i x_i + b_i, z_i>``: ``δ_i = ε·sign(U_iᵀ z_i*)``),
    computed at the equilibrium ``z*`` of the unperturbed inputs and held fixed (``sign`` has no
    gradient).  ``branches``: the input names ``x_1, …, x_k`` in cascade order."""

    perturbation: Perturbation
    branches: list[str]

    @property
    def eps(self) -> float:
        return self.perturbation.eps

    def inputs(self, x: torch.Tensor, states: dict[str, torch.Tensor], env: Env | None = None
               ) -> dict[str, torch.Tensor]:
        """The cascaded inputs ``{x_1: x, x_i: x - δ_{i-1}}`` for a shared input ``x`` (flat
        ``(B, d)`` or shaped) and the flat equilibrium ``states`` of the unperturbed inputs."""
        flat = x.reshape(x.shape[0], -1)
        values = {**states, **{name: flat for name in self.branches}}
        deltas = self.perturbation.delta(values, env)
        out = {self.branches[0]: flat}
        for prev, name in zip(self.branches, self.branches[1:]):
            out[name] = flat - deltas[prev].detach() if prev in deltas else flat
        return out


def cascade(objective: Any, eps: float) -> Cascade:
    """The PE cascade of ``objective`` (one input per branch, e.g.
    ``convex_eq.models.conv_mopteq(branch_inputs=True)``) with perturbations of size ``eps``."""
    pert = perturbation(objective, eps)
    names = [s.name for s in objective.inputs]
    if len(names) < 2:
        raise LoweringError(f"a PE cascade needs one input per branch; the objective has "
                            f"{names}", term="cascade",
                            hint="build the model with one input per branch "
                            "(conv_mopteq(branch_inputs=True))")
    shapes = {tuple(s.shape) for s in objective.inputs}
    if len(shapes) != 1:
        raise LoweringError(f"the branch inputs have different shapes {sorted(shapes)}: a "
                            "cascade feeds one shared input to every branch", term="cascade")
    return Cascade(pert, names)
