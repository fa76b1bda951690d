"""The emitted ``nn.Module``: a derived layer with real solvers and backward modes.

Forward: solve ``z = T(z, x)`` (plain / Anderson / Broyden, or SAM); backward: implicit
differentiation (adjoint fixed point ``g = Jᵀg + ∂ℓ/∂z``), phantom gradient (last ``k``
applications of ``T``), or unrolled ``K`` steps from the initial point.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from convex_eq.errors import (
    ConvergenceError,
    ConvergenceWarning,
    NonFiniteError,
    OptionError,
    ShapeError,
)
from convex_eq.symbols import Symbol

from ._compile import compile_disabled
from .nodes import broadcast_batch
from .sam import SAMConfig, sam_iterate
from .solvers import SolverStats, get_solver, rel_residual
from .weight_control import WeightControl

if TYPE_CHECKING:  # annotations only: derived.py builds this module (torch_module())
    from .derived import DerivedLayer

BACKWARDS = ("implicit", "phantom", "unroll")
ON_FAIL = ("raise", "warn")


class EquilibriumModule(nn.Module):
    """``z* = T(z*, x)`` as a trainable layer (weights are ``nn.Parameter``s)."""

    def __init__(self, derived: DerivedLayer, *, solver: str = "anderson",
                 backward: str = "implicit", tol: float = 1e-6, max_iter: int = 100,
                 solver_options: dict | None = None, backward_solver: str | None = None,
                 backward_tol: float | None = None, backward_max_iter: int | None = None,
                 phantom_steps: int = 1, phantom_damping: float = 1.0, unroll_steps: int = 20,
                 on_nonconvergence: str = "raise", weight_control: str | None = None,
                 margin: float = 0.01, weight_bounds: dict[str, float] | None = None,
                 sam: SAMConfig | None = None,
                 dtype: torch.dtype = torch.float32, learnable_constants: bool = False):
        super().__init__()
        get_solver(solver)
        get_solver(backward_solver or solver)
        if backward not in BACKWARDS:
            raise OptionError(f"unknown backward mode {backward!r}", term="torch_module",
                              hint=f"use one of {BACKWARDS}")
        if on_nonconvergence not in ON_FAIL:
            raise OptionError(f"on_nonconvergence={on_nonconvergence!r}", term="torch_module",
                              hint=f"use one of {ON_FAIL}: non-convergence is never silent")
        if tol <= 0 or max_iter < 1 or phantom_steps < 1 or unroll_steps < 1:
            raise OptionError("tol > 0, max_iter ≥ 1, phantom_steps ≥ 1, unroll_steps ≥ 1 required",
                              term="torch_module")
        self.derived = derived
        self.solver, self.backward = solver, backward
        self.tol, self.max_iter = float(tol), int(max_iter)
        self.solver_options = dict(solver_options or {})
        self.backward_solver = backward_solver or solver
        self.backward_tol = float(backward_tol if backward_tol is not None else tol)
        self.backward_max_iter = int(backward_max_iter or max_iter)
        self.phantom_steps, self.phantom_damping = int(phantom_steps), float(phantom_damping)
        self.unroll_steps = int(unroll_steps)
        self.on_nonconvergence = on_nonconvergence
        self.sam = sam
        self.blocks: list[Symbol] = list(derived.blocks)
        self.input_syms: list[Symbol] = list(derived.inputs)
        self.weights = nn.ParameterDict()
        #: declared shapes, checked in env() (a wrongly shaped tensor put into ``weights`` or a
        #: buffer would otherwise surface as a torch broadcasting error deep inside T)
        self._shapes = {s.name: tuple(s.shape) for s in derived.parameters}
        self._const_names: list[str] = []
        self._scalar_names: list[str] = []
        for s in derived.parameters:
            if s.kind == "weight" or (s.kind == "constant" and learnable_constants):
                self.weights[s.name] = nn.Parameter(s.value.detach().clone().to(dtype))
            elif s.kind == "constant":
                self.register_buffer(f"const_{s.name}", s.value.detach().clone().to(dtype))
                self._const_names.append(s.name)
            else:
                self.register_buffer(f"scalar_{s.name}",
                                     torch.tensor(float(s.value), dtype=torch.float64))
                self._scalar_names.append(s.name)
        if weight_bounds and weight_control is None:
            raise OptionError("weight_bounds needs weight_control='spectral_norm' or 'project'",
                              term="torch_module")
        self.weight_control = WeightControl(derived, weight_control, margin, weight_bounds) \
            if weight_control is not None else None
        if self.weight_control is not None:
            self.weight_control.register(self, dtype)
        self.last_stats: SolverStats | None = None

    # ------------------------------------------------------------------ env & shapes
    def env(self) -> dict[str, torch.Tensor]:
        """Name → tensor for weights (after weight control), constants and scalars."""
        env: dict[str, torch.Tensor] = dict(self.weights.items())
        for n in self._const_names:
            env[n] = getattr(self, f"const_{n}")
        for n in self._scalar_names:
            env[n] = getattr(self, f"scalar_{n}")
        for n, t in env.items():
            want = self._shapes.get(n)
            if want is not None and tuple(t.shape) != want:
                raise ShapeError(f"parameter '{n}' has shape {tuple(t.shape)}, the layer "
                                 f"declares {want}", term=n,
                                 hint="load weights of the declared shape")
            if not bool(torch.isfinite(t).all()):
                # an Inf weight can give a finite output (relu(-inf) = 0) with NaN gradients
                raise NonFiniteError(f"parameter '{n}' contains NaN or Inf", term=n,
                                     hint="check the optimizer step / the loaded state_dict")
        if self.weight_control is not None:
            env = self.weight_control(self, env)
        return env

    @property
    def state_size(self) -> int:
        return sum(b.size for b in self.blocks)

    def _inputs(self, x: Any) -> dict[str, torch.Tensor]:
        if isinstance(x, dict):
            given = x
        elif x is None and not self.input_syms:  # an input-free objective: mod(None)
            given = {}
        else:
            if len(self.input_syms) != 1:
                raise ShapeError(f"layer has inputs {[s.name for s in self.input_syms]}",
                                 term="forward", hint="pass a dict name → tensor")
            given = {self.input_syms[0].name: x}
        out = {}
        ref = next(iter(self.weights.values()), None)
        for s in self.input_syms:
            if s.name not in given:
                raise ShapeError(f"missing input '{s.name}'", term="forward")
            t = given[s.name]
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"input '{s.name}' must be a torch.Tensor", term="forward")
            if tuple(t.shape[1:]) != s.shape and not (t.ndim == 2 and t.shape[1] == s.size):
                raise ShapeError(
                    f"input '{s.name}' has shape {tuple(t.shape)}, expected (B, *{s.shape})",
                    term="forward", hint="batch the input along dim 0",
                )
            if not torch.isfinite(t).all():
                raise NonFiniteError(f"input '{s.name}' contains NaN or Inf", term="forward")
            if ref is not None and t.dtype != ref.dtype:
                t = t.to(ref.dtype)
            out[s.name] = t.reshape(t.shape[0], s.size)
        sizes = {k: v.shape[0] for k, v in out.items()}
        if len(set(sizes.values())) > 1:
            raise ShapeError(f"inputs have different batch sizes {sizes}", term="forward",
                             hint="batch every input along dim 0 with the same size")
        return out

    def T(self, z: torch.Tensor, inputs: dict[str, torch.Tensor],
          env: dict[str, torch.Tensor]) -> torch.Tensor:
        """One application of the derived operator on the flat stacked state ``(B, N)``."""
        Z = dict(inputs)
        if len(self.blocks) == 1:  # one block: no split / cat copies
            b = self.blocks[0]
            Z[b.name] = z
            return broadcast_batch(self.derived.nodes[b.name].eval(Z, env), z.shape[0])
        Z.update(self.derived.split(z))
        out = self.derived.apply(Z, env)
        return torch.cat([out[b.name] for b in self.blocks], dim=-1)

    def _shape_out(self, z: torch.Tensor) -> Any:
        parts = self.derived.split(z)
        shaped = [parts[b.name].reshape(z.shape[0], *b.shape) for b in self.blocks]
        return shaped[0] if len(shaped) == 1 else tuple(shaped)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Any, z0: torch.Tensor | None = None, return_stats: bool = False
                ) -> Any:
        inputs = self._inputs(x)
        env = self.env()
        # an input-free layer (mod(None) / mod({})) solves one sample, or z0's batch
        like = next(iter(inputs.values()), None)
        if like is None:
            ref = next(iter(self.weights.values()), torch.zeros(()))
            like = torch.zeros(z0.shape[0] if isinstance(z0, torch.Tensor) and z0.ndim else 1,
                               dtype=ref.dtype, device=ref.device)
        b, dt, dev = like.shape[0], like.dtype, like.device
        if z0 is None:
            z0 = torch.zeros(b, self.state_size, dtype=dt, device=dev)
        else:
            if not isinstance(z0, torch.Tensor) or z0.ndim == 0 or z0.shape[0] != b \
                    or z0.numel() != b * self.state_size:
                raise ShapeError(
                    f"z0 has shape {tuple(getattr(z0, 'shape', ()))}, expected (B, "
                    f"{self.state_size}) with B = {b} (or (B, *block shape))", term="forward",
                    hint="pass z0 as a tensor with one flat state per sample",
                )
            z0 = z0.reshape(b, self.state_size).to(dt)

        def f(z: torch.Tensor) -> torch.Tensor:
            return self.T(z, inputs, env)

        if self.backward == "unroll":
            z, stats = self._unroll(f, z0)
        else:
            z_star, stats = self._solve(f, z0, inputs, env)
            self._check(stats)
            z = self._attach(f, z_star.detach())
        self.last_stats = stats
        out = self._shape_out(z)
        return (out, stats) if return_stats else out

    @compile_disabled
    def _solve(self, f: Any, z0: torch.Tensor, inputs: dict, env: dict
               ) -> tuple[torch.Tensor, SolverStats]:
        """The forward solve (eager: data-dependent loops are not traced by torch.compile)."""
        with torch.no_grad():
            if self.sam is not None:
                return sam_iterate(self, f, z0, inputs, env)
            return get_solver(self.solver)(f, z0, tol=self.tol, max_iter=self.max_iter,
                                           **self.solver_options)

    @compile_disabled
    def _check(self, stats: SolverStats) -> None:
        self._check_stats(stats)

    def _unroll(self, f: Any, z0: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
        z = z0
        hist = []
        for _ in range(self.unroll_steps):
            fz = f(z)
            hist.append(rel_residual(fz, z).detach())
            z = fz
        if not torch.isfinite(z).all():
            raise NonFiniteError("NaN/Inf after unrolled iterations", term="forward")
        res = torch.stack(hist, dim=1)
        conv = res[:, -1] <= self.tol
        return z, SolverStats("unroll", res, torch.full((z.shape[0],), self.unroll_steps), conv,
                              self.tol)

    def _contraction_text(self) -> str:
        """The contraction estimate at the current weights (re-evaluated at most every 30 s in
        warn mode: the estimate runs power iterations, too costly for every training step)."""
        c = self.derived.contraction
        now = time.monotonic()
        cached = getattr(self, "_lip_cache", None)
        if self.on_nonconvergence == "warn" and cached is not None and now - cached[0] < 30:
            return f"{cached[1]} (estimated {now - cached[0]:.0f} s ago)"
        try:
            with torch.no_grad():
                env = {k: v.detach() for k, v in self.env().items()}
                text = c.describe(env)
        except Exception as err:
            text = f"{c.formula} (could not evaluate: {err})"
        self._lip_cache = (now, text)
        return text

    def _check_stats(self, stats: SolverStats) -> None:
        if bool(stats.converged.all()):
            return
        bad = int((~stats.converged).sum())
        lip = self._contraction_text()
        msg = (f"{bad}/{stats.converged.numel()} samples did not reach relative residual "
               f"{stats.tol:g} in {stats.residuals.shape[1]} iterations of {stats.solver} (worst "
               f"{stats.max_residual:.3e}); {lip}")
        hint = ("raise max_iter, use solver='anderson', or keep ||W||₂ < 1 with "
                "weight_control='spectral_norm'")
        if self.on_nonconvergence == "raise":
            raise ConvergenceError(msg, term="forward", hint=hint)
        warnings.warn(f"forward: {msg}. Hint: {hint}", ConvergenceWarning, stacklevel=3)

    def _attach(self, f: Any, z_star: torch.Tensor) -> torch.Tensor:
        """Re-engage autograd at the equilibrium according to the backward mode."""
        if not torch.is_grad_enabled():
            return z_star
        if self.backward == "phantom":
            z = z_star
            lam = self.phantom_damping
            for _ in range(self.phantom_steps):
                fz = f(z)
                z = fz if lam == 1.0 else lam * fz + (1 - lam) * z
            return z
        z = f(z_star)
        if not z.requires_grad:
            return z
        z0 = z_star.clone().requires_grad_()
        with torch.enable_grad():
            f0 = f(z0)
        solver = get_solver(self.backward_solver)
        module = self

        def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
            if grad is None:
                return None

            def adj(y: torch.Tensor) -> torch.Tensor:
                return torch.autograd.grad(f0, z0, y, retain_graph=True)[0] + grad

            with torch.no_grad():
                g, st = solver(adj, grad, tol=module.backward_tol,
                               max_iter=module.backward_max_iter)
            module.last_backward_stats = st
            if not bool(st.converged.all()):
                msg = (f"adjoint fixed point did not reach {module.backward_tol:g} "
                       f"(worst {st.max_residual:.3e})")
                if module.on_nonconvergence == "raise":
                    raise ConvergenceError(msg, term="backward",
                                           hint="raise backward_max_iter or backward_tol")
                warnings.warn(f"backward: {msg}", ConvergenceWarning, stacklevel=2)
            return g

        z.register_hook(hook)
        return z

    def extra_repr(self) -> str:
        return (f"state={[(b.name, b.shape) for b in self.blocks]}, solver={self.solver}, "
                f"backward={self.backward}, tol={self.tol:g}, max_iter={self.max_iter}")


_ = math
