"""Weight control keeping ``||W||₂ ≤ bound − margin`` for the weights named in the certificate.

* ``"spectral_norm"``: reparametrize ``W ↦ W · min(1, (bound − margin)/σ̂(W))`` with a persistent
  power-iteration estimate ``σ̂`` (differentiable, like ``torch.nn.utils.spectral_norm``);
* ``"project"``: rescale the stored parameter in place (no gradient) before each training
  forward (eval forwards rescale functionally and leave the parameter alone).
"""

from __future__ import annotations

from typing import Any

import torch

from convex_eq.errors import OptionError

from ._compile import compile_disabled

MODES = ("spectral_norm", "project")


def norm_conditions(derived: Any) -> list[tuple[Any, float]]:
    """``(operator, bound)`` pairs from ``||op||₂ ≤ bound`` conditions of the derivation."""
    conds = []
    cert = derived.certificate
    sources = list(cert.conditions) if cert is not None else []
    sources += [c for c in derived.info.get("conditions", []) if all(c is not o for o in sources)]
    for c in sources:
        op = getattr(c, "op", None)
        if op is not None and c.sense == "<=":
            conds.append((op, c.bound))
    return conds


class WeightControl:
    """Applies the chosen control to every weight with a spectral-norm condition."""

    def __init__(self, derived: Any, mode: str, margin: float,
                 bounds: dict[str, float] | None = None):
        if mode not in MODES:
            raise OptionError(f"unknown weight_control {mode!r}", term="torch_module",
                              hint=f"use one of {MODES}")
        if not 0 <= margin < 1:
            raise OptionError("margin must lie in [0, 1)", term="torch_module")
        self.mode, self.margin = mode, margin
        self.targets = []
        for op, bound in norm_conditions(derived):
            ws = [s for s in op.symbols() if s.kind == "weight"]
            if len(ws) == 1:
                self.targets.append((op, ws[0].name, bound - margin))
        for name, bound in (bounds or {}).items():
            op = _operator_for(derived, name)
            self.targets = [t for t in self.targets if t[1] != name]
            self.targets.append((op, name, bound - margin))
        if not self.targets:
            raise OptionError("weight control requested but the certificate has no "
                              "||W||₂ ≤ bound condition", term="torch_module",
                              hint="name the weights to control: weight_bounds={'W': 1.0}")

    def register(self, module: Any, dtype: torch.dtype) -> None:
        """Create the power-iteration vectors as buffers of ``module`` (saved in ``state_dict``
        so that a reloaded module reproduces the controlled weights bit for bit)."""
        for op, name, _ in self.targets:
            g = torch.Generator().manual_seed(0)
            v = torch.randn(1, op.in_size, generator=g, dtype=torch.float64).to(dtype)
            module.register_buffer(f"wc_v_{name}", v / v.norm())

    def _power(self, module: Any, op: Any, name: str, env: dict, iters: int) -> torch.Tensor:
        """Differentiable ``σ̂ = ||A v||`` (``||v|| = 1``) after warm-started power iteration."""
        v = self._power_vector(module, op, name, env, iters)
        return op.apply(v, env).norm()

    @compile_disabled
    def _power_vector(self, module: Any, op: Any, name: str, env: dict,
                      iters: int) -> torch.Tensor:
        """Power iteration on ``AᵀA`` from the stored vector; stops once ``σ̂²`` changes by
        < 1e-5.  Training mode writes the vector back (persistent warm start, as
        ``torch.nn.utils.spectral_norm``); eval mode does not, so that repeated eval forwards
        are bit-identical.  Returns a fresh tensor: later in-place buffer updates cannot
        invalidate a graph that used it (two forwards before one backward)."""
        w = env[name]
        buf = getattr(module, f"wc_v_{name}")
        if buf.shape != (1, op.in_size):
            from convex_eq.errors import ShapeError

            raise ShapeError(f"power-iteration buffer wc_v_{name} has shape "
                             f"{tuple(buf.shape)}, expected {(1, op.in_size)}",
                             term=f"wc_v_{name}",
                             hint="load a state_dict saved from a module of the same layer")
        v = buf.to(w)
        with torch.no_grad():
            detached = {**env, name: w.detach()}
            prev = 0.0
            for _ in range(iters):
                u = op.adjoint(op.apply(v, detached), detached)
                un = float(u.norm())
                v = u / max(un, 1e-30)
                if abs(un - prev) <= 1e-5 * un:
                    break
                prev = un
            if module.training:
                buf.copy_(v.to(buf))
        return v

    def __call__(self, module: Any, env: dict) -> dict:
        """The controlled weights (``project`` rescales the parameter in place in training
        mode only; in eval mode both modes rescale functionally, leaving parameters alone)."""
        env = dict(env)
        for op, name, target in self.targets:
            if self.mode == "project" and module.training:
                with torch.no_grad():
                    sig = self._power(module, op, name, env, 30)
                    if sig > target:
                        module.weights[name].mul_(target / sig)
                env[name] = module.weights[name]
            else:
                sig = self._power(module, op, name, env, 50)
                env[name] = env[name] * torch.clamp(target / sig, max=1.0)
        return env


def _operator_for(derived: Any, name: str) -> Any:
    """The linear operator applying weight ``name`` (a Dense wrapper for plain matrices)."""
    from convex_eq.operators import Compose, Dense

    def walk(op: Any) -> Any:
        if isinstance(op, Compose):
            return walk(op.A) or walk(op.B)
        syms = op.symbols() if hasattr(op, "symbols") else []
        if len(syms) == 1 and syms[0].name == name and type(op).__name__ in ("Dense", "Conv1d",
                                                                              "Conv2d"):
            return op
        return None

    src = derived.source
    layers = getattr(src, "layers", None) or [src]
    for obj in layers:
        for t in getattr(obj, "terms", []):
            for a in t.args:
                for e in a.entries:
                    if e.op is not None and (found := walk(e.op)) is not None:
                        return found
    for s in derived.parameters:
        if s.name == name and len(s.shape) == 2:
            return Dense(s)
    raise OptionError(f"no weight named '{name}' to control", term="torch_module")
