"""Jacobian regularisation of an equilibrium layer: a Hutchinson estimate of
``||∂T/∂z||_F² / (B·N)`` at the returned equilibrium, differentiable in the weights and inputs.

Bai, Koltun & Kolter, "Stabilizing Equilibrium Models by Jacobian Regularization" (ICML 2021):
adding ``γ·||J_T(z*)||_F²`` to the loss keeps ``T`` well conditioned, so the forward and adjoint
solves need fewer iterations for the same tolerance.  ``E_ε ||εᵀJ||² = ||J||_F²`` for
``ε ~ N(0, I)``; one vector-Jacobian product per sample vector estimates it (docs/guide.md,
training speed).
"""

from __future__ import annotations

from typing import Any

import torch

from convex_eq.errors import OptionError, ShapeError

from .guards import inputs_of


def jacobian_penalty(module: Any, x: Any, z: Any, *, samples: int = 1,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``(1/(s·B·N)) Σ_k ||ε_kᵀ ∂T/∂z (z, x)||²`` with ``ε_k ~ N(0, I)``, ``k = 1..s``: an
    unbiased estimate of ``||∂T/∂z||_F² / (B·N)`` at the state ``z`` (the module's output at
    ``x``, detached: the penalty shapes ``T``, not the solve), with the graph to the module's
    (controlled) weights and to ``x``.  Refused where the output is not the state."""
    if not (isinstance(samples, int) and samples >= 1):
        raise OptionError(f"samples = {samples!r} must be an integer ≥ 1",
                          term="jacobian_penalty", hint="1 vector per step is the usual choice")
    if module.derived.outputs is not None:
        raise OptionError(f"the module returns {[b.name for b in module.derived.output_blocks]}"
                          f", a map of its state {[b.name for b in module.blocks]}: the "
                          "Jacobian of T is taken at the state", term="jacobian_penalty",
                          hint="regularise a layer whose output is its state")
    blocks = z if isinstance(z, tuple) else (z,)
    if not blocks or not all(isinstance(b, torch.Tensor) for b in blocks):
        raise ShapeError("z must be the module's output (a tensor or a tuple of blocks)",
                         term="jacobian_penalty")
    flat = torch.cat([b.detach().reshape(b.shape[0], -1) for b in blocks], dim=1)
    if flat.shape[1] != module.state_size:
        raise ShapeError(f"z has {flat.shape[1]} entries per sample, the state "
                         f"{module.state_size}", term="jacobian_penalty",
                         hint="pass what the module returned for x")
    half = module.dtype in (torch.float16, torch.bfloat16)  # (solved in float32, as forward)
    dtype = torch.float32 if half else module.dtype
    inputs = inputs_of(module, x, dtype)
    env = {k: (v.float() if half and v.is_floating_point() else v)
           for k, v in module.env().items()}
    zf = flat.to(dtype).requires_grad_(True)
    with torch.enable_grad():
        tz = module.T(zf, inputs, env)
        total = tz.new_zeros(())
        for _ in range(samples):
            eps = torch.randn(tz.shape, generator=generator, dtype=tz.dtype,
                              device="cpu" if generator is not None else tz.device)
            # create_graph: the penalty's own gradient reaches the weights and x
            (vjp,) = torch.autograd.grad(tz, zf, eps.to(tz.device), create_graph=True)
            total = total + vjp.pow(2).sum()
    return total / (samples * tz.numel())


__all__ = ["jacobian_penalty"]
