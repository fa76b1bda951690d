"""The emitted ``nn.Module``: a derived layer with real solvers and backward modes.

Forward: solve ``z = T(z, x)`` (a registered solver, or SAM) without autograd; then a backward
strategy (:mod:`lowering.runtime.backward`) re-attaches the gradient (implicit, phantom,
unroll).  Options are grouped in :class:`~lowering.runtime.config.ModuleConfig` (flat keywords
accepted).  See docs/guide.md (the emitted module) and docs/theory.md §8.

Guarantees: a sample is reported converged only if the returned iterate meets the tolerance
(scaled residuals, any dtype); non-convergence and NaN/Inf are never silent (``raise``: a typed
error naming the sample indices; ``warn``: a warning naming them; ``mask``: those samples'
outputs are NaN and excluded from the backward, and a sample whose adjoint solve fails is left
out of the gradient, with a warning naming it); with weight control on (the default whenever
the certificate has a norm condition) the certified norm never exceeds its bound.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from convex_eq.errors import OptionError
from convex_eq.symbols import Symbol
from lowering.derived import DerivedLayer
from lowering.nodes import broadcast_batch

from . import parameters as params
from .call import HALF, general_call
from .compile import compile_disabled
from .config import ModuleConfig, build_config
from .express import express_call, express_width
from .guards import batch_coupled, refuse_coupled_mask, refuse_transforms
from .scalars import check_learnable
from .solvers import SolverStats
from .warm_start import WarmStartCache, refuse_without_uniqueness
from .weight_control import (
    ConditionStatus,
    certificate_conditions,
    kept_by,
    make_weight_control,
    normalize_weights,
    refuse_double_control,
    warn_uncontrolled,
)


class EquilibriumModule(nn.Module):
    """``z* = T(z*, x)`` as a trainable layer (weights are ``nn.Parameter``s).

    Build it with ``derived.torch_module(**options)``; the options are the fields of
    :class:`~lowering.runtime.config.ModuleConfig` (see docs/guide.md, module options)."""

    def __init__(self, derived: DerivedLayer, config: ModuleConfig | None = None,
                 **options: Any):
        super().__init__()
        cfg = build_config(config, **options)
        self.config = cfg
        self.derived = derived
        self.blocks: list[Symbol] = list(derived.blocks)
        self.input_syms: list[Symbol] = list(derived.inputs)
        self._batch_coupled = batch_coupled(derived)
        if cfg.on_nonconvergence == "mask":
            refuse_coupled_mask(self, term="torch_module")
        params.register_tensors(self, derived, cfg)
        normalize_weights(self, cfg.weight_control.normalized)
        self.weight_control = make_weight_control(derived, cfg.weight_control,
                                                  list(self.weights.keys()),
                                                  lambda: params.raw_env(self))
        refuse_double_control(cfg.weight_control.normalized, self.weight_control)
        warn_uncontrolled(derived, self.weight_control, list(self.weights.keys()),
                          self.trained_names())
        #: False once the node tree has been found to have no plan (lowering.runtime.plan)
        self._plannable = True
        if self._scalar_maps:
            check_learnable(derived, list(self._scalar_maps), self.T, self.env(),
                            dict(self.scalar_params.items()))
        self._fingerprint = params.fingerprint(derived)
        #: per-sample equilibria for warm starts (``warm_start=N``), None when off
        self.warm_start_cache: WarmStartCache | None = None
        if cfg.warm_start:
            refuse_without_uniqueness(self)
            self.warm_start_cache = WarmStartCache(cfg.warm_start, self.state_size)
        self.last_stats: SolverStats | None = None
        self.last_backward_stats: SolverStats | None = None

    # ------------------------------------------------------------------ options (read-only views)
    @property
    def solver(self) -> str:
        """The forward solver's registry name (``config.forward.solver``)."""
        return self.config.forward.solver

    @property
    def tol(self) -> float:
        """Relative residual the forward solve stops at (``config.forward.tol``)."""
        return self.config.forward.tol

    @property
    def max_iter(self) -> int:
        """Iteration cap of the forward solve (``config.forward.max_iter``)."""
        return self.config.forward.max_iter

    @property
    def backward(self) -> str:
        """The backward strategy's registry name (``config.backward.mode``)."""
        return self.config.backward.mode

    @property
    def on_nonconvergence(self) -> str:
        """``"raise"`` | ``"warn"`` | ``"mask"`` (``config.on_nonconvergence``)."""
        return self.config.on_nonconvergence

    @property
    def sam(self) -> Any:
        """The SAM selection config, or None (``config.sam``)."""
        return self.config.sam

    @property
    def dtype(self) -> torch.dtype:
        """The module's floating dtype (its parameters' after ``.to()``; inputs are cast to it,
        float16/bfloat16 modules solve in float32)."""
        return params.dtype_from(self, params.weight_values(self))

    @property
    def state_size(self) -> int:
        """Length of the flat stacked state ``(B, N)`` the solvers iterate on."""
        n = self.__dict__.get("_state_size")  # the blocks are fixed: summed once
        if n is None:
            n = self.__dict__["_state_size"] = sum(b.size for b in self.blocks)
        return n

    # ------------------------------------------------------------------ state dict / pickle
    def get_extra_state(self) -> dict[str, Any]:
        """The derivation's fingerprint and the weight-control targets, saved in
        ``state_dict`` (raw weights mean the trained layer only together with them)."""
        return params.extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Refuse weights saved from a different layer (same names and shapes, other ``T``);
        adopt the saved weight-control targets."""
        params.load_extra_state(self, state)

    def __getstate__(self) -> dict:
        """A derived layer that cannot be pickled (closures in its contraction estimate) is
        pickled as its objective and re-lowered on load (checked by fingerprint)."""
        return params.pickled_state(self)

    def __setstate__(self, state: dict) -> None:
        derived = params.relowered(state)
        super().__setstate__(state)
        if derived is not None:
            self.derived = derived

    def enable_warm_start(self, size: int) -> WarmStartCache:
        """Keep the last equilibrium of each of ``size`` samples and start their next solves
        there (``forward(x, sample_ids=...)``; the same as building the module with
        ``warm_start=size``).  Refused with a typed error where the certificate does not make
        the equilibrium unique (docs/guide.md, training speed)."""
        from dataclasses import replace

        self.config = replace(self.config, warm_start=int(size))  # (validated there)
        refuse_without_uniqueness(self)
        cache = self.warm_start_cache
        if cache is None or cache.size != int(size):
            cache = self.warm_start_cache = WarmStartCache(int(size), self.state_size)
        return cache

    # ------------------------------------------------------------------ tensors
    def scalar_values(self) -> dict[str, float]:
        """Current values of the layer's scalar hyper-parameters (learnable ones included)."""
        with torch.no_grad():
            env = params.raw_env(self)
            return {n: float(env[n]) for n in [*self._scalar_names, *self._scalar_maps]}

    @compile_disabled
    def env(self) -> dict[str, torch.Tensor]:
        """Name → tensor for weights (after weight control), constants and scalars.

        Shapes are checked on every call; finiteness of a weight once per change of the weight
        (``tensor._version``), i.e. once per optimizer step, not on every forward."""
        return params.checked_env(self, params.weight_values(self))

    def trained_names(self) -> list[str]:
        """Names of the tensors training changes: the weights (and constants made learnable),
        and the learnable scalars."""
        return [*self.weights.keys(), *self._scalar_maps]

    def certificate_status(self) -> list[ConditionStatus]:
        """Every condition of the certificate evaluated at the current (controlled) weights:
        its value, whether it holds, and how training keeps it (``"weight control"``,
        ``"fixed"`` or ``"not kept"``; docs/guide.md, weight control).  Empty for a layer whose
        objective is convex without conditions, and for one that certifies nothing (a
        nonconvex objective, whose claim is a stationary point: ``derived.certificate.kind``)."""
        out = []
        with torch.no_grad():
            env = {k: v.detach() for k, v in self.env().items()}
            trained = self.trained_names()
            for c in certificate_conditions(self.derived):
                out.append(ConditionStatus(c.text, c.value(env), float(c.bound), c.sense,
                                           bool(c.holds(env)),
                                           kept_by(c, self.weight_control, trained)))
        return out

    def weight_norms(self) -> dict[str, tuple[float, float]]:
        """``name → (upper bound of the controlled operator norm, target)`` at the current
        (controlled) weights; empty without weight control."""
        if self.weight_control is None:
            return {}
        with torch.no_grad():
            return self.weight_control.norms(self.env())

    # ------------------------------------------------------------------ T and the output
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

    def shape_out(self, z: torch.Tensor) -> Any:
        """The flat output ``(B, N)`` as the output block (or a tuple of blocks), shaped."""
        if self.__dict__.get("_flat_out") == z.shape[1]:  # one flat block (checked before)
            return z
        blocks = self.derived.output_blocks
        if len(blocks) == 1 and blocks[0].shape == (z.shape[1],):  # one flat block: z itself
            self.__dict__["_flat_out"] = z.shape[1]
            return z
        parts, o = {}, 0
        for b in blocks:
            parts[b.name] = z[:, o:o + b.size]
            o += b.size
        shaped = [parts[b.name].reshape(z.shape[0], *b.shape) for b in blocks]
        return shaped[0] if len(shaped) == 1 else tuple(shaped)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Any = None, z0: torch.Tensor | None = None,
                return_stats: bool = False, sample_ids: torch.Tensor | None = None) -> Any:
        """``z*(x)``: the equilibrium of ``T(·, x)`` (shaped like the state block, or a tuple of
        blocks), with the gradient of the configured backward strategy; ``return_stats`` also
        returns the forward :class:`~lowering.runtime.solvers.SolverStats`.  ``z0``: a warm
        start; ``sample_ids``: the dataset index of each sample, whose last equilibrium starts
        its solve (a module built with ``warm_start=N``; docs/guide.md, training speed).

        Inside ``torch.compile`` the branch below is what dynamo traces (``is_compiling()`` is
        True only while tracing, and the traced code keeps it): the solve itself stays a graph
        break, and its plain iterations run ``compile_steps`` at a time in one compiled call
        (docs/guide.md, torch.compile).  Eager calls never take it."""
        if sample_ids is not None:
            return self._warm_forward(x, z0, return_stats, sample_ids)
        if "torch._dynamo" not in sys.modules and type(self)._forward is _FORWARD_CALL \
                and "_forward" not in self.__dict__:  # (nor an instance's own, e.g. a spy)
            # no compiler loaded: nothing to trace, nothing to disable (two calls fewer, cold)
            return _FORWARD(self, x, z0, return_stats, 0)
        if torch.compiler.is_compiling():
            steps = getattr(self.config, "compile_steps", 0)
            disabled = getattr(type(self)._forward, "disabled", None)  # (None: not made yet)
            if disabled is not None:
                return disabled(self, x, z0, return_stats, steps)
            return self._forward(x, z0, return_stats, steps)
        return self._forward(x, z0, return_stats, 0)

    @compile_disabled
    def _warm_forward(self, x: Any, z0: Any, return_stats: bool, ids: torch.Tensor) -> Any:
        """:meth:`forward` with each sample started from its cached equilibrium."""
        cache = self.warm_start_cache
        if cache is None:
            raise OptionError("sample_ids are given, but this module keeps no equilibria",
                              term="forward", hint="build it with torch_module(warm_start="
                              "len(dataset)) (layers with a unique equilibrium only)")
        if z0 is not None:
            raise OptionError("pass either z0 or sample_ids (whose cached equilibria are the "
                              "start), not both", term="forward")
        ref = next(iter(x.values())) if isinstance(x, dict) and x else x
        b = ref.shape[0] if isinstance(ref, torch.Tensor) and ref.ndim else 1
        ids = cache.check_ids(ids, b)
        dt = torch.float32 if self.dtype in HALF else self.dtype
        dev = ref.device if isinstance(ref, torch.Tensor) else params.device_of(self)
        start = cache.start(ids, torch.zeros((), dtype=dt, device=dev))
        return self._forward(x, start, return_stats, 0, ids)

    @compile_disabled
    def _forward(self, x: Any, z0: torch.Tensor | None, return_stats: bool,
                 steps: int, ids: torch.Tensor | None = None) -> Any:
        """:meth:`forward` (``steps``: plain iterations per compiled call, 0: eager; ``ids``:
        the samples' indices in the warm-start cache, ``z0`` then their cached start): the
        express call where it applies, else the general call."""
        refuse_transforms(self)
        # a plain attribute (no nn.Module bookkeeping); None until this call's solve has run,
        # so that a call that raises never leaves an earlier call's statistics behind
        d = self.__dict__
        d["last_stats"] = None
        # (weight_values and the first weight's dtype, inline: this is every call's entry)
        w = d["_modules"]["weights"]
        weights = w._parameters if type(w) is nn.ParameterDict else dict(w.items())
        ref = next(iter(weights.values()), None)
        out_dtype = ref.dtype if ref is not None else params.dtype_from(self, weights)
        env = None
        if not steps and (z0 is None or ids is not None) and type(x) is torch.Tensor \
                and x.dtype == out_dtype \
                and x.layout == torch.strided and not x.is_nested and not x.is_meta \
                and x.ndim == 2 and x.shape[0] and x.shape[1] == express_width(self) \
                and out_dtype not in HALF and torch.autograd.forward_ad._current_level < 0:
            # (a disabled region already: env()'s own wrapper is not needed; an env set on the
            # instance, e.g. a test substituting a weight, is honoured)
            env = params.checked_env(self, weights) if "env" not in d else self.env()
            out = express_call(self, x, env, return_stats, z0, ids)
            if out is not None:
                return out
        return general_call(self, x, z0, return_stats, steps, weights, out_dtype, env, ids)

    def jacobian_penalty(self, x: Any, z: Any, *, samples: int = 1,
                         generator: torch.Generator | None = None) -> torch.Tensor:
        """Jacobian regularisation: an unbiased Hutchinson estimate of ``||∂T/∂z||_F² / (B·N)``
        at the output ``z`` this module returned for ``x``, differentiable in the weights (add
        ``γ·penalty`` to the loss for fewer solver iterations;
        :func:`lowering.runtime.jacobian.jacobian_penalty`; docs/guide.md, training speed)."""
        from .jacobian import jacobian_penalty

        return jacobian_penalty(self, x, z, samples=samples, generator=generator)

    # ------------------------------------------------------------------ certified bounds
    def error_bound(self, x: Any = None, z: torch.Tensor | None = None) -> torch.Tensor:
        """Per sample, ``||o − o*(x)||₂ ≤ c_e·||T(u) − u||₂`` for the returned output ``o`` of the
        last forward (or of a forward at ``x``; or at the flat state ``z`` with ``T`` evaluated
        once in float64); a :class:`~convex_eq.errors.CertificateError` where no certificate
        holds (:func:`lowering.runtime.bounds.error_bound`; docs/theory.md §9.6)."""
        from .bounds import error_bound

        return error_bound(self, x, z)

    def lipschitz_bound(self) -> float:
        """A certified ``Lip(x ↦ o*(x))`` (stacked inputs, ℓ2) at the current weights, derived
        from the objective's input terms (:func:`lowering.runtime.bounds.lipschitz_bound`;
        docs/theory.md §9.6); a :class:`~convex_eq.errors.CertificateError` where none is."""
        from .bounds import lipschitz_bound

        return lipschitz_bound(self).value

    def extra_repr(self) -> str:
        """State shapes, solver, backward, tolerance and weight control, for ``repr``."""
        wc = self.weight_control.mode if self.weight_control is not None else None
        wn = getattr(self.config.weight_control, "normalized", ())
        return (f"state={[(b.name, b.shape) for b in self.blocks]}, solver={self.solver}, "
                f"backward={self.backward}, tol={self.tol:g}, max_iter={self.max_iter}, "
                f"weight_control={wc}" + (f", weight_normalization={wn}" if wn else ""))


#: :meth:`EquilibriumModule._forward` itself, called while ``torch._dynamo`` is not loaded (its
#: ``compile_disabled`` wrapper then runs it as is)
_FORWARD_CALL = EquilibriumModule._forward
_FORWARD = _FORWARD_CALL.__wrapped__


def emit(derived: DerivedLayer, **options: Any) -> EquilibriumModule:
    """``derived.torch_module(**options)`` for the default backend ``"fixed_point"``."""
    return EquilibriumModule(derived, **options)


__all__ = ["EquilibriumModule", "emit"]
