"""Deep OptEq (docs/theory.md §5): ``T = f_L ∘ … ∘ f_1``, ``f_l = α prox_{φ_l} + (1-α) id``.

Each layer objective ``φ_l`` is declared on its own output block (``z_l``; the last layer's output
is ``z_0``), which is exactly the multi-block form of Lemma 3: ``z_1 = f_1(z_0)``, …,
``z_0 = f_L(z_{L-1})``.  For ``L = 2`` the equilibrium minimizes the Corollary 1 objective;
for ``L ≥ 3`` it satisfies the monotone inclusion of Theorem 2 (no objective exists in general).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ScaleError, ShapeError
from .objective import Objective
from .symbols import Env, Scalar, Symbol, scalar_value
from .terms.moreau import MoreauEnvelope
from .terms.quadratic import SqNorm


@dataclass
class DeepComposition:
    """``f_L ∘ … ∘ f_1`` with ``f_l = α prox_{φ_l} + (1-α) id`` (one φ per layer/block)."""

    #: the hidden objectives ``φ_1, …, φ_L`` of the layers, each with its own output state
    layers: list[Objective]
    #: the skip weight ``α ∈ (0, 1]``: a number, or a :class:`Scalar` (possibly learnable)
    alpha: float | Scalar = 1.0
    #: the name printed in derivations
    name: str = "deep"
    #: where the composition's theory is stated
    reference: str = field(default="TPAMI OptEq §5 (Lemma 3, Theorem 2, Corollary 1)")

    def __post_init__(self) -> None:
        if len(self.layers) < 1:
            raise ShapeError("a composition needs at least one layer", term=self.name)
        a = scalar_value(self.alpha)
        if not 0 < a <= 1:
            raise ScaleError(f"α = {a} must lie in (0, 1]", term=self.name)
        al = self.alpha
        if isinstance(al, Scalar) and al.learnable and (
                al.low is None or al.low <= 0 or al.high is None or al.high > 1):
            raise ScaleError(f"learnable α '{al.name}' has the range [{al.low}, {al.high}]; it "
                             "needs 0 < low and high ≤ 1: α ∈ (0, 1] is the skip connection's "
                             "condition, and the solver's stop test measures the residual of "
                             "αT + (1 − α)I, which shrinks with α (a positive floor keeps it "
                             "meaningful)", term=self.name,
                             hint=f"declare Scalar('{al.name}', {a:g}, low=0.05, high=1, "
                             "learnable=True)")
        sizes = set()
        for i, phi in enumerate(self.layers):
            if len(phi.states) != 1:
                raise ShapeError(f"layer {i + 1} objective must have one state block",
                                 term=self.name)
            sizes.add(phi.states[0].size)
        if len(sizes) != 1:
            raise ShapeError(f"all layers must act on one space, got sizes {sorted(sizes)}",
                             term=self.name)
        names = [phi.states[0].name for phi in self.layers]
        if len(set(names)) != len(names):
            raise ShapeError("each layer needs its own output state symbol", term=self.name)

    @property
    def L(self) -> int:
        """The number of layers."""
        return len(self.layers)

    @property
    def blocks(self) -> list[Symbol]:
        """Output blocks ``z_1, …, z_{L-1}, z_0`` (the stacked multi-block state)."""
        return [phi.states[0] for phi in self.layers]

    @property
    def symbols(self) -> list[Symbol]:
        """The layers' symbols, then ``α`` when it is a :class:`Scalar` (possibly learnable)."""
        out: list[Symbol] = []
        for phi in self.layers:
            for s in phi.symbols:
                if all(s is not o for o in out):
                    out.append(s)
        if isinstance(self.alpha, Scalar) and all(self.alpha is not o for o in out):
            out.append(self.alpha)
        return out

    def alpha_value(self, env: Env | None = None) -> float:
        """``α`` at ``env`` (a trained/learnable value there) or its declared value."""
        return scalar_value(self.alpha, env)

    def corollary1_objective(self, env: Env | None = None) -> Objective:
        """L = 2: ``α M_{φ_1}^{1-α}(z_1) + α M_{φ_2}^{1-α}(z_0) + ½||z_1 - z_0||²`` (``α`` at
        ``env``)."""
        if self.L != 2:
            raise ShapeError(f"Corollary 1 needs L = 2, got L = {self.L}", term=self.name,
                             hint="for L ≥ 3 use the Theorem 2 inclusion residual")
        a = self.alpha_value(env)
        if a == 1.0:
            raise ScaleError("Corollary 1 with α = 1 has no envelope (μ = 1 - α = 0)",
                             term=self.name, hint="use α < 1")
        z1, z0 = self.blocks
        terms = [MoreauEnvelope(phi, 1.0 - a) * a for phi in self.layers]
        return Objective([*terms, SqNorm(z1 - z0)], name=f"{self.name}-cor1")

    def latex(self) -> str:
        """``T = f_L ∘ … ∘ f_1, f_l = α prox_{φ_l} + (1 − α) I`` as LaTeX."""
        fs = " \\circ ".join(f"f_{{{i}}}" for i in range(self.L, 0, -1))
        return f"T = {fs},\\quad f_l = \\alpha\\,\\mathrm{{prox}}_{{\\varphi_l}} + (1-\\alpha) I"

    def __str__(self) -> str:
        inner = "; ".join(f"φ_{i + 1}({phi.states[0].name}) = {phi}"
                          for i, phi in enumerate(self.layers))
        return f"{self.name}: T = f_{self.L}∘…∘f_1, α = {self.alpha_value():g}; {inner}"
