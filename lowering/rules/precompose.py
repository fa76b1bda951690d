"""Affine precomposition (docs/theory.md §4): ``φ → φ∘A`` ⇒ ``T' = A⁻¹∘T∘A``; fixed points of ``T'``
are
the minimizers of ``φ∘A`` for any invertible ``A``; ``T'`` is a prox only if ``M`` is orthogonal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convex_eq._lazy import torch
from convex_eq.precompose import Precomposed

from ..derived import DerivedLayer
from ..nodes import LinearMap, Substitute, Var
from ..trace import Claim, Contraction, Step
from .base import LowerContext, Match, Payload


@dataclass(frozen=True)
class PrecomposePayload(Payload):
    inner: DerivedLayer


def match(obj: Any) -> Match | None:
    return Match(obj) if isinstance(obj, Precomposed) else None


def lower(m: Match, ctx: LowerContext) -> DerivedLayer:
    pc: Precomposed = m.objective
    obj = pc
    inner = ctx.lower(pc.inner)
    old, new = pc.old, pc.new
    m_sym, c_sym = pc.M, pc.c

    def fwd(v: torch.Tensor, env: Any) -> torch.Tensor:
        m = m_sym.resolve(env).to(v)
        out = v @ m.T
        return out if c_sym is None else out + c_sym.resolve(env).to(v)

    def inv(w: torch.Tensor, env: Any) -> torch.Tensor:
        m = m_sym.resolve(env).to(w)
        r = w if c_sym is None else w - c_sym.resolve(env).to(w)
        return torch.linalg.solve(m, r.T).T

    mn = m_sym.resolve(None).detach().cpu().numpy()

    s = np.linalg.svd(mn, compute_uv=False)
    cond = float(s.max() / s.min())
    a_node = LinearMap(fwd, Var(new), f"{m_sym.name}·◊" + (f" + {c_sym.name}" if c_sym else ""),
                       f"{m_sym.latex()} ◊" + (f" + {c_sym.latex()}" if c_sym else ""),
                       float(s.max()))
    inner_node = Substitute(inner.nodes[old.name], old, a_node)
    node = LinearMap(inv, inner_node, f"{m_sym.name}⁻¹(◊" + (f" - {c_sym.name})" if c_sym
                                                            else ")"),
                     f"{m_sym.latex()}^{{-1}}(◊" + (f" - {c_sym.latex()})" if c_sym else ")"),
                     float(1.0 / s.min()))
    defect = pc.orthogonality_defect()
    d = inner.derivation.then(Step(
        "affine precomposition φ → φ∘A",
        f"A(z) = Mz + c with M invertible (cond(M) = {cond:.3g})",
        ("φ(", old, ")"), (new, " ← ", node),
        note=("M orthogonal: the layer is prox_{φ∘A}" if defect < 1e-9 else
              f"M not orthogonal (||MᵀM − I||₂ = {defect:.3g}): fixed points are the minimizers "
              "of φ∘A but the layer is not a prox"),
    ))
    kind = inner.claim.kind
    claim = Claim(kind, f"A(z*) is a {kind} of φ = {pc.inner}, i.e. z* is a {kind} of φ∘A",
                  inner.claim.latex, str(obj), inner.claim.conditions)
    base = inner.contraction
    contraction = Contraction(f"cond(M)·({base.formula})", f"\\kappa(M)\\,({base.latex})",
                              lambda env, b=base, k=cond: k * b.value(env))
    return DerivedLayer(source=obj, blocks=[new], nodes={new.name: node}, derivation=d,
                        claim=claim, contraction=contraction,
                        is_prox=defect < 1e-9 and inner.is_prox,
                        certificate=inner.certificate, payload=PrecomposePayload(inner))


class Precompose:
    """``φ∘A``, ``A = M· + c`` invertible ⇒ ``T' = A⁻¹∘T_φ∘A``."""

    name = "precompose"

    def match(self, objective: Any) -> Match | None:
        return match(objective)

    def lower(self, m: Match, ctx: LowerContext) -> DerivedLayer:
        return lower(m, ctx)


RULE = Precompose()
