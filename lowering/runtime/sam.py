"""SAM iteration (docs/theory.md §6, Theorem 5): choose ``argmin_{z ∈ Fix T} R(z)`` among many
equilibria.

``z^k = β_k S_{λ_k}(z^{k-1}) + (1-β_k) T(z^{k-1})``, ``S_λ(z) = (1-γλ)z - γ∇R(z)``,
``β_k = λ_k = ρ/k^c``, ``γ = 1/(2L_R)``, ``ρ, c > 0``, ``ρ + 2c < 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import OptionError
from convex_eq.objective import Objective

from .solvers import SolverStats, Tracker, empty_stats, rel_residual


@dataclass
class SAMConfig:
    """Selection objective ``R`` (convex, L_R-smooth, on the layer state) and the schedules."""

    #: the selection objective ``R`` on the layer's state (a smooth term or an ``Objective``)
    R: Any
    #: ``ρ`` of the schedule ``β_k = λ_k = ρ/k^c``
    rho: float = 0.1
    #: ``c`` of the schedule (``ρ, c > 0``, ``ρ + 2c < 1``)
    c: float = 0.44
    #: the step ``γ`` (None: ``1/(2L_R)``)
    gamma: float | None = None
    #: SAM steps run (Theorem 5 is asymptotic: it runs them all)
    max_iter: int = 5000
    #: the fixed-point residual of the returned point is reported converged at this tolerance
    tol: float = 1e-2

    def __post_init__(self) -> None:
        if not (self.rho > 0 and self.c > 0 and self.rho + 2 * self.c < 1):
            raise OptionError(f"SAM needs ρ, c > 0 and ρ + 2c < 1 (got ρ={self.rho}, c={self.c})",
                              term="SAM")
        if not isinstance(self.R, Objective):
            self.R = Objective([self.R])
        for t in self.R.terms:
            if not t.smooth:
                raise OptionError(f"SAM needs a smooth R; '{t}' is not", term="SAM")

    def lipschitz(self, env: Any = None) -> float:
        """``L_R``: the Lipschitz constant of ``∇R`` at the weights ``env``."""
        return sum(t.grad_lipschitz(env) for t in self.R.terms)

    def step_size(self, env: Any = None) -> float:
        """``γ``: the given step, else ``1/(2L_R)``."""
        return self.gamma if self.gamma is not None else 1.0 / (2.0 * self.lipschitz(env))

    def beta(self, k: int) -> float:
        """``β_k = λ_k = ρ/k^c`` of step ``k`` (from 1)."""
        return self.rho / k ** self.c


def sam_iterate(module: Any, f: Any, z0: torch.Tensor, inputs: dict, env: dict
                ) -> tuple[torch.Tensor, SolverStats]:
    """Run SAM for ``max_iter`` steps; stats report the fixed-point residual of ``T``."""
    cfg: SAMConfig = module.sam
    if z0.shape[0] == 0:  # an empty batch (e.g. every sample masked out)
        return z0.clone(), empty_stats("sam", z0, cfg.tol)
    gamma = cfg.step_size(env)
    names = [b.name for b in module.blocks]
    tr = Tracker("sam", z0, cfg.tol)
    z = z0
    for k in range(1, cfg.max_iter + 1):
        beta = cfg.beta(k)
        Z = dict(inputs)
        Z.update(module.derived.split(z))
        g = cfg.R.grad_tensor(Z, env)
        grad = torch.cat([g.get(n, torch.zeros_like(Z[n])) for n in names], dim=-1)
        s = (1 - gamma * beta) * z - gamma * grad
        tz = f(z)
        tr.record_residual(rel_residual(tz, z))
        z = beta * s + (1 - beta) * tz
    tr.record(z, f(z))  # the residual of the point SAM returns (its converged flag)
    return z, tr.stats()
