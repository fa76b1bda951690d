"""Canonical stationarity form (docs/theory.md §3): ``G = Σ_b 1ᵀf_{σ_b}(z_b) + ½||z||² - S(z)``
⇒ ``0 ∈ ∂f_σ(z) + z - ∇S(z)`` ⇔ ``z_b = σ_b(∇_b S(z))`` (forward–backward with unit step).

A separable prox-able term ``g`` on a block joins the potential when ``prox_{f_σ + g}`` composes
in closed form, ``prox_{f_σ + g} = σ ∘ prox_g``:

* ``f_σ`` the indicator of an interval (ReLU, hard-tanh, clamp, identity): any 1-D convex ``g``;
* ``g = c|·|`` (``∂g`` depends on the sign only) and ``σ(0) = 0``: with ``w = soft_c(v)`` and
  ``u = σ(w)``, ``v − u ∈ c∂|w| + ∂f_σ(u) ⊆ c∂|u| + ∂f_σ(u)`` because ``σ`` is nondecreasing
  with ``σ(0) = 0`` (so ``u`` has the sign of ``w`` or is 0); hence ``u = prox_{f_σ + c|·|}(v)``.
  ``σ(0) = 0`` is also necessary: at ``v = 0`` the formula gives ``σ(0)``, the prox gives 0."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from convex_eq._lazy import torch
from convex_eq.activations.base import Activation
from convex_eq.objective import Objective
from convex_eq.terms.base import Term
from convex_eq.terms.potential import Potential
from convex_eq.terms.quadratic import SqNorm

from ..derived import DerivedLayer
from ..nodes import GradSum, Prox, Sigma, Var
from ..trace import Claim, ClaimKind, Contraction, Derivation, Step
from .base import LowerContext, Match, Payload
from .common import certificate, claim_from_certificate, proxable, sum_lip_text


@dataclass(frozen=True)
class CanonicalMatch(Match):
    potentials: dict[str, Potential]
    unit_sq: dict[str, SqNorm]
    rest: tuple[Term, ...]
    extra_prox: dict[str, Term] = field(default_factory=dict)


@dataclass(frozen=True)
class CanonicalPayload(Payload):
    S_terms: tuple[Term, ...]
    potentials: dict[str, Potential]


@dataclass(frozen=True)
class _Defined:
    """A definition written once as text and once as LaTeX (a formula part for the printer)."""

    plain: str
    tex: str

    def text(self) -> str:
        return self.plain

    def latex(self) -> str:
        return self.tex


def _interval_potential(act: Activation) -> bool:
    """f_σ is the indicator of an interval (or 0): σ is the projection onto it."""
    return act.name in ("relu", "hardtanh", "clamp", "identity")


def fixes_zero(act: Activation) -> bool:
    """``σ(0) = 0`` (exactly, up to float rounding of the activation's own formula)."""
    return abs(float(act.sigma(torch.zeros(1, dtype=torch.float64))[0])) <= 1e-12


def composes(act: Activation, g: Term) -> str:
    """Why ``prox_{f_σ + g} = σ ∘ prox_g`` holds ("" if it does not)."""
    if _interval_potential(act):
        return (f"f_σ is the indicator of an interval ({act.name}) and {g} is separable: in 1-D, "
                "prox_{ι_I + g} = proj_I ∘ prox_g")
    if getattr(g, "sign_subdifferential", False) and fixes_zero(act):
        return (f"{g} = c|·| coordinate-wise (∂g depends on the sign only) and σ = {act.name} "
                "is nondecreasing with σ(0) = 0, so σ keeps the sign of soft_c(v): "
                "prox_{f_σ + c|·|} = σ ∘ soft_c")
    return ""


def _separable_prox(t: Term) -> bool:
    return bool(getattr(t, "separable", False)) and proxable(t) and t.prox_state is not None


def _differentiable(t: Term) -> bool:
    return t.smooth or getattr(t, "almost_everywhere_grad", False)


def match(obj: Any) -> CanonicalMatch | None:
    """Every block has one potential ``Σf_σ(z_b)`` and one ``½||z_b||²``; the rest is -S."""
    if not isinstance(obj, Objective):
        return None
    pots: dict[str, Potential] = {}
    sqs: dict[str, SqNorm] = {}
    rest: list[Term] = []
    for t in obj.terms:
        s = t.prox_state
        if isinstance(t, Potential) and s is not None and t.scale == 1.0 and not t.scalars \
                and s.name not in pots:
            pots[s.name] = t
        elif isinstance(t, SqNorm) and s is not None and t.scale == 1.0 and not t.scalars \
                and s.name not in sqs:
            sqs[s.name] = t
        else:
            rest.append(t)
    names = [b.name for b in obj.states]
    if set(pots) != set(names) or set(sqs) != set(names):
        return None
    extra: dict[str, Term] = {}
    smooth_rest = []
    for t in rest:
        s = t.prox_state
        if not _differentiable(t) and s is not None and _separable_prox(t) \
                and s.name not in extra and composes(pots[s.name].act, t):
            extra[s.name] = t
        else:
            smooth_rest.append(t)
    if not all(_differentiable(t) for t in smooth_rest):
        return None
    return CanonicalMatch(obj, pots, sqs, tuple(smooth_rest), extra)


#: the condition of a state-dependent parameter's step (docs/theory.md §3.2)
_ITERATION_CONDITION = (
    "it reads the state z: every application of T recomputes it at the current z and holds it "
    "fixed in ∇_z S, so T is that iteration and not the stationarity map of G (whose gradient "
    "has the extra ∂S/∂γ·∇_z γ); a fixed point z* is a stationary point of G(·; x) with the "
    "parameter frozen at its own value at z*, not of z ↦ G(z; x) with it varying")


def lower(m: CanonicalMatch) -> DerivedLayer:
    obj = m.objective
    blocks = obj.states
    nodes = {}
    rest = list(m.rest)
    s_obj = Objective([-t for t in rest], name="S") if rest else None
    acts = ", ".join(f"σ_{b.name} = {m.potentials[b.name].act.name}" for b in blocks)
    steps = [Step(
        "canonical form G = Σ f_σ(z) + ½||z||² − S(z)",
        f"{acts} nondecreasing and 1-Lipschitz (f_σ convex, prox_{{f_σ}} = σ); "
        "S differentiable (gradient rules of its terms)",
        ("G = ", obj), ("S(z) = ", s_obj if s_obj is not None else "0"),
    )]
    steps += [Step(
        "input-dependent parameter (fixed per sample)",
        "it reads the input only, never z: G(·; x) is one fixed objective for each sample, so "
        "the steps below and the claim hold sample by sample; Lip(∇S) does not depend on it",
        t, _Defined(text, tex),
    ) for t in rest for text, tex in t.input_parameters()]
    state_params = [(text, tex) for t in rest for text, tex in t.state_parameters()]
    steps += [Step("state-dependent parameter (recomputed in every iteration)",
                   _ITERATION_CONDITION, t, _Defined(text, tex))
              for t in rest for text, tex in t.state_parameters()]
    for b in blocks:
        notes = "; ".join(["∇S assembled from the terms' own gradient rules",
                           *(n for t in rest if any(s is b for s in t.states())
                             for n in t.derivation_notes())])
        grad = GradSum(rest, b, sign=-1.0)
        act = m.potentials[b.name].act
        g = m.extra_prox.get(b.name)
        nodes[b.name] = Sigma(act, grad if g is None else Prox(g, grad))
        if g is not None:
            steps.append(Step(
                "separable prox composed with the potential",
                composes(act, g),
                ("prox_{f_σ + ", g, "}(v)"), ("σ(", Prox(g, Var(b)), ")"),
                note=f"exact: fixed points are stationary points of G including {g} "
                     "(no envelope)",
            ))
        steps.append(_fixed_point_step(b, nodes[b.name], notes, bool(state_params)))
    cert = certificate(obj)
    l_sig = max(m.potentials[b.name].act.lipschitz for b in blocks)
    if state_params:
        claim, contraction = _iteration_claim(obj, state_params)
    else:
        claim = _stationary_claim(obj, cert, [t for t in rest if not t.smooth])
        contraction = _contraction(m, rest, l_sig)
    return DerivedLayer(source=obj, blocks=list(blocks), nodes=nodes,
                        derivation=Derivation(tuple(steps)), claim=claim,
                        contraction=contraction, is_prox=False, certificate=cert,
                        payload=CanonicalPayload(m.rest, m.potentials))


def _contraction(m: CanonicalMatch, rest: list[Term], l_sig: float) -> Contraction:
    """``Lip(T) ≤ L_σ·Lip(∇S)``.  When every term of ``S`` reads one block only (independent
    branches), ``∇S`` is block diagonal and its Lipschitz constant is the largest block's:
    ``max_b L_{σ_b}·Σ_{t on b} Lip(∇t)`` (the norm of a block-diagonal Jacobian is its largest
    block's); otherwise the sum over all terms."""
    blocks = m.objective.states
    own = {b.name: [t for t in rest if [s.name for s in t.states()] == [b.name]]
           for b in blocks}
    if len(blocks) > 1 and sum(len(v) for v in own.values()) == len(rest):
        lsig = {b.name: m.potentials[b.name].act.lipschitz for b in blocks}
        parts = ", ".join(f"{lsig[b.name]:g}·({sum_lip_text(own[b.name])})" for b in blocks)
        return Contraction(
            f"max_b L_σ·Lip(∇_b S) = max({parts}) (independent blocks)",
            "\\max_b L_{\\sigma_b} \\cdot \\mathrm{Lip}(\\nabla_b S)",
            lambda env, o=own, ls=lsig: max(ls[k] * sum(t.grad_lipschitz(env) for t in v)
                                            for k, v in o.items()))
    return Contraction(
        f"L_σ·Lip(∇S) = {l_sig:g}·({sum_lip_text(rest)})",
        "L_\\sigma \\cdot \\mathrm{Lip}(\\nabla S)",
        lambda env, r=rest, ls=l_sig: ls * sum(t.grad_lipschitz(env) for t in r),
    )


def _fixed_point_step(b: Any, node: Any, notes: str, iteration: bool) -> Step:
    """The step from stationarity (or, with a state-dependent parameter, from the iteration's
    frozen-parameter gradient) to the fixed point of block ``b``."""
    if iteration:
        return Step(
            "fixed point of the iteration (forward–backward, unit step, parameter frozen at z)",
            "z = σ(∇_z S(z; γ)|_{γ = γ(x, z)}) ⇔ 0 ∈ ∂f_σ(z) + z − ∇_z S(z; γ̄) at γ̄ = γ(x, z)",
            ("0 ∈ ∂f_σ(", b, ") + ", b, " − ∇_", b, "S(z; γ̄)"), (b, " = ", node), note=notes)
    return Step(
        "stationarity ⇔ fixed point (forward–backward, unit step)",
        "0 ∈ ∂f_σ(z) + z − ∇S(z) ⇔ z = prox_{f_σ}(∇S(z)) = σ(∇S(z))",
        ("0 ∈ ∂f_σ(", b, ") + ", b, " − ∇_", b, "S(z)"), (b, " = ", node), note=notes)


def _stationary_claim(obj: Objective, cert: Any, nonsmooth: list[Term]) -> Claim:
    """"minimizer of G" when certified convex, else "stationary point" (with the a.e.
    gradients of non-smooth terms named)."""
    claim = claim_from_certificate(obj, cert, f"minimizer of G = {obj}",
                                   latex=f"\\text{{%s of }} {obj.latex()}")
    if nonsmooth and claim.kind != ClaimKind.MINIMIZER:
        claim = Claim(ClaimKind.STATIONARY,
                      f"stationary point of G = {obj} (a.e. gradient of "
                      f"{', '.join(t.label for t in nonsmooth)}; not convex: {cert.reason})",
                      f"\\text{{stationary point of }} {obj.latex()}",
                      objective_text=str(obj))
    return claim


def _iteration_claim(obj: Objective, params: list[tuple[str, str]]
                     ) -> tuple[Claim, Contraction]:
    """The claim and (absent) contraction bound of a layer whose parameters are recomputed
    from the state (docs/theory.md §3.2)."""
    defs = "; ".join(text for text, _ in params)
    claim = Claim(
        ClaimKind.ITERATION,
        f"fixed point of z = σ(∇_z S(z; γ)|_{{γ = γ(x, z)}}) with {defs} recomputed from the "
        "current state in every iteration; a stationary point of G(·; x, γ̄), the objective "
        f"{obj} with γ(x, z) held at its own value γ̄ = γ(x, z*), NOT a stationary point of "
        "z ↦ G(z; x, γ(x, z)) (that gradient has the extra term ∂S/∂γ·∇_z γ)",
        "\\text{fixed point of } z = \\sigma(\\nabla_z S(z;\\gamma)|_{\\gamma = "
        f"\\gamma(x,z)}}),\\ {', '.join(tex for _, tex in params)}",
        objective_text=str(obj))
    contraction = Contraction(
        "∞ (no bound: γ(x, z) varies with the state, ∂γ/∂z unbounded as its patch statistic → 0)",
        "\\text{none (state-dependent } \\gamma)", lambda env: math.inf)
    return claim, contraction


class Canonical:
    """``Σf_σ(z) + ½||z||² − S(z)`` ⇒ ``z = σ(∇S(z))`` (a composable separable prox joins σ)."""

    name = "canonical"

    def match(self, objective: Any) -> CanonicalMatch | None:
        return match(objective)

    def lower(self, m: CanonicalMatch, ctx: LowerContext) -> DerivedLayer:
        return lower(m)


RULE = Canonical()
