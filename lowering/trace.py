"""The derivation trace (rule, condition, before/after), the claim and the contraction estimate.

Steps, derivations and claims are immutable values: a rule that edits a layer returns a new
derivation (``d.then(step)``), it never appends to the one it was given.  Formulas are written
once, as a tuple of parts (plain strings in unicode math, nodes, objectives, terms, symbols), and
one printer (:func:`render`) turns them into plain text or LaTeX."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from convex_eq.symbols import Env

#: a formula: one part or a tuple of parts; a part is a string or an object with ``latex()``
Formula = Any

_WORDS = {"prox": "\\mathrm{prox}", "argmin": "\\arg\\min", "soft": "\\mathrm{soft}",
          "Lip": "\\mathrm{Lip}", "cond": "\\mathrm{cond}", "sign": "\\mathrm{sign}"}
_CHARS = {
    "∇": "\\nabla ", "∂": "\\partial ", "φ": "\\varphi ", "ψ": "\\psi ", "σ": "\\sigma ",
    "λ": "\\lambda ", "μ": "\\mu ", "α": "\\alpha ", "γ": "\\gamma ", "τ": "\\tau ",
    "κ": "\\kappa ", "Σ": "\\sum ", "Φ": "\\Phi ", "ι": "\\iota ", "Π": "\\prod ",
    "−": "-", "∈": "\\in ", "≤": "\\le ", "≥": "\\ge ", "⪰": "\\succeq ", "≻": "\\succ ",
    "∘": "\\circ ", "·": "\\cdot ", "←": "\\leftarrow ", "⇔": "\\Leftrightarrow ",
    "⇒": "\\Rightarrow ", "→": "\\to ", "⟶": "\\longrightarrow ", "…": "\\dots ",
    "½": "\\tfrac12 ", "²": "^2", "₂": "_2", "₁": "_1", "ᵀ": "^\\top ", "⁻¹": "^{-1}",
    "∫": "\\int ", "◊": "\\diamond ", "̃": "", "*": "^*", "⊆": "\\subseteq ",
}
_TOKEN = re.compile("|".join([*(f"(?<![A-Za-z]){w}(?![A-Za-z])" for w in _WORDS),
                               *sorted(map(re.escape, _CHARS), key=len, reverse=True),
                               r"\|\|"]))


def _latex_of_text(s: str) -> str:
    """Unicode math as written in the rules → LaTeX (``prox_φ`` → ``\\mathrm{prox}_\\varphi``)."""
    def sub(m: re.Match[str]) -> str:
        t = m.group(0)
        if t == "||":
            return "\\|"
        return _WORDS.get(t) or _CHARS[t]

    return _TOKEN.sub(sub, s)


def render(formula: Formula, latex: bool = False) -> str:
    """The one printer: a formula (a part or a tuple of parts) as plain text or as LaTeX."""
    if isinstance(formula, tuple):
        return "".join(render(p, latex) for p in formula)
    if isinstance(formula, str):
        return _latex_of_text(formula) if latex else formula
    if latex:
        return formula.latex()
    return formula.text() if hasattr(formula, "text") and callable(formula.text) else str(formula)


def _prose_latex(s: str) -> str:
    return "\\text{" + s.replace("_", "\\_").replace("{", "\\{").replace("}", "\\}") + "}"


@dataclass(frozen=True)
class Step:
    """One rule application: ``before ⟶ after`` under ``condition`` (formulas printed by
    :func:`render`; ``condition`` and ``note`` are prose)."""

    #: the rule's name (e.g. ``"Theorem 1 (OptEq): prox of ψ* − ½||·||² is ∇ψ"``)
    rule: str
    #: the condition under which the rule applies, in words
    condition: str
    #: the formula before the step
    before: Formula
    #: the formula after the step
    after: Formula
    #: what the step implies (e.g. which claim it supports), in words
    note: str = ""

    def text(self, i: int) -> str:
        """The step as printed text, numbered ``[i]``."""
        lines = [f"[{i}] {self.rule}", f"    condition: {self.condition or 'none'}",
                 f"    before: {render(self.before)}", f"    after:  {render(self.after)}"]
        if self.note:
            lines.append(f"    note:   {self.note}")
        return "\n".join(lines)

    def latex(self, i: int) -> str:
        """The step as LaTeX, numbered ``[i]``."""
        note = f"\\\\ \\quad{_prose_latex('note: ' + self.note)}" if self.note else ""
        return (f"\\textbf{{[{i}] {self.rule}}}\\quad"
                f"({_prose_latex('condition: ' + (self.condition or 'none'))})\\\\\n"
                f"\\quad {render(self.before, True)} \\;\\Longrightarrow\\; "
                f"{render(self.after, True)}{note}")


class ClaimKind(StrEnum):
    """What an equilibrium of the layer is (compares equal to its string value)."""

    MINIMIZER = "minimizer"
    MODIFIED_MINIMIZER = "modified minimizer"  # of φ + M¹[γR] (prox-variant edit)
    STATIONARY = "stationary point"
    INCLUSION = "inclusion"  # Theorem 2's monotone inclusion (deep compositions, L ≥ 3)
    #: a fixed point of an iteration that recomputes a parameter from the state (GEQ's
    #: bandwidth γ(x, z)): a stationary point of the objective at the parameter's own value
    #: there, not of the objective with the parameter varying (docs/theory.md §3.2)
    ITERATION = "fixed point of the iteration"

    @property
    def needs_certificate(self) -> bool:
        """Only a convexity certificate makes this claim true."""
        return self not in (ClaimKind.STATIONARY, ClaimKind.ITERATION)


@dataclass(frozen=True)
class Claim:
    """What the equilibrium satisfies, stated exactly."""

    #: minimizer, modified minimizer (of ``φ + M¹[γR]``), stationary point or inclusion
    kind: ClaimKind
    #: the claim in words, e.g. ``"z* ∈ argmin φ, φ = …"``
    statement: str
    #: the claim as LaTeX
    latex: str = ""
    #: the objective the claim is about, as text
    objective_text: str = ""
    #: the certificate's conditions the claim needs (e.g. ``||W||₂ ≤ 1``)
    conditions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ClaimKind(self.kind))
        object.__setattr__(self, "conditions", tuple(self.conditions))

    def __str__(self) -> str:
        cond = f" (if {'; '.join(self.conditions)})" if self.conditions else ""
        return f"{self.kind}: {self.statement}{cond}"


@dataclass(frozen=True)
class Contraction:
    """Lipschitz bound of ``T``: a formula from the terms and its current value."""

    #: the bound as text, e.g. ``"s·L_σ·||W||₂²"``
    formula: str
    #: the bound as LaTeX
    latex: str
    #: computes the bound at given weights (None: the current ones)
    value_fn: Callable[[Env | None], float]

    def value(self, env: Env | None = None) -> float:
        """The bound on ``Lip(T)`` at the weights ``env`` (None: the current ones)."""
        return float(self.value_fn(env))

    def describe(self, env: Env | None = None, value: float | None = None) -> str:
        """``Lip(T) ≤ formula = value (verdict)``; ``value``: the bound at ``env`` when the
        caller has evaluated it already."""
        v = self.value(env) if value is None else value
        verdict = "contraction" if v < 1 else ("nonexpansive" if v <= 1 + 1e-12 else
                                               "not a certified contraction")
        return f"Lip(T) ≤ {self.formula} = {v:.4g} ({verdict})"


@dataclass(frozen=True)
class Derivation:
    """Ordered derivation steps (a value: ``then`` returns a new derivation)."""

    #: the steps in the order they were applied
    steps: tuple[Step, ...] = field(default_factory=tuple)

    def then(self, *steps: Step) -> Derivation:
        """A new derivation with ``steps`` appended."""
        return Derivation((*self.steps, *steps))

    def text(self) -> str:
        """Every step as printed text."""
        return "\n".join(s.text(i + 1) for i, s in enumerate(self.steps))

    def latex(self) -> str:
        """Every step as one LaTeX ``array``."""
        body = "\\\\[4pt]\n".join(s.latex(i + 1) for i, s in enumerate(self.steps))
        return f"\\begin{{array}}{{l}}\n{body}\n\\end{{array}}"

    def rules(self) -> list[str]:
        """The names of the rules applied, in order."""
        return [s.rule for s in self.steps]

    def __str__(self) -> str:
        return self.text()
