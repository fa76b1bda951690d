"""``y = L y + b`` for ``L = M ∘ diag(d)``, ``M`` self-adjoint and ``d ≥ 0``, by conjugate
gradients on the symmetrised system (docs/theory.md §8, the adjoint solve)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..grad_mode import set_grad_enabled
from ..solvers import SolverStats, exact_rel_residual

#: the conjugate-gradient adjoint stops its recurrence at this fraction of ``tol`` first (the
#: returned gradient is then checked against ``tol`` exactly with the true map; the target is
#: tightened ten-fold while that check fails, within the iteration cap).  ½: the true residual
#: is ``||L(s ⊙ r)||/||T(g)||`` for the recurrence's ``r`` (docs/theory.md §8), at most
#: ``2ρ/(1 − 3ρ)`` for ``ρ = ||r||/||s ⊙ v||`` where ``||L|| < 1`` and ``0 ≤ d ≤ 1``, so the
#: check passes at the first stop there up to a relative 1.5·tol
CG_TARGET = 0.5


def solve_cg(matvec: Any, b: torch.Tensor, *, tol: float, max_iter: int,
             split: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, SolverStats] | None:
    """``y = b + M(d ⊙ y)`` for ``split = (d, M)`` (``matvec = M ∘ diag(d)``, a plan's transpose
    map with ``plus``), per sample: with ``s = √d`` and ``h = s ⊙ y`` the system is
    ``(I − S M S) h = s ⊙ b``, symmetric, and positive definite where ``L`` contracts; then
    ``y = b + M(s ⊙ h)``.  About a third of the plain iterations of a well-contracting layer
    (each about twice the work).  The returned ``y`` is checked with the true map (relative
    residual ``||L y + b − y|| / ||L y + b||`` ≤ ``tol``, as the fixed-point solvers measure it);
    None when that check fails within ``max_iter`` iterations or stops improving, or on a
    non-finite value (an indefinite system, a NaN right-hand side, a negative ``d``).
    ``residuals`` hold the recurrence's ``||r_k|| / ||s ⊙ b||`` per iteration."""
    on = torch.is_grad_enabled()
    if on:
        set_grad_enabled(False)
    try:
        return _cg_run(split[0], split[1], matvec, b.detach(), tol, max_iter)
    finally:
        if on:
            set_grad_enabled(True)


def _cg_run(d: torch.Tensor, inner: Any, jt: Any, v: torch.Tensor, tol: float, max_iter: int
            ) -> tuple[torch.Tensor, SolverStats] | None:
    if v.ndim != 2 or d.shape != v.shape or not v.shape[0]:  # (an empty batch: iterate)
        return None
    norm, addcmul = torch.linalg.vector_norm, torch.addcmul
    s = d.sqrt()  # NaN for a negative d: the recurrence reads non-finite and gives up
    # the right-hand side s ⊙ v scaled to unit norm per sample (its norm nb is put back on the
    # returned h): ||r|| is then the relative residual itself, with no division per iteration.
    # Clamped away from 0: a sample with b = 0 (h = 0 is exact), or one whose recurrence
    # residual reaches exactly 0 before the others (finite termination: a ReLU sample with few
    # active units, common in float32), would read 0/0 in α or β
    tiny = torch.finfo(v.dtype).tiny
    r = s * v
    nb = norm(r, 2, 1, True).clamp_min_(tiny)  # (B, 1)
    r.div_(nb)
    p = r.clone()
    h = torch.zeros_like(r)
    rr = norm(r, 2, 1, True).square_().clamp_min_(tiny)  # (B, 1) squared norms
    target = CG_TARGET * tol
    checked = math.inf  # the worst checked residual of the last failed check
    hist: list[torch.Tensor] = []  # ||r_k|| / ||s ⊙ v|| per iteration, (B, 1) each
    k = 0
    single = v.shape[0] == 1
    while k < max_iter:
        k += 1
        ap = addcmul(p, s, inner(s * p), value=-1.0)  # (I − S L S) p
        alpha = rr / torch.linalg.vecdot(p, ap).unsqueeze_(1).clamp_min_(tiny)
        h.addcmul_(alpha, p)
        r.addcmul_(alpha, ap, value=-1.0)
        nr = norm(r, 2, 1, True)
        hist.append(nr)
        top = float(nr if single else nr.max())  # (one sample: no reduction)
        if not math.isfinite(top):
            return None
        if top <= target:
            g = inner.plus((h * nb).mul_(s), v)
            tg = jt.plus(g, v)  # T(g) = Jᵀg + v
            exact = exact_rel_residual(tg - g, tg)  # the fixed-point residual, exactly
            conv = exact <= tol  # False for NaN: non-finite and unconverged in one test
            if bool(conv.all()):
                # (the history's columns, joined when first read; iterations: each sample's
                # first k with ||r_k||/||b|| ≤ tol there)
                return g, SolverStats("cg", tuple(hist), None, conv, tol,
                                      returned_residual=exact.to(g.dtype), all_converged=True)
            # the recurrence's residual ran ahead of the true one: go on with a target ten
            # times lower while that moves the checked residual (it stalls where round-off in
            # the state's dtype, not the recurrence, limits it: the configured solver then)
            worst = float(exact.max())
            if not worst < 0.5 * checked:
                return None
            checked = worst
            target *= 0.1
        rr_new = nr.square().clamp_min_(tiny)
        p = addcmul(r, rr_new / rr, p)
        rr = rr_new
    return None
