"""Numerical helpers shared by the property modules (float64 throughout).

Tolerances used by the properties, and why:

* ``FP_TOL = 1e-12`` — relative fixed-point residual the equilibria are solved to.  For a
  ``c``-contraction the distance to the true fixed point is at most ``res·||z||/(1 - c)``;
  with ``c ≤ 0.95²`` that is ``≈ 1e-11`` relative.
* ``ROUND = 1e-11`` — closed-form float64 identities evaluated two ways (rounding only: a few
  hundred ulps of O(1) quantities).
* ``CVX_TOL = 1e-5`` — state agreement with a CVXPY/Clarabel reference solved at
  ``tol_gap_abs = tol_gap_rel = tol_feas = 1e-11``.  Typical agreement is 1e-9…1e-7, but at
  degenerate optima (a constraint active with a zero multiplier: no strict complementarity, e.g.
  ReLU units exactly at the kink) an interior-point method stops at distance ``≈ sqrt(gap)`` from
  the face, ``≈ 1e-6`` (measured: 1.26e-6 on ``W = [[0.5, 0]]``, ``x = 0``, exact answer
  ``z = 0``).  1e-5 covers that with margin; every broken rule moves the state by ≫ 1e-3.
* ``STAT_TOL = 1e-8`` — stationarity residuals of non-convex objectives (Must-show 2).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

import lowering

T64 = torch.float64
FP_TOL = 1e-12
ROUND = 1e-11
CVX_TOL = 1e-5
STAT_TOL = 1e-8


class ReferenceFailure(RuntimeError):
    """The reference (CVXPY solve, fixed-point solve) failed: not a verdict on the theorem."""


def t64(a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach().to(T64)
    return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=T64)


def nrm(a: Any) -> float:
    return float(torch.linalg.vector_norm(t64(a)))


def rel_err(a: Any, b: Any, floor: float = 1.0) -> float:
    """``||a - b|| / max(||b||, floor)`` (absolute error for references smaller than ``floor``)."""
    return nrm(t64(a) - t64(b)) / max(nrm(b), floor)


def check(cond: bool, msg: str) -> None:
    """``assert`` that survives ``python -O`` (properties are a library, not only tests)."""
    if not cond:
        raise AssertionError(msg)


def stacked_operator(derived: Any, inputs: Mapping[str, torch.Tensor],
                     env: Mapping[str, Any] | None = None
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``z ↦ T(z, x)`` on the flat stacked state ``(B, N)`` of a derived layer."""

    def f(z: torch.Tensor) -> torch.Tensor:
        Z = dict(inputs)
        Z.update(derived.split(z))
        return derived.stack(derived.apply(Z, env))

    return f


def equilibrium(derived: Any, inputs: Mapping[str, torch.Tensor],
                env: Mapping[str, Any] | None = None, *, tol: float = FP_TOL,
                max_iter: int = 3000, z0: torch.Tensor | None = None,
                plain_fallback: int = 60000) -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
    """Solve ``z = T(z, x)`` (Anderson, then plain iteration if needed) to relative residual
    ``tol``; returns ``(blocks, stacked z, worst relative residual)`` with ``z = T(z')`` at the
    solver's iterate ``z'`` (in ``T``'s range, e.g. a prox's domain, which an Anderson mixture
    of iterates need not be).

    Raises :class:`ReferenceFailure` when the residual is not reached (the caller's instance
    is then outside the contraction regime it assumed)."""
    f = stacked_operator(derived, inputs, env)
    b = next(iter(inputs.values())).shape[0]
    if z0 is None:
        z0 = torch.zeros(b, derived.state_size, dtype=T64)
    with torch.no_grad():
        z, _ = lowering.solve(f, z0, solver="anderson", tol=tol, max_iter=max_iter)
        z = f(z)
        res = _res(f, z)
        k = 0
        while res > tol and k < plain_fallback:
            for _ in range(200):
                z = f(z)
            k += 200
            res = _res(f, z)
    if not res <= tol:
        raise ReferenceFailure(f"fixed-point solve reached relative residual {res:.3e} > {tol:g}")
    return derived.split(z), z, res


def _res(f: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> float:
    fz = f(z)
    num = torch.linalg.vector_norm(fz - z, dim=-1)
    den = torch.linalg.vector_norm(z, dim=-1).clamp_min(1.0)
    return float((num / den).max())


#: reference solver chain: Clarabel at 1e-11 (docs/theory.md §9.1), then SCS at eps 1e-12 when
#: Clarabel
#: reports an inaccurate status (it does on degenerate instances, e.g. ``x = 0``, ``b = 0``)
SOLVER_CHAIN: tuple[dict[str, Any], ...] = (
    {},  # ExportedProblem.solve default: Clarabel, tol_gap_abs = tol_gap_rel = tol_feas = 1e-11
    {"solver": "SCS", "eps_abs": 1e-12, "eps_rel": 1e-12, "max_iters": 200000},
)


def cvxpy_states(objective: Any, **instance: Any) -> tuple[dict[str, np.ndarray], float]:
    """Minimize the exported objective; returns the states and the optimal value.  Tries the
    :data:`SOLVER_CHAIN` in order and accepts only status ``optimal``; otherwise raises
    :class:`ReferenceFailure` (an inaccurate reference is never compared as if solved)."""
    inst = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v)
            for k, v in instance.items()}
    ex = objective.to_cvxpy(**inst)
    seen = []
    for opts in SOLVER_CHAIN:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                val = ex.solve(**opts)
        except Exception as err:  # solver crash: a reference failure, not a theorem failure
            seen.append(f"{opts.get('solver', 'CLARABEL')}: {type(err).__name__}")
            continue
        status = ex.problem.status
        if status == "optimal":
            return ex.state_values(), val
        seen.append(f"{opts.get('solver', 'CLARABEL')}: {status}")
    raise ReferenceFailure(f"no accurate CVXPY reference ({'; '.join(seen)}); not compared")


def jacobian(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """Dense Jacobian of ``fn`` at one unbatched point ``z`` (``(n,) → (n,)``)."""
    return torch.autograd.functional.jacobian(lambda v: fn(v[None])[0], z)


def stationarity_residual(objective: Any, Z: Mapping[str, torch.Tensor],
                          inputs: Mapping[str, torch.Tensor]) -> float:
    """Canonical-form stationarity residual of ``G = Σ_b f_{σ_b}(z_b) + h(z)`` (docs/theory.md §3):
    ``max_b ||z_b − σ_b(z_b − ∇_b h(z))|| / max(1, ||z_b||)``, i.e. the forward–backward
    residual ``||z − prox_{f_σ}(z − ∇h(z))||`` with ``prox_{f_σ} = σ`` (docs/theory.md §1).

    ``∇h`` is computed by autograd of the *declared* terms' values (every term except the
    potentials), not by the terms' gradient rules the lowering used — an independent check of
    the derived layer.  Almost-everywhere gradients (``|·|`` in the decorrelation term) follow
    autograd's convention ``sign(0) = 0``, the same choice as the toolkit's rule."""
    from convex_eq.terms.potential import Potential

    pots = {t.prox_state.name: t.act for t in objective.terms if isinstance(t, Potential)}
    rest = [t for t in objective.terms if not isinstance(t, Potential)]
    zs = {k: v.detach().clone().requires_grad_() for k, v in Z.items()}
    vals = {**inputs, **zs}
    h = sum(t.value(vals) for t in rest)
    grads = torch.autograd.grad(h.sum(), list(zs.values()))
    worst = 0.0
    with torch.no_grad():
        for (k, z), g in zip(zs.items(), grads):
            r = z - pots[k].sigma(z - g)
            num = torch.linalg.vector_norm(r, dim=-1)
            den = torch.linalg.vector_norm(z, dim=-1).clamp_min(1.0)
            worst = max(worst, float((num / den).max()))
    return worst
