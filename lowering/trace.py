"""The derivation trace (rule, condition, before/after), the claim and the contraction estimate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from convex_eq.symbols import Env


@dataclass
class Step:
    """One rule application: ``before ⟶ after`` under ``condition``."""

    rule: str
    condition: str
    before: str
    after: str
    before_latex: str = ""
    after_latex: str = ""
    note: str = ""

    def text(self, i: int) -> str:
        lines = [f"[{i}] {self.rule}", f"    condition: {self.condition or 'none'}",
                 f"    before: {self.before}", f"    after:  {self.after}"]
        if self.note:
            lines.append(f"    note:   {self.note}")
        return "\n".join(lines)

    def latex(self, i: int) -> str:
        cond = self.condition.replace("_", "\\_") if self.condition else "none"
        before = self.before_latex or self.before
        after = self.after_latex or self.after
        note = f"\\\\ \\quad\\text{{note: {self.note}}}" if self.note else ""
        return (f"\\textbf{{[{i}] {self.rule}}}\\quad(\\text{{condition: {cond}}})\\\\\n"
                f"\\quad {before} \\;\\Longrightarrow\\; {after}{note}")


@dataclass
class Claim:
    """What the equilibrium satisfies, stated exactly."""

    kind: str  # "minimizer" | "modified minimizer" | "stationary point" | "inclusion"
    statement: str
    latex: str = ""
    objective_text: str = ""
    conditions: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        cond = f" (if {'; '.join(self.conditions)})" if self.conditions else ""
        return f"{self.kind}: {self.statement}{cond}"


@dataclass
class Contraction:
    """Lipschitz bound of ``T``: a formula from the terms and its current value."""

    formula: str
    latex: str
    value_fn: Callable[[Env | None], float]

    def value(self, env: Env | None = None) -> float:
        return float(self.value_fn(env))

    def describe(self, env: Env | None = None) -> str:
        v = self.value(env)
        verdict = "contraction" if v < 1 else ("nonexpansive" if v <= 1 + 1e-12 else
                                               "not a certified contraction")
        return f"Lip(T) ≤ {self.formula} = {v:.4g} ({verdict})"


@dataclass
class Derivation:
    """Ordered derivation steps; prints as plain text or LaTeX."""

    steps: list[Step] = field(default_factory=list)

    def add(self, step: Step) -> None:
        self.steps.append(step)

    def extend(self, other: Derivation) -> None:
        self.steps.extend(other.steps)

    def text(self) -> str:
        return "\n".join(s.text(i + 1) for i, s in enumerate(self.steps))

    def latex(self) -> str:
        body = "\\\\[4pt]\n".join(s.latex(i + 1) for i, s in enumerate(self.steps))
        return f"\\begin{{array}}{{l}}\n{body}\n\\end{{array}}"

    def rules(self) -> list[str]:
        return [s.rule for s in self.steps]

    def __str__(self) -> str:
        return self.text()
