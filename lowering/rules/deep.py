"""Deep composition (docs/theory.md §5): ``T = f_L∘…∘f_1``, ``f_l = α prox_{φ_l} + (1-α) id``, and
its multi-block form (Lemma 3); claims: Corollary 1 (L = 2) or the Theorem 2 inclusion (L ≥ 3).

``lower(comp, deep_form=…)`` returns a layer whose ``T(**blocks)`` gives, for
``"composition"``, the single block ``z_0`` (a tensor/array), and for ``"multiblock"`` every block
``z_1, …, z_{L-1}, z_0`` (a dict by name, like any multi-block layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convex_eq.certificate import Certificate
from convex_eq.composition import DeepComposition
from convex_eq.errors import LoweringError, OptionError
from convex_eq.symbols import Scalar
from convex_eq.terms.base import Condition

from ..derived import DerivedLayer
from ..nodes import Coef, Combo, Named, Node, ScalarCoef, Substitute, Var
from ..trace import Claim, ClaimKind, Contraction, Derivation, Step
from .base import DEEP_FORMS, LowerContext, Match, Payload

FORMS = DEEP_FORMS


@dataclass(frozen=True)
class DeepPayload(Payload):
    form: str
    alpha: float
    conditions: tuple[Condition, ...]
    layer_nodes: tuple[Node, ...]
    layers: tuple[DerivedLayer, ...]


def match(obj: Any) -> Match | None:
    return Match(obj) if isinstance(obj, DeepComposition) else None


def layers_certificate(layers: list[DerivedLayer]) -> Certificate:
    """Every ``φ_l`` convex: the conjunction of the layers' own conditions, each naming the
    layer's weights (``||W_l||₂ ≤ …``)."""
    conds: list[Condition] = []
    for inner in layers:
        for c in inner.certificate.conditions if inner.certificate is not None else []:
            if all(c.text != o.text for o in conds):
                conds.append(c)
    if any(inner.certificate is None or inner.certificate.kind == "nonconvex"
           for inner in layers):
        bad = [str(inner.source) for inner in layers
               if inner.certificate is None or inner.certificate.kind == "nonconvex"]
        return Certificate("nonconvex", holds=False, nonconvex_terms=bad,
                           reason="layer objective(s) " + "; ".join(bad) + " not convex")
    if not conds:
        return Certificate("convex")
    return Certificate("conditional", conds, [c.value(None) for c in conds],
                       all(c.holds(None) for c in conds))


def lower(m: Match, ctx: LowerContext) -> DerivedLayer:
    comp: DeepComposition = m.objective
    form = ctx.deep_form
    if form not in FORMS:
        raise OptionError(f"unknown deep form {form!r}", term="lower", hint=f"use one of {FORMS}")
    a = comp.alpha_value()
    ca, cb, a_txt, a_of = _skip_coefficients(comp, a)
    blocks = comp.blocks
    steps: list[Step] = []
    layer_nodes, inners = [], []
    for i, phi in enumerate(comp.layers):
        inner = ctx.lower(phi)
        if not inner.is_prox:
            raise LoweringError(f"layer {i + 1} does not lower to prox_φ", term=str(phi),
                                hint="deep OptEq layers are φ_l = ψ_l* − ½||·||² (Theorem 1)")
        inners.append(inner)
        b = blocks[i]
        fixed_one = isinstance(ca, float) and ca == 1.0
        f = inner.nodes[b.name] if fixed_one else Combo([(ca, inner.nodes[b.name]), (cb, Var(b))])
        layer_nodes.append(f)
        conds = inner.certificate.conditions if inner.certificate else []
        steps.append(Step(f"layer {i + 1}: Theorem 1 + skip connection (α = {a_txt})",
                          "; ".join(c.text for c in conds) or "none",
                          (f"φ_{i + 1}(", b, ") = ", phi), (f"f_{i + 1}(", b, ") = ", f),
                          note=f"f_{i + 1} = prox of α M^{{1-α}}[φ_{i + 1}]"))
    nodes, out_blocks, step = _composed(form, blocks, layer_nodes, comp.L)
    steps.append(step)
    cert = layers_certificate(inners)
    hyp = (*(c.text for c in cert.conditions), "L_σ = 1")
    if comp.L == 2 and a < 1:
        obj = comp.corollary1_objective()
        claim = Claim(ClaimKind.MINIMIZER, f"(z_1, z_0) minimizes {obj} (Corollary 1)",
                      obj.latex(), str(obj), hyp)
    else:
        claim = Claim(ClaimKind.INCLUSION, "0 ∈ ∂Φ(z̃) + (I − P)z̃, Φ(z̃) = Σ_i α M^{1-α}[φ_i](z_i) "
                      "(Theorem 2)", "0 \\in \\partial\\Phi(\\tilde z) + (I - P)\\tilde z",
                      "", hyp)
    return DerivedLayer(source=comp, blocks=out_blocks, nodes=nodes,
                        derivation=Derivation(tuple(steps)), claim=claim,
                        contraction=_contraction(form, [i.contraction for i in inners], a_of),
                        certificate=cert,
                        payload=DeepPayload(form, a, tuple(cert.conditions), tuple(layer_nodes),
                                            tuple(inners)))


def _skip_coefficients(comp: DeepComposition, a: float) -> tuple[Coef, Coef, str, Any]:
    """``(α, 1 − α, α's text, env ↦ α)``: α as read at each evaluation (a Scalar, possibly
    learnable) or a fixed number."""
    if isinstance(comp.alpha, Scalar):
        return (ScalarCoef(comp.alpha), ScalarCoef(comp.alpha, -1.0, 1.0), comp.alpha.name,
                comp.alpha_value)

    def a_of(env: Any, a: float = a) -> float:
        return a

    return a, 1.0 - a, f"{a:g}", a_of


def _composed(form: str, blocks: list[Any], layer_nodes: list[Any], L: int
              ) -> tuple[dict[str, Any], list[Any], Step]:
    """The layer's nodes, its state blocks and the derivation step: ``T = f_L ∘ … ∘ f_1`` on
    ``z_0`` (composition), or every block updated from its predecessor (multi-block)."""
    nodes: dict[str, Any] = {}
    if form == "composition":
        z0 = blocks[-1]
        cur: Any = Var(z0)
        for i in range(L):
            cur = Named(f"f_{i + 1}", f"f_{{{i + 1}}}", Substitute(layer_nodes[i], blocks[i], cur),
                        cur)
        nodes[z0.name] = cur
        return nodes, [z0], Step("deep composition", "each f_l averaged/nonexpansive",
                                 ("T = f_L ∘ … ∘ f_1"), (z0, " ← ", cur))
    for i in range(L):
        prev = blocks[i - 1]
        nodes[blocks[i].name] = Named(f"f_{i + 1}", f"f_{{{i + 1}}}",
                                      Substitute(layer_nodes[i], blocks[i], Var(prev)),
                                      Var(prev))
    return nodes, list(blocks), Step(
        "multi-block form (Lemma 3)", "z̃ = (z_1, …, z_{L-1}, z_0); cyclic block permutation P",
        "T = f_L ∘ … ∘ f_1",
        "; ".join(f"{blocks[i].name} ← f_{i + 1}({blocks[i - 1].name})" for i in range(L)))


def _contraction(form: str, lips: list[Contraction], a_of: Any) -> Contraction:
    if form == "composition":
        return Contraction(
            "Π_l (α·Lip(prox_{φ_l}) + 1 − α)", "\\prod_l (\\alpha L_l + 1 - \\alpha)",
            lambda env, ls=lips: _prod([a_of(env) * lc.value(env) + 1 - a_of(env)
                                        for lc in ls]),
        )
    # one application of the multi-block T updates every block from its predecessor, so
    # Lip(T) (stacked Euclidean norm) is the largest layer constant, not their product
    return Contraction(
        "max_l (α·Lip(prox_{φ_l}) + 1 − α)", "\\max_l (\\alpha L_l + 1 - \\alpha)",
        lambda env, ls=lips: max(a_of(env) * lc.value(env) + 1 - a_of(env) for lc in ls),
    )


class Deep:
    """``f_L∘…∘f_1`` of Theorem-1 layers with skip ``α`` (or its multi-block form)."""

    name = "deep"

    def match(self, objective: Any) -> Match | None:
        return match(objective)

    def lower(self, m: Match, ctx: LowerContext) -> DerivedLayer:
        return lower(m, ctx)


RULE = Deep()


def _prod(xs: list[float]) -> float:
    out = 1.0
    for x in xs:
        out *= x
    return out
