"""``G(z)``, the claim objective's value at a given state, for the gap between the layer and a
reference (docs/theory.md §9): the objective's own value rules; else the innermost objective's
lifted problem at ``u = A(z)``; else the export with the states fixed; else the lifted problem
minimized over its auxiliary blocks (inner envelopes)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from convex_eq.errors import ConvexEqError
from convex_eq.export import ExportedProblem
from convex_eq.objective import Objective

from .conic import CLARABEL_TIGHT, value_at_states_cvxpy
from .lifting import LiftedProblem, lift
from .optimize import partial_value
from .unwind import unwind


def objective_value(obj: Objective, z: Mapping[str, np.ndarray], inputs: Mapping[str, Any],
                    env: Mapping[str, Any], *, exported: ExportedProblem | None = None,
                    lifted: LiftedProblem | None = None,
                    opts: Mapping[str, Any] | None = None) -> float | None:
    """``G(z)`` by the first of the four ways of the module docstring that gives a finite value
    (``exported``/``lifted``: the reference's export or lifted problem, when it has one)."""
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
