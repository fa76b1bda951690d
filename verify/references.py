"""Reference solutions for ``verify.check`` (docs/theory.md §9), one function per reference.

* ``cvxpy_reference``: CVXPY on the exported objective, Clarabel at tight tolerances (SCS only
  with eps ≤ 1e-9); the status is checked, never compared when not ``optimal``.
* ``numeric_reference``: certified-convex objectives that are not DCP (tanh / sigmoid / softplus
  potentials, Corollary 1 envelopes of ``ψ* - ½||·||²``): scipy on the lifted objective with
  exact gradients; stationarity of a convex objective proves global optimality.
* ``local_reference``: non-convex objectives: multi-start local minimization, stationarity
  residual and a second-order check; the label is "stationary point" or "local minimizer".
* ``sam_reference``: ``argmin_{Fix T} R`` as the limit of ``argmin φ + εR``, ε → 0
  (docs/theory.md §6).
* ``inclusion_residuals``: Theorem 2 (deep, L ≥ 3) block residuals in prox and gradient form.
* ``wide_solution``: Theorem 3's limit ``L y = Σ W_iᵀσ(W_i y + U_i x + b_i)``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cvxpy as cp
import numpy as np
import torch

from convex_eq.composition import DeepComposition
from convex_eq.errors import ConvexEqError, OptionError, ShapeError
from convex_eq.export import ExportedProblem
from convex_eq.objective import Objective
from convex_eq.terms.conjugate import SeparableAffineConjugate
from lowering import solve

from .lifting import (
    LiftedProblem,
    MinResult,
    lift,
    lift_batch,
    minimize,
    partial_value,
    second_order,
)
from .unwind import unwind

T64 = torch.float64

#: Clarabel at tight tolerances (the default reference solver).
CLARABEL_TIGHT: dict[str, Any] = {"solver": "CLARABEL", "tol_gap_abs": 1e-11,
                                  "tol_gap_rel": 1e-11, "tol_feas": 1e-11}
SCS_MAX_EPS = 1e-9


def reference_solver_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validated CVXPY solve options: Clarabel tight by default; SCS only with eps ≤ 1e-9."""
    if not options:
        return dict(CLARABEL_TIGHT)
    o = dict(options)
    solver = str(o.get("solver", "CLARABEL")).upper()
    o["solver"] = solver
    if solver == "CLARABEL":
        return {**CLARABEL_TIGHT, **o}
    if solver == "SCS":
        if "eps" in o:
            e = o.pop("eps")
            o.setdefault("eps_abs", e)
            o.setdefault("eps_rel", e)
        eps = [o.get("eps_abs"), o.get("eps_rel")]
        if any(e is None or float(e) > SCS_MAX_EPS for e in eps):
            raise OptionError(
                f"SCS is a reference only with eps_abs, eps_rel ≤ {SCS_MAX_EPS:g} (got "
                f"eps_abs={eps[0]}, eps_rel={eps[1]})", term="verify.check",
                hint="its default accuracy (~1e-4) is off by up to 1e-3 on these problems "
                "(docs/theory.md §9.1); use Clarabel (default) or pass eps=1e-10")
        o.setdefault("max_iters", 200000)
        return o
    return o


def _tolerances_of(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k != "solver"}


# ---------------------------------------------------------------------- CVXPY
@dataclass
class CvxpyOutcome:
    """One CVXPY solve: the state blocks (when optimal), the optimal value and provenance."""

    status: str
    solver: str
    ok: bool
    states: dict[str, np.ndarray] = field(default_factory=dict)
    value: float = math.nan
    exported: ExportedProblem | None = None
    message: str = ""
    options: dict[str, Any] = field(default_factory=dict)


def solve_exported(exported: ExportedProblem, opts: Mapping[str, Any],
                   problem: cp.Problem | None = None) -> tuple[str, str, str]:
    """Solve; returns ``(status, solver name, message)`` (errors become a status)."""
    prob = problem if problem is not None else exported.problem
    kw = dict(opts)
    try:
        with warnings.catch_warnings():  # "solution may be inaccurate": the status says so
            warnings.simplefilter("ignore", UserWarning)
            prob.solve(**kw)
    except cp.SolverError as err:
        return "solver_error", str(kw.get("solver")), str(err).splitlines()[0]
    except Exception as err:  # solver crash: reported, never compared
        return "solver_error", str(kw.get("solver")), f"{type(err).__name__}: {err}"
    name = prob.solver_stats.solver_name if prob.solver_stats is not None else str(kw["solver"])
    return str(prob.status), str(name), ""


def cvxpy_reference(obj: Objective, inputs: Mapping[str, np.ndarray], env: Mapping[str, Any],
                    opts: Mapping[str, Any]) -> CvxpyOutcome:
    """Export one sample and solve; raises ``NotDCPError``/``ExportError`` if not exportable."""
    exported = obj.to_cvxpy(**dict(inputs), **dict(env))
    status, solver, msg = solve_exported(exported, opts)
    ok = status == cp.OPTIMAL
    out = CvxpyOutcome(status, solver, ok, exported=exported, message=msg)
    if ok or status == cp.OPTIMAL_INACCURATE:  # inaccurate: kept for polishing, not compared
        out.states = {k: np.asarray(v, dtype=np.float64).reshape(-1)
                      for k, v in exported.state_values().items()}
        out.value = exported.value
    return out


def value_at_states_cvxpy(exported: ExportedProblem, z: Mapping[str, np.ndarray],
                          opts: Mapping[str, Any]) -> float | None:
    """``G(z)`` through the export: minimize over the auxiliary variables with the states fixed
    (None if that restricted problem is not solved to ``optimal``)."""
    cons = list(exported.problem.constraints)
    for k, m in exported.state_maps.items():
        cons.append(m @ exported.variable == np.asarray(z[k], dtype=np.float64).reshape(-1))
    prob = cp.Problem(exported.problem.objective, cons)
    status, _, _ = solve_exported(exported, opts, prob)
    if status != cp.OPTIMAL:
        return None
    return float(prob.value) + exported.constant


# ---------------------------------------------------------------------- numeric (convex)
@dataclass
class NumericOutcome:
    """Certified-convex numeric reference at one sample."""

    states: dict[str, np.ndarray]
    value: float
    stationarity: float
    result: MinResult
    problem: LiftedProblem


def numeric_reference(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Mapping[str, Any]
                      ) -> NumericOutcome:
    """Minimize the lifted objective from a deterministic interior start (independent of the
    layer); ``stationarity = ||v - P(v - ∇F(v))|| / max(1, ||v||)``."""
    pc = getattr(obj, "precomposition", None)
    if pc is not None:
        # φ∘A with A(z) = Mz + c: minimize φ itself (its potentials' domains are boxes in u),
        # then z_ref = M⁻¹(u_ref - c); A(z*) ∈ argmin φ is exactly the claim
        inner = numeric_reference(pc.inner, inputs, env)
        m = pc.M.resolve(env).detach().to(T64).numpy()
        u = inner.states[pc.old.name]
        if pc.c is not None:
            u = u - pc.c.resolve(env).detach().to(T64).numpy().reshape(-1)
        z = np.linalg.solve(m, u)
        return NumericOutcome({pc.new.name: z}, inner.value, inner.stationarity, inner.result,
                              lift(obj, inputs, env))
    p = lift(obj, inputs, env)
    res = minimize(p, p.start_point(), polish=True)
    stat = res.pg / max(1.0, float(np.linalg.norm(res.v)))
    return NumericOutcome(p.states(res.v), res.f, stat, res, p)


def objective_value(obj: Objective, z: Mapping[str, np.ndarray], inputs: Mapping[str, Any],
                    env: Mapping[str, Any], *, exported: ExportedProblem | None = None,
                    lifted: LiftedProblem | None = None,
                    opts: Mapping[str, Any] | None = None) -> float | None:
    """``G(z)``: the objective's own value rules; else the export with the states fixed; else
    the lifted problem minimized over its auxiliary blocks (inner envelopes)."""
    vals = {k: torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(1, -1))
            for k, v in z.items()}
    for k, v in inputs.items():
        vals[k] = torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(1, -1))
    try:
        with torch.no_grad():
            val = float(obj.value_tensor(vals, env)[0])
        if math.isfinite(val):
            return val
    except (ConvexEqError, NotImplementedError, RuntimeError):
        pass
    val = _domain_value(obj, z, inputs, env)
    if val is not None:
        return val
    if exported is not None:
        return value_at_states_cvxpy(exported, z, opts or CLARABEL_TIGHT)
    if lifted is not None:
        return partial_value(lifted, z)
    return None


def _domain_value(obj: Objective, z: Mapping[str, np.ndarray], inputs: Mapping[str, Any],
                  env: Mapping[str, Any]) -> float | None:
    """``G(z)`` on the lifted problem of the innermost objective at ``u = A(z)``, with round-off
    outside a closed domain bound (≤ 1e-10 relative, e.g. one ulp after ``A⁻¹∘T∘A``) clipped
    back — a direct evaluation reads +∞ there; None where that does not apply."""
    try:
        uw = unwind(obj, env, envelopes=False)
        ins = {k: torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(1, -1))
               for k, v in inputs.items()}
        p = lift(uw.inner, ins, env)
        v = p.lift_point(uw.forward({k: np.asarray(a, dtype=np.float64).reshape(-1)
                                     for k, a in z.items()}))
        if v is None or p.coupled or any(b.origin == "aux" for b in p.blocks):
            return None
        val = p.value(v)
    except (ConvexEqError, NotImplementedError, RuntimeError, KeyError, np.linalg.LinAlgError):
        return None
    return val if math.isfinite(val) else None


# ---------------------------------------------------------------------- local (non-convex)
@dataclass
class LocalOutcome:
    """Local reference at one sample (non-convex objectives)."""

    starts: int
    solutions: list[MinResult]
    nearest: dict[str, np.ndarray] | None
    nearest_distance: float
    layer_value: float | None
    best_value: float
    stationarity: float | None
    second_order: dict[str, Any] | None
    lifted_layer: np.ndarray | None
    at_layer: int
    problem: LiftedProblem


def local_reference(obj: Objective, inputs: Mapping[str, torch.Tensor], env: Mapping[str, Any],
                    z_layer: Mapping[str, np.ndarray], starts: int, rng: np.random.Generator
                    ) -> LocalOutcome:
    """Multi-start local minimization (one start next to the layer's state, the others random),
    the independent stationarity residual at the layer's state (projected gradient of the
    lifted objective, autograd) and the second-order check there."""
    with np.errstate(all="ignore"):
        return _local_reference(lift(obj, inputs, env), z_layer, starts, rng)


def batch_local_reference(obj: Objective, inputs: Mapping[str, torch.Tensor],
                          env: Mapping[str, Any], z_layer: Mapping[str, np.ndarray],
                          starts: int, rng: np.random.Generator) -> LocalOutcome:
    """``local_reference`` for a batch-coupled objective: one problem over the whole batch
    (``lift_batch``; inputs and ``z_layer`` are ``(B, size)``); states come back ``(B, size)``
    and values are those of the batch objective."""
    with np.errstate(all="ignore"):
        return _local_reference(lift_batch(obj, inputs, env), z_layer, starts, rng)


def _local_reference(p: LiftedProblem, z_layer: Mapping[str, np.ndarray], starts: int,
                     rng: np.random.Generator) -> LocalOutcome:
    v_star = p.lift_point(z_layer)
    inits: list[np.ndarray] = []
    scale = max(1.0, float(np.sqrt(sum(float(np.sum(np.square(v))) for v in z_layer.values()) /
                                   max(1, p.n))))
    if v_star is not None:
        pert = rng.standard_normal(p.n) * 1e-3 * max(1.0, float(np.linalg.norm(v_star))) / \
            math.sqrt(p.n)
        inits.append(v_star + pert)
    while len(inits) < max(1, starts):
        inits.append(p.start_point() + scale * rng.uniform(-1.0, 1.0, p.n))
    sols = [minimize(p, v0, polish=False, gtol=1e-11, maxiter=2000) for v0 in inits]
    zl = np.concatenate([np.asarray(z_layer[s]).reshape(-1) for s in p.top_states])
    best_d, nearest = math.inf, None
    at_layer = 0
    for r in sols:
        zs = p.states(r.v)
        zz = np.concatenate([np.asarray(zs[s]).reshape(-1) for s in p.top_states])
        d = float(np.linalg.norm(zz - zl)) / max(float(np.linalg.norm(zl)), 1e-3)
        at_layer += int(d <= 1e-5)
        if d < best_d:
            best_d, nearest = d, zs
    stat = so_info = None
    layer_value = None
    if v_star is not None:
        stat = p.projected_gradient(v_star) / max(1.0, float(np.linalg.norm(v_star)))
        so_info = second_order(p, v_star)
        layer_value = p.value(v_star)
    finite = [r.f for r in sols if math.isfinite(r.f)]
    return LocalOutcome(len(inits), sols, nearest, best_d, layer_value,
                        min(finite) if finite else math.inf, stat, so_info, v_star, at_layer, p)


# ---------------------------------------------------------------------- SAM (docs/theory.md §6)
@dataclass
class SamOutcome(CvxpyOutcome):
    """The SAM reference at one sample: the Tikhonov point ``z(ε_K)`` kept and its estimated
    error ``||z(ε_K) − z(ε_{K−1})||`` (absolute; NaN unless two weights solved)."""

    eps: float = math.nan
    error: float = math.nan
    levels: list[tuple[float, str]] = field(default_factory=list)


#: Tikhonov weights ``ε`` of ``φ + ε R``, largest first (ratio 10)
SAM_LEVELS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)


def sam_reference(phi: Objective, R: Objective, inputs: Mapping[str, np.ndarray],
                  env: Mapping[str, Any], opts: Mapping[str, Any],
                  levels: tuple[float, ...] = SAM_LEVELS) -> SamOutcome:
    """``argmin_{z ∈ Fix T} R(z)``, ``Fix T = argmin φ``, as the limit of the Tikhonov path
    ``z(ε) = argmin φ + ε R`` (ε → 0; φ convex, R strongly convex).

    Each ``φ + ε R`` is an ordinary, strongly convex CVXPY problem — well posed, unlike the
    value-function form ``min R s.t. φ ≤ min φ + δ`` whose constraint is degenerate (Clarabel
    ended it ``optimal_inaccurate`` or with a solver error depending on δ, tolerance and
    CPU).  ``z(ε) → z*`` like ``ε^p`` (``p = 1`` when φ grows quadratically off its argmin,
    e.g. any convex quadratic), so with ratio 10 between weights the error of ``z(ε_k)`` is
    at most ``||z(ε_k) − z(ε_{k−1})||`` for any ``p ≥ log 2 / log 10``.  The weight kept is the
    one with the smallest such difference (at tiny ε the solver's ``tol/ε`` error takes over):
    that difference is the stated accuracy.  Fewer than two solved weights: a failure."""
    first = cvxpy_reference(phi, inputs, env, opts)
    if not first.ok:
        return SamOutcome(first.status, first.solver, False, message=first.message,
                          options=dict(opts))
    e_phi = first.exported
    assert e_phi is not None
    r_inputs = {s.name: inputs[s.name] for s in R.inputs}
    r_env = {s.name: env[s.name] for s in R.symbols if s.name in env}
    e_r = R.to_cvxpy(**r_inputs, **r_env)
    cons = list(e_phi.problem.constraints) + list(e_r.problem.constraints)
    for k, m in e_r.state_maps.items():
        if k not in e_phi.state_maps:
            raise ShapeError(f"SAM objective R uses state '{k}' that the layer does not have",
                             term="sam_reference")
        cons.append(m @ e_r.variable == e_phi.state_maps[k] @ e_phi.variable)
    phi_expr, r_expr = e_phi.problem.objective.args[0], e_r.problem.objective.args[0]
    path: list[tuple[float, dict[str, np.ndarray], float]] = []
    tried: list[tuple[float, str]] = []
    status, solver, msg = "not solved", str(opts.get("solver")), ""
    for eps in levels:
        prob = cp.Problem(cp.Minimize(phi_expr + eps * r_expr), cons)
        status, solver, msg = solve_exported(e_phi, opts, prob)
        tried.append((eps, status))
        if status != cp.OPTIMAL:
            continue
        f = np.asarray(e_phi.variable.value, dtype=np.float64)
        r_val = float(r_expr.value) + e_r.constant
        path.append((eps, {k: m @ f for k, m in e_phi.state_maps.items()}, r_val))
    diffs = []
    for (e0, z0, _), (e1, z1, _) in itertools.pairwise(path):
        if abs(e0 / e1 - 10.0) <= 1e-9 * 10.0:  # consecutive weights only
            diffs.append((math.sqrt(sum(float(np.sum((z1[k] - z0[k]) ** 2)) for k in z1)), e1))
    if not diffs:
        return SamOutcome(status if not path else "path too short", solver, False,
                          exported=e_phi, message=msg, levels=tried, options=dict(opts))
    err, eps = min(diffs)
    _, states, value = next(p for p in path if p[0] == eps)
    return SamOutcome(cp.OPTIMAL, solver, True, states=states, value=value, exported=e_phi,
                      message=msg, options=dict(opts), eps=eps, error=err, levels=tried)


# ---------------------------------------------------------- deep models (docs/theory.md §5)
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


def inclusion_residuals(comp: DeepComposition, blocks: Mapping[str, torch.Tensor],
                        inputs: Mapping[str, torch.Tensor], env: Any
                        ) -> dict[str, dict[str, torch.Tensor]]:
    """Theorem 2 per block ``i`` (cyclic, ``z_{i-1}`` the previous block), normalized by
    ``max(1, ||z_i||)``:

    * prox form ``||z_i - prox_{g_i}(z_{i-1})||`` with ``g_i = α M^{1-α}_{φ_i}`` and
      ``prox_{g_i} = α prox_{φ_i} + (1-α) id`` (the Moreau identity, μ + λ = 1);
    * gradient form ``||∇g_i(z_i) + z_i - z_{i-1}||`` (the inclusion ``0 ∈ ∂Φ(z̃) + (I - P)z̃``
      read per block; ``∇g_i`` by ``envelope_gradient``, independent of the layer; α < 1)."""
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
        if a < 1.0:
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
