"""The emitted module's tensors: weights as ``nn.Parameter``s, constants and scalars as buffers,
learnable scalars; the name → tensor map ``T`` reads (``env``) with its guards; what
``state_dict`` and pickles carry besides them (docs/guide.md, the emitted module)."""

from __future__ import annotations

import hashlib
import pickle
import warnings
from typing import Any

import torch
from torch import nn

from convex_eq.errors import NonFiniteError, ShapeError
from lowering.derived import EDITS, DerivedLayer
from lowering.lower import lower

from .config import ModuleConfig
from .layer import Layer
from .scalars import LearnableScalar
from .versions import Checksums, finite
from .weight_control import WeightControlWarning


def fingerprint(derived: DerivedLayer) -> str:
    """A short hash of what the layer *is*: the objective, the rules applied and ``T``."""
    rules = [getattr(s, "rule", "") for s in getattr(derived.derivation, "steps", [])]
    text = "|".join([str(derived.source), ";".join(map(str, rules)),
                     " ".join(f"{b.name}:{b.shape}" for b in derived.blocks),
                     str(getattr(derived.claim, "kind", derived.claim))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def register_tensors(m: Layer, derived: DerivedLayer, cfg: ModuleConfig) -> None:
    """Weights (and constants made learnable) as parameters of ``m.weights``, other constants
    and fixed scalars as buffers, learnable scalars as unconstrained parameters
    ``m.scalar_params`` with the map onto their declared range."""
    dtype = cfg.dtype
    m.weights = nn.ParameterDict()
    m._checksums = Checksums()
    #: declared shapes, checked in env() (a wrongly shaped tensor put into ``weights`` or a
    #: buffer would otherwise surface as a torch broadcasting error deep inside T)
    m._shapes = {s.name: tuple(s.shape) for s in derived.parameters}
    m._const_names = []
    m._scalar_names = []
    m.scalar_params = nn.ParameterDict()
    m._scalar_maps = {}
    for s in derived.parameters:
        if s.kind == "weight" or (s.kind == "constant" and cfg.learnable_constants):
            m.weights[s.name] = nn.Parameter(s.value.detach().clone().to(dtype))
        elif s.kind == "constant":
            m.register_buffer(f"const_{s.name}", s.value.detach().clone().to(dtype))
            m._const_names.append(s.name)
        elif getattr(s, "learnable", False):
            scalar = LearnableScalar(s)
            m._scalar_maps[s.name] = scalar
            m.scalar_params[s.name] = nn.Parameter(
                torch.tensor(scalar.initial_raw(float(s.value)), dtype=torch.float64))
        else:
            m.register_buffer(f"scalar_{s.name}", torch.tensor(float(s.value),
                                                               dtype=torch.float64))
            m._scalar_names.append(s.name)
    if not len(m.weights) and not m._const_names:
        # no tensor follows .to()/.double()/.half() otherwise: the dtype would stay the
        # configured one (a float64 input then cast down to float32, silently)
        m.register_buffer("dtype_ref", torch.zeros((), dtype=dtype), persistent=False)


def weight_values(m: Layer) -> dict[str, torch.Tensor]:
    """The weights by name: the ParameterDict's own storage (same names and order as its
    ``items()``, which walk the container protocol per call), unless a
    ``torch.nn.utils.parametrize`` map replaced an entry by a computed value (its class is then
    a generated subclass, and the entry is absent from that storage)."""
    w = m.weights
    return w._parameters if type(w) is nn.ParameterDict else dict(w.items())


def dtype_from(m: Layer, weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The module's dtype from its weights (else its first constant, else its dtype buffer)."""
    ref = next(iter(weights.values()), None)
    if ref is None and m._const_names:
        ref = getattr(m, f"const_{m._const_names[0]}")
    if ref is None:  # a layer without tensors of its own: the dtype buffer
        ref = m._buffers.get("dtype_ref")
    return ref.dtype if ref is not None else m.config.dtype


def device_of(m: Layer) -> torch.device:
    """The device of the module's tensors (the CPU for a module without any)."""
    t = next(iter(weight_values(m).values()), None)
    if t is None:
        t = next(iter(m.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


def raw_env(m: Layer, weights: dict[str, torch.Tensor] | None = None
            ) -> dict[str, torch.Tensor]:
    """Name → tensor of the weights (before weight control), constants and scalars."""
    env: dict[str, torch.Tensor] = dict(weight_values(m) if weights is None else weights)
    for n in m._const_names:
        env[n] = getattr(m, f"const_{n}")
    for n in m._scalar_names:
        env[n] = getattr(m, f"scalar_{n}")
    for n, scalar in m._scalar_maps.items():
        env[n] = scalar.value(m.scalar_params[n])
    return env


def checked_env(m: Layer, weights: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """:func:`raw_env` with every shape and the finiteness of every tensor checked (from their
    content keys, :mod:`lowering.runtime.versions`: one reduction and one host synchronisation
    for all, a check no write can slip past), then weight control applied."""
    env = raw_env(m, weights) if m._const_names or m._scalar_names or m._scalar_maps \
        else dict(weights)  # (raw_env's whole work then, inline)
    shapes = m._shapes
    for n, t in env.items():
        want = shapes.get(n)
        if want is not None and tuple(t.shape) != want:
            raise ShapeError(f"parameter '{n}' has shape {tuple(t.shape)}, the layer "
                             f"declares {want}", term=n, hint="load weights of the declared shape")
    keys = m._checksums.keys(env)
    m.__dict__["_env_keys"] = keys  # (stamped on this forward's statistics)
    for n, key in keys.items():
        # an Inf weight can give a finite output (relu(-inf) = 0) with NaN gradients; a sum that
        # overflowed is confirmed entry by entry
        if not finite(key) and not bool(torch.isfinite(env[n]).all()):
            raise NonFiniteError(f"parameter '{n}' contains NaN or Inf", term=n,
                                 hint="check the optimizer step / the loaded state_dict")
    if m.weight_control is not None:
        env = m.weight_control(m, env, keys)
    return env


def refuse_nonfinite_weights(m: Layer) -> None:
    """After NaN/Inf iterates: a weight or constant with NaN/Inf entries is named (a
    ``NonFiniteError`` in every mode: it poisons every sample)."""
    tensors = {**weight_values(m), **{n: getattr(m, f"const_{n}") for n in m._const_names}}
    for name, t in tensors.items():
        with torch.no_grad():
            if not bool(torch.isfinite(t).all()):
                raise NonFiniteError(
                    f"parameter '{name}' contains NaN or Inf (the solve's iterates became "
                    "NaN/Inf)",
                    term=name, hint="check the optimizer step / the loaded state_dict")


def describe_layer(m: Layer) -> str:
    rules = [getattr(s, "rule", "?") for s in getattr(m.derived.derivation, "steps", [])]
    return f"{' → '.join(map(str, rules)) or 'layer'} of {m.derived.source}"[:200]


def extra_state(m: Layer) -> dict[str, Any]:
    """What ``state_dict`` carries besides the tensors: the derivation's fingerprint and the
    weight-control targets (raw weights mean the trained layer only together with them)."""
    targets = ({name: t for _, name, t in m.weight_control.targets}
               if m.weight_control is not None else {})
    return {"fingerprint": m._fingerprint, "layer": describe_layer(m), "weight_targets": targets}


def load_extra_state(m: Layer, state: Any) -> None:
    """Refuse weights saved from a different layer (same names and shapes, other ``T``);
    adopt the saved weight-control targets."""
    theirs = state.get("fingerprint") if isinstance(state, dict) else None
    if theirs != m._fingerprint:
        raise ShapeError(
            f"state_dict was saved from another layer ({state.get('layer', '?')}, "
            f"fingerprint {theirs}) and cannot be loaded into this one "
            f"({describe_layer(m)}, fingerprint {m._fingerprint})", term="load_state_dict",
            hint="lower the same objective with the same rules before loading its weights")
    targets = state.get("weight_targets") or {}
    if m.weight_control is not None:
        m.weight_control.targets = [(op, name, float(targets.get(name, t)))
                                    for op, name, t in m.weight_control.targets]
    elif targets:
        warnings.warn("the state_dict was saved by a module with weight control (targets "
                      f"{targets}); this module has none, so its layer uses the raw weights, "
                      "not the controlled ones that were trained", WeightControlWarning,
                      stacklevel=3)


def pickled_state(m: Layer) -> dict[str, Any]:
    """Pickle support: a derived layer that cannot be pickled (closures in its contraction
    estimate) is replaced by its objective and re-lowered on load (checked by fingerprint)."""
    state = m.__dict__.copy()
    state.pop("_compiled", None)  # compiled functions: made again on first use
    state.pop("_express_spec", None)  # decided again on first use
    state.pop("_held_builder", None)  # closures over the node tree: made again on use
    try:
        pickle.dumps(m.derived)
    except Exception:
        state["derived"] = None
        state["_relower_source"] = m.derived.source
        state["_relower_options"] = dict(getattr(m.derived, "lower_options", {}) or {})
        state["_relower_edits"] = tuple(getattr(m.derived, "edits", ()))
    return state


def relowered(state: dict[str, Any]) -> DerivedLayer | None:
    """The derived layer of an unpickled module whose layer was pickled as its objective
    (re-derived and checked against the saved fingerprint), else None."""
    source = state.pop("_relower_source", None)
    options = state.pop("_relower_options", {})
    edits = state.pop("_relower_edits", ())
    if source is None:
        return None
    derived = lower(source, **options)
    for name, opts in edits:
        derived = EDITS[name](derived, **opts)
    if fingerprint(derived) != state.get("_fingerprint"):
        raise ShapeError("the unpickled layer re-derives to a different layer "
                         f"({fingerprint(derived)} ≠ {state.get('_fingerprint')})",
                         term="unpickle", hint="unpickle with the same convex-eq version")
    return derived
