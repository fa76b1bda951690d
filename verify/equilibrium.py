"""Targets, weights, inputs and the tight equilibrium solve (shared by check and gradients)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from convex_eq.errors import NonFiniteError, ShapeError
from convex_eq.symbols import Symbol
from lowering import DerivedLayer, EquilibriumModule, SolverStats, solve

from .report import EquilibriumInfo

T64 = torch.float64


def resolve_target(target: Any) -> tuple[DerivedLayer, EquilibriumModule | None]:
    """``(derived layer, module or None)`` from a DerivedLayer or an emitted module."""
    if isinstance(target, EquilibriumModule):
        return target.derived, target
    if isinstance(target, DerivedLayer):
        return target, None
    derived = getattr(target, "derived", None)
    if isinstance(derived, DerivedLayer):
        raise ShapeError(f"cannot verify a {type(target).__name__} directly", term="verify.check",
                         hint="pass the fixed-point EquilibriumModule or its DerivedLayer")
    raise ShapeError(f"cannot verify a {type(target).__name__}", term="verify.check",
                     hint="pass lowering.lower(objective) or derived.torch_module(...)")


def environment(derived: DerivedLayer, module: EquilibriumModule | None) -> dict[str, torch.Tensor]:
    """Weights/constants/scalars as detached float64 tensors: the module's current (effective,
    after weight control) weights, else the symbols' stored values."""
    if module is not None:
        env = {k: v.detach().to(T64).clone() for k, v in module.env().items()}
    else:
        env = {}
    for s in derived.parameters:
        if s.name not in env:
            env[s.name] = torch.as_tensor(s.resolve(None)).detach().to(T64).clone()
    for k, v in env.items():
        if not torch.isfinite(v).all():
            raise NonFiniteError(f"weight '{k}' contains NaN or Inf", term="verify.check")
    return env


def prepare_inputs(derived: DerivedLayer, x: Any) -> dict[str, torch.Tensor]:
    """Inputs as float64 ``(B, size)`` tensors; raises ``ShapeError`` on any mismatch with the
    layer's declared inputs (``x`` may be unbatched, batched, or a dict name → array)."""
    syms: list[Symbol] = list(derived.inputs)
    if isinstance(x, Mapping):
        unknown = sorted(set(x) - {s.name for s in syms})
        if unknown:
            raise ShapeError(f"unknown input(s) {unknown}", term="verify.check",
                             hint=f"the layer's inputs are {[s.name for s in syms]}")
        given = dict(x)
    else:
        if len(syms) != 1:
            raise ShapeError(f"the layer has inputs {[s.name for s in syms]}",
                             term="verify.check", hint="pass a dict name → array")
        given = {syms[0].name: x}
    out: dict[str, torch.Tensor] = {}
    for s in syms:
        if s.name not in given:
            raise ShapeError(f"missing input '{s.name}'", term="verify.check",
                             hint=f"pass {s.name} of shape (B, *{s.shape})")
        v = given[s.name]
        t = v.detach() if isinstance(v, torch.Tensor) else torch.as_tensor(
            np.asarray(v, dtype=np.float64))
        t = t.to(T64)
        shape = tuple(t.shape)
        if shape == s.shape or (t.ndim == 1 and t.numel() == s.size and len(s.shape) == 1):
            t = t.reshape(1, s.size)
        elif t.ndim >= 2 and (shape[1:] == s.shape or (t.ndim == 2 and shape[1] == s.size)):
            t = t.reshape(shape[0], s.size)
        else:
            raise ShapeError(f"input '{s.name}' has shape {shape}, expected {s.shape} or "
                             f"(B, *{s.shape})", term="verify.check",
                             hint="the layer and its inputs disagree on the input size")
        if not torch.isfinite(t).all():
            raise NonFiniteError(f"input '{s.name}' contains NaN or Inf", term="verify.check")
        out[s.name] = t
    sizes = {t.shape[0] for t in out.values()}
    if len(sizes) > 1:
        raise ShapeError(f"inputs have different batch sizes {sorted(sizes)}",
                         term="verify.check")
    return out


def scaled_norm(v: torch.Tensor) -> torch.Tensor:
    """``||v||₂`` per row as ``m·||v/m||₂``, ``m = max|v_i|``: finite for every finite ``v``
    (``Σv²`` overflows float64 once ``|v| ≳ 1e154``, and ``d/inf = 0`` would read as a zero
    residual); NaN and ±inf entries propagate."""
    v = v.reshape(v.shape[0], -1)
    m = v.abs().amax(dim=-1, keepdim=True)
    safe = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m))
    out = safe.squeeze(-1) * torch.linalg.vector_norm(v / safe, dim=-1)
    return torch.where(torch.isfinite(m.squeeze(-1)) | torch.isnan(m.squeeze(-1)), out,
                       m.squeeze(-1))


def relative_residual(z: torch.Tensor, tz: torch.Tensor) -> torch.Tensor:
    """``||z − T(z)|| / max(1, ||z||)`` per sample with overflow-safe norms (``scaled_norm``):
    NaN (never "converged") if either side is not finite."""
    bad = ~(torch.isfinite(z).all(dim=-1) & torch.isfinite(tz).all(dim=-1))
    r = scaled_norm(z - tz) / scaled_norm(z).clamp_min(1.0)
    return torch.where(bad, torch.full_like(r, math.nan), r)


def operator(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
             env: Mapping[str, torch.Tensor]) -> Any:
    """``z ↦ T(z, x)`` on the flat stacked state ``(B, N)``."""

    def f(z: torch.Tensor) -> torch.Tensor:
        Z = dict(inputs)
        Z.update(derived.split(z))
        return derived.stack(derived.apply(Z, env))

    return f


def equilibrium(derived: DerivedLayer, inputs: Mapping[str, torch.Tensor],
                env: Mapping[str, torch.Tensor], tol: float = 1e-12, max_iter: int = 500,
                fallback: bool = True, z0: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, EquilibriumInfo]:
    """Tight float64 solve of ``z = T(z, x)`` from ``z0`` (default 0): Anderson (m = 5), then
    (``fallback``) plain iteration from its best iterate; returns the stacked state ``T(z)`` at
    the solver's iterate ``z`` (in ``T``'s range, e.g. a prox's domain, which an Anderson
    mixture of iterates need not be; no farther from the fixed point than ``z`` for a
    nonexpansive ``T``) and the solve's record."""
    f = operator(derived, inputs, env)
    bsz = next(iter(inputs.values())).shape[0] if inputs else 1
    if z0 is None:
        z0 = torch.zeros(bsz, derived.state_size, dtype=T64)
    with torch.no_grad():
        try:
            z, st = solve(f, z0, "anderson", tol=tol, max_iter=max_iter, m=5)
        except NonFiniteError as err:  # diverged: reported as "equilibrium not found"
            return z0, _diverged("anderson (m=5)", err, bsz, tol)
        if bool(st.nonfinite.any()):  # solvers flag NaN/Inf samples instead of raising
            return z0, _diverged("anderson (m=5)", _nonfinite(st), bsz, tol)
        name = "anderson (m=5)"
        hist = [st.residuals]
        if fallback and not bool(st.converged.all()):
            try:
                z, st = solve(f, z, "plain", tol=tol, max_iter=2 * max_iter)
            except NonFiniteError as err:
                return z0, _diverged(name + " → plain", err, bsz, tol)
            if bool(st.nonfinite.any()):
                return z0, _diverged(name + " → plain", _nonfinite(st), bsz, tol)
            name += " → plain"
            hist.append(st.residuals)
        image = f(z)
        if bool(torch.isfinite(image).all()):
            z = image
    return z, info_from_stats(name, st, torch.cat(hist, dim=1), tol)


def _nonfinite(st: SolverStats) -> NonFiniteError:
    return NonFiniteError(f"NaN/Inf in the fixed-point iterates of samples {st.nonfinite_indices} "
                          f"within {st.residuals.shape[1]} iterations", term="verify.check")


def _diverged(name: str, err: NonFiniteError, bsz: int, tol: float) -> EquilibriumInfo:
    """Record of a solve whose iterates became NaN/Inf (no equilibrium to compare)."""
    return EquilibriumInfo(name, tol, [0] * bsz, math.inf, False, np.zeros((bsz, 0)),
                           note=f"diverged: {err.reason}")


def info_from_stats(name: str, st: SolverStats, hist: torch.Tensor, tol: float
                    ) -> EquilibriumInfo:
    """Summarize a solve (iterations per sample, worst ``||z − T(z)||/||z||``, converged)."""
    return EquilibriumInfo(name, tol, [int(i) for i in st.iterations.tolist()],
                           float(st.max_residual), bool(st.converged.all()),
                           hist.detach().cpu().numpy())


def fresh_module(derived: DerivedLayer, env: Mapping[str, torch.Tensor], **options: Any
                 ) -> EquilibriumModule:
    """A float64 module of ``derived`` carrying the weights ``env`` (no weight control)."""
    # the layer as declared: no default weight control rescaling weights that break the claim
    m = derived.torch_module(dtype=T64, **{"weight_control": None, **options})
    sd = m.state_dict()
    new = {}
    for key, val in sd.items():
        name = key
        for pre in ("weights.", "const_", "scalar_"):
            if key.startswith(pre):
                name = key[len(pre):]
        new[key] = env[name].to(val.dtype).reshape(val.shape) if name in env else val
    m.load_state_dict(new)
    return m



def sam_equilibrium(derived: DerivedLayer, module: EquilibriumModule,
                    inputs: dict[str, torch.Tensor], env: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, EquilibriumInfo]:
    """SAM's own iteration (Theorem 5, docs/theory.md §6), float64, with the module's weights."""
    sam = module.sam
    m = fresh_module(derived, env, sam=sam)
    x = inputs if len(inputs) > 1 else next(iter(inputs.values()))
    with torch.no_grad():
        out, st = m(x, return_stats=True)
    outs = out if isinstance(out, tuple) else (out,)
    z = torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1)
    return z, info_from_stats(f"SAM (ρ={sam.rho:g}, c={sam.c:g}, {sam.max_iter} steps)", st,
                              st.residuals, sam.tol)


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch and the BLAS/OpenMP pools (through ``threadpoolctl`` when installed) on one
    thread: the references evaluate tiny problems thousands of times, and thread hand-offs
    (spinning OpenBLAS workers under load) dominate otherwise; settings are restored."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - optional
        limiter = None
    else:
        limiter = threadpool_limits(1)
    try:
        yield
    finally:
        if limiter is not None:
            limiter.restore_original_limits()
        torch.set_num_threads(n)


@contextmanager
def bound_values(symbols: list[Symbol], env: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily store ``env``'s values in the symbols (for code that reads symbol values,
    such as the cvxpylayers backend, which bakes the weights in when it is built)."""
    old: dict[int, tuple[Symbol, Any]] = {}
    for s in symbols:
        if s.kind in ("weight", "constant", "scalar") and s.name in env:
            old[id(s)] = (s, s.value)
            s.value = env[s.name].detach().to(T64).clone().reshape(s.shape)
    try:
        yield
    finally:
        for s, v in old.values():
            s.value = v
