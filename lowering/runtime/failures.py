"""What the emitted module does when a solve fails: ``raise`` (a typed error naming the samples,
the residual and the contraction estimate), ``warn`` or ``mask`` (``on_nonconvergence``), with a
hint that never suggests an option already set (docs/guide.md, failures)."""

from __future__ import annotations

import math
import time
import warnings

import torch

from convex_eq.errors import ConvergenceError, ConvergenceWarning, NonFiniteError

from .guards import indices, refuse_coupled_mask
from .layer import Layer
from .parameters import refuse_nonfinite_weights
from .solvers import SolverStats
from .weight_control import controlled_conditions


def judge(m: Layer, stats: SolverStats, bad_in: torch.Tensor | None
           ) -> tuple[torch.Tensor | None, bool]:
    """``(ok mask of the solved samples, whether all are ok)``; raises / warns per
    ``on_nonconvergence``.  ``bad_in``: samples dropped for NaN/Inf inputs (None: none).
    The mask is None when the solver knows every sample converged (nothing to mask)."""
    if stats.all_converged and m.backward != "unroll":
        return None, True
    if m.backward == "unroll":
        report_unrolled(m, stats)
    nonfinite = stats.nonfinite if stats.nonfinite is not None else \
        torch.zeros_like(stats.converged)
    # an unrolled layer is K iterations by definition: only NaN/Inf fails it
    ok = ~nonfinite if m.backward == "unroll" else stats.converged
    if bool(ok.all()):
        return ok, True
    ok = ok.clone()
    if bool(nonfinite.any()):
        refuse_nonfinite_weights(m)
    if bad_in is None:
        bad_in = torch.zeros(ok.numel(), dtype=torch.bool, device=ok.device)
    keep = ~bad_in
    idx_map = torch.nonzero(keep).flatten()  # solved sample → batch index
    failed_batch = torch.zeros_like(bad_in)
    failed_batch[idx_map[~ok]] = True
    nf_batch = torch.zeros_like(bad_in)
    nf_batch[idx_map[nonfinite]] = True
    bad = int((~ok).sum())
    lip = contraction_text(m)
    if bool(nonfinite.any()):
        what = (f"the iterates of samples {indices(nf_batch)} became NaN/Inf "
                f"(diverged) under {stats.solver}")
    else:
        what = ""
    conv = (f"{bad}/{ok.numel()} samples (indices {indices(failed_batch)}) did not reach "
            f"relative residual {stats.tol:g} in {stats.residuals.shape[1]} iterations of "
            f"{stats.solver} (worst {stats.max_residual:.3e}); {lip}")
    msg = f"{what}; {conv}" if what else conv
    tip = hint(m)
    # NaN/Inf iterates (divergence) raise unless the caller opted into NaN outputs (mask)
    if m.on_nonconvergence == "raise" or (bool(nonfinite.any()) and
                                              m.on_nonconvergence != "mask"):
        cls = NonFiniteError if bool(nonfinite.any()) else ConvergenceError
        raise cls(msg, term="forward", hint=tip)
    if m.on_nonconvergence == "warn":  # finite, unconverged samples: their best iterate
        warnings.warn(f"forward: {msg}. Hint: {tip}", ConvergenceWarning, stacklevel=5)
        return torch.ones_like(ok), True
    refuse_coupled_mask(m)
    warnings.warn(f"forward: {msg}; their outputs are NaN and excluded from the backward "
                  "(on_nonconvergence='mask')", ConvergenceWarning, stacklevel=5)
    return ok, False


def report_unrolled(m: Layer, stats: SolverStats) -> None:
    """``backward="unroll"`` returns the ``K``-th plain iterate whatever its residual (the layer
    is the ``K``-step map): its statistics say per sample whether it met ``tol``
    (``converged``), and the first call whose iterate does not meet it warns, once per module
    and ``K``, that the output is not an equilibrium."""
    k = m.config.backward.unroll_steps
    if m.__dict__.get("_unroll_reported") == k or not stats.converged.numel() \
            or bool(stats.converged.all()):
        return
    m.__dict__["_unroll_reported"] = k
    failed = ~stats.converged
    warnings.warn(f"forward: backward='unroll' returns the plain iterate after K = {k} steps; for "
                  f"{int(failed.sum())}/{failed.numel()} samples (indices {indices(failed)}) it "
                  f"is not an equilibrium: relative residual up to {stats.max_residual:.3e} > tol "
                  f"{stats.tol:g} (module.last_stats.converged says which; warned once per "
                  "module)", ConvergenceWarning, stacklevel=6)


def hint(m: Layer) -> str:
    """What to change — never an option that is already set."""
    tips = [f"raise max_iter (now {m.max_iter})" if m.sam is None else
            f"raise SAMConfig.max_iter (now {m.sam.max_iter}) or its tol (now "
            f"{m.sam.tol:g})"]
    if m.solver not in ("anderson", "auto") and m.sam is None:
        tips.append("use solver='anderson'")
    lip = getattr(m, "_lip_cache", None)  # (judge evaluates it before asking)
    if m.solver == "anderson" and m.sam is None and lip is not None \
            and len(lip) > 2 and lip[2] < 1:
        tips.append(f"use solver='plain' (Lip(T) ≤ {lip[2]:.4g} < 1 here: plain iteration "
                    "converges, at that rate, where Anderson can stall on a slow "
                    "contraction)")
    if m.weight_control is None and controlled_conditions(m.derived,
                                                             list(m.weights.keys())):
        tips.append("keep the certified norms below their bounds with "
                    "weight_control='spectral_norm' (off here)")
    if m.on_nonconvergence == "raise" and not m._batch_coupled:
        tips.append("or pass on_nonconvergence='mask' to drop failing samples")
    elif m.on_nonconvergence == "raise":
        tips.append("or pass on_nonconvergence='warn' to train through it")
    return ", ".join(tips)


def contraction_text(m: Layer) -> str:
    """The contraction estimate at the current weights (re-evaluated at most every 30 s
    outside raise mode: the estimate runs power iterations, too costly for every step)."""
    c = m.derived.contraction
    now = time.monotonic()
    cached = getattr(m, "_lip_cache", None)
    if m.on_nonconvergence != "raise" and cached is not None and now - cached[0] < 30:
        return f"{cached[1]} (estimated {now - cached[0]:.0f} s ago)"
    value = math.nan
    try:
        with torch.no_grad():
            env = {k: v.detach() for k, v in m.env().items()}
            value = c.value(env)
            text = c.describe(env, value)
    except Exception as err:
        text = f"{c.formula} (could not evaluate: {err})"
    m._lip_cache = (now, text, value)
    return text


def expand_stats(stats: SolverStats, keep: torch.Tensor) -> SolverStats:
    """Statistics of the solved subset spread back over the batch (dropped samples: not
    converged, non-finite, NaN residuals)."""
    return spread_stats(stats, torch.nonzero(keep).flatten(), keep.shape[0],
                         dropped_nonfinite=True)


def spread_stats(stats: SolverStats, rows: torch.Tensor, b: int,
                  dropped_nonfinite: bool) -> SolverStats:
    """Statistics of a subset (row ``i`` is batch sample ``rows[i]``, ascending) spread over the
    ``b`` samples of the batch: the others not converged, 0 iterations, NaN residuals, and
    non-finite as ``dropped_nonfinite`` says."""
    k = stats.residuals.shape[1]
    dev = stats.residuals.device
    res = torch.full((b, k), float("nan"), dtype=stats.residuals.dtype, device=dev)
    res[rows] = stats.residuals
    it = torch.zeros(b, dtype=stats.iterations.dtype, device=dev)
    it[rows] = stats.iterations
    conv = torch.zeros(b, dtype=torch.bool, device=dev)
    conv[rows] = stats.converged
    nf = torch.full((b,), dropped_nonfinite, dtype=torch.bool, device=dev)
    assert stats.nonfinite is not None
    nf[rows] = stats.nonfinite
    ret = None
    if stats.returned_residual is not None:
        ret = torch.full((b,), float("nan"), dtype=stats.returned_residual.dtype, device=dev)
        ret[rows] = stats.returned_residual
    out = SolverStats(stats.solver, res, it, conv, stats.tol, nf, ret)
    if stats.image_norm is not None:  # (dropped samples: NaN, no bound)
        out.image_norm = torch.full((b,), float("nan"), dtype=torch.float64,
                                    device=stats.image_norm.device).index_put(
            (rows.to(stats.image_norm.device),), stats.image_norm)
    out.weights_keys = stats.weights_keys
    return out
