"""``verify.check``: is the layer's equilibrium what its derivation claims (docs/theory.md §9)?

1. the equilibrium, by a tight float64 solve of ``z = T(z, x)`` with the target's current weights;
2. the certificate at these weights ("claim not certified here: <condition>" when violated);
3. the reference chosen by docs/theory.md §9 and the claim (:mod:`verify.selection`) — CVXPY
   (DCP-exportable), the certified-convex numeric reference (convex, not DCP), the local
   reference (non-convex: never "minimizer"), Corollary 1 / Theorem 2 for deep models, the
   Tikhonov path for SAM — each one unit of ``verify/references/``;
4. relative state error, objective gap, optimality residual ``||z - T(z)||`` (the lowering's
   forward–backward map: ``prox_g(z - ∇h(z))`` with unit step for the canonical rule), an
   independent projected-gradient stationarity residual, pass/fail against ``Tolerances``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convex_eq.certificate import certify
from convex_eq.errors import OptionError
from convex_eq.objective import Objective
from convex_eq.terms.moreau import MoreauEnvelope
from lowering import DerivedLayer, EquilibriumModule

from .conic import reference_solver_options
from .context import CheckContext
from .equilibrium import (
    environment,
    equilibrium,
    operator,
    prepare_inputs,
    relative_residual,
    resolve_target,
    sam_equilibrium,
    single_thread,
)
from .gradients import gradient_check
from .inclusion import check_inclusion, handles
from .module_output import Against, judge_module, module_output
from .references.base import source_family
from .report import GradientReport, ModuleJudgement, Report, SampleResult, Tolerances
from .selection import REFERENCE_KINDS, REQUESTS, Situation, refuse_inapplicable, select_reference

REFERENCES = REQUESTS
NEEDS_CERTIFICATE = ("minimizer", "modified minimizer", "inclusion")


@dataclass
class CertificateAt:
    """The certificate evaluated at the verified weights."""

    #: the certificate as one line, with the conditions' values at these weights
    text: str
    #: ``"convex"``, ``"conditional"`` or ``"nonconvex"``
    kind: str
    #: True if the objective is certified convex at these weights (every condition holds)
    certified: bool
    #: the conditions that fail at these weights, as text
    violated: list[str] = field(default_factory=list)


def certificate_at(derived: DerivedLayer, env: Mapping[str, torch.Tensor]) -> CertificateAt:
    """Convexity certificate of the claim's objective at ``env`` (deep models: the layers'
    Theorem 1 conditions, which Corollary 1 / Theorem 2 assume)."""
    src = derived.source
    if source_family(src) == "deep":
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


def tolerances(tol: Tolerances | float | Mapping[str, float] | None) -> Tolerances:
    """``tol`` of ``check`` as ``Tolerances`` (a float is the relative-error tolerance)."""
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
    if reference not in REFERENCES:
        raise OptionError(f"unknown reference {reference!r}", term="verify.check",
                          hint=f"use one of {REFERENCES}")
    if handles(resolve_target(target)[0].source):
        if reference not in ("auto", "cvxpy"):
            raise OptionError(f"reference={reference!r} does not apply: inclusion and saddle "
                              "layers are verified by the gap, LCP and duality-gap references "
                              "(CVXPY, docs/monotone.md §6)", term="verify.check",
                              hint="use reference='auto' or 'cvxpy'")
        rep = check_inclusion(target, x, tol=tolerances(tol).rel_error,
                              solver_options=solver_options).as_report()
        if gradients:
            rep.notes.append("gradient check skipped: it needs an objective verified against "
                             "CVXPY (cvxpylayers reference)")
        return rep
    with single_thread():
        return _check(target, x, gradients=gradients, tol=tol, starts=starts, seed=seed,
                      reference=reference, solver_options=solver_options)


def _check(target: Any, x: Any, *, gradients: bool,
           tol: Tolerances | float | Mapping[str, float] | None, starts: int, seed: int,
           reference: str, solver_options: Mapping[str, Any] | None) -> Report:
    """The body of ``check`` (see there): the four steps of the module docstring."""
    t0 = time.perf_counter()
    if starts < 1:
        raise OptionError("starts must be ≥ 1", term="verify.check")
    derived, module = resolve_target(target)
    sam = getattr(module, "sam", None) is not None
    src = claim_objective(derived)
    refuse_inapplicable(Situation(src, derived.claim.kind, True, sam, True, reference))
    tols = tolerances(tol)
    opts = reference_solver_options(solver_options)
    env = environment(derived, module)
    inputs = prepare_inputs(derived, x)
    ctx = CheckContext(derived, module, inputs, env, tols, opts, starts,
                       np.random.default_rng(seed), reference, label=derived.claim.kind,
                       compare_names=[b.name for b in derived.blocks])
    ctx.samples = [SampleResult(i) for i in range(ctx.bsz)]
    z, found = _equilibrium_step(ctx, sam)
    layer_inputs = ctx.inputs
    if derived.claim_inputs is not None:
        _claim_inputs_step(ctx, layer_inputs)
    cert = certificate_at(derived, env)
    not_certified = _certificate_step(ctx, cert, sam)
    situation = Situation(src, derived.claim.kind, cert.certified, sam, found, reference)
    REFERENCE_KINDS[select_reference(situation)].run(ctx, src, situation)
    grad_report = _gradient_step(ctx, src, seed, sam) if gradients else None
    judged = (_module_step(ctx, module, z, found, sam, layer_inputs) if module is not None
              else None)
    if not_certified and ctx.label.startswith(("minimizer", "modified")):
        ctx.label = "stationary point"
    z_layer = np.concatenate([ctx.states[k].numpy().reshape(ctx.bsz, -1)
                              for k in ctx.compare_names], axis=1)
    return Report(
        target=_describe(derived, module), claim=derived.claim.kind,
        claim_statement=derived.claim.statement, label=ctx.label, certificate=cert.text,
        certified=cert.certified, violated=cert.violated, reference=ctx.ref, tolerances=tols,
        samples=ctx.samples, equilibrium=ctx.eq, z_layer=z_layer, z_reference=ctx.z_ref,
        block_names=ctx.compare_names, gradients=grad_report, failures=ctx.failures,
        notes=ctx.notes, pass_rules=ctx.rules, elapsed=time.perf_counter() - t0,
        module=judged)


def _equilibrium_step(ctx: CheckContext, sam: bool) -> tuple[torch.Tensor, bool]:
    """Step 1: the tight solve (SAM's own iteration for a SAM module), its residual per
    sample, the ``equilibrium`` and ``residual`` rules; returns ``(z, equilibrium found)``."""
    derived, inputs, env, tols = ctx.derived, ctx.inputs, ctx.env, ctx.tols
    if sam:
        z, eq = sam_equilibrium(derived, ctx.module, inputs, env)  # type: ignore[arg-type]
    else:
        z, eq = equilibrium(derived, inputs, env, tol=tols.equilibrium, z0=_module_start(ctx))
    f = operator(derived, inputs, env)
    with torch.no_grad():
        tz = f(z)
    res = relative_residual(z, tz)  # overflow-safe: a huge state never reads as converged
    for b in range(ctx.bsz):
        ctx.samples[b].residual = float(res[b])
    ctx.eq = eq
    ctx.states = {k: v.detach() for k, v in derived.split(z).items()}
    res_tol = tols.sam if sam else tols.residual
    worst = float(res.max())
    ctx.rule("equilibrium", eq.converged or worst <= res_tol,
             f"equilibrium not found: {eq.solver} {eq.note}" if eq.note.startswith("diverged")
             else f"equilibrium not found: {eq.solver} stopped at relative residual "
             f"{eq.max_residual:.3e} (tol {eq.tol:g})")
    ctx.rule("residual", worst <= res_tol,
             f"optimality residual ||z - T(z)||/max(1,||z||) = {worst:.3e} > {res_tol:g}")
    return z, not (worst > res_tol and not eq.converged)


def _module_start(ctx: CheckContext) -> torch.Tensor | None:
    """Where no contraction bound makes the fixed point unique, the tight solve starts at the
    module's own output, so the fixed point judged is the one the module returns (None: from 0;
    also where the module fails, or its output is not the state)."""
    d, module = ctx.derived, ctx.module
    if module is None or d.outputs is not None or d.contraction.value(ctx.env) < 1:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, _ = module_output(module, d, ctx.inputs)
    except Exception:  # the module step reports the module's own failure
        return None
    if not np.isfinite(out).all():
        return None
    ctx.notes.append("no contraction bound makes the fixed point unique: the tight solve starts "
                     "at the module's output, and the fixed point judged is the one it returns")
    return torch.as_tensor(out, dtype=torch.float64)


def _claim_inputs_step(ctx: CheckContext, layer_inputs: dict[str, torch.Tensor]) -> None:
    """A layer whose claim is about other inputs than its own (MOptEq's PE layer: ``x_i −
    δ*_{i−1}`` with ``δ*`` frozen at the fixed point): the references check the claim there."""
    d = ctx.derived
    with torch.no_grad():
        ctx.inputs = {k: v.detach() for k, v in
                      d.claim_inputs(ctx.states, ctx.inputs, ctx.env).items()}
    reads = getattr(d.payload, "sign_inputs", None)
    note = "the claim is checked at the inputs the layer states it for (" \
        f"{d.claim.statement.split(' at the inputs ')[-1].split(':')[0]})"
    if reads is not None:
        with torch.no_grad():
            g = reads(ctx.states, layer_inputs, ctx.env).abs()
        nz = g[g > 0]
        note += (f"; entries the signs read at the fixed point: {int((g == 0).sum())} exactly 0 "
                 "(any δ entry there maximizes), smallest non-zero |entry| "
                 f"{float(nz.min()) if nz.numel() else float('nan'):.3e} (small: near a jump "
                 "of T)")
    ctx.notes.append(note)


def _certificate_step(ctx: CheckContext, cert: CertificateAt, sam: bool) -> bool:
    """Step 2: the ``certificate`` rule where the claim needs it; returns whether a claim that
    needs the certificate is not certified here."""
    claim = ctx.derived.claim
    needs = claim.kind in NEEDS_CERTIFICATE or sam
    if needs:
        ctx.rule("certificate", cert.certified,
                 "claim not certified here: " + ("; ".join(cert.violated) or cert.text))
    if needs and not cert.certified:
        ctx.notes.append(f"the claim '{claim.kind}' needs the certificate; at these weights it "
                         f"does not hold, so the equilibrium is checked as a stationary point "
                         f"only (local reference)")
    return needs and not cert.certified


def _gradient_step(ctx: CheckContext, src: Any, seed: int, sam: bool
                   ) -> GradientReport | None:
    """``dℓ/dx`` against cvxpylayers and finite differences (objectives verified by CVXPY)."""
    if not (source_family(src) == "objective" and ctx.ref.kind == "cvxpy" and not sam):
        ctx.notes.append("gradient check skipped: it needs a DCP-exportable objective "
                         "verified against CVXPY (cvxpylayers reference)")
        return None
    rep = gradient_check(ctx.derived, ctx.inputs, ctx.env, seed=seed, tol=ctx.tols.gradient)
    if not rep.passed:
        bad = [f"{k} = {rep.errors[k]:.3e}" for k in rep.required
               if not rep.errors[k] <= rep.tolerance]
        ctx.rule("gradients", False, f"gradient check failed: {', '.join(bad)} > "
                 f"{rep.tolerance:g}")
    else:
        ctx.rules["gradients"] = True
    return rep


def _module_step(ctx: CheckContext, module: EquilibriumModule, z: torch.Tensor, found: bool,
                 sam: bool, layer_inputs: dict[str, torch.Tensor]) -> ModuleJudgement | None:
    """The module's own forward judged against the reference point the check accepted (else
    the tight equilibrium; docs/theory.md §9.5): the ``module_output`` rule."""
    if not found:
        ctx.notes.append("module output not judged: no equilibrium to compare it with")
        return None
    tols = ctx.tols
    against = Against(reference_outputs(ctx), f"the reference ({ctx.ref.kind})",
                      tols.sam if sam else tols.rel_error, z,
                      np.array([s.residual for s in ctx.samples]), tols.scale_floor,
                      tols.sam if sam else None)
    judged = judge_module(module, ctx.derived, layer_inputs, ctx.env, against)
    ctx.rule("module_output", judged.passed, judged.failure)
    ctx.notes += [f"module forward warned: {w}" for w in judged.warnings]
    return judged


def reference_outputs(ctx: CheckContext) -> np.ndarray | None:
    """The accepted reference point in the layer's output layout, ``(B, M)``, with NaN rows for
    the samples not compared with it (another minimizer, an unresolved tight solve); None where
    the reference gives no point (local, Theorem 2) or was not accepted."""
    if ctx.z_ref is None or not ctx.ref.ok or ctx.ref.kind == "local":
        return None
    sizes = [ctx.states[k].shape[1] for k in ctx.compare_names]
    cuts = np.cumsum([0, *sizes])
    blocks = {k: ctx.z_ref[:, a:b] for k, a, b in zip(ctx.compare_names, cuts, cuts[1:])}
    d = ctx.derived
    if d.outputs is None and all(b.name in blocks for b in d.output_blocks):
        out = np.concatenate([blocks[b.name] for b in d.output_blocks], axis=1)
    elif all(b.name in blocks for b in d.blocks):
        z = torch.as_tensor(np.concatenate([blocks[b.name] for b in d.blocks], axis=1))
        with torch.no_grad():
            out = d.output(z, ctx.inputs, ctx.env).numpy()
    else:
        return None
    skip = [s.argmin_not_unique or s.unresolved for s in ctx.samples]
    out = np.array(out, dtype=np.float64)
    out[skip] = np.nan
    return out


def _describe(derived: DerivedLayer, module: EquilibriumModule | None) -> str:
    src = derived.source
    name = getattr(src, "name", "") or type(src).__name__
    kind = "EquilibriumModule" if module is not None else "DerivedLayer"
    return f"{kind} of {name} (blocks {', '.join(b.name for b in derived.blocks)})"
