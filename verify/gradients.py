"""Gradient check (DCP-exportable objectives): ``dℓ/dx`` for ``ℓ(z) = Σ c·z`` (fixed random
``c``) from the emitted module in every backward mode, against the ``backend="cvxpylayers"``
module (an exact conic solve, differentiated by diffcp) and central finite differences of the
forward map ``x ↦ ℓ(z*(x))`` (tight float64 solves)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lowering import DerivedLayer

from .equilibrium import bound_values, equilibrium, fresh_module
from .report import GradientReport

T64 = torch.float64

#: mode name → module options (implicit IFT, phantom k = 1, unrolled K = 50)
MODES: dict[str, dict[str, Any]] = {
    "implicit": {"backward": "implicit", "backward_tol": 1e-12, "backward_max_iter": 2000},
    "phantom (k=1)": {"backward": "phantom", "phantom_steps": 1},
    "unroll (K=50)": {"backward": "unroll", "unroll_steps": 50},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _loss(out: Any, c: list[torch.Tensor]) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.reshape(o.shape[0], -1) * ci).sum() for o, ci in zip(outs, c))


def _call(module: torch.nn.Module, x: dict[str, torch.Tensor]) -> Any:
    return module(x if len(x) > 1 else next(iter(x.values())))


def gradient_check(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
                   env: Mapping[str, torch.Tensor], *, seed: int = 0, tol: float = 1e-4,
                   scs_eps: float = 1e-10, fd_step: float = 1e-5) -> GradientReport:
    """Relative errors of ``dℓ/dx`` between the backward modes, cvxpylayers and FD."""
    g = torch.Generator().manual_seed(seed)
    c = [torch.randn(b.size, generator=g, dtype=T64) for b in derived.blocks]
    names = list(inputs)
    notes: list[str] = []
    grads: dict[str, torch.Tensor] = {}

    def run(module: torch.nn.Module) -> torch.Tensor:
        x = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        loss = _loss(_call(module, x), c)
        gs = torch.autograd.grad(loss, [x[k] for k in names])
        return torch.cat([t.reshape(t.shape[0], -1) for t in gs], dim=1).detach()

    for mode, opts in MODES.items():
        m = fresh_module(derived, env, solver="anderson", tol=1e-12, max_iter=2000, **opts)
        grads[mode] = run(m)
    solver_args = {"eps": scs_eps, "max_iters": 100000}
    cl_text = f"cvxpylayers (diffcp + SCS, eps={scs_eps:g}, max_iters=100000)"
    try:
        with bound_values(derived.symbols, env):
            cl = derived.torch_module(backend="cvxpylayers", solver_args=solver_args)
        with warnings.catch_warnings():  # numpy-2 copy-keyword deprecations inside diffcp
            warnings.simplefilter("ignore", DeprecationWarning)
            grads["cvxpylayers"] = run(cl)
    except Exception as err:  # reported as a failed reference, never compared
        notes.append(f"cvxpylayers failed: {type(err).__name__}: {err}")
    grads["finite differences"] = finite_differences(derived, inputs, env, c, fd_step)
    ref = grads.get("cvxpylayers")
    errors: dict[str, float] = {}
    nan = float("nan")
    errors["implicit vs cvxpylayers"] = _rel(grads["implicit"], ref) if ref is not None else nan
    errors["implicit vs finite differences"] = _rel(grads["implicit"],
                                                    grads["finite differences"])
    errors["cvxpylayers vs finite differences"] = (
        _rel(ref, grads["finite differences"]) if ref is not None else nan)
    for mode in ("phantom (k=1)", "unroll (K=50)"):
        base = ref if ref is not None else grads["finite differences"]
        errors[f"{mode} vs {'cvxpylayers' if ref is not None else 'finite differences'}"] = \
            _rel(grads[mode], base)
    required = ["implicit vs cvxpylayers", "implicit vs finite differences",
                "cvxpylayers vs finite differences"]
    errors = {k: (v if np.isfinite(v) else float("inf")) for k, v in errors.items()}
    loss = "ℓ(z) = Σ_b <c_b, z_b> summed over the batch, c ~ N(0, I) (seed " + str(seed) + ")"
    notes.append("phantom (k=1) and unroll (K=50) gradients are approximations by design "
                 "(reported, not required)")
    return GradientReport(loss, errors, required, tol, cl_text, fd_step, notes)


def finite_differences(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
                       env: Mapping[str, torch.Tensor], c: list[torch.Tensor], h: float
                       ) -> torch.Tensor:
    """Central differences of ``x ↦ ℓ(z*(x))``, all perturbations in one batched tight solve."""
    names = list(inputs)
    bsz = next(iter(inputs.values())).shape[0]
    sizes = [inputs[k].shape[1] for k in names]
    total = sum(sizes)
    cols = []
    for j in range(total):
        for sign in (1.0, -1.0):
            pert = {}
            off = 0
            for k, sz in zip(names, sizes):
                t = inputs[k].clone()
                if off <= j < off + sz:
                    step = h * max(1.0, float(t[:, j - off].abs().max()))
                    t[:, j - off] += sign * step
                pert[k] = t
                off += sz
            cols.append(pert)
    big = {k: torch.cat([p[k] for p in cols], dim=0) for k in names}
    z, _ = equilibrium(derived, big, env, tol=1e-13, max_iter=1000, fallback=False)
    blocks = derived.split(z)
    loss = sum((blocks[b.name] * ci).sum(-1) for b, ci in zip(derived.blocks, c))
    loss = loss.reshape(total, 2, bsz)
    out = torch.zeros(bsz, total, dtype=T64)
    off = 0
    for k, sz in zip(names, sizes):
        for j in range(sz):
            step = h * max(1.0, float(inputs[k][:, j].abs().max()))
            jj = off + j
            out[:, jj] = (loss[jj, 0] - loss[jj, 1]) / (2 * step)
        off += sz
    return out
