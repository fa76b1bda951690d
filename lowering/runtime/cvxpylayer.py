"""``backend="cvxpylayers"``: the same layer as an exact conic solve (``CvxpyLayer``).

The objective is exported once in DPP form with the inputs as ``cp.Parameter``s; weights are
constants of the conic program (so gradients flow to the inputs only).  Slow, exact: the reference
module for gradient checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from convex_eq.errors import ExportError, OptionError, ShapeError
from lowering.derived import DerivedLayer


class CvxpyLayerModule(nn.Module):
    """``x ↦ argmin_z φ(z; x)`` via ``cvxpylayers.torch.CvxpyLayer`` (same call as the fixed-point
    module; ``return_stats`` is not available)."""

    def __init__(self, derived: DerivedLayer, *, solver_args: dict | None = None,
                 dtype: torch.dtype = torch.float64, weights: dict | None = None,
                 **unknown: Any):
        super().__init__()
        if unknown:
            raise OptionError(f"unknown option(s) for backend='cvxpylayers': {sorted(unknown)}",
                              term="torch_module", hint="valid: solver_args, dtype")
        try:
            from cvxpylayers.torch import CvxpyLayer
        except ImportError as err:  # pragma: no cover - dependency is in the extras
            raise ExportError("cvxpylayers is not installed", term="torch_module",
                              hint="pip install cvxpylayers (extra 'layers')") from err
        obj = derived.claim_objective() if hasattr(derived, "claim_objective") else derived.source
        self.inputs = [s for s in obj.inputs]
        zeros = {s.name: np.zeros(s.size) for s in self.inputs}
        names = tuple(s.name for s in self.inputs)
        # weights (e.g. a trained module's ``env()``) become constants of the conic program
        w = {k: torch.as_tensor(v).detach().double() for k, v in (weights or {}).items()}
        self.exported = obj.to_cvxpy(parameters=names, **zeros, **w)
        if not self.exported.problem.is_dpp():
            raise ExportError("exported problem is not DPP", term="cvxpylayers")
        params = [self.exported.parameters[n] for n in names]
        self.layer = CvxpyLayer(self.exported.problem, parameters=params,
                                variables=[self.exported.variable])
        self.blocks = list(derived.blocks)
        maps = np.vstack([self.exported.state_maps[b.name] for b in self.blocks])
        self.register_buffer("state_map", torch.as_tensor(maps, dtype=dtype))
        self.solver_args = dict(solver_args or {"eps": 1e-10, "max_iters": 100000})
        self.dtype = dtype

    def forward(self, x: Any) -> Any:
        given = x if isinstance(x, dict) else {self.inputs[0].name: x}
        args = []
        for s in self.inputs:
            t = given[s.name]
            if tuple(t.shape[1:]) != s.shape and not (t.ndim == 2 and t.shape[1] == s.size):
                raise ShapeError(f"input '{s.name}' has shape {tuple(t.shape)}, "
                                 f"expected (B, *{s.shape})", term="forward")
            args.append(t.reshape(t.shape[0], s.size).to(self.dtype))
        (f,) = self.layer(*args, solver_args=self.solver_args)
        z = f.to(self.state_map.dtype) @ self.state_map.T
        out, o = [], 0
        for b in self.blocks:
            out.append(z[:, o:o + b.size].reshape(z.shape[0], *b.shape))
            o += b.size
        return out[0] if len(out) == 1 else tuple(out)


def emit(derived: DerivedLayer, **options: Any) -> CvxpyLayerModule:
    """``derived.torch_module(backend="cvxpylayers", **options)``."""
    return CvxpyLayerModule(derived, **options)
