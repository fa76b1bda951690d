"""What the emitted module checks before it solves: its inputs (shape, layout, dtype, NaN/Inf),
the warm start, and the autograd modes it cannot serve (each a typed error naming the culprit
and what to do; docs/guide.md, the emitted module)."""

from __future__ import annotations

import math
from typing import Any

import torch

from convex_eq.errors import InputTypeError, NonFiniteError, OptionError, ShapeError
from lowering.derived import DerivedLayer

from .grad_mode import grad_off
from .layer import Layer


def indices(mask: torch.Tensor, limit: int = 10) -> str:
    """The indices where ``mask`` is True, at most ``limit`` of them, as text."""
    idx = [int(i) for i in torch.nonzero(mask).flatten()]
    return ", ".join(map(str, idx[:limit])) + (", …" if len(idx) > limit else "")


def batch_coupled(derived: DerivedLayer) -> bool:
    """Whether the objective couples the samples of a batch (its ``T`` changes when samples
    are removed)."""
    src = derived.source
    layers = getattr(src, "layers", None) or [src]
    return any(getattr(t, "batch_coupled", False)
               for obj in layers for t in getattr(obj, "terms", []))


def refuse_coupled_mask(m: Layer, term: str = "forward") -> None:
    """``on_nonconvergence='mask'`` on a layer that couples its batch (refused at construction,
    but the config is mutable): removing samples changes the others' ``T``."""
    if m._batch_coupled:
        hint = ("use on_nonconvergence='raise' or 'warn'" if term == "torch_module" else
                "set module.config.on_nonconvergence to 'raise' or 'warn'")
        raise OptionError("on_nonconvergence='mask' needs a layer whose samples are "
                          "independent; this objective couples the batch (its T changes "
                          "when samples are removed)", term=term, hint=hint)


def inputs_of(m: Layer, x: Any, dtype: torch.dtype | None = None
              ) -> dict[str, torch.Tensor]:
    """The inputs as name → flat ``(B, size)`` tensors of the module's dtype, checked."""
    syms = m.input_syms
    if isinstance(x, torch.Tensor) and len(syms) == 1 and x.layout == torch.strided \
            and not x.is_nested and not x.is_meta and x.ndim == 2 and x.shape[1] == syms[0].size:
        # the common call: one flat (B, size) dense input (a nested tensor has no .shape)
        dtype = m.dtype if dtype is None else dtype
        return {syms[0].name: x if x.dtype == dtype else x.to(dtype)}
    if x is None or (isinstance(x, dict) and not x):
        if syms:
            raise ShapeError(f"layer has inputs {[s.name for s in syms]}", term="forward",
                             hint="pass a dict name → tensor")
        return {}
    if isinstance(x, dict):
        given = x
        unknown = sorted(set(given) - {s.name for s in syms})
        if unknown:
            raise ShapeError(f"unknown input name(s) {unknown}; the layer's inputs are "
                             f"{[s.name for s in syms]}", term="forward",
                             hint="pass exactly the declared inputs by name")
    elif not syms:
        raise ShapeError("this layer has no input (its objective declares none), but one was "
                         "passed", term="forward", hint="call module() or module(None)")
    else:
        if len(syms) != 1:
            raise ShapeError(f"layer has inputs {[s.name for s in syms]}", term="forward",
                             hint="pass a dict name → tensor")
        given = {syms[0].name: x}
    dtype = m.dtype if dtype is None else dtype
    out = {s.name: _one_input(s, given, dtype) for s in syms}
    sizes = {k: v.shape[0] for k, v in out.items()} if len(out) > 1 else {}
    if len(set(sizes.values())) > 1:
        raise ShapeError(f"inputs have different batch sizes {sizes}", term="forward",
                         hint="batch every input along dim 0 with the same size")
    return out


def _one_input(s: Any, given: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Input ``s`` from ``given``, checked and made a flat ``(B, size)`` tensor of ``dtype``."""
    if s.name not in given:
        raise ShapeError(f"missing input '{s.name}'", term="forward")
    t = given[s.name]
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"input '{s.name}' is a {type(t).__module__}.{type(t).__name__}, "
                             "not a torch.Tensor", term="forward",
                             hint=f"convert it first: torch.as_tensor({s.name}) (a NumPy array: "
                             f"torch.from_numpy({s.name}))")
    if t.is_meta:  # (no values: the solve reads residuals on the host)
        raise InputTypeError(f"input '{s.name}' is on the meta device: it has no values to "
                             "solve for", term="forward",
                             hint="pass a tensor on a real device (cpu or cuda)")
    if t.is_nested:  # (its .shape fails untyped in the strided layout)
        raise ShapeError(f"input '{s.name}' is a nested tensor; the layer takes one dense "
                         "tensor batched along dim 0", term="forward",
                         hint=f"stack the samples: torch.stack({s.name}.unbind())")
    if t.layout != torch.strided:  # the solvers' norms and the plans need dense storage
        raise ShapeError(f"input '{s.name}' is a {t.layout} tensor; the layer takes dense "
                         "(strided) inputs", term="forward", hint=f"pass {s.name}.to_dense()")
    if tuple(t.shape[1:]) != s.shape and not (t.ndim == 2 and t.shape[1] == s.size):
        raise ShapeError(f"input '{s.name}' has shape {tuple(t.shape)}, expected "
                         f"(B, *{s.shape})", term="forward", hint="batch the input along dim 0")
    if t.dtype != dtype:  # documented: inputs are cast to the module's dtype
        t = t.to(dtype)
    # already flat (B, size): no reshape view (one autograd node less per call)
    return t if t.ndim == 2 and t.shape[1] == s.size else t.reshape(t.shape[0], s.size)


def nonfinite_inputs(m: Layer, inputs: dict[str, torch.Tensor]
                     ) -> torch.Tensor | None:
    """Samples with NaN/Inf inputs: named in a ``NonFiniteError``, or (mask mode) returned to
    be left out of the solve; None when every input is finite (one reduction each)."""
    bad_in = None
    for name, t in inputs.items():
        # one reduction in the common case: a finite norm means finite entries (an inf or NaN
        # makes it inf or NaN); only an overflowing norm needs the entrywise test
        with grad_off():
            if math.isfinite(float(torch.linalg.vector_norm(t))) \
                    or bool(torch.isfinite(t).all()):
                continue
        bad = ~torch.isfinite(t).all(dim=1)
        if m.config.on_nonconvergence == "mask":
            refuse_coupled_mask(m)
        else:
            raise NonFiniteError(f"input '{name}' contains NaN or Inf in samples "
                                 f"{indices(bad)}", term="forward",
                                 hint="clean those samples" + (
                                     "" if m._batch_coupled else ", or pass "
                                     "on_nonconvergence='mask' to drop them from the batch"))
        bad_in = bad if bad_in is None else bad_in | bad
    return bad_in


def initial_state(m: Layer, z0: Any, b: int, dt: torch.dtype, dev: torch.device,
                  bad_in: torch.Tensor | None = None) -> torch.Tensor:
    """The flat start ``(B, N)``: zeros, or the given warm start, which must be finite except
    in the samples ``bad_in`` (NaN/Inf inputs, dropped from the solve)."""
    n = m.state_size
    if z0 is None:
        return torch.zeros(b, n, dtype=dt, device=dev)
    if not isinstance(z0, torch.Tensor) or z0.ndim == 0 or z0.shape[0] != b \
            or z0.numel() != b * n:
        raise ShapeError(f"z0 has shape {tuple(getattr(z0, 'shape', ()))}, expected (B, {n}) "
                         f"with B = {b} (or (B, *block shape))", term="forward",
                         hint="pass z0 as a tensor with one flat state per sample")
    z = z0.reshape(b, n).to(dt)
    with torch.no_grad():  # one reduction (a finite norm means finite entries)
        bad = None if math.isfinite(float(torch.linalg.vector_norm(z))) else \
            ~torch.isfinite(z).all(dim=1)
        if bad is not None and bad_in is not None:
            bad &= ~bad_in  # dropped samples: their start is never used
        if bad is not None and bool(bad.any()):
            # a NaN/Inf start would be reported as a diverged solve (and, warm-starting from
            # masked outputs, keep those samples NaN from call to call)
            raise NonFiniteError(
                f"z0 contains NaN or Inf in samples {indices(bad)}"
                + (f" (after the cast to {dt})" if z0.dtype != dt else ""), term="forward",
                hint="pass a finite warm start (e.g. torch.nan_to_num(z0) for outputs masked "
                "by on_nonconvergence='mask'), or leave z0 out to start from 0")
    return z


def functorch_ok(m: Layer) -> bool:
    """Whether the active ``torch.func`` transforms can run this call: ``backward="unroll"``
    (plain autograd through ``K`` iterations, no autograd.Function) without weight control,
    under grad / jacrev / jvp of the inputs.  vmap (the residuals are read on the host) and
    transformed weights (``functional_call`` inside a transform: the env cache reads their
    storage) are refused."""
    if m.config.backward.mode != "unroll" or m.weight_control is not None:
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    if any(i.key() == torch._C._functorch.TransformType.Vmap
           for i in retrieve_all_functorch_interpreters()):
        return False
    from .parameters import weight_values
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(w)
                   for w in weight_values(m).values())


def refuse_transforms(m: Layer) -> None:
    """A typed error for ``torch.func`` transforms the module cannot serve: the solve reads
    residuals on the host every iteration and its backward is an autograd.Function."""
    if torch._C._are_functorch_transforms_active() and not functorch_ok(m):
        raise OptionError(
            "torch.func transforms (vmap, grad, jacrev, jvp, …) over the emitted module are "
            "not supported: its solve reads residuals on the host every iteration and its "
            "gradient is an autograd.Function for torch.autograd", term="forward",
            hint="batch samples along dim 0 instead of vmap, and take gradients with "
            "loss.backward() or torch.autograd.grad (create_graph=True for second order); "
            "torch.func.functional_call works")


def refuse_forward_ad(m: Layer, inputs: dict[str, torch.Tensor],
                      env: dict[str, torch.Tensor]) -> None:
    """Forward-mode AD (dual tensors) reaches the implicit and phantom backwards'
    autograd.Functions, which have no ``jvp``: a typed error before the solve."""
    if m.config.backward.mode == "unroll":
        return
    import torch.autograd.forward_ad as fwad
    duals = [k for k, t in (*inputs.items(), *env.items())
             if torch.is_tensor(t) and fwad.unpack_dual(t).tangent is not None]
    if duals:
        raise OptionError(
            f"forward-mode AD (dual tensors: {duals}) through backward="
            f"'{m.config.backward.mode}' is not supported: its gradient is a reverse-mode "
            "autograd.Function", term="forward",
            hint="take gradients with loss.backward() or torch.autograd.grad, or use "
            "backward='unroll' for forward-mode AD")
