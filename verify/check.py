"""``verify.check``: is the layer's equilibrium what its derivation claims (docs/theory.md §9)?

1. the equilibrium, by a tight float64 solve of ``z = T(z, x)`` with the target's current weights;
2. the certificate at these weights ("claim not certified here: <condition>" when violated);
3. the reference chosen by docs/theory.md §9 and the claim — CVXPY (DCP-exportable), the
   certified-convex
   numeric reference (convex, not DCP), the local reference (non-convex: never "minimizer"),
   Corollary 1 / Theorem 2 for deep models, the value-function reformulation for SAM;
4. relative state error, objective gap, optimality residual ``||z - T(z)||`` (the lowering's
   forward–backward map: ``prox_g(z - ∇h(z))`` with unit step for the canonical rule), an
   independent projected-gradient stationarity residual, pass/fail against ``Tolerances``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convex_eq.certificate import certify
from convex_eq.composition import DeepComposition
from convex_eq.errors import ConvexEqError, ExportError, OptionError
from convex_eq.objective import Objective
from convex_eq.terms.moreau import MoreauEnvelope
from lowering import EquilibriumModule
from lowering.derived import DerivedLayer

from .equilibrium import (
    environment,
    equilibrium,
    fresh_module,
    info_from_stats,
    operator,
    prepare_inputs,
    relative_residual,
    resolve_target,
    single_thread,
)
from .gradients import gradient_check
from .inclusion import check_inclusion, handles
from .lifting import lift, lift_batch, minimize
from .references import (
    CvxpyOutcome,
    batch_local_reference,
    cvxpy_reference,
    deep_blocks,
    inclusion_residuals,
    local_reference,
    numeric_reference,
    objective_value,
    reference_solver_options,
    sam_reference,
    wide_solution,
)
from .report import EquilibriumInfo, ReferenceInfo, Report, SampleResult, Tolerances
from .report import worst as _worst
from .selection import REFERENCE_KINDS, Situation, select_reference
from .unwind import unwind

T64 = torch.float64
REFERENCES = ("auto", "cvxpy", "numeric", "local")
NEEDS_CERTIFICATE = ("minimizer", "modified minimizer", "inclusion")


@dataclass
class CertificateAt:
    """The certificate evaluated at the verified weights."""

    text: str
    kind: str
    certified: bool
    violated: list[str] = field(default_factory=list)


def certificate_at(derived: DerivedLayer, env: Mapping[str, torch.Tensor]) -> CertificateAt:
    """Convexity certificate of the claim's objective at ``env`` (deep models: the layers'
    Theorem 1 conditions, which Corollary 1 / Theorem 2 assume)."""
    src = derived.source
    if isinstance(src, DeepComposition):
        conds = list(derived.info.get("conditions", []))
        violated = [c.describe(env) for c in conds if not c.holds(env)]
        if not conds:
            return CertificateAt("layers convex", "convex", True)
        text = "layers convex if " + " and ".join(c.describe(env) for c in conds)
        return CertificateAt(text, "conditional", not violated, violated)
    cert = certify(src, env)
    if cert.kind == "nonconvex":
        return CertificateAt(cert.text, "nonconvex", False)
    violated = [c.describe(env) for c in cert.conditions if not c.holds(env)]
    return CertificateAt(cert.text, cert.kind, cert.holds, violated)


def _tolerances(tol: Tolerances | float | Mapping[str, float] | None) -> Tolerances:
    if tol is None:
        return Tolerances()
    if isinstance(tol, Tolerances):
        return tol
    if isinstance(tol, (int, float)):
        return Tolerances(rel_error=float(tol))
    if isinstance(tol, Mapping):
        known = set(Tolerances.__dataclass_fields__)
        unknown = sorted(set(tol) - known)
        if unknown:
            raise OptionError(f"unknown tolerance(s) {unknown}", term="verify.check",
                              hint=f"known: {sorted(known)}")
        return Tolerances(**{k: float(v) for k, v in tol.items()})
    raise OptionError(f"tol must be a Tolerances, a float or a dict, got {type(tol).__name__}",
                      term="verify.check")


def _env_for(obj: Any, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = {s.name for s in obj.symbols if s.kind in ("weight", "constant", "scalar")}
    return {k: v for k, v in env.items() if k in names}


def _flat(z: Mapping[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(z[k], dtype=np.float64).reshape(-1) for k in names])


def _rel_err(a: np.ndarray, ref: np.ndarray, floor: float) -> tuple[float, float]:
    with np.errstate(all="ignore"):
        d = float(np.linalg.norm(a - ref))
        return d / max(float(np.linalg.norm(ref)), floor), d


class _Run:
    """State of one ``check`` call (kept together so each reference path stays short)."""

    def __init__(self, derived: DerivedLayer, module: EquilibriumModule | None,
                 inputs: dict[str, torch.Tensor], env: dict[str, torch.Tensor], tols: Tolerances,
                 opts: dict[str, Any], starts: int, seed: int, reference: str):
        self.derived, self.module, self.inputs, self.env = derived, module, inputs, env
        self.tols, self.opts, self.starts, self.reference = tols, opts, starts, reference
        self.rng = np.random.default_rng(seed)
        self.bsz = next(iter(inputs.values())).shape[0] if inputs else 1
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.rules: dict[str, bool] = {}
        self.samples = [SampleResult(i) for i in range(self.bsz)]
        self.ref = ReferenceInfo("none", "no reference")
        self.label = derived.claim.kind
        self.z_ref: np.ndarray | None = None
        self.compare_names: list[str] = [b.name for b in derived.blocks]

    # ---------------------------------------------------------------- helpers
    def sample_inputs_np(self, b: int) -> dict[str, np.ndarray]:
        return {k: v[b].numpy() for k, v in self.inputs.items()}

    def sample_inputs_t(self, b: int) -> dict[str, torch.Tensor]:
        return {k: v[b:b + 1] for k, v in self.inputs.items()}

    def layer_state(self, b: int) -> dict[str, np.ndarray]:
        return {k: v[b].numpy() for k, v in self.states.items()}

    def rule(self, name: str, ok: bool, message: str) -> None:
        self.rules[name] = self.rules.get(name, True) and ok
        if not ok:
            self.failures.append(message)

    def independent_stationarity(self, obj: Objective, b: int) -> float | None:
        """Projected gradient of the lifted objective at the layer's state (autograd); for
        ``φ∘A`` at ``u = A(z)`` on ``φ`` (whose potentials then act on plain states)."""
        uw = unwind(obj, self.env)  # φ∘A∘B… and λM^μ_φ: down to the innermost φ at u = A(…z)
        obj = uw.inner
        zs = uw.forward({k: v.detach().to(T64).numpy() for k, v in self.states.items()})
        env = _env_for(obj, self.env)
        if _batch_coupled(obj):
            # batch-coupled terms (decorrelation, HSIC): the objective is one function of the
            # whole batch; sample b's rows of its forward–backward residual
            pb = lift_batch(obj, self.inputs, env)
            vb = pb.lift_point(zs)
            if vb is None:
                return None
            if not math.isfinite(pb.value(vb)):
                return math.inf
            g = pb.smooth_grad(vb, raw=True)
            if not np.all(np.isfinite(g)):
                return math.inf
            r, vr = pb.rows(vb - pb.prox_step(vb - g))[b], pb.rows(vb)[b]
            return float(np.linalg.norm(r)) / max(1.0, float(np.linalg.norm(vr)))
        p = lift(obj, self.sample_inputs_t(b), env)
        v = p.lift_point({k: a[b] for k, a in zs.items()})
        if v is None:
            return None
        return p.projected_gradient(v) / max(1.0, float(np.linalg.norm(v)))

    # ---------------------------------------------------------------- references
    _polish_pg: tuple[float, float] = (math.nan, math.nan)

    def polish_reference(self, obj: Objective, b: int, states: Mapping[str, np.ndarray]
                         ) -> dict[str, np.ndarray] | None:
        """Polish a CVXPY point that disagrees with the layer: local minimization of the lifted
        claim objective *from the CVXPY point* (independent of the layer).  Interior-point
        solvers are only ~sqrt(gap)-accurate at degenerate minimizers (``z* = 0`` on ``z ≥ 0``
        with a zero multiplier: ~3e-6 at gap 1e-11).  The polished point replaces the CVXPY
        one only if it is at least as good and more stationary, and only starting from a point
        already near-stationary (projected gradient ≤ ``POLISH_FROM``): the reference stays
        CVXPY's, refined; ``None`` if not applicable."""
        # φ∘A: polish φ at u = A(z), map back z = A⁻¹(u); λM^μ_φ: polish φ (same argmin)
        uw = unwind(obj, self.env)
        obj = uw.inner
        st = uw.forward({k: np.asarray(v, dtype=np.float64).reshape(-1)
                         for k, v in states.items()})
        try:
            p = lift(obj, self.sample_inputs_t(b), _env_for(obj, self.env))
            v0 = p.lift_point(st)
            if v0 is None or p.n > 512 or p.coupled:  # Newton polish: O(n) gradients
                return None
            f0, pg0 = p.value(v0), p.projected_gradient(v0)
            if not pg0 <= POLISH_FROM:  # refine a near-optimal point only, never replace one
                return None
            res = minimize(p, v0)
        except (ConvexEqError, ValueError, RuntimeError):
            return None
        if not (res.success and res.pg < pg0
                and res.f <= f0 + 1e-12 * max(1.0, abs(f0))):
            return None
        self._polish_pg = (pg0, res.pg)
        return uw.backward(p.states(res.v))

    def second_reference(self, obj: Objective, b: int, o: CvxpyOutcome, a: np.ndarray,
                         r: np.ndarray) -> np.ndarray:
        """A CVXPY point that disagrees and cannot be polished (its lifted variables are not
        determined by the state, e.g. a conjugate's dual with ``Mᵀ`` not injective): the
        certified-convex numeric reference, a second method from its own start, replaces it
        only if it is stationary to the reference tolerance and at least as good in value
        (interior points are ~√gap-accurate at a degenerate minimizer).  Returns the point
        compared with."""
        s = self.samples[b]
        try:
            num = numeric_reference(obj, self.sample_inputs_t(b), _env_for(obj, self.env))
        except (ConvexEqError, ValueError, RuntimeError, np.linalg.LinAlgError):
            return r
        if not (num.stationarity <= self.tols.reference_stationarity and math.isfinite(num.value)
                and num.value <= o.value + 1e-9 * max(1.0, abs(o.value))):
            return r
        r2 = _flat(num.states, self.compare_names)
        before = s.rel_error
        s.rel_error, s.abs_error = _rel_err(a, r2, self.tols.scale_floor)
        s.notes.append(f"CVXPY point (relative error {before:.2e}) not polishable; compared "
                       f"with the certified-convex numeric reference instead (stationary to "
                       f"{num.stationarity:.1e}, value {num.value - o.value:+.1e} vs CVXPY)")
        return r2

    def run_cvxpy(self, obj: Objective, label: str) -> bool:
        """CVXPY per sample; returns False (nothing recorded) if the objective is not DCP and
        the caller may fall back to the numeric reference."""
        env = _env_for(obj, self.env)
        outs: list[CvxpyOutcome] = []
        for b in range(self.bsz):
            try:
                outs.append(cvxpy_reference(obj, self.sample_inputs_np(b), env, self.opts))
            except ExportError as err:
                if self.reference == "auto":
                    self.notes.append(f"not DCP-exportable ({err.reason}): using the "
                                      "certified-convex numeric reference (docs/theory.md §9.2)")
                    return False
                self.ref = ReferenceInfo("cvxpy", "CVXPY", ok=False,
                                         failure=f"not DCP-exportable: {err}")
                self.rule("reference", False, f"reference unavailable: not DCP-exportable "
                          f"({err.reason})")
                return True
        for b, o in enumerate(outs):  # an inaccurate interior point, polished to stationarity
            if o.status == "optimal_inaccurate" and o.states:
                polished = self.polish_reference(obj, b, o.states)
                if polished is not None and self._polish_pg[1] <= self.tols.reference_stationarity:
                    val = objective_value(obj, polished, self.sample_inputs_np(b), env,
                                          exported=o.exported, opts=self.opts)
                    if val is not None and math.isfinite(val):
                        o.states, o.value, o.ok = polished, val, True
                        o.status = "optimal_inaccurate → polished"
                        self.samples[b].notes.append(
                            f"CVXPY returned optimal_inaccurate; its point was polished by local "
                            f"minimization to projected gradient {self._polish_pg[1]:.1e}")
        solver = outs[0].solver if outs else ""
        self.ref = ReferenceInfo("cvxpy", f"CVXPY on {obj.name or 'the claim objective'}"
                                 f" ({len(outs)} exported instance(s))", solver,
                                 [o.status for o in outs], _tol_dict(self.opts))
        bad = [b for b, o in enumerate(outs) if not o.ok]
        if bad:
            o = outs[bad[0]]
            self.ref.ok = False
            self.ref.failure = f"status {o.status}"
            self.rule("reference", False, f"reference solver failed: {o.solver} status "
                      f"'{o.status}' on sample(s) {bad}" + (f" ({o.message})" if o.message else "")
                      + " — not compared")
        else:
            self.rules["reference"] = True
        refs = []
        for b, o in enumerate(outs):
            s = self.samples[b]
            s.status = o.status
            if not o.ok:
                s.notes.append(f"reference {o.status}: not compared")
                continue
            zl = self.layer_state(b)
            a, r = _flat(zl, self.compare_names), _flat(o.states, self.compare_names)
            s.rel_error, s.abs_error = _rel_err(a, r, self.tols.scale_floor)
            if s.rel_error > self.tols.rel_error:
                polished = self.polish_reference(obj, b, o.states)
                if polished is not None:
                    r = _flat(polished, self.compare_names)
                    before = s.rel_error
                    s.rel_error, s.abs_error = _rel_err(a, r, self.tols.scale_floor)
                    s.notes.append(f"CVXPY point polished (projected gradient "
                                   f"{self._polish_pg[0]:.1e} → {self._polish_pg[1]:.1e}); "
                                   f"relative error {before:.2e} before polishing")
                elif s.rel_error <= self.tols.distinct_minimizer:  # a numerical disagreement
                    r = self.second_reference(obj, b, o, a, r)
            refs.append(r)
            s.reference_objective = o.value
            g = objective_value(obj, zl, self.sample_inputs_np(b), env, exported=o.exported,
                                opts=self.opts)
            s.objective = g
            s.gap = None if g is None else (g - o.value) / max(1.0, abs(o.value))
            if s.stationarity is None:
                s.stationarity = self.independent_stationarity(obj, b)
            s.label = label
        if not bad:
            self.z_ref = np.stack(refs)
            self.label = label
            self.check_rel_gap(self.tols.rel_error)
        self.check_stationarity()
        return True

    def run_numeric(self, obj: Objective, label: str) -> None:
        env = _env_for(obj, self.env)
        refs, stats, msgs = [], [], set()
        for b in range(self.bsz):
            out = numeric_reference(obj, self.sample_inputs_t(b), env)
            s = self.samples[b]
            zl = self.layer_state(b)
            a, r = _flat(zl, self.compare_names), _flat(out.states, self.compare_names)
            refs.append(r)
            s.rel_error, s.abs_error = _rel_err(a, r, self.tols.scale_floor)
            s.reference_objective = out.value
            g = objective_value(obj, zl, self.sample_inputs_np(b), env, lifted=out.problem)
            s.objective = g
            s.gap = None if g is None else (g - out.value) / max(1.0, abs(out.value))
            s.reference_stationarity = out.stationarity
            if s.stationarity is None:
                s.stationarity = self.independent_stationarity(obj, b)
            s.status = "stationary" if out.stationarity <= self.tols.reference_stationarity \
                else "not stationary"
            s.label = label
            stats.append(out.stationarity)
            msgs.add(out.result.method)
        self.ref = ReferenceInfo(
            "numeric", "certified-convex numeric reference: the lifted objective minimized "
            "from an interior start, independent of the layer", " / ".join(sorted(msgs)),
            [s.status for s in self.samples],
            {"gtol": 1e-12, "ftol": 1e-16, "newton_stop": 1e-14}, 1)
        worst = _worst(stats)
        ok = worst <= self.tols.reference_stationarity
        self.ref.ok = ok
        self.rule("reference_stationarity", ok, f"reference solver failed: numeric reference "
                  f"not stationary (projected gradient {worst:.3e} > "
                  f"{self.tols.reference_stationarity:g}) — not a certified minimizer")
        self.rules["reference"] = ok
        self.z_ref = np.stack(refs)
        self.label = label
        self.check_rel_gap(self.tols.rel_error)
        self.check_stationarity()

    def check_rel_gap(self, rel_tol: float, gap: bool = True) -> None:
        """Relative state error and objective gap vs the reference.  For a convex claim
        (``gap``) a sample whose state differs but whose objective equals the reference's
        (gap ≤ tol) and which is independently stationary (≤ tol) is *a* minimizer of a
        convex objective with a non-unique argmin: the state error is then reported, not
        failed (e.g. f_hardtanh = ι([-1, 1]ⁿ): every point of the box is a minimizer).
        Below ``distinct_minimizer`` the difference is numerical: it is then accepted only
        where the layer is at least as stationary as a numeric reference (a flat minimum
        that the reference, the less accurate of the two, approached from elsewhere)."""
        if gap:
            for s in self.samples:
                if (s.rel_error is not None and s.rel_error > rel_tol and s.gap is not None
                        and abs(s.gap) <= self.tols.gap and s.stationarity is not None
                        and s.stationarity <= self.tols.stationarity
                        and (s.rel_error > self.tols.distinct_minimizer
                             or (s.reference_stationarity is not None
                                 and s.stationarity <= s.reference_stationarity))):
                    what = ("the convex objective's argmin is not a single point here"
                            if s.rel_error > self.tols.distinct_minimizer else
                            "a flat minimum: the layer's point is the more stationary one")
                    s.notes.append(
                        f"state differs from the reference (relative error {s.rel_error:.2e}) "
                        f"but has its objective value (gap {s.gap:.1e}) and is stationary "
                        f"({s.stationarity:.1e}): {what}")
                    s.argmin_not_unique = True
        self.unresolved_equilibrium(rel_tol)
        errs = [s.rel_error for s in self.samples if s.rel_error is not None
                and not (gap and s.argmin_not_unique) and not s.unresolved]
        if errs:
            worst = _worst(errs)
            self.rule("rel_error", worst <= rel_tol,
                      f"relative error {worst:.3e} > {rel_tol:g} (layer vs reference)")
        gaps = [abs(s.gap) for s in self.samples if s.gap is not None]
        if gap and gaps:
            worst = _worst(gaps)
            self.rule("gap", worst <= self.tols.gap,
                      f"objective gap {worst:.3e} > {self.tols.gap:g}")

    def unresolved_equilibrium(self, rel_tol: float) -> None:
        """A tight solve that stopped above its tolerance leaves the state only
        ``r·max(1,||z||)/(1 − c)``-accurate (``r`` its residual, ``c < 1`` the contraction
        bound): a state error within that bound is verify's own inaccuracy, reported as
        "equilibrium not accurate enough to compare", never as a layer-vs-reference error."""
        eq = getattr(self, "eq", None)
        if eq is None or eq.converged:
            return
        try:
            c = float(self.derived.contraction.value(self.env))
        except (ConvexEqError, TypeError, ValueError, RuntimeError):
            return
        if not c < 1:
            return
        for s in self.samples:
            if s.rel_error is None or s.rel_error <= rel_tol or s.argmin_not_unique:
                continue
            zn = float(np.linalg.norm(_flat(self.layer_state(s.index), self.compare_names)))
            bound = s.residual * max(1.0, zn) / (1.0 - c)
            if s.abs_error is not None and s.abs_error <= bound * (1 + 1e-6):  # + round-off
                s.unresolved = True
                s.notes.append(f"state error {s.abs_error:.2e} is within the error bound "
                               f"{bound:.2e} = r·max(1,||z||)/(1 − c) of the tight solve "
                               f"(r = {s.residual:.1e}, c = {c:.6f}): not a layer error")
        bad = [s.index for s in self.samples if s.unresolved]
        if bad:
            self.rule("equilibrium", False, f"equilibrium not accurate enough to compare: the "
                      f"tight solve stopped above its tolerance and the state error of "
                      f"sample(s) {bad} is within its error bound r/(1 − c)")

    def check_stationarity(self) -> None:
        if "inclusion_gradient-form" in self.rules:
            return
        # a state accepted with fixed-point residual r (≤ the residual tolerance) is only
        # r-accurate, so its stationarity residual is allowed 10·r (a Lipschitz factor of the
        # unit-step forward–backward map); a wrong T, exactly at its own fixed point (r ≈ 0),
        # still faces the full tolerance
        allowed = [max(self.tols.stationarity, 10.0 * s.residual) if math.isfinite(s.residual)
                   else self.tols.stationarity for s in self.samples]
        stats = [(s.stationarity, a) for s, a in zip(self.samples, allowed)
                 if s.stationarity is not None]
        if stats:
            bad = [(v, a) for v, a in stats if not v <= a]
            v, a = bad[0] if bad else (_worst([v for v, _ in stats]), self.tols.stationarity)
            self.rule("stationarity", not bad,
                      f"independent stationarity residual {v:.3e} > {a:g}")

    def no_equilibrium(self) -> None:
        """No reference: without an equilibrium there is nothing to compare."""
        self.notes.append("no reference computed: without an equilibrium there is nothing to "
                          "compare (the layer may have no fixed point here)")
        self.ref = ReferenceInfo("none", "not computed (equilibrium not found)", ok=False)
        self.label = "equilibrium not found"
        tol = self.tols.sam if getattr(self.module, "sam", None) is not None \
            else self.tols.residual
        for s in self.samples:
            s.label = "equilibrium not found" if s.residual > tol else "not compared"

    def run_local(self, obj: Objective) -> None:
        # φ∘A (and λM^μ_φ): starts, stationarity and second-order check on the innermost φ at
        # u = A(z) — A invertible, so local minimizers and stationary points correspond, and
        # φ's non-smooth terms act on plain variables there (boxes, separable proxes)
        claim_obj, uw = obj, unwind(obj, self.env)
        obj = uw.inner
        env = _env_for(obj, self.env)
        labels = []
        refs = []
        coupled = _batch_coupled(obj)
        if coupled:  # one problem over the whole batch (a coupled term needs every sample)
            whole = batch_local_reference(
                obj, self.inputs, env,
                uw.forward({k: v.numpy() for k, v in self.states.items()}),
                self.starts, self.rng)
        for b in range(self.bsz):
            out = whole if coupled else local_reference(
                obj, self.sample_inputs_t(b), env, uw.forward(self.layer_state(b)), self.starts,
                self.rng)
            s = self.samples[b]
            s.stationarity = out.stationarity
            if out.nearest is not None:
                a = _flat(self.layer_state(b), self.compare_names)
                near = {k: v[b] for k, v in out.nearest.items()} if coupled else out.nearest
                r = _flat(uw.backward(near), self.compare_names)
                refs.append(r)
                s.rel_error, s.abs_error = _rel_err(a, r, self.tols.scale_floor)
            s.objective = out.layer_value
            s.reference_objective = out.best_value
            if out.best_value < -1e100:
                s.notes.append("a start ran off to an unbounded-below direction: G has no "
                               "global minimizer here")
            elif out.layer_value is not None and math.isfinite(out.best_value):
                s.gap = (out.layer_value - out.best_value) / max(1.0, abs(out.best_value))
                if s.gap > self.tols.gap:
                    s.notes.append(f"a start reached a lower value (by {s.gap:.3e}): the "
                                   "equilibrium is not a global minimizer")
            so_info = out.second_order
            if so_info is not None:
                s.lambda_min = so_info["lambda_min"]
                s.second_order = so_info["verdict"]
            if coupled:
                # one function of the whole batch: starts, values and the second-order check
                # are those of the batch problem; stationarity is sample b's share of it
                s.stationarity = self.independent_stationarity(claim_obj, b)
                s.notes.append("batch-coupled objective: local starts, objective values and "
                               "second-order check on the whole batch (one problem)")
            stationary = s.residual <= self.tols.residual and (
                s.stationarity is None or s.stationarity <= self.tols.stationarity)
            if not stationary:
                s.label = "not stationary"
            elif s.second_order == "local minimizer":
                s.label = "local minimizer"
            else:
                s.label = "stationary point"
            s.status = f"{out.at_layer}/{out.starts} starts at the layer's state"
            labels.append(s.label)
        self.ref = ReferenceInfo(
            "local", "local reference: multi-start L-BFGS-B on the lifted objective (one start "
            "next to the layer's state, the others random), stationarity residual and "
            "second-order check (reduced Hessian, strict complementarity)",
            "scipy L-BFGS-B (exact autograd gradients)", [s.status for s in self.samples],
            {"gtol": 1e-11, "hessian": "central differences of exact gradients"},
            max(1, self.starts))
        self.rules["reference"] = True
        self.z_ref = np.stack(refs) if len(refs) == self.bsz else None
        if "not stationary" in labels:
            self.label = "not stationary"
        elif labels and all(lab == "local minimizer" for lab in labels):
            self.label = "local minimizer"
        else:
            self.label = "stationary point"
        if any(s.stationarity is not None for s in self.samples):
            self.check_stationarity()
        else:
            self.notes.append("independent stationarity residual unavailable (the lifted "
                              "variables are not determined by the state); the fixed-point "
                              "residual is the stationarity certificate")
        self.notes.append("non-convex objective: the equilibrium is verified as a stationary "
                          "point (local minimizer where the second-order check is conclusive), "
                          "never as a global minimizer")

    def run_deep(self, comp: DeepComposition) -> None:
        blocks_t = deep_blocks(self.derived, self.states_t, self.inputs, self.env)
        self.states = {k: v.detach() for k, v in blocks_t.items()}
        self.compare_names = [b.name for b in comp.blocks]
        inc = inclusion_residuals(comp, blocks_t, self.inputs, self.env)
        for b in range(self.bsz):
            s = self.samples[b]
            for key in ("prox-form", "gradient-form"):
                vals = [float(r[key][b]) for r in inc.values() if key in r]
                if vals:
                    s.block_residuals[key] = _worst(vals)
            if "gradient-form" in s.block_residuals:
                s.stationarity = s.block_residuals["gradient-form"]
        for key in ("prox-form", "gradient-form"):
            vals = [s.block_residuals[key] for s in self.samples if key in s.block_residuals]
            if vals:
                self.rule(f"inclusion_{key}", _worst(vals) <= self.tols.residual,
                          f"Theorem 2 {key} residual {_worst(vals):.3e} > {self.tols.residual:g}")
        y = wide_solution(comp, self.inputs, self.env)
        for b in range(self.bsz):
            d = max(float((blocks_t[k][b] - y[b]).norm()) for k in self.compare_names)
            self.samples[b].theorem3_distance = d / max(float(y[b].norm()),
                                                        self.tols.scale_floor)
        a = comp.alpha_value(self.env)
        if comp.L == 2 and a < 1.0:
            obj = comp.corollary1_objective(self.env)
            lab = "minimizer (Corollary 1)"
            done = self.reference in ("auto", "cvxpy") and self.run_cvxpy(obj, lab)
            if not done:
                self.run_numeric(obj, "minimizer (Corollary 1; convex, numeric reference)")
            self.ref.kind = "corollary1-" + self.ref.kind
            self.ref.description = "Corollary 1: (z_1, z_0) minimizes α M^{1-α}[φ_1](z_1) + " \
                "α M^{1-α}[φ_2](z_0) + ½||z_1 - z_0||²; " + self.ref.description
        else:
            self.ref = ReferenceInfo(
                "inclusion", "Theorem 2 inclusion 0 ∈ ∂Φ(z̃) + (I − P)z̃ block by block: prox "
                "form ||z_i − (α prox_φi + (1−α) id)(z_{i−1})|| and gradient form "
                "||∇(α M^{1−α}_φi)(z_i) + z_i − z_{i−1}|| (∇ of the envelope by "
                "docs/theory.md §9.2 with "
                "a Newton solve of prox_{κψ}); no objective exists for L ≥ 3",
                "semismooth Newton (prox_{κψ})", ["computed"] * self.bsz)
            self.rules["reference"] = True
            self.label = "inclusion (Theorem 2)"
            for s in self.samples:
                s.label = self.label
        self.notes.append(f"Theorem 3 (informational): relative distance of the blocks to the "
                          f"wide solution at α = {a:g}; it tends to 0 only as α → 0")

    def run_sam(self, obj: Objective) -> None:
        cfg = self.module.sam  # type: ignore[union-attr]
        env = _env_for(obj, self.env)
        outs = [sam_reference(obj, cfg.R, self.sample_inputs_np(b), env, self.opts)
                for b in range(self.bsz)]
        epss = [o.eps for o in outs if o.ok]
        self.ref = ReferenceInfo(
            "sam", "argmin_(Fix T) R as the limit of the Tikhonov path z(ε) = argmin φ + ε R "
            "(ε = 1e-2 … 1e-7, each an ordinary strongly convex CVXPY solve), Fix T = argmin φ; "
            "the ε kept (" + (f"{max(epss):.0e}" if epss else "n/a") + ") minimizes the "
            "estimated error ||z(ε) − z(10ε)||, stated as the reference accuracy",
            outs[0].solver, [o.status for o in outs],
            {**{f"stage1 {k}": v for k, v in _tol_dict(self.opts).items()},
             **{f"stage2 {k}": v for k, v in _tol_dict(outs[-1].options).items()}})
        bad = [b for b, o in enumerate(outs) if not o.ok]
        if bad:
            o = outs[bad[0]]
            self.ref.ok = False
            self.ref.failure = f"status {o.status}"
            self.rule("reference", False, f"reference solver failed: {o.solver} status "
                      f"'{o.status}' on sample(s) {bad} (weights tried: "
                      + ", ".join(f"ε={d:.0e} {st}" for d, st in o.levels) + ") — not compared")
            return
        refs, accs = [], []
        for b, o in enumerate(outs):
            s = self.samples[b]
            a, r = _flat(self.layer_state(b), self.compare_names), _flat(o.states,
                                                                        self.compare_names)
            refs.append(r)
            s.rel_error, s.abs_error = _rel_err(a, r, self.tols.scale_floor)
            acc = o.error / max(float(np.linalg.norm(r)), self.tols.scale_floor)
            accs.append(acc)
            s.status = o.status
            s.notes.append(f"SAM reference at ε = {o.eps:.0e}: estimated relative accuracy "
                           f"{acc:.1e}")
            s.label = "argmin over Fix T of R (Theorem 5)"
        self.ref.tolerances["estimated reference accuracy (relative)"] = _worst(accs)
        # a reference whose own error is not ≤ tol/10 cannot decide a comparison at tol
        ok = _worst(accs) <= 0.1 * self.tols.sam
        self.rule("reference", ok, f"reference not accurate enough: estimated relative error "
                  f"{_worst(accs):.2e} > {0.1 * self.tols.sam:g} (a tenth of the SAM tolerance) — "
                  "not compared")
        if not ok:
            self.ref.ok = False
            return
        self.z_ref = np.stack(refs)
        self.label = "argmin over Fix T of R (Theorem 5)"
        self.check_rel_gap(self.tols.sam, gap=False)

def claim_objective(derived: DerivedLayer) -> Any:
    """The objective the claim is about: the source, except under a Moreau skip (``λM^μ_φ``,
    one term), which keeps the claim of the layer it wraps — whose source may be an edited
    objective (``φ + M¹[γR]`` for a prox-variant regularizer): that one is the reference's."""
    src = derived.source
    inner = getattr(derived.payload, "inner", None)
    while (isinstance(inner, DerivedLayer) and isinstance(src, Objective)
           and isinstance(inner.source, Objective) and len(src.terms) == 1
           and isinstance(src.terms[0], MoreauEnvelope)
           and [b.name for b in inner.blocks] == [b.name for b in derived.blocks]):
        src = inner.source
        inner = getattr(inner.payload, "inner", None)
    return src


def _tol_dict(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k != "solver"}


#: projected gradient below which a CVXPY point is refined by local minimization (a point
#: farther from stationarity is a solver failure, reported and never compared)
POLISH_FROM = 1e-4


def _batch_coupled(obj: Objective) -> bool:
    """True if a term couples the samples of a batch (e.g. batch decorrelation, HSIC)."""
    pc = getattr(obj, "precomposition", None)
    terms = (pc.inner if pc is not None else obj).terms
    return any(getattr(t, "batch_coupled", False) for t in terms)


def check(target: Any, x: Any, *, gradients: bool = False,
          tol: Tolerances | float | Mapping[str, float] | None = None, starts: int = 5,
          seed: int = 0, reference: str = "auto",
          solver_options: Mapping[str, Any] | None = None) -> Report:
    """Verify the equilibrium of ``target`` (a ``DerivedLayer`` or an emitted
    ``EquilibriumModule``, with its current weights) at inputs ``x`` against its claim.

    ``tol``: a ``Tolerances`` (or a float: the relative-error tolerance); ``starts``: number of
    starts of the local reference; ``reference``: "auto" (docs/theory.md §9) | "cvxpy" | "numeric" |
    "local"; ``solver_options``: CVXPY options (default Clarabel, gap/feasibility 1e-11; SCS only
    with eps ≤ 1e-9); ``gradients``: also compare ``dℓ/dx`` with cvxpylayers and finite
    differences (DCP-exportable objectives).  Torch runs single-threaded during the call.
    Inclusion and saddle layers are verified by ``verify.inclusion`` (docs/monotone.md §6)."""
    if handles(resolve_target(target)[0].source):
        rep = check_inclusion(target, x, tol=_tolerances(tol).rel_error,
                              solver_options=solver_options).as_report()
        if gradients:
            rep.notes.append("gradient check skipped: it needs an objective verified against "
                             "CVXPY (cvxpylayers reference)")
        return rep
    with single_thread():
        return _check(target, x, gradients=gradients, tol=tol, starts=starts, seed=seed,
                      reference=reference, solver_options=solver_options)


def _check(target: Any, x: Any, *, gradients: bool = False,
          tol: Tolerances | float | Mapping[str, float] | None = None, starts: int = 5,
          seed: int = 0, reference: str = "auto",
          solver_options: Mapping[str, Any] | None = None) -> Report:
    """The body of ``check`` (see there)."""
    t0 = time.perf_counter()
    if reference not in REFERENCES:
        raise OptionError(f"unknown reference {reference!r}", term="verify.check",
                          hint=f"use one of {REFERENCES}")
    if starts < 1:
        raise OptionError("starts must be ≥ 1", term="verify.check")
    derived, module = resolve_target(target)
    tols = _tolerances(tol)
    opts = reference_solver_options(solver_options)
    env = environment(derived, module)
    inputs = prepare_inputs(derived, x)
    run = _Run(derived, module, inputs, env, tols, opts, starts, seed, reference)
    src = claim_objective(derived)
    claim = derived.claim
    sam = getattr(module, "sam", None) if module is not None else None

    # 1. equilibrium -------------------------------------------------------------------------
    if sam is not None:
        z, eq = _sam_equilibrium(derived, module, inputs, env)
    else:
        z, eq = equilibrium(derived, inputs, env, tol=tols.equilibrium)
    f = operator(derived, inputs, env)
    with torch.no_grad():
        tz = f(z)
    res = relative_residual(z, tz)  # overflow-safe: a huge state never reads as converged
    for b in range(run.bsz):
        run.samples[b].residual = float(res[b])
    run.eq = eq
    run.states_t = derived.split(z)
    run.states = {k: v.detach() for k, v in run.states_t.items()}
    res_tol = tols.sam if sam is not None else tols.residual
    worst = float(res.max())
    run.rule("equilibrium", eq.converged or worst <= res_tol,
             f"equilibrium not found: {eq.solver} {eq.note}" if eq.note.startswith("diverged")
             else f"equilibrium not found: {eq.solver} stopped at relative residual "
             f"{eq.max_residual:.3e} (tol {eq.tol:g})")
    run.rule("residual", worst <= res_tol,
             f"optimality residual ||z - T(z)||/max(1,||z||) = {worst:.3e} > {res_tol:g}")

    # 2. certificate ------------------------------------------------------------------------
    cert = certificate_at(derived, env)
    needs = claim.kind in NEEDS_CERTIFICATE or sam is not None
    not_certified = needs and not cert.certified
    if needs:
        run.rule("certificate", cert.certified,
                 "claim not certified here: " + ("; ".join(cert.violated) or cert.text))
    if not_certified:
        run.notes.append(f"the claim '{claim.kind}' needs the certificate; at these weights it "
                         f"does not hold, so the equilibrium is checked as a stationary point "
                         f"only (local reference)")

    # 3. reference (docs/theory.md §9: verify.selection) -----------------------------------
    situation = Situation(src, claim.kind, cert.certified, sam is not None,
                          not (worst > res_tol and not eq.converged), reference)
    REFERENCE_KINDS[select_reference(situation)].run(run, src, situation)

    # 4. gradients ---------------------------------------------------------------------------
    grad_report = None
    if gradients:
        if isinstance(src, Objective) and run.ref.kind == "cvxpy" and sam is None:
            grad_report = gradient_check(derived, inputs, env, seed=seed, tol=tols.gradient)
            if not grad_report.passed:
                bad = [f"{k} = {grad_report.errors[k]:.3e}" for k in grad_report.required
                       if not grad_report.errors[k] <= grad_report.tolerance]
                run.rule("gradients", False, f"gradient check failed: {', '.join(bad)} > "
                         f"{grad_report.tolerance:g}")
            else:
                run.rules["gradients"] = True
        else:
            run.notes.append("gradient check skipped: it needs a DCP-exportable objective "
                             "verified against CVXPY (cvxpylayers reference)")

    if module is not None:
        _module_note(run, module, inputs, z)
    if not_certified and run.label.startswith(("minimizer", "modified")):
        run.label = "stationary point"
    z_layer = np.concatenate([run.states[k].numpy().reshape(run.bsz, -1)
                              for k in run.compare_names], axis=1)
    return Report(
        target=_describe(derived, module), claim=claim.kind, claim_statement=claim.statement,
        label=run.label, certificate=cert.text, certified=cert.certified,
        violated=cert.violated, reference=run.ref, tolerances=tols, samples=run.samples,
        equilibrium=eq, z_layer=z_layer, z_reference=run.z_ref, block_names=run.compare_names,
        gradients=grad_report, failures=run.failures, notes=run.notes, pass_rules=run.rules,
        elapsed=time.perf_counter() - t0)


def _sam_equilibrium(derived: DerivedLayer, module: Any, inputs: dict[str, torch.Tensor],
                     env: dict[str, torch.Tensor]) -> tuple[torch.Tensor, EquilibriumInfo]:
    """SAM's own iteration (Theorem 5), float64, with the module's weights."""
    m = fresh_module(derived, env, sam=module.sam)
    x = inputs if len(inputs) > 1 else next(iter(inputs.values()))
    with torch.no_grad():
        out, st = m(x, return_stats=True)
    outs = out if isinstance(out, tuple) else (out,)
    z = torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1)
    return z, info_from_stats(f"SAM (ρ={module.sam.rho:g}, c={module.sam.c:g}, "
                              f"{module.sam.max_iter} steps)", st, st.residuals, module.sam.tol)


def _module_note(run: _Run, module: EquilibriumModule, inputs: dict[str, torch.Tensor],
                 z: torch.Tensor) -> None:
    """How far the module's own forward (its solver, tolerance and dtype) is from the tight
    equilibrium (informational)."""
    dt = next(iter(module.parameters()), torch.zeros((), dtype=T64)).dtype
    x = {k: v.to(dt) for k, v in inputs.items()}
    try:
        with torch.no_grad():
            out = module(x if len(x) > 1 else next(iter(x.values())))
    except Exception as err:  # the module's own solver may refuse: say so
        run.notes.append(f"module forward failed with its own settings: {err}")
        return
    outs = out if isinstance(out, tuple) else (out,)
    zm = torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1).to(T64)
    if zm.shape == z.shape:
        d = float((zm - z).norm() / z.norm().clamp_min(1e-3))
        solver = "SAM" if module.sam is not None else module.solver
        run.notes.append(f"module forward ({solver}, tol {module.tol:g}, {dt}) vs the "
                         f"tight float64 equilibrium: relative difference {d:.3e} "
                         "(informational; the check uses the tight solve with the module's "
                         "weights)")


def _describe(derived: DerivedLayer, module: EquilibriumModule | None) -> str:
    src = derived.source
    name = getattr(src, "name", "") or type(src).__name__
    kind = "EquilibriumModule" if module is not None else "DerivedLayer"
    return f"{kind} of {name} (blocks {', '.join(b.name for b in derived.blocks)})"
