"""An independent adjudicator for every FAIL that ``verify.check`` reports in the fuzz.

It shares no code path with verify's references: no CVXPY, no lifted problem, no autograd, no
scipy minimizer — only the claim objective's own value rules (``Objective.value_tensor``) and
the layer's ``T``, probed by derivative-free line searches and plain iteration.  Each FAIL gets
one class:

* ``confirmed`` — the violation is real: a first-order descent direction of the claim
  objective at the layer's equilibrium (so it is neither a minimizer nor a stationary point),
  the equilibrium outside the objective's domain, or a certified contraction whose plain
  iteration does not converge;
* ``reference-failure`` — verify's own machinery failed (a reference solver status, a
  reference too inaccurate to decide, a tight solve that stopped where plain iteration
  converges): not a verdict on the layer;
* ``ill-posed`` — the claim does not apply here (its certificate is violated at these weights,
  or no fixed point exists: not a contraction and plain iteration does not converge either);
* ``unconfirmed`` — none of the above: the FAIL could not be confirmed (a suspected false
  alarm; the goal is none).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import lowering

T64 = torch.float64
CLASSES = ("confirmed", "reference-failure", "ill-posed", "unconfirmed")

#: a descent whose slope is at least this (relative to max(1, |G|)) confirms non-stationarity:
#: 100× verify's stationarity tolerance (1e-8), and at the step sizes used (≥ 1e-5·scale) the
#: decrease it implies is ≥ 1e-11·max(1,|G|), far above float64 round-off of G (~1e-15·|G|)
SLOPE = 1e-6


def classify(d: lowering.DerivedLayer, rep: Any, inputs: dict[str, torch.Tensor]) -> str:
    """The class of a failed report (module docstring)."""
    first = rep.failures[0]
    if first.startswith("claim not certified here"):
        return "ill-posed"
    if first.startswith(("reference solver failed", "reference unavailable",
                         "reference not accurate", "equilibrium not accurate enough")):
        return "reference-failure"
    if first.startswith("equilibrium not found") or (
            first.startswith("optimality residual") and rep.label == "equilibrium not found"):
        return _no_equilibrium(d, inputs)
    if first.startswith("optimality residual"):
        return _no_equilibrium(d, inputs)
    return _descent(d, rep, inputs)


# ----------------------------------------------------------------------------- no equilibrium
def _no_equilibrium(d: lowering.DerivedLayer, inputs: dict[str, torch.Tensor],
                    steps: int = 20000) -> str:
    """Plain iteration ``z ← T(z)`` from 0 (not Anderson): converged → verify's solve failed;
    a certified contraction that does not converge → a real violation; else ill-posed."""
    bsz = next(iter(inputs.values())).shape[0] if inputs else 1
    z = {b.name: torch.zeros(bsz, b.size, dtype=T64) for b in d.blocks}
    with torch.no_grad():
        for _ in range(steps):
            tz = d.apply({**inputs, **z})
            diff = max(float((tz[k] - z[k]).abs().max()) for k in z)
            scale = max(1.0, max(float(v.abs().max()) for v in tz.values()))
            z = {k: tz[k] for k in z}
            if not math.isfinite(diff):
                break
            if diff <= 1e-11 * scale:
                return "reference-failure"
    c = d.contraction.value()
    return "confirmed" if c < 1 - 1e-9 else "ill-posed"


# ----------------------------------------------------------------------------- descent test
def _claim_objective(d: lowering.DerivedLayer) -> Any:
    from verify.check import claim_objective

    return claim_objective(d)


def _env(obj: Any) -> dict[str, torch.Tensor]:
    return {s.name: torch.as_tensor(s.resolve(None), dtype=T64)
            for s in obj.symbols if s.kind in ("weight", "constant", "scalar")}


def _descent(d: lowering.DerivedLayer, rep: Any, inputs: dict[str, torch.Tensor]) -> str:
    """Look for a first-order descent direction of ``G = Σ_b G_b`` (the whole batch, so batch
    couplings are included) at the layer's equilibrium, by function values only: the negative
    central-difference gradient, single coordinates, the direction to verify's reference point
    (if any) and random directions; steps ``t·max(1, ||z||)``, ``t = 1e-2 … 1e-5``."""
    obj = _claim_objective(d)
    if not hasattr(obj, "value_tensor") or rep.z_layer is None:
        return "unconfirmed"
    names = rep.block_names
    sizes = {b.name: b.size for b in d.blocks}
    if any(n not in sizes for n in names) or {s.name for s in obj.states} != set(names):
        return "unconfirmed"
    env = _env(obj)
    z0 = np.asarray(rep.z_layer, dtype=np.float64)  # (B, N)
    shape = z0.shape

    def g(zf: np.ndarray) -> float:
        zz = torch.as_tensor(zf.reshape(shape), dtype=T64)
        vals, off = dict(inputs), 0
        for n in names:
            vals[n] = zz[:, off:off + sizes[n]]
            off += sizes[n]
        try:
            with torch.no_grad():
                v = float(obj.value_tensor(vals, env).sum())
        except Exception:  # a term without a value rule here: no adjudication
            return math.nan
        return v if not math.isnan(v) else math.inf

    z = z0.reshape(-1)
    f0 = g(z)
    if math.isnan(f0):
        return "unconfirmed"
    scale = max(1.0, float(np.linalg.norm(z)))
    if math.isinf(f0):  # outside dom G: round-off (an ulp) or a real violation?
        rng = np.random.default_rng(0)
        near = [g(z + 1e-12 * scale * rng.standard_normal(z.size)) for _ in range(8)]
        near.append(g(z * (1 - 1e-12)))
        return "unconfirmed" if any(math.isfinite(v) for v in near) else "confirmed"
    dirs = _directions(g, z, f0, scale, rep)
    fscale = max(1.0, abs(f0))
    for dv in dirs:
        nrm = float(np.linalg.norm(dv))
        if not nrm > 0 or not math.isfinite(nrm):
            continue
        dv = dv / nrm
        for t in (1e-2, 1e-3, 1e-4, 1e-5):
            step = t * scale
            f1 = g(z + step * dv)
            if math.isfinite(f1) and (f0 - f1) >= SLOPE * step * fscale:
                return "confirmed"
    return "unconfirmed"


def _directions(g: Any, z: np.ndarray, f0: float, scale: float, rep: Any) -> list[np.ndarray]:
    n = z.size
    h = 1e-6 * scale
    grad = np.zeros(n)
    for i in range(n):
        e = np.zeros(n)
        e[i] = h
        fp, fm = g(z + e), g(z - e)
        if math.isfinite(fp) and math.isfinite(fm):
            grad[i] = (fp - fm) / (2 * h)
        elif math.isfinite(fp):
            grad[i] = (fp - f0) / h
        elif math.isfinite(fm):
            grad[i] = (f0 - fm) / h
    dirs = [-grad]
    for i in np.argsort(-np.abs(grad))[: min(n, 6)]:
        e = np.zeros(n)
        e[i] = -np.sign(grad[i]) if grad[i] != 0 else 1.0
        dirs.append(e)
    if rep.z_reference is not None:
        dirs.append(np.asarray(rep.z_reference, dtype=np.float64).reshape(-1) - z)
    rng = np.random.default_rng(1)
    for _ in range(4):
        r = rng.standard_normal(n)
        dirs += [r, -r]
    return dirs
