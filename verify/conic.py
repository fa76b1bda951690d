"""CVXPY solves at reference accuracy (docs/theory.md §9.1): the validated solver options, one
exported instance solved and read back, and ``G(z)`` through the export with the states fixed.
A status other than ``optimal`` is recorded, never compared."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cvxpy as cp
import numpy as np

from convex_eq.errors import OptionError
from convex_eq.export import ExportedProblem
from convex_eq.objective import Objective

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



def solver_tolerances(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a solve without the solver's name (what a report lists as tolerances)."""
    return {k: v for k, v in opts.items() if k != "solver"}


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
