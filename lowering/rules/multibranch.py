"""Multi-branch fusion (MOptEq Proposition 1, docs/theory.md §3 row 4 and §3.3): a canonical
objective whose branches meet only through pair terms ``H(A_i y_i, A_j y_j)`` and
``D(A_i y_i, A_j y_j)`` of linear images ``z̃_i = A_i y_i`` (the signed branch states,
``A_i = W_iᵀ``).

The layer is the canonical one, ``y_i = σ(q_i + A_iᵀ ∇_{z̃_i}[½ΣH − (λ/2)ΣD])``, which is the
paper's Eq. 6 ``y_i = σ(W_i h_i(z̃) + q_i)``.  What this rule adds is the bound the generic sum
of term Lipschitz constants misses, by a block Schur test on the branches: with ``Γ_ij`` bounding
``||∇_{y_i}S(y) − ∇_{y_i}S(y')||`` by ``Σ_j Γ_ij ||y_j − y_j'||`` (a coupling ``c·H`` adds
``|c|·||A_i||·||P||·||A_j||`` to ``Γ_ij`` and ``Γ_ji``; a decorrelation ``c·D`` with
``|∂φ| ≤ 1`` adds ``|c|(C−1)·||A_i||·||P||·||A_j||``; a branch's own ``c·½||A_i y_i||²``, as in
POptEq, adds ``|c|·||A_i||²`` to ``Γ_ii``), ``||∇S_fusion(y)|| ≤ ||Γ||₂·||y||`` and

* ``κ = L_σ||Γ||₂ < 1`` ⇒ ``T`` maps the ball ``||y|| ≤ R(x) = L_σ||q(x)||/(1 − κ)`` into itself
  (``σ(0) = 0``);
* H only: ``Lip(T) ≤ κ`` everywhere;
* the Huber-smoothed D of width ε (``|φ''| ≤ 1/ε``) adds ``|c|(2/ε)||A_i||²p²||A_j||²R²`` to
  ``Γ_ii`` and ``Γ_jj`` on that ball: ``Lip(T) ≤ L_σ||Γ + R(x)²Δ||₂`` there, a contraction for
  the inputs where this is < 1;
* the paper's D (``|·|``): its gradient ``sign(M)`` jumps, ``T`` is discontinuous and need not
  have a fixed point — iterates stay in the ball, nothing more is claimed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convex_eq._lazy import torch
from convex_eq.symbols import Env, Symbol
from convex_eq.terms.coupling import ChannelDecorrelation, Coupling, SmoothChannelDecorrelation
from convex_eq.terms.quadratic import Linear, SqNorm

from ..derived import DerivedLayer
from ..trace import Claim, ClaimKind, Contraction, Step
from . import canonical
from .base import LowerContext, Match


@dataclass(frozen=True)
class MultiBranchMatch(Match):
    base: canonical.CanonicalMatch
    #: per block, the linear map ``A_i`` the fusion terms read it through (``z̃_i = A_i y_i``)
    maps: dict[str, Any]
    fusion: tuple[Any, ...]
    injections: dict[str, Linear]


def _single_image(arg: Any) -> tuple[Symbol, Any] | None:
    """``(y, A)`` when the affine ``arg`` is exactly ``A y`` for one state ``y``."""
    if len(arg.entries) != 1:
        return None
    e = arg.entries[0]
    if e.symbol.kind != "state" or e.coef != 1.0 or e.op is None:
        return None
    return e.symbol, e.op


def match(obj: Any) -> MultiBranchMatch | None:
    """Canonical, with at least one coupling between two different blocks, every other term an
    injection ``−<q_i, y_i>`` or a pair term, each block read through one linear map."""
    base = canonical.match(obj)
    if base is None or base.extra_prox:
        return None
    maps: dict[str, Any] = {}
    fusion, inj = [], {}
    for t in base.rest:
        if type(t) is Linear:
            q, y = t.args
            if q.symbols("state") or len(y.entries) != 1 or y.entries[0].op is not None \
                    or y.entries[0].symbol.name in inj:
                return None
            inj[y.entries[0].symbol.name] = t
            continue
        if type(t) is SqNorm:  # a branch's own feedback −½||A_i y_i||² (POptEq)
            one = _single_image(t.args[0])
            if one is None or maps.setdefault(one[0].name, one[1]) is not one[1]:
                return None
            fusion.append(t)
            continue
        if type(t) not in (Coupling, ChannelDecorrelation, SmoothChannelDecorrelation):
            return None
        pair = [_single_image(a) for a in t.args]
        if None in pair or pair[0][0] is pair[1][0]:
            return None
        for y, op in pair:
            if maps.setdefault(y.name, op) is not op:
                return None
        fusion.append(t)
    if len(obj.states) < 2:
        return None
    if set(inj) != {b.name for b in obj.states}:
        return None
    return MultiBranchMatch(obj, base, maps, tuple(fusion), inj)


# ----------------------------------------------------------------------------- bounds
def _pair(t: Any, blocks: list[str]) -> tuple[int, int]:
    return (blocks.index(t.args[0].entries[0].symbol.name),
            blocks.index(t.args[1].entries[0].symbol.name))


def growth_matrix(m: MultiBranchMatch, blocks: list[str], env: Env | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(Γ, Δ)``: the block bounds of the module docstring (``Δ``: the Huber terms' part that
    scales with ``R²``)."""
    k = len(blocks)
    gam, dlt = np.zeros((k, k)), np.zeros((k, k))
    norms = {b: float(op.norm(env)) for b, op in m.maps.items()}
    for t in m.fusion:
        if type(t) is SqNorm:  # ∇(c/2·||A y||²) = c·AᵀA y
            i = blocks.index(t.args[0].entries[0].symbol.name)
            gam[i, i] += abs(float(t.coef(env))) * norms[blocks[i]] ** 2
            continue
        i, j = _pair(t, blocks)
        a_i, a_j = norms[blocks[i]], norms[blocks[j]]
        p = float(t.P.norm(env))
        c = abs(float(t.coef(env)))
        w = c * a_i * p * a_j * (1.0 if type(t) is Coupling else t.channels - 1)
        gam[i, j] += w
        gam[j, i] += w
        if type(t) is SmoothChannelDecorrelation:
            e = c * 2.0 / t.width * (a_i * p * a_j) ** 2
            dlt[i, i] += e
            dlt[j, j] += e
    return gam, dlt


def _lip_sigma(m: MultiBranchMatch) -> float:
    return max(p.act.lipschitz for p in m.base.potentials.values())


def _fixes_zero(m: MultiBranchMatch) -> bool:
    return all(canonical.fixes_zero(p.act) for p in m.base.potentials.values())


@dataclass(frozen=True)
class BallContraction(Contraction):
    """A contraction bound that holds on the ball ``||y|| ≤ R(x)`` the layer maps into itself:
    :meth:`on_ball` gives ``(R(x), L(x))`` per sample (``L(x) < 1``: a contraction there)."""

    ball_fn: Any = None
    growth_fn: Any = None

    def growth(self, env: Env | None = None) -> float:
        """``κ = L_σ||Γ||₂``: ``||T(y) − σ(q)||``-growth, ``||∇S_fusion(y)|| ≤ ||Γ||₂·||y||``."""
        return float(self.growth_fn(env))

    def on_ball(self, inputs: Mapping[str, torch.Tensor], env: Env | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R, L)`` per sample for flat batched ``inputs``."""
        return self.ball_fn(inputs, env)


def _contraction(m: MultiBranchMatch, blocks: list[str]) -> Contraction:
    ls = _lip_sigma(m)
    kinds = {type(t) for t in m.fusion}
    sign_d = ChannelDecorrelation in kinds
    smooth_d = SmoothChannelDecorrelation in kinds

    def kappa(env: Env | None) -> float:
        gam, _ = growth_matrix(m, blocks, env)
        return ls * float(np.linalg.norm(gam, 2))

    def global_value(env: Env | None) -> float:
        return kappa(env) if not (sign_d or smooth_d) else math.inf

    def ball(inputs: Mapping[str, torch.Tensor], env: Env | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        gam, dlt = growth_matrix(m, blocks, env)
        kap = ls * float(np.linalg.norm(gam, 2))
        q2 = None
        for b in blocks:
            q = m.injections[b].args[0].evaluate(inputs, env)
            s = (q * q).sum(-1)
            q2 = s if q2 is None else q2 + s
        q_norm = torch.sqrt(q2)
        if kap >= 1 or not _fixes_zero(m):
            inf = torch.full_like(q_norm, math.inf)
            return inf, inf
        r = ls * q_norm / (1 - kap)
        if sign_d:
            return r, torch.full_like(q_norm, math.inf)
        lips = [ls * float(np.linalg.norm(gam + float(rr) ** 2 * dlt, 2))
                for rr in r.detach().cpu().tolist()]
        return r, torch.tensor(lips, dtype=q_norm.dtype, device=q_norm.device)

    if sign_d:
        formula = ("∞: the decorrelation's a.e. gradient sign(M) jumps (T is discontinuous); "
                   "iterates stay in ||y|| ≤ R(x) = L_σ||q(x)||/(1 − κ) when κ = L_σ||Γ||₂ < 1")
    elif smooth_d:
        formula = ("∞ globally; on the ball ||y|| ≤ R(x) = L_σ||q(x)||/(1 − κ) it maps into "
                   "itself (κ = L_σ||Γ||₂ < 1): L_σ||Γ + R(x)²Δ||₂ (Γ_ij = |c|·||A_i||·||P||·"
                   "||A_j||·(1 for H, C−1 for D), Δ_ii = Σ|c|(2/ε)(||A_i||·||P||·||A_j||)²)")
    else:
        formula = ("L_σ||Γ||₂ (block Schur test: Γ_ij = Σ_H |c|·||A_i||·||P||·||A_j||, "
                   "Γ_ii += |c|·||A_i||² of a branch's own ½||A_i y_i||²)")
    return BallContraction(formula, "L_\\sigma\\|\\Gamma\\|_2", global_value, ball, kappa)


def _step(m: MultiBranchMatch, blocks: list[str]) -> Step:
    kinds = {type(t) for t in m.fusion}
    if not kinds & {Coupling, ChannelDecorrelation, SmoothChannelDecorrelation}:
        return Step(
            "independent branches (block-diagonal bound)",
            "no term couples two branches: ∇S is block-diagonal, Lip(T) ≤ L_σ max_i Γ_ii",
            ("∇_{y_i} S(y)",), ("depends on y_i only",),
            note="POptEq (MOptEq paper Eq. 10-11) when each branch is an OptEq")
    maps = ", ".join(f"z̃_{b} = {m.maps[b]} {b}" for b in blocks)
    note = {
        ChannelDecorrelation: "D is |·| of bilinear channel correlations: where an off-diagonal "
        "correlation M_k1k2 crosses 0, sign(M) jumps, T is discontinuous and NO fixed point is "
        "guaranteed (a solve that stalls is reported as not converged)",
        SmoothChannelDecorrelation: "D uses the Huber-smoothed |·| (width ε): T is continuous; "
        "a contraction on the ball it maps into itself for the inputs where L_σ||Γ + R²Δ||₂ < 1",
    }
    notes = [note[k] for k in (ChannelDecorrelation, SmoothChannelDecorrelation) if k in kinds]
    return Step(
        "multi-branch fusion on signed branch states (MOptEq Proposition 1)",
        f"every pair term reads its branches through one linear map ({maps}), so "
        "∇_y S = Aᵀ∇_z̃[½ΣH − (λ/2)ΣD]: the layer is y_i = σ(q_i + A_iᵀ h_i(z̃)), "
        "h_i = ½(P z̃_{i+1} + Pᵀ z̃_{i−1}) − (λ/2)∇_{z̃_i}ΣD — the paper's Eq. 6 with A_i = W_iᵀ",
        ("∇_{y_i} S_fusion(y)",), ("A_iᵀ h_i(z̃), z̃_i = A_i y_i",),
        note="; ".join(notes) or "H only: Lip(T) ≤ L_σ||Γ||₂ on the whole space",
    )


def lower(m: MultiBranchMatch) -> DerivedLayer:
    d = canonical.lower(m.base)
    blocks = [b.name for b in d.blocks]
    d.derivation = d.derivation.then(_step(m, blocks))
    d.contraction = _contraction(m, blocks)
    if any(type(t) is ChannelDecorrelation for t in m.fusion):
        c = d.claim
        d.claim = Claim(ClaimKind.STATIONARY, c.statement, c.latex, c.objective_text,
                        conditions=(*c.conditions, "no off-diagonal channel correlation is 0 "
                                    "at the fixed point (else sign(M) is only a subgradient "
                                    "choice)"))
    return d


class MultiBranch:
    """MOptEq-type fusion: the canonical layer with the branch-wise bound of the module
    docstring."""

    name = "multibranch"

    def match(self, objective: Any) -> MultiBranchMatch | None:
        return match(objective)

    def lower(self, m: MultiBranchMatch, ctx: LowerContext) -> DerivedLayer:
        return lower(m)


RULE = MultiBranch()
