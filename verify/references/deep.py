"""The deep reference (docs/theory.md §5): the blocks of a deep equilibrium (Lemma 3), the
Theorem 2 inclusion checked block by block in prox and gradient form, Corollary 1's convex
objective for ``L = 2`` (by the CVXPY or numeric unit), and Theorem 3's wide solution
(informational)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convex_eq.composition import DeepComposition
from convex_eq.errors import ShapeError
from convex_eq.objective import Objective
from convex_eq.terms.conjugate import SeparableAffineConjugate
from lowering import solve

from ..context import CheckContext
from ..report import ReferenceInfo, worst
from .base import Situation
from .cvxpy import run_cvxpy
from .numeric import run_numeric

T64 = torch.float64


@dataclass
class ProxPieces:
    """``prox_φ(v) = s Mᵀσ(Mv + q)`` for ``φ = ψ* - ½||·||²``, ``ψ = s Σσ̃(Mv + q)``."""

    term: SeparableAffineConjugate
    M: torch.Tensor
    s: float

    def q(self, inputs: Mapping[str, torch.Tensor], env: Any, b: int) -> torch.Tensor:
        """The injection ``q = Ux + b`` of the term for ``b`` samples (zero if it has none)."""
        if self.term.q is None:
            return torch.zeros(b, self.M.shape[0], dtype=T64)
        return self.term.q.evaluate(dict(inputs), env).to(T64).expand(b, -1)

    def prox(self, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Theorem 1: ``prox_φ(v) = ∇ψ(v)``."""
        return self.s * self.term.act.sigma(v @ self.M.T + q) @ self.M

    def prox_kappa_psi(self, w: torch.Tensor, q: torch.Tensor, kappa: float,
                       iters: int = 100) -> torch.Tensor:
        """``prox_{κψ}(w)``: Newton on ``u + κ s Mᵀσ(Mu + q) = w`` with backtracking on the
        strongly convex ``½||u||² + κψ(u) - <w, u>``."""
        act, m, s = self.term.act, self.M, self.s

        def merit(u: torch.Tensor) -> torch.Tensor:
            return 0.5 * (u * u).sum(-1) + kappa * s * act.antiderivative(u @ m.T + q).sum(-1) \
                - (w * u).sum(-1)

        u = w.clone()
        eye = torch.eye(m.shape[1], dtype=T64)
        for _ in range(iters):
            a = u @ m.T + q
            r = u + kappa * s * act.sigma(a) @ m - w
            if float(r.norm(dim=-1).max()) <= 1e-15 * max(1.0, float(w.norm(dim=-1).max())):
                break
            jac = eye + kappa * s * torch.einsum("ij,bj,jk->bik", m.T, act.sigma_prime(a), m)
            d = -torch.linalg.solve(jac, r.unsqueeze(-1)).squeeze(-1)
            t = torch.ones(u.shape[0], 1, dtype=T64)
            f0 = merit(u)
            for _ in range(40):
                cand = u + t * d
                bad = merit(cand) > f0 + 1e-12 * f0.abs().clamp_min(1.0)
                if not bool(bad.any()):
                    break
                t = torch.where(bad[:, None], 0.5 * t, t)
            u = u + t * d
        return u


def prox_pieces(phi: Objective, env: Any) -> ProxPieces:
    """The ``ψ`` of a Theorem 1 layer objective ``φ = ψ* - ½||·||²``."""
    conj = [t for t in phi.terms if isinstance(t, SeparableAffineConjugate)]
    if len(conj) != 1:
        raise ShapeError("deep-model layer objective is not ψ* - ½||·||² (Theorem 1)",
                         term=str(phi))
    t = conj[0]
    return ProxPieces(t, torch.as_tensor(np.asarray(t.op.matrix(env)), dtype=T64), t.s)


def envelope_gradient(pieces: ProxPieces, z: torch.Tensor, q: torch.Tensor, alpha: float
                      ) -> torch.Tensor:
    """``∇(α M^μ_φ)(z)``, ``μ = 1 - α``, by docs/theory.md §9.2:
    ``M^μ_φ(z) = ||z||²/(2μ) - M^κ_ψ(z/μ)``,
    ``κ = 1/μ - 1``, so ``∇M^μ_φ(z) = z/μ - (z/μ - prox_{κψ}(z/μ))/(μκ)``."""
    mu = 1.0 - alpha
    kappa = 1.0 / mu - 1.0
    w = z / mu
    u = pieces.prox_kappa_psi(w, q, kappa)
    return alpha * (z / mu - (w - u) / (mu * kappa))


def deep_blocks(derived: Any, z: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                env: Any) -> dict[str, torch.Tensor]:
    """All blocks ``(z_1, …, z_{L-1}, z_0)`` of a deep equilibrium: the composition form carries
    ``z_0`` only, and ``z_l = f_l(z_{l-1})`` recovers the others (Lemma 3)."""
    comp: DeepComposition = derived.source
    blocks = comp.blocks
    if derived.info.get("form") == "multiblock":
        return {b.name: z[b.name] for b in blocks}
    nodes = derived.info["layer_nodes"]
    cur = z[blocks[-1].name]
    out: dict[str, torch.Tensor] = {}
    for i, b in enumerate(blocks):
        cur = nodes[i].eval({**inputs, b.name: cur}, env)
        out[b.name] = cur
    out[blocks[-1].name] = z[blocks[-1].name]
    return out


#: the gradient form divides by μ = 1 − α (``∇M^μ[φ](z) = (z − prox_{μφ}(z))/μ``): its round-off
#: is ~ε/μ, so below μ = 1e-6 (2e-10 in float64, far under the 1e-8 tolerance at 1e-6 and
#: growing to 0.6 at μ = 1e-16) it measures rounding, not the inclusion; the prox form decides
GRADIENT_FORM_MIN_MU = 1e-6


def inclusion_residuals(comp: DeepComposition, blocks: Mapping[str, torch.Tensor],
                        inputs: Mapping[str, torch.Tensor], env: Any
                        ) -> dict[str, dict[str, torch.Tensor]]:
    """Theorem 2 per block ``i`` (cyclic, ``z_{i-1}`` the previous block), normalized by
    ``max(1, ||z_i||)``:

    * prox form ``||z_i - prox_{g_i}(z_{i-1})||`` with ``g_i = α M^{1-α}_{φ_i}`` and
      ``prox_{g_i} = α prox_{φ_i} + (1-α) id`` (the Moreau identity, μ + λ = 1);
    * gradient form ``||∇g_i(z_i) + z_i - z_{i-1}||`` (the inclusion ``0 ∈ ∂Φ(z̃) + (I - P)z̃``
      read per block; ``∇g_i`` by ``envelope_gradient``, independent of the layer; where
      ``1 − α ≥`` :data:`GRADIENT_FORM_MIN_MU`)."""
    a = comp.alpha_value(env)
    names = [b.name for b in comp.blocks]
    out: dict[str, dict[str, torch.Tensor]] = {}
    bsz = next(iter(blocks.values())).shape[0]
    for i, phi in enumerate(comp.layers):
        pieces = prox_pieces(phi, env)
        q = pieces.q(inputs, env, bsz)
        zi, prev = blocks[names[i]], blocks[names[i - 1]]
        den = zi.norm(dim=-1).clamp_min(1.0)
        prox_form = (zi - (a * pieces.prox(prev, q) + (1 - a) * prev)).norm(dim=-1) / den
        res = {"prox-form": prox_form}
        if 1.0 - a >= GRADIENT_FORM_MIN_MU:
            g = envelope_gradient(pieces, zi, q, a)
            res["gradient-form"] = (g + zi - prev).norm(dim=-1) / den
        out[names[i]] = res
    return out


def wide_solution(comp: DeepComposition, x: Any, env: Mapping[str, Any] | None = None,
                  tol: float = 1e-13, max_iter: int = 5000) -> torch.Tensor:
    """Theorem 3: the wide one-layer solution ``y`` of ``L y = Σ_i W_iᵀσ(W_i y + U_i x + b_i)``
    (the last block of ``argmin Σ_i φ_i(x_i) + ½||x_i - y||²``), by Anderson on
    ``y = (1/L) Σ_i prox_{φ_i}(y)`` (a contraction when some ``||W_i||₂ < 1``)."""
    env = dict(env or {})
    ins = [s for s in comp.symbols if s.kind == "input"]
    if isinstance(x, Mapping):
        inputs = {k: torch.as_tensor(np.asarray(v, dtype=np.float64)) for k, v in x.items()}
    else:
        if len(ins) != 1:
            raise ShapeError(f"the model has inputs {[s.name for s in ins]}", term="wide_solution",
                             hint="pass a dict name → array")
        inputs = {ins[0].name: torch.as_tensor(np.asarray(x, dtype=np.float64))}
    for s in ins:
        t = inputs[s.name]
        inputs[s.name] = t.reshape(1, s.size) if t.ndim == len(s.shape) and \
            tuple(t.shape) == s.shape else t.reshape(t.shape[0], s.size)
    bsz = next(iter(inputs.values())).shape[0] if inputs else 1  # input-free models: one sample
    pieces = [prox_pieces(phi, env) for phi in comp.layers]
    qs = [p.q(inputs, env, bsz) for p in pieces]
    n = comp.blocks[0].size

    def f(y: torch.Tensor) -> torch.Tensor:
        return sum(p.prox(y, q) for p, q in zip(pieces, qs)) / comp.L

    y, st = solve(f, torch.zeros(bsz, n, dtype=T64), "anderson", tol=tol, max_iter=max_iter)
    if not bool(st.converged.all()):
        y, st = solve(f, y, "plain", tol=tol, max_iter=50 * max_iter)
    return y


def run_deep(ctx: CheckContext, comp: DeepComposition) -> None:
    """Every block of the deep equilibrium, the Theorem 2 residuals, Theorem 3's distance, and
    Corollary 1 (``L = 2``, ``α < 1``) or the Theorem 2 inclusion as the reference."""
    blocks_t = deep_blocks(ctx.derived, ctx.states, ctx.inputs, ctx.env)
    ctx.states = {k: v.detach() for k, v in blocks_t.items()}
    ctx.compare_names = [b.name for b in comp.blocks]
    _theorem2_rules(ctx, comp, blocks_t)
    y = wide_solution(comp, ctx.inputs, ctx.env)
    for b in range(ctx.bsz):
        d = max(float((blocks_t[k][b] - y[b]).norm()) for k in ctx.compare_names)
        ctx.samples[b].theorem3_distance = d / max(float(y[b].norm()), ctx.tols.scale_floor)
    a = comp.alpha_value(ctx.env)
    if comp.L == 2 and a < 1.0:
        obj = comp.corollary1_objective(ctx.env)
        lab = "minimizer (Corollary 1)"
        done = ctx.requested in ("auto", "cvxpy") and run_cvxpy(ctx, obj, lab)
        if not done:
            run_numeric(ctx, obj, "minimizer (Corollary 1; convex, numeric reference)")
        ctx.ref.kind = "corollary1-" + ctx.ref.kind
        ctx.ref.description = "Corollary 1: (z_1, z_0) minimizes α M^{1-α}[φ_1](z_1) + " \
            "α M^{1-α}[φ_2](z_0) + ½||z_1 - z_0||²; " + ctx.ref.description
    else:
        ctx.ref = ReferenceInfo(
            "inclusion", "Theorem 2 inclusion 0 ∈ ∂Φ(z̃) + (I − P)z̃ block by block: prox "
            "form ||z_i − (α prox_φi + (1−α) id)(z_{i−1})|| and gradient form "
            "||∇(α M^{1−α}_φi)(z_i) + z_i − z_{i−1}|| (∇ of the envelope by "
            "docs/theory.md §9.2 with "
            "a Newton solve of prox_{κψ}); no objective exists for L ≥ 3",
            "semismooth Newton (prox_{κψ})", ["computed"] * ctx.bsz)
        ctx.rules["reference"] = True
        ctx.label = "inclusion (Theorem 2)"
        for s in ctx.samples:
            s.label = ctx.label
    ctx.notes.append(f"Theorem 3 (informational): relative distance of the blocks to the "
                     f"wide solution at α = {a:g}; it tends to 0 only as α → 0")


def _theorem2_rules(ctx: CheckContext, comp: DeepComposition,
                    blocks_t: Mapping[str, torch.Tensor]) -> None:
    """The worst Theorem 2 block residual per sample and form, and its rule."""
    inc = inclusion_residuals(comp, blocks_t, ctx.inputs, ctx.env)
    for s in ctx.samples:
        for key in ("prox-form", "gradient-form"):
            vals = [float(r[key][s.index]) for r in inc.values() if key in r]
            if vals:
                s.block_residuals[key] = worst(vals)
        if "gradient-form" in s.block_residuals:
            s.stationarity = s.block_residuals["gradient-form"]
    for key in ("prox-form", "gradient-form"):
        vals = [s.block_residuals[key] for s in ctx.samples if key in s.block_residuals]
        if vals:
            ctx.rule(f"inclusion_{key}", worst(vals) <= ctx.tols.residual,
                     f"Theorem 2 {key} residual {worst(vals):.3e} > {ctx.tols.residual:g}")


class DeepReference:
    """Deep compositions: Corollary 1 (``L = 2``) or the Theorem 2 inclusion (docs/theory.md §5)."""

    kind = "deep"

    def applies(self, s: Situation) -> bool:
        """A deep composition (its blocks are checked whatever was requested)."""
        return s.family == "deep"

    def answers(self, requested: str, s: Situation) -> bool:
        """``auto``; ``cvxpy`` or ``numeric`` choose the solver of Corollary 1 (``L = 2``)."""
        return requested == "auto" or (requested in ("cvxpy", "numeric")
                                        and getattr(s.source, "L", 0) == 2)

    def scope(self, s: Situation) -> str:
        return (f"a deep composition with L = {getattr(s.source, 'L', '?')} is verified by its "
                "Theorem 2 block residuals, and for L = 2 by Corollary 1's convex objective "
                "(CVXPY or the numeric reference); it has no local reference")

    def run(self, ctx: CheckContext, source: Any, s: Situation) -> None:
        """Check the deep claim; violated layer conditions are noted (they certify nothing)."""
        if not s.certified:
            ctx.notes.append("deep model with violated layer conditions: Corollary 1 / "
                             "Theorem 2 residuals are reported but certify nothing")
        run_deep(ctx, source)
