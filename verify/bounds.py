"""verify checks the certified bounds of a module (docs/theory.md §9.6) against references that
do not use them:

* :func:`check_error_bound`: the a posteriori error bound of the module's own forward against the
  distance of its output to the tight float64 equilibrium of the same weights
  (:func:`verify.equilibrium.equilibrium`);
* :func:`check_lipschitz`: the Lipschitz bound of ``x ↦ o*(x)`` against pairs of nearby inputs,
  each side a tight float64 solve — random directions and the direction of largest growth found by
  power iteration on the solution map's Jacobian (finite differences forward, the module's
  implicit backward for the transpose);
* :func:`attack_certified`: an ℓ2 projected-gradient attack (random restarts) on an
  :class:`~lowering.runtime.classifier.EquilibriumClassifier` inside each sample's certified radius:
  no prediction may change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lowering import EquilibriumModule
from lowering.runtime.bounds import error_factor, lipschitz_bound, with_rounding

from .equilibrium import environment, equilibrium, operator, prepare_inputs

T64 = torch.float64


@dataclass
class BoundReport:
    """Per sample: the certified ``bound`` and the ``observed`` quantity it must dominate (a
    distance, or a ratio for the Lipschitz check), the reference's own inaccuracy ``slack``;
    ``holds`` where ``observed ≤ bound + slack``."""

    #: what is bounded (printed)
    name: str
    #: the certified bound per sample
    bound: np.ndarray
    #: the quantity it must dominate per sample, from the reference
    observed: np.ndarray
    #: the reference's own inaccuracy per sample
    slack: np.ndarray
    #: the bound's formula, as the rule states it
    formula: str
    #: how the observations were made
    notes: list[str] = field(default_factory=list)

    @property
    def holds(self) -> np.ndarray:
        """Per sample: ``observed ≤ bound + slack``."""
        return self.observed <= self.bound + self.slack

    @property
    def passed(self) -> bool:
        """The bound held for every sample."""
        return bool(self.holds.all())

    @property
    def failures(self) -> list[int]:
        """The samples where it did not."""
        return [int(i) for i in np.flatnonzero(~self.holds)]

    def ratios(self) -> np.ndarray:
        """``bound/observed`` where the observed value is above the reference's slack."""
        keep = self.observed > self.slack
        return self.bound[keep] / self.observed[keep]

    def summary(self) -> str:
        """One line: the verdict and the distribution of bound/observed."""
        r = self.ratios()
        dist = (f"bound/observed min {r.min():.3g}, median {np.median(r):.3g}, max {r.max():.3g} "
                f"over {r.size}" if r.size else "no sample above the reference's accuracy")
        verdict = "holds" if self.passed else f"FAILS at samples {self.failures[:10]}"
        return f"{self.name}: {verdict} on {self.bound.size} samples; {dist} ({self.formula})"


def _flat(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1)


def tight_outputs(module: EquilibriumModule, x: Any, tol: float = 1e-13, max_iter: int = 5000
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o*(x), slack)``: the float64 tight solve's outputs ``(B, M)`` at the module's
    controlled weights, and its own distance to the exact equilibrium, bounded by the layer's
    error factor times its float64 residual (below 1e-11 for the seeds: orders of magnitude under
    what a module's solve leaves)."""
    derived = module.derived
    env = environment(derived, module)
    inputs = prepare_inputs(derived, x)
    z, _ = equilibrium(derived, inputs, env, tol=tol, max_iter=max_iter)
    with torch.no_grad():
        tz = operator(derived, inputs, env)(z)
        r = with_rounding(torch.linalg.vector_norm(tz - z, dim=1),
                          torch.linalg.vector_norm(tz, dim=1), z.shape[1], T64)
        out = derived.output(z, inputs, env)
    return out, error_factor(module).value * r


def check_error_bound(module: EquilibriumModule, x: Any, tol: float = 1e-13) -> BoundReport:
    """The module's forward at ``x`` (its own solver, tolerance and dtype), its error bound from
    that forward's statistics, and the distance of its output to the tight float64 equilibrium."""
    with torch.no_grad():
        out = module(x)
    bound = module.error_bound().double()
    ref, slack = tight_outputs(module, x, tol)
    dist = torch.linalg.vector_norm(_flat(out).double().cpu() - ref, dim=1)
    return BoundReport("error bound ||o − o*||", bound.numpy(), dist.numpy(), slack.numpy(),
                       error_factor(module).formula)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / torch.linalg.vector_norm(v, dim=1, keepdim=True).clamp_min(1e-300)


def _solution(module: EquilibriumModule, x: torch.Tensor) -> torch.Tensor:
    return tight_outputs(module, x)[0]


def top_direction(module: EquilibriumModule, x: torch.Tensor, iters: int = 8, h: float = 1e-5,
                  seed: int = 0) -> torch.Tensor:
    """Per sample, a unit input direction ``v`` of largest growth of ``x ↦ o*(x)``: power
    iteration ``v ← Jᵀ(Jv)`` with ``Jv`` by central differences of tight solves and ``Jᵀu`` by
    the module's own forward and implicit backward."""
    g = torch.Generator().manual_seed(seed)
    x = x.detach().to(T64).reshape(x.shape[0], -1)
    v = _unit(torch.randn(x.shape, generator=g, dtype=T64))
    for _ in range(iters):
        ju = (_solution(module, x + h * v) - _solution(module, x - h * v)) / (2 * h)
        xr = x.clone().requires_grad_(True)
        out = _flat(module(xr.to(module.dtype)))
        (jt,) = torch.autograd.grad(out, xr, ju.to(out.dtype))
        v = _unit(jt.detach().to(T64))
    return v


def check_lipschitz(module: EquilibriumModule, x: torch.Tensor, radius: float = 1e-2,
                    directions: int = 4, seed: int = 0, power_iters: int = 8) -> BoundReport:
    """``||o*(x) − o*(x + δ)|| ≤ Lip·||δ||`` for ``||δ|| = radius`` along ``directions`` random
    unit vectors and the power-iteration direction (:func:`top_direction`), per sample the
    largest observed ratio against the certified ``Lip``."""
    x = x.detach().to(T64).reshape(x.shape[0], -1)
    lip = lipschitz_bound(module)
    base, s0 = tight_outputs(module, x)
    g = torch.Generator().manual_seed(seed)
    dirs = [_unit(torch.randn(x.shape, generator=g, dtype=T64)) for _ in range(directions)]
    if power_iters:
        dirs.append(top_direction(module, x, power_iters, seed=seed))
    worst = torch.zeros(x.shape[0], dtype=T64)
    slack = torch.zeros(x.shape[0], dtype=T64)
    for v in dirs:
        other, s1 = tight_outputs(module, x + radius * v)
        ratio = torch.linalg.vector_norm(other - base, dim=1) / radius
        worst = torch.maximum(worst, ratio)
        slack = torch.maximum(slack, (s0 + s1) / radius)
    return BoundReport("Lipschitz ||o*(x) − o*(x')||/||x − x'||",
                       np.full(x.shape[0], lip.value), worst.numpy(), slack.numpy(), lip.formula,
                       [f"{directions} random directions + power iteration, ||δ|| = {radius:g}"])


# ----------------------------------------------------------------------------- the attack
@dataclass
class AttackReport:
    """An ℓ2 PGD attack inside each sample's certified radius: ``changed`` where the computed
    prediction changed, ``margin`` the smallest computed margin of the clean prediction found."""

    #: the certified radius per sample (the attack's ball)
    radius: np.ndarray
    #: per sample: the computed prediction changed inside the ball
    changed: np.ndarray
    #: per sample: the smallest margin of the clean prediction the attack found
    margin: np.ndarray
    #: samples attacked (radius > 0)
    attacked: int
    #: PGD steps per restart
    steps: int
    #: starts per sample (the first from the input itself)
    restarts: int

    @property
    def success_rate(self) -> float:
        """Changed predictions over attacked samples (0 where the certificate holds)."""
        return float(self.changed.sum()) / max(1, self.attacked)

    def summary(self) -> str:
        """One line: steps, restarts, attacked samples and changed predictions."""
        return (f"PGD ({self.steps} steps × {self.restarts} restarts) inside the certified radius "
                f"of {self.attacked} samples: {int(self.changed.sum())} predictions changed")


def _margin(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``f_k − max_{j≠k} f_j`` per sample."""
    other = logits.scatter(1, k[:, None], -math.inf)
    return logits.gather(1, k[:, None])[:, 0] - other.max(dim=1).values


def _project(d: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(d.flatten(1), dim=1).clamp_min(1e-30)
    return d * torch.clamp(r / n, max=1.0).reshape(-1, *[1] * (d.ndim - 1))


def attack_certified(model: Any, x: torch.Tensor, steps: int = 50, restarts: int = 4,
                     seed: int = 0, batch: int = 500, scale: float = 1.0) -> AttackReport:
    """Minimise the margin of the clean prediction by ℓ2 PGD within each sample's certified
    radius ``r`` (``model.certified_radius``; samples with ``r = 0`` are not attacked): step
    ``2.5·r/steps`` along the normalised gradient, projection onto the ball, restarts from
    random points of the ball (the first from ``x``).  ``scale``: attack within ``scale·r``
    instead (``scale > 1`` leaves the certificate: a check that the attack has teeth)."""
    model.eval()
    radii, changed, margins = [], [], []
    g = torch.Generator().manual_seed(seed)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:  # (gradients in the input only: the adjoint solve skips the weights')
        p.requires_grad_(False)
    try:
        for i in range(0, len(x), batch):
            xb = x[i:i + batch]
            cert = model.certified_radius(xb)
            best = _attack_batch(model, xb, cert.radius * scale, cert.prediction, steps,
                                 restarts, g)
            radii.append(cert.radius)
            margins.append(best)
            changed.append((best < 0) & (cert.radius > 0))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    rad = torch.cat(radii)
    return AttackReport(rad.numpy(), torch.cat(changed).numpy(), torch.cat(margins).numpy(),
                        int((rad > 0).sum()), steps, restarts)


def _attack_batch(model: Any, xb: torch.Tensor, radius: torch.Tensor, k: torch.Tensor,
                  steps: int, restarts: int, g: torch.Generator) -> torch.Tensor:
    """The smallest margin of the prediction ``k`` PGD finds per sample of ``xb`` within
    ``radius``."""
    r = radius.to(xb.dtype)
    best = torch.full((len(xb),), math.inf, dtype=torch.float64)
    shape = (-1, *[1] * (xb.ndim - 1))
    for rs in range(restarts):
        d = torch.zeros_like(xb) if rs == 0 else _project(
            torch.randn(xb.shape, generator=g, dtype=xb.dtype) * 1e3,
            r * torch.rand(len(xb), generator=g, dtype=xb.dtype))
        for _ in range(steps):
            d = d.detach().requires_grad_(True)
            m = _margin(model(xb + d).double(), k)
            (grad,) = torch.autograd.grad(m.sum(), d)
            best = torch.minimum(best, m.detach())
            n = torch.linalg.vector_norm(grad.flatten(1), dim=1).clamp_min(1e-30)
            d = _project(d.detach() - (2.5 * r / steps / n).reshape(shape) * grad, r)
        with torch.no_grad():
            best = torch.minimum(best, _margin(model(xb + d).double(), k))
    return best


__all__ = ["AttackReport", "BoundReport", "attack_certified", "check_error_bound",
           "check_lipschitz", "tight_outputs", "top_direction"]
