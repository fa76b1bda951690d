"""Deep composition (docs/theory.md §5): ``T = f_L∘…∘f_1``, ``f_l = α prox_{φ_l} + (1-α) id``, and
its
multi-block form (Lemma 3); claims: Corollary 1 (L = 2) or the Theorem 2 inclusion (L ≥ 3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from convex_eq.composition import DeepComposition
from convex_eq.errors import LoweringError, OptionError

from ..derived import DerivedLayer
from ..nodes import Combo, Named, Substitute, Var
from ..trace import Claim, Contraction, Derivation, Step

FORMS = ("composition", "multiblock")


def match(obj: Any) -> DeepComposition | None:
    return obj if isinstance(obj, DeepComposition) else None


def lower(comp: DeepComposition, lower_inner: Callable[..., DerivedLayer],
          form: str = "composition") -> DerivedLayer:
    if form not in FORMS:
        raise OptionError(f"unknown deep form {form!r}", term="lower", hint=f"use one of {FORMS}")
    a = comp.alpha_value()
    blocks = comp.blocks
    d = Derivation()
    layer_nodes, lips, conds, cond_objs = [], [], [], []
    for i, phi in enumerate(comp.layers):
        inner = lower_inner(phi)
        if not inner.is_prox:
            raise LoweringError(f"layer {i + 1} does not lower to prox_φ", term=str(phi),
                                hint="deep OptEq layers are φ_l = ψ_l* − ½||·||² (Theorem 1)")
        b = blocks[i]
        f = Combo([(a, inner.nodes[b.name]), (1 - a, Var(b))]) if a != 1.0 else inner.nodes[b.name]
        layer_nodes.append(f)
        lips.append(inner.contraction)
        conds += [c.text for c in inner.certificate.conditions] if inner.certificate else []
        cond_objs += list(inner.certificate.conditions) if inner.certificate else []
        d.add(Step(f"layer {i + 1}: Theorem 1 + skip connection (α = {a:g})",
                   "; ".join(c.text for c in inner.certificate.conditions) or "none",
                   f"φ_{i + 1}({b.name}) = {phi}", f"f_{i + 1}({b.name}) = {f.text()}",
                   phi.latex(), f"f_{{{i + 1}}}({b.latex()}) = {f.latex()}",
                   note=f"f_{i + 1} = prox of α M^{{1-α}}[φ_{i + 1}]"))
    L = comp.L
    nodes: dict[str, Any] = {}
    if form == "composition":
        z0 = blocks[-1]
        cur: Any = Var(z0)
        for i in range(L):
            cur = Named(f"f_{i + 1}", f"f_{{{i + 1}}}", Substitute(layer_nodes[i], blocks[i], cur),
                        cur)
        nodes[z0.name] = cur
        out_blocks = [z0]
        d.add(Step("deep composition", "each f_l averaged/nonexpansive",
                   "T = f_L ∘ … ∘ f_1", f"{z0.name} ← {cur.text()}",
                   comp.latex(), f"{z0.latex()} \\leftarrow {cur.latex()}"))
    else:
        for i in range(L):
            prev = blocks[i - 1]
            nodes[blocks[i].name] = Named(f"f_{i + 1}", f"f_{{{i + 1}}}",
                                          Substitute(layer_nodes[i], blocks[i], Var(prev)),
                                          Var(prev))
        out_blocks = list(blocks)
        d.add(Step("multi-block form (Lemma 3)",
                   "z̃ = (z_1, …, z_{L-1}, z_0); cyclic block permutation P",
                   "T = f_L ∘ … ∘ f_1",
                   "; ".join(f"{blocks[i].name} ← f_{i + 1}({blocks[i - 1].name})"
                             for i in range(L)),
                   comp.latex(), "\\tilde z \\leftarrow F(P\\tilde z)"))
    hyp = [*sorted(set(conds)), "L_σ = 1"]
    if L == 2 and a < 1:
        obj = comp.corollary1_objective()
        claim = Claim("minimizer", f"(z_1, z_0) minimizes {obj} (Corollary 1)",
                      obj.latex(), str(obj), hyp)
    else:
        claim = Claim("inclusion", "0 ∈ ∂Φ(z̃) + (I − P)z̃, Φ(z̃) = Σ_i α M^{1-α}[φ_i](z_i) "
                      "(Theorem 2)", "0 \\in \\partial\\Phi(\\tilde z) + (I - P)\\tilde z",
                      "", hyp)
    if form == "composition":
        contraction = Contraction(
            "Π_l (α·Lip(prox_{φ_l}) + 1 − α)", "\\prod_l (\\alpha L_l + 1 - \\alpha)",
            lambda env, ls=lips, a=a: _prod([a * lc.value(env) + 1 - a for lc in ls]),
        )
    else:
        # one application of the multi-block T updates every block from its predecessor, so
        # Lip(T) (stacked Euclidean norm) is the largest layer constant, not their product
        contraction = Contraction(
            "max_l (α·Lip(prox_{φ_l}) + 1 − α)", "\\max_l (\\alpha L_l + 1 - \\alpha)",
            lambda env, ls=lips, a=a: max(a * lc.value(env) + 1 - a for lc in ls),
        )
    return DerivedLayer(source=comp, blocks=out_blocks, nodes=nodes, derivation=d, claim=claim,
                        contraction=contraction,
                        info={"form": form, "alpha": a, "conditions": cond_objs,
                              "layer_nodes": layer_nodes})


def _prod(xs: list[float]) -> float:
    out = 1.0
    for x in xs:
        out *= x
    return out
