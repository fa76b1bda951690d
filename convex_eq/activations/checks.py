"""The conditions every activation must meet, checked on a grid: ``σ`` real and finite,
nondecreasing (``σ' ≥ 0``) and 1-Lipschitz (``σ' ≤ 1``) (docs/theory.md §1).

``from_sympy`` runs this grid check when sympy cannot decide the conditions symbolically, and
``register_activation`` runs it on every activation a factory builds (and on a plain ``σ``
passed by mistake in place of a factory), so an activation that breaks them is refused where it
is declared, with the condition and the point that breaks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._lazy import torch
from ..errors import ActivationError

#: grid used when sympy cannot decide the monotonicity / Lipschitz checks
_TAIL = np.geomspace(20.0, 1e6, 2001)
GRID = np.unique(np.concatenate([np.linspace(-20.0, 20.0, 40001), _TAIL, -_TAIL]))
#: slack of the grid checks (``σ' ≥ -GRID_TOL`` and ``σ' ≤ 1 + GRID_TOL``)
GRID_TOL = 1e-10

CONDITION_HINT = (
    "an activation must be nondecreasing and 1-Lipschitz (0 ≤ σ'(t) ≤ 1 for all t) for "
    "f_σ = σ̃* - u²/2 to be convex with prox_{f_σ} = σ"
)


def _derivative(sigma: Callable[[Any], Any], t: torch.Tensor) -> torch.Tensor:
    """``σ'`` at ``t`` by autograd, or by central differences where ``σ`` is not
    differentiable by torch."""
    x = t.clone().requires_grad_()
    with torch.enable_grad():
        y = sigma(x)
        if isinstance(y, torch.Tensor) and y.requires_grad:
            return torch.autograd.grad(y.sum(), x)[0].detach()
    h = 1e-6 * (1 + t.abs())
    with torch.no_grad():
        return (sigma(t + h) - sigma(t - h)) / (2 * h)


def check_sigma(sigma: Callable[[Any], Any], name: str,
                sigma_prime: Callable[[Any], Any] | None = None,
                lipschitz: float | None = None) -> tuple[float, float]:
    """``(min σ', max σ')`` over :data:`GRID` (float64), after refusing with
    ``ActivationError`` a ``σ`` that is not real and finite there, decreases somewhere, has a
    slope above 1 (or above its declared ``lipschitz``) or is constant.  ``sigma_prime``:
    ``σ'`` in closed form (else autograd of ``σ``)."""
    t = torch.as_tensor(GRID, dtype=torch.float64)
    where = f"on a grid of {GRID.size} points in [-1e6, 1e6]"
    try:
        with torch.no_grad():
            s = sigma(t)
        d = sigma_prime(t) if sigma_prime is not None else _derivative(sigma, t)
        s, d = torch.as_tensor(s), torch.as_tensor(d)
    except Exception as exc:  # a σ that cannot take a float64 tensor of the grid
        raise ActivationError(f"σ of '{name}' cannot be evaluated on a float64 tensor "
                              f"({type(exc).__name__}: {exc})", term=name,
                              hint="σ must map a torch tensor elementwise to a tensor") from exc
    if s.shape != t.shape or d.shape != t.shape:
        raise ActivationError(f"σ of '{name}' is not elementwise: a tensor of shape "
                              f"{tuple(t.shape)} gave {tuple(s.shape)}", term=name,
                              hint=CONDITION_HINT)
    bad = ~(torch.isfinite(s) & torch.isfinite(d))
    if bool(bad.any()):
        t0 = float(t[bad][0])
        raise ActivationError(f"σ of '{name}' is not real and differentiable everywhere: σ or "
                              f"σ' is not finite at t = {t0:.6g} {where}", term=name,
                              hint=CONDITION_HINT)
    i_min, i_max = int(d.argmin()), int(d.argmax())
    lo, hi = float(d[i_min]), float(d[i_max])
    if lo < -GRID_TOL:
        raise ActivationError(f"σ of '{name}' is not nondecreasing: min σ' = {lo:.6g} < 0 at "
                              f"t = {float(t[i_min]):.6g} {where}", term=name,
                              hint=CONDITION_HINT)
    bound = 1.0 if lipschitz is None else min(1.0, float(lipschitz))
    if hi > bound + GRID_TOL:
        declared = bound < 1.0 and hi <= 1.0 + GRID_TOL
        what = f"{bound:g}-Lipschitz as it declares" if declared else "1-Lipschitz"
        raise ActivationError(f"σ of '{name}' is not {what}: max σ' = {hi:.6g} > "
                              f"{bound if declared else 1.0:g} at t = {float(t[i_max]):.6g} "
                              f"{where}", term=name,
                              hint=(f"declare lipschitz = sup σ' (≥ {hi:.6g}): it enters the "
                                    "contraction bounds" if declared else CONDITION_HINT))
    if hi <= 0:
        raise ActivationError(f"σ of '{name}' is constant: f_σ would be the indicator of a "
                              "point", term=name, hint="use a non-constant activation")
    return lo, min(hi, 1.0)
