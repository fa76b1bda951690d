"""verify judges what an emitted module returns (docs/theory.md §9.5): its own forward, as it is
configured (solver, tolerance, unrolled steps, caches, weight control, dtype, device), at the
verified inputs, against the point the check accepted as the reference (the tight float64
equilibrium of the same weights where the reference gives no point).

The allowance.  A module stops at ``||T(z) − z|| ≤ tol·||T(z)||``.  Where ``T`` is a
``c``-contraction, ``||z − z*|| ≤ ||z − T(z)||/(1 − c)`` and ``||T(z)|| ≤ ||z*|| + c||z − z*||``
give ``||z − z*||/||z*|| ≤ (tol + γ)·κ`` with ``κ = 1/(1 − c(1 + tol + γ))``; ``γ`` is the error
of the module's measurement in its dtype (``||T_dtype(z*) − T(z*)||/||T(z*)||`` at the tight
state, plus ``(√N + 2)·u`` for its norms and its rounded output, ``u`` the unit roundoff, ``N``
the state size).  Without a contraction bound, ``κ = 1/σ_min(I − ∂T/∂z)`` at the tight state
(first order; where the flat batch state has at most ``JACOBIAN_MAX`` entries).  A splitting
layer returns a resolvent of its state (1-Lipschitz), so its output is allowed that distance
times ``||z*||/||o*||``.  The point judged against adds its own accuracy ``ε``: the tolerance at
which the check accepted the reference, or ``κ·r`` for the tight solve stopped at residual
``r``.  Where the output is the state it must also be a fixed point to the module's tolerance:
``||T(o) − o||/||T(o)|| ≤ tol(1 + γ) + γ`` in float64.  SAM modules are allowed the SAM
tolerance (Theorem 5 is asymptotic).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convex_eq.errors import ConvexEqError
from lowering import DerivedLayer, EquilibriumModule

from .equilibrium import operator, scaled_norm
from .report import ModuleJudgement

T64 = torch.float64
#: largest flat batch state ``B·N`` whose Jacobian ``∂T/∂z`` is formed for ``κ`` (a dense
#: ``(B·N)²`` matrix and its singular values)
JACOBIAN_MAX = 1024


@dataclass
class Against:
    """The points a module's output is judged against: ``points`` ``(B, M)`` in the layer's
    output layout (NaN rows where the reference gives none), named ``name``, accurate to the
    relative ``accuracy``; the tight equilibrium ``z`` ``(B, N)`` and its residuals ``r``."""

    points: np.ndarray | None
    name: str
    accuracy: float
    z: torch.Tensor
    r: np.ndarray
    floor: float
    sam_tol: float | None = None


def judge_module(module: EquilibriumModule, derived: DerivedLayer,
                 inputs: Mapping[str, torch.Tensor], env: Mapping[str, torch.Tensor],
                 against: Against) -> ModuleJudgement:
    """The module's forward at ``inputs`` judged against ``against`` (module docstring)."""
    desc = describe(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, stats = module_output(module, derived, inputs)
        except Exception as err:  # the module's own refusal is its answer at these inputs
            out, stats = None, f"module forward failed with its own settings: {err}"
    said = list(dict.fromkeys(str(w.message) for w in caught))
    if out is None:
        return ModuleJudgement(desc, against.name, [], [], [], None, None, "", stats, said)
    with torch.no_grad():
        tight = derived.output(against.z, dict(inputs), dict(env)).detach().numpy()
    if out.shape != tight.shape:
        return ModuleJudgement(desc, against.name, [], [], [], None, None, "",
                               f"module output has shape {out.shape}, the layer's "
                               f"{tight.shape}", said)
    d_tight = _rel_rows(out, tight, against.floor)
    rows = against.points
    if rows is None or rows.shape != tight.shape:
        rows = np.full_like(tight, np.nan)
    has_ref = ~np.isnan(rows).any(axis=1)
    d_ref = _rel_rows(out, np.where(has_ref[:, None], rows, tight), against.floor)
    if against.sam_tol is not None:
        allow = np.full(len(out), against.sam_tol)
        formula, res, res_allow = f"SAM tolerance {against.sam_tol:g}", None, None
    else:
        allow, formula, res, res_allow = _allowance(module, derived, inputs, env, against,
                                                    out, tight, has_ref)
    j = ModuleJudgement(desc, against.name if has_ref.any() else "the tight equilibrium",
                        d_ref.tolist(), d_tight.tolist(), allow.tolist(),
                        None if res is None else res.tolist(), res_allow, formula, "", said)
    j.failure = _failure(module, stats, j)
    return j


def _allowance(module: EquilibriumModule, derived: DerivedLayer,
               inputs: Mapping[str, torch.Tensor], env: Mapping[str, torch.Tensor],
               against: Against, out: np.ndarray, tight: np.ndarray, has_ref: np.ndarray
               ) -> tuple[np.ndarray, str, np.ndarray | None, float | None]:
    """``(distance allowance per sample, its formula with numbers, the output's residual per
    sample or None, the residual allowance or None)``; distances are relative to
    ``max(||o*||, floor)``, so the state's bound is scaled by ``||z*||/max(||o*||, floor)``."""
    tol, z = module.tol, against.z
    gam = measurement_error(derived, inputs, env, z, module.dtype)
    kappa, how = conditioning(derived, inputs, env, z, tol + float(gam.max()))
    zn = scaled_norm(z).numpy()
    on = np.maximum(np.linalg.norm(tight, axis=1), against.floor)
    with np.errstate(invalid="ignore"):  # κ = inf at r = 0: no bound either way
        # the tight solve stopped at r = ||z − T(z)||/max(1, ||z||) is κ·r·max(1, ||z||) off
        eps = np.where(has_ref, against.accuracy, kappa * against.r * np.maximum(1.0, zn) / on)
        # (posinf kept: without a bound the allowance is infinite and the residual rules)
        allow = np.nan_to_num((tol + gam) * kappa * zn / on + eps, nan=math.inf,
                              posinf=math.inf)
    formula = (f"(tol + γ)·κ·||z*||/max(||o*||, {against.floor:g}) + ε, tol {tol:g}, "
               f"γ ≤ {float(gam.max()):.1e}, κ = {kappa:.4g} ({how}), ε ≤ {float(eps.max()):.1e}")
    if derived.outputs is not None:
        return allow, formula, None, None
    res = own_residual(derived, inputs, env, out)
    return allow, formula, res, float(tol * (1 + gam.max()) + gam.max())


def _failure(module: EquilibriumModule, stats: Any, j: ModuleJudgement) -> str:
    """The failure message (empty when the output is within its allowances)."""
    bad = [b for b, (d, a) in enumerate(zip(j.distance, j.allowance)) if not d <= a]
    bad_res = [b for b, r in enumerate(j.residual or []) if not r <= j.residual_allowance] \
        if j.residual_rules else []
    if not bad and not bad_res:
        return ""
    parts = []
    if bad:
        b = max(bad, key=lambda i: j.distance[i])  # the worst sample speaks for the rest
        parts.append(f"relative distance {j.distance[b]:.3e} to {j.against} > allowed "
                     f"{j.allowance[b]:.3e} = {j.formula}")
    if bad_res:
        r = max(j.residual[i] for i in bad_res)  # type: ignore[index]
        parts.append(f"residual ||T(o) − o||/||T(o)|| = {r:.3e} > {j.residual_allowance:.3e} "
                     "= tol(1 + γ) + γ (no distance bound here)")
    samples = sorted(set(bad) | set(bad_res))
    reason = _reason(module, stats, j, max(samples, key=lambda i: j.distance[i]))
    return f"module output: {reason} (sample(s) {samples}: {'; '.join(parts)})"


def _reason(module: EquilibriumModule, stats: Any, j: ModuleJudgement, b: int) -> str:
    """Why sample ``b``'s output is off, in the module's own terms."""
    if module.sam is None and module.backward == "unroll":
        return (f"unrolled K = {module.config.backward.unroll_steps}: not an equilibrium "
                "(the forward returns the K-th plain iterate whatever its residual)")
    conv = getattr(stats, "converged", None)
    if conv is not None and not bool(torch.as_tensor(conv).all()):
        return (f"{module.solver} stopped at relative residual {float(stats.max_residual):.1e} "
                f"> tol {module.tol:g} (max_iter {module.max_iter})")
    return f"module output differs from {j.against} by {j.distance[b]:.1e}"


def describe(module: EquilibriumModule) -> str:
    """The configuration the module runs with, in one line."""
    if module.sam is not None:
        solver = f"SAM ({module.sam.max_iter} steps)"
    elif module.backward == "unroll":
        solver = f"unrolled K = {module.config.backward.unroll_steps}"
    else:
        solver = f"{module.solver}, tol {module.tol:g}, max_iter {module.max_iter}"
    return f"{solver}, {str(module.dtype).replace('torch.', '')}"


def module_output(module: EquilibriumModule, derived: DerivedLayer,
                  inputs: Mapping[str, torch.Tensor]) -> tuple[np.ndarray, Any]:
    """The module's own forward at ``inputs`` (cast to its dtype and device, shaped as its
    inputs are declared): ``(output (B, M) float64, its solver statistics)``."""
    ref = next(itertools.chain(module.parameters(), module.buffers()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    shapes = {s.name: s.shape for s in derived.inputs}
    x = {k: v.reshape(v.shape[0], *shapes[k]).to(device=device, dtype=module.dtype)
         for k, v in inputs.items()}
    with torch.no_grad():
        if not x:
            out, stats = module(return_stats=True)
        else:
            out, stats = module(x if len(x) > 1 else next(iter(x.values())), return_stats=True)
    outs = out if isinstance(out, tuple) else (out,)
    flat = torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1)
    return flat.detach().to("cpu", T64).numpy(), stats


def measurement_error(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
                      env: Mapping[str, torch.Tensor], z: torch.Tensor, dtype: torch.dtype
                      ) -> np.ndarray:
    """``γ`` per sample: ``||T_dtype(z) − T(z)||/||T(z)||`` plus ``(√N + 2)·u`` (the module
    solves in float32 when its dtype is narrower)."""
    solve = dtype if dtype in (torch.float32, T64) else torch.float32
    u = torch.finfo(dtype).eps / 2
    floor = (math.sqrt(derived.state_size) + 2) * u
    with torch.no_grad():
        t64 = operator(derived, inputs, env)(z)
        try:
            low = operator(derived, {k: v.to(solve) for k, v in inputs.items()},
                           {k: v.to(solve) for k, v in env.items()})(z.to(solve)).to(T64)
        except (RuntimeError, TypeError, ConvexEqError):
            return np.full(z.shape[0], derived.state_size * u + floor)
    meas = scaled_norm(low - t64) / scaled_norm(t64).clamp_min(1e-300)
    return np.nan_to_num(meas.numpy(), nan=math.inf) + floor


def conditioning(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
                 env: Mapping[str, torch.Tensor], z: torch.Tensor, tg: float
                 ) -> tuple[float, str]:
    """``(κ, how it was obtained)``: ``1/(1 − c(1 + tg))`` from the contraction bound ``c``,
    else ``1/σ_min(I − ∂T/∂z)`` at ``z`` (first order), else ``inf``."""
    try:
        c = float(derived.contraction.value(env))
    except (ConvexEqError, TypeError, ValueError, RuntimeError, AttributeError):
        c = math.nan
    if c * (1 + tg) < 1:
        return 1.0 / (1.0 - c * (1 + tg)), f"contraction c = {c:.4g}"
    n = z.numel()
    if n <= JACOBIAN_MAX:
        f = operator(derived, inputs, env)
        try:
            jac = torch.autograd.functional.jacobian(lambda v: f(v.reshape(z.shape)).reshape(-1),
                                                     z.reshape(-1))
            smin = float(torch.linalg.svdvals(torch.eye(n, dtype=T64) - jac).min())
        except (RuntimeError, ConvexEqError):
            smin = math.nan
        if smin > 0:
            return 1.0 / smin, f"1/σ_min(I − ∂T/∂z) = 1/{smin:.3g}, first order"
    return math.inf, "no contraction bound"


def own_residual(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
                 env: Mapping[str, torch.Tensor], out: np.ndarray) -> np.ndarray:
    """``||T(o) − o||/||T(o)||`` per sample in float64 at the module's output ``o`` (the state)."""
    o = torch.as_tensor(out, dtype=T64)
    with torch.no_grad():
        to = operator(derived, inputs, env)(o)
    r = scaled_norm(to - o) / scaled_norm(to).clamp_min(1e-300)
    return np.nan_to_num(r.numpy(), nan=math.inf)


def _rel_rows(a: np.ndarray, ref: np.ndarray, floor: float) -> np.ndarray:
    """``||a_b − ref_b|| / max(||ref_b||, floor)`` per row (NaN/Inf rows: inf)."""
    with np.errstate(all="ignore"):
        d = np.linalg.norm(a - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), floor)
    return np.nan_to_num(d, nan=math.inf)
