"""The emitted ``nn.Module``: a derived layer with real solvers and backward modes.

Forward: solve ``z = T(z, x)`` (a registered solver, or SAM) without autograd; then a backward
strategy from :mod:`lowering.backward` re-attaches the gradient (implicit, phantom, unroll).
Options are grouped in :class:`lowering.config.ModuleConfig` (flat keywords accepted).
See ``docs/guide.md`` (training the emitted module) and ``docs/theory.md`` §8.

Guarantees: a sample is reported converged only if the returned iterate meets the tolerance
(scaled residuals, any dtype); non-convergence and NaN/Inf are never silent (``raise``: a typed
error naming the sample indices; ``warn``: a warning naming them; ``mask``: those samples'
outputs are NaN and excluded from the backward, and a sample whose adjoint solve fails is left
out of the gradient, with a warning naming it); with weight control on (the default whenever
the certificate has a norm condition) the certified norm never exceeds its bound.
"""

from __future__ import annotations

import hashlib
import math
import sys
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
from .backward import (
    BACKWARD_STRATEGIES,
    AdjointConfig,
    BackwardStrategy,
    FixedPointProblem,
    get_backward,
)
from .config import ModuleConfig, build_config
from .nodes import broadcast_batch, partial_evaluation
from .plan import Plan, PlanContext, Root
from .sam import sam_iterate
from .scalars import LearnableScalar, check_learnable
from .solvers import (
    _COMPILED,
    SOLVERS,
    CompiledSteps,
    SolverStats,
    Tracker,
    _empty_stats,
    compiled_steps,
    compiled_steps_set,
    get_solver,
    grad_off,
)
from .weight_control import (
    ConditionStatus,
    UncontrolledConditionWarning,
    WeightControl,
    certificate_conditions,
    controlled_conditions,
    kept_by,
)

if TYPE_CHECKING:  # annotations only: derived.py builds this module (torch_module())
    from .derived import DerivedLayer

#: ``lowering.lower``, registered by the package (the module sits below the rules it would
#: otherwise import): unpickling re-derives a layer whose derivation holds closures
RELOWER: Any = None


#: dtypes solved internally in float32 (their 8-/11-bit mantissas cannot reach useful tolerances)
HALF = (torch.float16, torch.bfloat16)


def _indices(mask: torch.Tensor, limit: int = 10) -> str:
    idx = [int(i) for i in torch.nonzero(mask).flatten()]
    return ", ".join(map(str, idx[:limit])) + (", …" if len(idx) > limit else "")


def fingerprint(derived: DerivedLayer) -> str:
    """A short hash of what the layer *is*: the objective, the rules applied and ``T``."""
    rules = [getattr(s, "rule", "") for s in getattr(derived.derivation, "steps", [])]
    text = "|".join([str(derived.source), ";".join(map(str, rules)),
                     " ".join(f"{b.name}:{b.shape}" for b in derived.blocks),
                     str(getattr(derived.claim, "kind", derived.claim))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class EquilibriumModule(nn.Module):
    """``z* = T(z*, x)`` as a trainable layer (weights are ``nn.Parameter``s).

    Build it with ``derived.torch_module(**options)``; the options are the fields of
    :class:`~lowering.config.ModuleConfig` (see :data:`lowering.config.FLAT_OPTIONS`)."""

    def __init__(self, derived: DerivedLayer, config: ModuleConfig | None = None,
                 **options: Any):
        super().__init__()
        cfg = build_config(config, **options)
        self.config = cfg
        self.derived = derived
        self.blocks: list[Symbol] = list(derived.blocks)
        self.input_syms: list[Symbol] = list(derived.inputs)
        self._batch_coupled = _batch_coupled(derived)
        if cfg.on_nonconvergence == "mask" and self._batch_coupled:
            raise OptionError("on_nonconvergence='mask' needs a layer whose samples are "
                              "independent; this objective couples the batch (its T changes "
                              "when samples are removed)", term="torch_module",
                              hint="use on_nonconvergence='raise' or 'warn'")
        dtype = cfg.dtype
        self.weights = nn.ParameterDict()
        #: declared shapes, checked in env() (a wrongly shaped tensor put into ``weights`` or a
        #: buffer would otherwise surface as a torch broadcasting error deep inside T)
        self._shapes = {s.name: tuple(s.shape) for s in derived.parameters}
        self._const_names: list[str] = []
        self._scalar_names: list[str] = []
        #: learnable scalars: unconstrained θ (trained) and the map onto the declared range
        self.scalar_params = nn.ParameterDict()
        self._scalar_maps: dict[str, LearnableScalar] = {}
        for s in derived.parameters:
            if s.kind == "weight" or (s.kind == "constant" and cfg.learnable_constants):
                self.weights[s.name] = nn.Parameter(s.value.detach().clone().to(dtype))
            elif s.kind == "constant":
                self.register_buffer(f"const_{s.name}", s.value.detach().clone().to(dtype))
                self._const_names.append(s.name)
            elif getattr(s, "learnable", False):
                m = LearnableScalar(s)
                self._scalar_maps[s.name] = m
                self.scalar_params[s.name] = nn.Parameter(
                    torch.tensor(m.initial_raw(float(s.value)), dtype=torch.float64))
            else:
                self.register_buffer(f"scalar_{s.name}",
                                     torch.tensor(float(s.value), dtype=torch.float64))
                self._scalar_names.append(s.name)
        if not len(self.weights) and not self._const_names:
            # no tensor follows .to()/.double()/.half() otherwise: the dtype would stay the
            # configured one (a float64 input then cast down to float32, silently)
            self.register_buffer("dtype_ref", torch.zeros((), dtype=dtype), persistent=False)
        wc = cfg.weight_control
        mode = wc.mode
        trainable = list(self.weights.keys())  # weights, and constants made learnable
        if mode == "auto":  # conditions on constants alone hold as declared: nothing to control
            mode = "spectral_norm" if (controlled_conditions(derived, trainable)
                                       or wc.bounds) else None
        self.weight_control = WeightControl(derived, mode, wc.margin, wc.bounds, trainable) \
            if mode is not None else None
        if self.weight_control is not None and wc.mode == "auto":
            self.weight_control.calibrate(self._raw_env())
        # conditions that no weight control could keep (a norm bound of one weight could be:
        # switched off, that is the user's choice, which a failing solve's hint names)
        controllable = [op for op, _, _ in controlled_conditions(derived, trainable)]
        loose = [c.text for c in certificate_conditions(derived)
                 if kept_by(c, self.weight_control, self._trained_names()) == "not kept"
                 and all(getattr(c, "op", None) is not op for op in controllable)]
        if loose:
            many = len(loose) > 1
            it = "them" if many else "it"
            warnings.warn(
                f"the certificate's condition{'s' if many else ''} {'; '.join(loose)} "
                f"read{'' if many else 's'} trained tensors and weight control cannot keep "
                f"{it} (it keeps norm bounds ||op||₂ ≤ b of one weight each): training may "
                f"leave {it} false, and the layer's equilibrium then is no longer a certified "
                f"minimizer. Evaluate {it} at the trained weights with "
                "module.certificate_status()", UncontrolledConditionWarning, stacklevel=3)
        self._checked: dict[str, tuple[int, int]] = {}
        #: False once the node tree has been found to have no plan (lowering/plan.py)
        self._plannable = True
        if self._scalar_maps:
            check_learnable(derived, list(self._scalar_maps), self.T, self.env(),
                            dict(self.scalar_params.items()), RELOWER)
        self._fingerprint = fingerprint(derived)
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
        return self._dtype_from(self._weight_values())

    def _dtype_from(self, weights: dict[str, torch.Tensor]) -> torch.dtype:
        """:attr:`dtype` from the weights as :meth:`_weight_values` gives them."""
        ref = next(iter(weights.values()), None)
        if ref is None and self._const_names:
            ref = getattr(self, f"const_{self._const_names[0]}")
        if ref is None:  # a layer without tensors of its own: the dtype buffer
            ref = self._buffers.get("dtype_ref")
        return ref.dtype if ref is not None else self.config.dtype

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
        targets = ({name: t for _, name, t in self.weight_control.targets}
                   if self.weight_control is not None else {})
        return {"fingerprint": self._fingerprint, "layer": self._describe_layer(),
                "weight_targets": targets}

    def set_extra_state(self, state: Any) -> None:
        """Refuse weights saved from a different layer (same names and shapes, other ``T``);
        adopt the saved weight-control targets."""
        theirs = state.get("fingerprint") if isinstance(state, dict) else None
        if theirs != self._fingerprint:
            raise ShapeError(
                f"state_dict was saved from another layer ({state.get('layer', '?')}, "
                f"fingerprint {theirs}) and cannot be loaded into this one "
                f"({self._describe_layer()}, fingerprint {self._fingerprint})",
                term="load_state_dict",
                hint="lower the same objective with the same rules before loading its weights")
        targets = state.get("weight_targets") or {}
        if self.weight_control is not None:
            self.weight_control.targets = [(op, name, float(targets.get(name, t)))
                                           for op, name, t in self.weight_control.targets]
        elif targets:
            from .weight_control import WeightControlWarning

            warnings.warn("the state_dict was saved by a module with weight control (targets "
                          f"{targets}); this module has none, so its layer uses the raw "
                          "weights, not the controlled ones that were trained",
                          WeightControlWarning, stacklevel=2)

    def _describe_layer(self) -> str:
        rules = [getattr(s, "rule", "?") for s in getattr(self.derived.derivation, "steps", [])]
        return f"{' → '.join(map(str, rules)) or 'layer'} of {self.derived.source}"[:200]

    def __getstate__(self) -> dict:
        """Pickle support: a derived layer that cannot be pickled (closures in its contraction
        estimate) is replaced by its objective and re-lowered on load (checked by fingerprint)."""
        state = self.__dict__.copy()
        state.pop("_compiled", None)  # compiled functions: made again on first use
        state.pop("_express_spec", None)  # decided again on first use
        state.pop("_held_builder", None)  # closures over the node tree: made again on use
        try:
            import pickle

            pickle.dumps(self.derived)
        except Exception:
            state["derived"] = None
            state["_relower_source"] = self.derived.source
            state["_relower_options"] = dict(getattr(self.derived, "lower_options", {}) or {})
        return state

    def __setstate__(self, state: dict) -> None:
        source = state.pop("_relower_source", None)
        options = state.pop("_relower_options", {})
        super().__setstate__(state)
        if source is not None:
            if RELOWER is None:
                raise ShapeError("cannot re-derive the unpickled layer: lowering.lower is not "
                                 "registered", term="unpickle", hint="import lowering first")
            derived = RELOWER(source, **options)
            if fingerprint(derived) != self._fingerprint:
                raise ShapeError("the unpickled layer re-derives to a different layer "
                                 f"({fingerprint(derived)} ≠ {self._fingerprint})",
                                 term="unpickle", hint="unpickle with the same convex-eq version")
            self.derived = derived

    # ------------------------------------------------------------------ env & inputs
    def _weight_values(self) -> dict[str, torch.Tensor]:
        """The weights by name: the ParameterDict's own storage (same names and order as its
        ``items()``, which walk the container protocol per call), unless a
        ``torch.nn.utils.parametrize`` map replaced an entry by a computed value (its class
        is then a generated subclass, and the entry is absent from that storage)."""
        w = self.weights
        return w._parameters if type(w) is nn.ParameterDict else dict(w.items())

    def _raw_env(self, weights: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
        env: dict[str, torch.Tensor] = dict(
            self._weight_values() if weights is None else weights)
        for n in self._const_names:
            env[n] = getattr(self, f"const_{n}")
        for n in self._scalar_names:
            env[n] = getattr(self, f"scalar_{n}")
        for n, m in self._scalar_maps.items():
            env[n] = m.value(self.scalar_params[n])
        return env

    def scalar_values(self) -> dict[str, float]:
        """Current values of the layer's scalar hyper-parameters (learnable ones included)."""
        with torch.no_grad():
            env = self._raw_env()
            return {n: float(env[n]) for n in [*self._scalar_names, *self._scalar_maps]}

    @compile_disabled
    def env(self) -> dict[str, torch.Tensor]:
        """Name → tensor for weights (after weight control), constants and scalars.

        Shapes are checked on every call; finiteness of a weight once per change of the weight
        (``tensor._version``), i.e. once per optimizer step, not on every forward."""
        return self._env(self._weight_values())

    def _env(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`env` from the weights as :meth:`_weight_values` gives them."""
        env = self._raw_env(weights) if self._const_names or self._scalar_names \
            or self._scalar_maps else dict(weights)  # (_raw_env's whole work then, inline)
        for n, t in env.items():
            want = self._shapes.get(n)
            if want is not None and tuple(t.shape) != want:
                raise ShapeError(f"parameter '{n}' has shape {tuple(t.shape)}, the layer "
                                 f"declares {want}", term=n,
                                 hint="load weights of the declared shape")
            key = (t._version, t.data_ptr())
            if self._checked.get(n) != key:
                if not bool(torch.isfinite(t).all()):
                    # an Inf weight can give a finite output (relu(-inf) = 0) with NaN gradients
                    raise NonFiniteError(f"parameter '{n}' contains NaN or Inf", term=n,
                                         hint="check the optimizer step / the loaded state_dict")
                self._checked[n] = key
        if self.weight_control is not None:
            env = self.weight_control(self, env)
        return env

    def _trained_names(self) -> list[str]:
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
            trained = self._trained_names()
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

    def _inputs(self, x: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        syms = self.input_syms
        if isinstance(x, torch.Tensor) and len(syms) == 1 and x.layout == torch.strided \
                and not x.is_nested and x.ndim == 2 and x.shape[1] == syms[0].size:
            # the common call: one flat (B, size) dense input (a nested tensor has no .shape)
            dtype = self.dtype if dtype is None else dtype
            return {syms[0].name: x if x.dtype == dtype else x.to(dtype)}
        if x is None or (isinstance(x, dict) and not x):
            if self.input_syms:
                raise ShapeError(f"layer has inputs {[s.name for s in self.input_syms]}",
                                 term="forward", hint="pass a dict name → tensor")
            return {}
        if isinstance(x, dict):
            given = x
        else:
            if len(self.input_syms) != 1:
                raise ShapeError(f"layer has inputs {[s.name for s in self.input_syms]}",
                                 term="forward", hint="pass a dict name → tensor")
            given = {self.input_syms[0].name: x}
        out = {}
        dtype = self.dtype if dtype is None else dtype
        for s in self.input_syms:
            if s.name not in given:
                raise ShapeError(f"missing input '{s.name}'", term="forward")
            t = given[s.name]
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"input '{s.name}' must be a torch.Tensor", term="forward")
            if t.is_nested:  # (its .shape fails untyped in the strided layout)
                raise ShapeError(f"input '{s.name}' is a nested tensor; the layer takes one "
                                 "dense tensor batched along dim 0", term="forward",
                                 hint=f"stack the samples: torch.stack({s.name}.unbind())")
            if t.layout != torch.strided:  # the solvers' norms and the plans need dense storage
                raise ShapeError(f"input '{s.name}' is a {t.layout} tensor; the layer takes "
                                 "dense (strided) inputs", term="forward",
                                 hint=f"pass {s.name}.to_dense()")
            if tuple(t.shape[1:]) != s.shape and not (t.ndim == 2 and t.shape[1] == s.size):
                raise ShapeError(
                    f"input '{s.name}' has shape {tuple(t.shape)}, expected (B, *{s.shape})",
                    term="forward", hint="batch the input along dim 0",
                )
            if t.dtype != dtype:  # documented: inputs are cast to the module's dtype
                t = t.to(dtype)
            # already flat (B, size): no reshape view (one autograd node less per call)
            out[s.name] = t if t.ndim == 2 and t.shape[1] == s.size else \
                t.reshape(t.shape[0], s.size)
        sizes = {k: v.shape[0] for k, v in out.items()} if len(out) > 1 else {}
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
                return_stats: bool = False) -> Any:
        """``z*(x)``: the equilibrium of ``T(·, x)`` (shaped like the state block, or a tuple of
        blocks), with the gradient of the configured backward strategy; ``return_stats`` also
        returns the forward :class:`~lowering.solvers.SolverStats`.

        Inside ``torch.compile`` the branch below is what dynamo traces (``is_compiling()`` is
        True only while tracing, and the traced code keeps it): the solve itself stays a graph
        break, and its plain iterations run ``compile_steps`` at a time in one compiled call
        (docs/guide.md, torch.compile).  Eager calls never take it."""
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

    def _functorch_ok(self) -> bool:
        """Whether the active ``torch.func`` transforms can run this call: ``backward="unroll"``
        (plain autograd through ``K`` iterations, no autograd.Function) without weight control,
        under grad / jacrev / jvp of the inputs.  vmap (the residuals are read on the host) and
        transformed weights (``functional_call`` inside a transform: the env cache reads their
        storage) are refused."""
        if self.config.backward.mode != "unroll" or self.weight_control is not None:
            return False
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
        if any(i.key() == torch._C._functorch.TransformType.Vmap
               for i in retrieve_all_functorch_interpreters()):
            return False
        return not any(torch._C._functorch.is_functorch_wrapped_tensor(w)
                       for w in self._weight_values().values())

    def _refuse_forward_ad(self, inputs: dict[str, torch.Tensor],
                           env: dict[str, torch.Tensor]) -> None:
        """Forward-mode AD (dual tensors) reaches the implicit and phantom backwards'
        autograd.Functions, which have no ``jvp``: a typed error before the solve."""
        if self.config.backward.mode == "unroll":
            return
        import torch.autograd.forward_ad as fwad
        duals = [k for k, t in (*inputs.items(), *env.items())
                 if torch.is_tensor(t) and fwad.unpack_dual(t).tangent is not None]
        if duals:
            raise OptionError(
                f"forward-mode AD (dual tensors: {duals}) through backward="
                f"'{self.config.backward.mode}' is not supported: its gradient is a reverse-mode "
                "autograd.Function", term="forward",
                hint="take gradients with loss.backward() or torch.autograd.grad, or use "
                "backward='unroll' for forward-mode AD")

    @compile_disabled
    def _forward(self, x: Any, z0: torch.Tensor | None, return_stats: bool,
                 steps: int) -> Any:
        """:meth:`forward` (``steps``: plain iterations per compiled call, 0: eager)."""
        if torch._C._are_functorch_transforms_active() and not self._functorch_ok():
            # the solve reads residuals on the host every iteration and its backward is an
            # autograd.Function differentiated by torch.autograd: torch.func would fail deep
            # inside, untyped
            raise OptionError(
                "torch.func transforms (vmap, grad, jacrev, jvp, …) over the emitted module are "
                "not supported: its solve reads residuals on the host every iteration and its "
                "gradient is an autograd.Function for torch.autograd", term="forward",
                hint="batch samples along dim 0 instead of vmap, and take gradients with "
                "loss.backward() or torch.autograd.grad (create_graph=True for second order); "
                "torch.func.functional_call works")
        # a plain attribute (no nn.Module bookkeeping); None until this call's solve has run,
        # so that a call that raises never leaves an earlier call's statistics behind
        d = self.__dict__
        d["last_stats"] = None
        # (_weight_values and the first weight's dtype, inline: this is every call's entry)
        w = d["_modules"]["weights"]
        weights = w._parameters if type(w) is nn.ParameterDict else dict(w.items())
        ref = next(iter(weights.values()), None)
        out_dtype = ref.dtype if ref is not None else self._dtype_from(weights)
        env = None
        if not steps and z0 is None and type(x) is torch.Tensor and x.dtype == out_dtype \
                and x.layout == torch.strided and not x.is_nested \
                and x.ndim == 2 and x.shape[0] and x.shape[1] == self._express_width() \
                and out_dtype not in HALF and torch.autograd.forward_ad._current_level < 0 \
                and _COMPILED.get() is None:
            # (a disabled region already: env()'s own wrapper is not needed; an env set on the
            # instance, e.g. a test substituting a weight, is honoured)
            env = self._env(weights) if "env" not in d else self.env()
            out = self._express(x, env, return_stats)
            if out is not None:
                return out
        compiled = self._compiled_steps(steps) if steps else None
        inputs = self._inputs(x, out_dtype)
        if env is None:
            env = self._env(weights) if "env" not in self.__dict__ else self.env()
        if out_dtype in HALF:  # solved in float32; gradients flow back through the casts
            inputs = {k: v.float() for k, v in inputs.items()}
            env = {k: (v.float() if v.dtype in HALF else v) for k, v in env.items()}
        if torch.autograd.forward_ad._current_level >= 0:  # (-1: no dual level entered)
            self._refuse_forward_ad(inputs, env)
        ref = next(iter(inputs.values()), None)
        b = ref.shape[0] if ref is not None else \
            (z0.shape[0] if isinstance(z0, torch.Tensor) and z0.ndim else 1)
        if ref is None:
            ref = next((v for v in env.values() if v.is_floating_point()),
                       torch.zeros((), dtype=out_dtype))
        dt = torch.float32 if out_dtype in HALF else out_dtype
        bad_in = self._nonfinite_inputs(inputs, b, ref.device)  # None: every input finite
        z0 = self._initial(z0, b, dt, ref.device, bad_in) if z0 is not None else \
            torch.zeros(b, self.__dict__.get("_state_size") or self.state_size, dtype=dt,
                        device=ref.device)
        if bad_in is not None:
            keep = ~bad_in
            warnings.warn(f"forward: samples {_indices(bad_in)} have NaN/Inf inputs; their "
                          "outputs are NaN and they are excluded from the solve and the backward "
                          "(on_nonconvergence='mask')", ConvergenceWarning, stacklevel=2)
            inputs = {k: v[keep] for k, v in inputs.items()}
            z0 = z0[keep]
        keys_in, keys_env = list(inputs), list(env)
        fn = self._t_fn(keys_in, keys_env)
        tensors = [inputs[k] for k in keys_in] + [env[k] for k in keys_env]

        def f(z: torch.Tensor) -> torch.Tensor:
            return fn(z, tensors)

        if self.config.backward.mode == "unroll":
            z_star, stats = self._unroll(f, z0)
            planned = None
        else:
            planned = self._plan(keys_in, keys_env, tensors, z0)
            if planned is None:  # only a plan's T is compiled
                compiled = None
            z_star, stats = self._solve(f if planned is None else planned[0].fn, z0, inputs, env,
                                        compiled and compiled[0], planned is not None)
        stats.__dict__.pop("image", None)  # (not kept by last_stats)
        return self._finish(z_star, stats, z0, planned, compiled, fn, tensors, len(keys_in),
                            inputs, env, bad_in, b, out_dtype, return_stats)

    def _express_width(self) -> int:
        """The width of the one flat input when the layer can take the express call
        (:meth:`_express`), else 0: one state block with a plan, one input, no SAM, no
        unrolled backward, no output map, the state itself as the output.  The layer's part
        is decided once (the node tree does not change; ``_plannable`` turns False once a plan
        is refused); the options are read on every call, as the general path reads them
        (``config`` is mutable: a field changed in place keeps the same object)."""
        cfg = self.config
        if cfg.sam is not None or cfg.backward.mode == "unroll" \
                or not self.__dict__.get("_plannable", True):
            return 0
        width = self.__dict__.get("_express_spec")
        if width is None:
            derived = self.derived
            blocks, syms = self.blocks, self.input_syms
            outs = derived.output_blocks
            ok = (len(blocks) == 1 and len(syms) == 1 and derived.outputs is None
                  and len(outs) == 1 and tuple(outs[0].shape) == (blocks[0].size,))
            width = self.__dict__["_express_spec"] = syms[0].size if ok else 0
        return width

    def _express(self, x: torch.Tensor, env: dict[str, torch.Tensor],
                 return_stats: bool) -> Any:
        """The common call (one flat finite input of the module's dtype, a planned layer,
        eager, no warm start) on its shortest way: the same checks, plan, solver, statistics
        and backward strategy as the general path, without the steps that only other calls
        need (input dicts, casts, masks, output maps; docs/theory.md §8).  With the implicit
        backward and a plan that holds its state-free tensors in closed form (``plan.held``:
        the canonical ``σ(c + zM)``), the problem is posed on those tensors (``problem.held``:
        the implicit strategy differentiates the plan in closed form).  None when the input
        has NaN/Inf or the layer has no plan: nothing was solved, and the general path (which
        reports or masks those samples) takes the call with the same ``env``."""
        on = torch.is_grad_enabled()  # (grad_off's work inline: every call's first step)
        if on:
            _set_grad_enabled(False)
        try:  # one reduction: a finite norm means finite entries
            finite = math.isfinite(float(torch.linalg.vector_norm(x)))
        finally:
            if on:
                _set_grad_enabled(True)
        if not finite:
            return None
        d = self.__dict__
        b = x.shape[0]
        z0 = torch.zeros(b, d.get("_state_size") or self.state_size, dtype=x.dtype,
                         device=x.device)
        name = self.input_syms[0].name
        plan = None
        misses = d.get("_held_misses")
        cfg = self.config
        bc = cfg.backward
        if bc.mode == "implicit" and on and (misses is None or b not in misses) \
                and (x.requires_grad or any(t.requires_grad for t in env.values())):
            plan = self._plan_held(name, x, env, z0)
            if plan is None and not d.get("_plannable", True):
                return None
        if plan is None:
            return self._express_leaves(x, env, z0, name, return_stats)
        fc = cfg.forward
        solve = SOLVERS.get(fc.solver) or get_solver(fc.solver)  # (the latter: a typed error)
        if on:
            _set_grad_enabled(False)
        try:
            z_star, stats = solve(plan.fn, z0, tol=fc.tol, max_iter=fc.max_iter, **fc.options)
        finally:
            if on:
                _set_grad_enabled(True)
        image = stats.__dict__.pop("image", None)  # (not kept by last_stats)
        if not stats.all_converged:  # judged, masked or warned as any other call
            return self._finish(z_star, stats, z0, None, None, self._t_fn([name], list(env)),
                                [x, *env.values()], 1, {name: x}, env, None, b, x.dtype,
                                return_stats)
        d["last_stats"] = stats
        problem = FixedPointProblem(plan.eval_with, list(plan.held),
                                    self._adjoint_config(None, None), self._backward_sink, plan,
                                    None, True, image)
        z = _strategy(bc.mode).attach(problem, z_star, z0, bc)
        return (z, stats) if return_stats else z

    def _plan_held(self, name: str, x: torch.Tensor, env: dict[str, torch.Tensor],
                   z0: torch.Tensor) -> Any:
        """The plan of ``T`` built with autograd from ``x`` and the weights themselves, when it
        holds its state-free tensors in closed form (``plan.held``); None otherwise (no plan:
        ``_plannable`` turns False; a plan of another kind: the batch size joins
        ``_held_misses``, and later calls of that size plan with leaf copies directly — the
        node tree decides a plan's kind by the batch size, e.g. whether a Gram matrix pays)."""
        d = self.__dict__
        build = d.get("_held_builder")
        if build:  # the node tree's builder of this plan (made below, on the first call)
            plan = build({name: x}, env, z0)
            if plan is not None and (plan.c.requires_grad or plan.m.requires_grad):
                return plan
        if len(self.blocks) != 1 or not d.get("_plannable", True):
            return None
        block = self.blocks[0].name
        ctx = PlanContext(block, {name: x}, env, z0.shape[0], z0)
        node = self.derived.nodes[block]
        plan = node.plan(ctx)
        if plan is None:
            self._plannable = False
            return None
        # (held tensors without gradients while some weight has one, e.g. a weight that does
        # not reach T: the leaf path, whose output keeps a graph as on every other path)
        if not getattr(plan, "batch_shaped", False) or not hasattr(plan, "held") \
                or not any(t.requires_grad for t in plan.held):
            misses = d.setdefault("_held_misses", set())
            if len(misses) >= 64:  # (bounded: a stream of batch sizes)
                misses.clear()
            misses.add(z0.shape[0])
            return None
        if build is None:
            d["_held_builder"] = _checked_builder(node.held_builder(ctx), plan, ctx)
        return plan

    def _express_leaves(self, x: torch.Tensor, env: dict[str, torch.Tensor],
                        z0: torch.Tensor, name: str, return_stats: bool) -> Any:
        """:meth:`_express` for a plan differentiated through leaf copies of the tensors it
        was built from (:meth:`_plan`), or without gradients."""
        b = x.shape[0]
        keys_in, keys_env = [name], list(env)
        tensors = [x, *env.values()]
        planned = self._plan(keys_in, keys_env, tensors, z0)
        if planned is None:
            return None
        fc = self.config.forward
        with grad_off():
            z_star, stats = get_solver(fc.solver)(planned[0].fn, z0, tol=fc.tol,
                                                  max_iter=fc.max_iter, **fc.options)
        stats.__dict__.pop("image", None)
        fn = self._t_fn(keys_in, keys_env)
        if not stats.all_converged:  # judged, masked or warned as any other call
            return self._finish(z_star, stats, z0, planned, None, fn, tensors, 1,
                                {keys_in[0]: x}, env, None, b, x.dtype, return_stats)
        self.__dict__["last_stats"] = stats
        z = self._attach(fn, tensors, z_star, z0, planned, None, None, b)
        return (z, stats) if return_stats else z

    def _t_fn(self, keys_in: list[str], keys_env: list[str]) -> Any:
        """``T(z, tensors)`` with the tensors in the order inputs (``keys_in``) then weights
        (``keys_env``): what the backward strategies differentiate."""
        n_in = len(keys_in)

        def fn(z: torch.Tensor, ts: Any) -> torch.Tensor:
            return self.T(z, dict(zip(keys_in, ts[:n_in])), dict(zip(keys_env, ts[n_in:])))

        return fn

    def _finish(self, z_star: torch.Tensor, stats: SolverStats, z0: torch.Tensor,
                planned: tuple[Plan, list[torch.Tensor]] | None,
                compiled: tuple[CompiledSteps, CompiledSteps] | None, fn: Any,
                tensors: list[torch.Tensor], n_in: int, inputs: dict[str, torch.Tensor],
                env: dict[str, torch.Tensor], bad_in: torch.Tensor | None, b: int,
                out_dtype: torch.dtype, return_stats: bool) -> Any:
        """After the solve: judge it (raise / warn / mask), attach the backward strategy,
        apply the output map, put masked samples back, shape the output."""
        mode = self.config.backward.mode
        # over the whole batch (dropped samples: non-finite), kept when _judge raises
        batch_stats = stats if bad_in is None else _expand_stats(stats, ~bad_in)
        self.__dict__["last_stats"] = batch_stats
        ok, all_ok = self._judge(stats, bad_in)
        # batch index of each solved sample (None: the solve saw the whole batch), so that the
        # backward's statistics and messages name batch samples, not rows of a subset
        solved = torch.nonzero(~bad_in).flatten() if bad_in is not None else None
        if all_ok:
            z = z_star if mode == "unroll" else self._attach(
                fn, tensors, z_star, z0, planned, compiled and compiled[1], solved, b)
        else:  # gradients through the accepted samples only; the others are NaN
            assert ok is not None
            rows = torch.nonzero(ok).flatten()
            sub = [t[ok] if i < n_in else t for i, t in enumerate(tensors)]
            if mode == "unroll":
                z_ok, _ = self._unroll(lambda z: fn(z, sub), z0[ok])
            else:
                z_ok = self._attach(fn, sub, z_star[ok], z0[ok], None, None,
                                    rows if solved is None else solved[rows], b)
            z = z_star.detach().clone().index_put((rows,), z_ok)
            z = torch.where(ok[:, None], z, torch.full_like(z, float("nan")))
        derived = self.derived
        if derived.outputs is not None:  # the layer's outputs (the state without a map)
            z = derived.output(z, inputs, env)
        if bad_in is not None:  # put the dropped samples back (NaN)
            full = torch.full((b, z.shape[1]), float("nan"), dtype=z.dtype, device=z.device)
            z = full.index_put((torch.nonzero(~bad_in).flatten(),), z)
            stats = batch_stats
        if out_dtype in HALF:
            z = z.to(out_dtype)
        out = self._shape_out(z)
        return (out, stats) if return_stats else out

    # (no compile_disabled of its own: called only from _forward's disabled region)
    def _nonfinite_inputs(self, inputs: dict[str, torch.Tensor], b: int,
                          device: torch.device) -> torch.Tensor | None:
        """Samples with NaN/Inf inputs: named in a ``NonFiniteError``, or (mask mode) returned
        to be left out of the solve; None when every input is finite (one reduction each)."""
        bad_in = None
        for name, t in inputs.items():
            # the common case, one reduction: a finite norm means finite entries (an inf or NaN
            # makes it inf or NaN); only an overflowing norm needs the entrywise test.  (The
            # norm kernel is the one the solver's residuals use: already in the caches; no
            # detach, an operation of its own: the norm is taken without autograd.)
            with grad_off():
                if math.isfinite(float(torch.linalg.vector_norm(t))) \
                        or bool(torch.isfinite(t).all()):
                    continue
            bad = ~torch.isfinite(t).all(dim=1)
            if self.on_nonconvergence == "mask":
                self._refuse_coupled_mask()
            else:
                raise NonFiniteError(f"input '{name}' contains NaN or Inf in samples "
                                     f"{_indices(bad)}", term="forward",
                                     hint="clean those samples" + (
                                         "" if self._batch_coupled else ", or pass "
                                         "on_nonconvergence='mask' to drop them from the "
                                         "batch"))
            bad_in = bad if bad_in is None else bad_in | bad
        return bad_in

    def _compiled_steps(self, steps: int) -> tuple[CompiledSteps, CompiledSteps] | None:
        """The module's compiled chunks (forward, adjoint) of ``steps`` iterations, made on
        first use inside ``torch.compile`` (own dynamo caches; not pickled); None for 0/1."""
        if steps < 2:
            return None
        have = self.__dict__.get("_compiled")
        if have is None or have[0].chunk != steps:
            have = (CompiledSteps(steps), CompiledSteps(steps))
            self.__dict__["_compiled"] = have
        return have

    def _initial(self, z0: Any, b: int, dt: torch.dtype, dev: torch.device,
                 bad_in: torch.Tensor | None = None) -> torch.Tensor:
        """The flat start ``(B, N)``: zeros, or the given warm start, which must be finite
        except in the samples ``bad_in`` (NaN/Inf inputs, dropped from the solve)."""
        if z0 is None:
            return torch.zeros(b, self.state_size, dtype=dt, device=dev)
        if not isinstance(z0, torch.Tensor) or z0.ndim == 0 or z0.shape[0] != b \
                or z0.numel() != b * self.state_size:
            raise ShapeError(
                f"z0 has shape {tuple(getattr(z0, 'shape', ()))}, expected (B, "
                f"{self.state_size}) with B = {b} (or (B, *block shape))", term="forward",
                hint="pass z0 as a tensor with one flat state per sample",
            )
        z = z0.reshape(b, self.state_size).to(dt)
        with torch.no_grad():  # one reduction (a finite norm means finite entries)
            bad = None if math.isfinite(float(torch.linalg.vector_norm(z))) else \
                ~torch.isfinite(z).all(dim=1)
            if bad is not None and bad_in is not None:
                bad &= ~bad_in  # dropped samples: their start is never used
            if bad is not None and bool(bad.any()):
                # a NaN/Inf start would be reported as a diverged solve (and, warm-starting
                # from masked outputs, keep those samples NaN from call to call)
                raise NonFiniteError(
                    f"z0 contains NaN or Inf in samples {_indices(bad)}"
                    + (f" (after the cast to {dt})" if z0.dtype != dt else ""), term="forward",
                    hint="pass a finite warm start (e.g. torch.nan_to_num(z0) for outputs "
                    "masked by on_nonconvergence='mask'), or leave z0 out to start from 0")
        return z

    def _plan(self, keys_in: list[str], keys_env: list[str], tensors: list[torch.Tensor],
              z0: torch.Tensor, mode: str | None = None
              ) -> tuple[Plan, list[torch.Tensor]] | None:
        """``T`` planned for these inputs and weights (:mod:`lowering.plan`): state-free parts
        computed once, the transpose Jacobian as a closure.  With gradients needed (implicit
        backward) the plan is built with autograd from leaf copies of ``tensors``, so that the
        backward differentiates it with respect to them (returned with the plan; ``[]`` when no
        gradient is needed).  None for layers without a plan (several state blocks, or a node
        that has none)."""
        if len(self.blocks) != 1 or not getattr(self, "_plannable", True):  # (older pickles)
            return None
        on = torch.is_grad_enabled()
        grad = False
        if on and (mode or self.config.backward.mode) == "implicit":
            for t in tensors:
                if t.requires_grad:
                    grad = True
                    break
        leaves = ([t.detach().requires_grad_() if t.requires_grad else t for t in tensors]
                  if grad else tensors)
        n_in = len(keys_in)
        ctx = PlanContext(self.blocks[0].name, dict(zip(keys_in, leaves[:n_in])),
                          dict(zip(keys_env, leaves[n_in:])), z0.shape[0], z0)
        node = self.derived.nodes[self.blocks[0].name]
        if grad == on:  # (no grad-mode switch to pay for)
            plan = node.plan(ctx)
        else:
            with torch.set_grad_enabled(grad):
                plan = node.plan(ctx)
        if plan is None:
            self._plannable = False  # the node tree does not change: do not ask again
            return None
        # without gradients the plan holds the tensors themselves (no leaves for a backward);
        # a plan whose value always has the state's shape needs no Root (nothing to broadcast)
        return (plan if getattr(plan, "batch_shaped", False) else Root(plan)), \
            (leaves if grad else [])

    def _attach(self, fn: Any, tensors: list[torch.Tensor], z_star: torch.Tensor,
                z0: torch.Tensor, planned: tuple[Plan, list[torch.Tensor]] | None = None,
                steps: CompiledSteps | None = None, rows: torch.Tensor | None = None,
                batch: int = 0) -> torch.Tensor:
        """The backward strategy's differentiable output at ``z_star`` (detached when no
        tensor needs a gradient); ``planned``: the forward's plan and the leaves it was built
        from (the implicit backward then linearises the plan instead of ``T``); ``rows``: the
        batch index of each row of ``z_star`` when it holds a subset of the ``batch`` samples
        (masked ones left out), None when it holds them all."""
        if planned is None or not planned[1]:  # (a plan built with leaves: both hold)
            if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
                return z_star.detach()
        cfg = self.config
        # (made per call: the options are read on every call, as config is mutable)
        adj = self._adjoint_config(steps if planned is not None else None, rows)
        if rows is None:
            sink = self._backward_sink
        else:
            def sink(st: SolverStats) -> None:
                # over the whole batch: samples left out of the backward read not converged,
                # residual NaN
                self.__dict__["last_backward_stats"] = st if rows is None else \
                    _spread_stats(st, rows, batch, dropped_nonfinite=False)

        problem = FixedPointProblem(fn, tensors, adj, sink)
        if planned is not None and planned[1]:  # built with autograd from leaf copies
            problem.plan, problem.leaves = planned
        return _strategy(cfg.backward.mode).attach(problem, z_star, z0, cfg.backward)

    def _adjoint_config(self, steps: CompiledSteps | None, rows: torch.Tensor | None
                        ) -> AdjointConfig:
        """How this module's adjoint fixed points are solved (``rows``: the batch index of
        each row of a subset, None for the whole batch)."""
        cfg = self.config
        return AdjointConfig(*cfg.adjoint_settings(), cfg.on_nonconvergence, cfg.backward.adjoint,
                             not self._batch_coupled, steps, rows)

    def _backward_sink(self, st: SolverStats) -> None:
        """The adjoint solve's statistics, as ``last_backward_stats`` (a plain attribute, as
        ``last_stats``)."""
        self.__dict__["last_backward_stats"] = st

    # (no compile_disabled of its own: called only from _forward's disabled region)
    def _solve(self, f: Any, z0: torch.Tensor, inputs: dict, env: dict,
               steps: CompiledSteps | None = None, planned: bool = False
               ) -> tuple[torch.Tensor, SolverStats]:
        """The forward solve.  Its data-dependent loop is never traced; under ``torch.compile``
        (``steps`` given) plain iterations of the planned ``T`` run in compiled chunks
        (:func:`~lowering.solvers.compiled_steps`), the injections and Gram matrices still
        computed once per call (docs/guide.md).  ``planned``: ``f`` is a plan's evaluation,
        whose state-free parts are computed already (no partial evaluation needed)."""
        cfg = self.config
        if planned and steps is None and cfg.sam is None and not compiled_steps_set():
            fc = cfg.forward  # the common call: a plan, eager (no contexts but gradients off)
            with grad_off():
                return get_solver(fc.solver)(f, z0, tol=fc.tol, max_iter=fc.max_iter,
                                             **fc.options)
        with grad_off(), compiled_steps(steps):
            if cfg.sam is not None:
                with partial_evaluation():
                    return sam_iterate(self, f, z0, inputs, env)
            fc = cfg.forward
            solver = get_solver(fc.solver)
            if planned:
                return solver(f, z0, tol=fc.tol, max_iter=fc.max_iter, **fc.options)
            with partial_evaluation():
                return solver(f, z0, tol=fc.tol, max_iter=fc.max_iter, **fc.options)

    def _unroll(self, f: Any, z0: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
        """``K`` plain iterations with autograd; the returned point is the last iterate."""
        if z0.shape[0] == 0:  # an empty batch (e.g. every sample masked out): nothing to
            # measure; one application keeps the (empty) output in the graph of the weights
            return f(z0), _empty_stats("unroll", z0, self.tol)
        tr = Tracker("unroll", z0, self.tol)
        z = z0
        for _ in range(self.config.backward.unroll_steps):
            fz = f(z)
            tr.record_residual(_rel(fz.detach(), z.detach()))
            z = fz
        with torch.no_grad():
            tr.record(z.detach(), f(z.detach()))  # the residual of the returned iterate
        return z, tr.stats()

    # ------------------------------------------------------------------ failures
    def _judge(self, stats: SolverStats, bad_in: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, bool]:
        """``(ok mask of the solved samples, whether all are ok)``; raises / warns per
        ``on_nonconvergence``.  ``bad_in``: samples dropped for NaN/Inf inputs (None: none).
        The mask is None when the solver knows every sample converged (nothing to mask)."""
        if stats.all_converged and self.backward != "unroll":
            return None, True
        nonfinite = stats.nonfinite if stats.nonfinite is not None else \
            torch.zeros_like(stats.converged)
        # an unrolled layer is K iterations by definition: only NaN/Inf fails it
        ok = ~nonfinite if self.backward == "unroll" else stats.converged
        if bool(ok.all()):
            return ok, True
        ok = ok.clone()
        if bool(nonfinite.any()):
            self._refuse_nonfinite_weights()
        if bad_in is None:
            bad_in = torch.zeros(ok.numel(), dtype=torch.bool, device=ok.device)
        keep = ~bad_in
        idx_map = torch.nonzero(keep).flatten()  # solved sample → batch index
        failed_batch = torch.zeros_like(bad_in)
        failed_batch[idx_map[~ok]] = True
        nf_batch = torch.zeros_like(bad_in)
        nf_batch[idx_map[nonfinite]] = True
        bad = int((~ok).sum())
        lip = self._contraction_text()
        if bool(nonfinite.any()):
            what = (f"the iterates of samples {_indices(nf_batch)} became NaN/Inf "
                    f"(diverged) under {stats.solver}")
        else:
            what = ""
        conv = (f"{bad}/{ok.numel()} samples (indices {_indices(failed_batch)}) did not reach "
                f"relative residual {stats.tol:g} in {stats.residuals.shape[1]} iterations of "
                f"{stats.solver} (worst {stats.max_residual:.3e}); {lip}")
        msg = f"{what}; {conv}" if what else conv
        hint = self._hint()
        # NaN/Inf iterates (divergence) raise unless the caller opted into NaN outputs (mask)
        if self.on_nonconvergence == "raise" or (bool(nonfinite.any()) and
                                                  self.on_nonconvergence != "mask"):
            cls = NonFiniteError if bool(nonfinite.any()) else ConvergenceError
            raise cls(msg, term="forward", hint=hint)
        if self.on_nonconvergence == "warn":  # finite, unconverged samples: their best iterate
            warnings.warn(f"forward: {msg}. Hint: {hint}", ConvergenceWarning, stacklevel=3)
            return torch.ones_like(ok), True
        self._refuse_coupled_mask()
        warnings.warn(f"forward: {msg}; their outputs are NaN and excluded from the backward "
                      "(on_nonconvergence='mask')", ConvergenceWarning, stacklevel=3)
        return ok, False

    def _refuse_coupled_mask(self) -> None:
        """``on_nonconvergence='mask'`` set on the config of a layer that couples its batch
        (refused at construction, but the config is mutable): removing samples changes the
        others' ``T``, so masking would return wrong values for the kept samples."""
        if self._batch_coupled:
            raise OptionError("on_nonconvergence='mask' needs a layer whose samples are "
                              "independent; this objective couples the batch (its T changes "
                              "when samples are removed)", term="forward",
                              hint="set module.config.on_nonconvergence to 'raise' or 'warn'")

    def _refuse_nonfinite_weights(self) -> None:
        """After NaN/Inf iterates: a weight or constant with NaN/Inf entries is named (a
        ``NonFiniteError``, in every mode: it poisons every sample).  :meth:`env` checks them
        once per change of a weight's version, which a write through ``.data`` does not make;
        this check runs only when a solve has failed."""
        tensors = {**self._weight_values(),
                   **{n: getattr(self, f"const_{n}") for n in self._const_names}}
        for name, t in tensors.items():
            with torch.no_grad():
                if not bool(torch.isfinite(t).all()):
                    raise NonFiniteError(
                        f"parameter '{name}' contains NaN or Inf (the solve's iterates became "
                        "NaN/Inf); it was written without a version change of the tensor "
                        "(e.g. through .data), so it was not caught when it was read",
                        term=name, hint="check the optimizer step / the loaded state_dict")

    def _hint(self) -> str:
        """What to change — never an option that is already set."""
        tips = [f"raise max_iter (now {self.max_iter})" if self.sam is None else
                f"raise SAMConfig.max_iter (now {self.sam.max_iter}) or its tol (now "
                f"{self.sam.tol:g})"]
        if self.solver not in ("anderson", "auto") and self.sam is None:
            tips.append("use solver='anderson'")
        lip = getattr(self, "_lip_cache", None)  # (_judge evaluates it before asking)
        if self.solver == "anderson" and self.sam is None and lip is not None \
                and len(lip) > 2 and lip[2] < 1:
            tips.append(f"use solver='plain' (Lip(T) ≤ {lip[2]:.4g} < 1 here: plain iteration "
                        "converges, at that rate, where Anderson can stall on a slow "
                        "contraction)")
        if self.weight_control is None and controlled_conditions(self.derived,
                                                                 list(self.weights.keys())):
            tips.append("keep the certified norms below their bounds with "
                        "weight_control='spectral_norm' (off here)")
        if self.on_nonconvergence == "raise" and not self._batch_coupled:
            tips.append("or pass on_nonconvergence='mask' to drop failing samples")
        elif self.on_nonconvergence == "raise":
            tips.append("or pass on_nonconvergence='warn' to train through it")
        return ", ".join(tips)

    def _contraction_text(self) -> str:
        """The contraction estimate at the current weights (re-evaluated at most every 30 s
        outside raise mode: the estimate runs power iterations, too costly for every step)."""
        c = self.derived.contraction
        now = time.monotonic()
        cached = getattr(self, "_lip_cache", None)
        if self.on_nonconvergence != "raise" and cached is not None and now - cached[0] < 30:
            return f"{cached[1]} (estimated {now - cached[0]:.0f} s ago)"
        value = math.nan
        try:
            with torch.no_grad():
                env = {k: v.detach() for k, v in self.env().items()}
                value = c.value(env)
                text = c.describe(env, value)
        except Exception as err:
            text = f"{c.formula} (could not evaluate: {err})"
        self._lip_cache = (now, text, value)
        return text

    def extra_repr(self) -> str:
        """State shapes, solver, backward, tolerance and weight control, for ``repr``."""
        wc = self.weight_control.mode if self.weight_control is not None else None
        return (f"state={[(b.name, b.shape) for b in self.blocks]}, solver={self.solver}, "
                f"backward={self.backward}, tol={self.tol:g}, max_iter={self.max_iter}, "
                f"weight_control={wc}")


def _rel(fz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    from .solvers import rel_residual

    return rel_residual(fz, z)


def _expand_stats(stats: SolverStats, keep: torch.Tensor) -> SolverStats:
    """Statistics of the solved subset spread back over the batch (dropped samples: not
    converged, non-finite, NaN residuals)."""
    return _spread_stats(stats, torch.nonzero(keep).flatten(), keep.shape[0],
                         dropped_nonfinite=True)


def _spread_stats(stats: SolverStats, rows: torch.Tensor, b: int,
                  dropped_nonfinite: bool) -> SolverStats:
    """Statistics of a subset (row ``i`` is batch sample ``rows[i]``, ascending) spread over the
    ``b`` samples of the batch: the others not converged, 0 iterations, NaN residuals, and
    non-finite as ``dropped_nonfinite`` says."""
    k = stats.residuals.shape[1]
    dev = stats.residuals.device
    res = torch.full((b, k), float("nan"), dtype=stats.residuals.dtype, device=dev)
    res[rows] = stats.residuals
    it = torch.zeros(b, dtype=stats.iterations.dtype, device=dev)
    it[rows] = stats.iterations
    conv = torch.zeros(b, dtype=torch.bool, device=dev)
    conv[rows] = stats.converged
    nf = torch.full((b,), dropped_nonfinite, dtype=torch.bool, device=dev)
    assert stats.nonfinite is not None
    nf[rows] = stats.nonfinite
    ret = None
    if stats.returned_residual is not None:
        ret = torch.full((b,), float("nan"), dtype=stats.returned_residual.dtype, device=dev)
        ret[rows] = stats.returned_residual
    return SolverStats(stats.solver, res, it, conv, stats.tol, nf, ret)


def _checked_builder(build: Any, plan: Any, ctx: PlanContext) -> Any:
    """``build`` (a node tree's :meth:`~lowering.nodes.Node.held_builder`) when it rebuilds
    ``plan`` — made by the general path at ``ctx`` — exactly: the same input tensor ``c`` or an
    equal one, an equal ``M`` (symmetric alike), the same activation functions (``σ``, its
    in-place form, ``σ'``, ``σ'`` from the value); else False (the general path is kept:
    a builder that disagrees is a bug, never a different layer).  Checked once per module, on
    the call that made ``plan``."""
    if build is None:
        return False
    again = build(ctx.values, ctx.env, ctx.like)  # (in the call's grad mode: the same test)
    same = again is not None and type(again) is type(plan) and again.f is plan.f \
        and again.f_inplace is plan.f_inplace and again.df is plan.df \
        and again.df_of_value is plan.df_of_value and again.mat.symmetric == plan.mat.symmetric \
        and (again.c is plan.c or torch.equal(again.c, plan.c)) and torch.equal(again.m, plan.m)
    return build if same else False


#: :meth:`EquilibriumModule._forward` itself, called while ``torch._dynamo`` is not loaded (its
#: ``compile_disabled`` wrapper then runs it as is)
_FORWARD_CALL = EquilibriumModule._forward
_FORWARD = _FORWARD_CALL.__wrapped__
_set_grad_enabled = torch._C._set_grad_enabled


def _strategy(mode: str) -> BackwardStrategy:
    """The registered backward strategy ``mode`` (``config.backward.mode``, read on every call:
    the config is mutable in place)."""
    return BACKWARD_STRATEGIES.get(mode) or get_backward(mode)  # (the latter: a typed error)


def _batch_coupled(derived: DerivedLayer) -> bool:
    src = derived.source
    layers = getattr(src, "layers", None) or [src]
    return any(getattr(t, "batch_coupled", False)
               for obj in layers for t in getattr(obj, "terms", []))
