"""Strategies for emitted modules (``derived.torch_module(...)``) under numerical stress."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import lowering
from convex_eq import SqNorm, models
from lowering import SAMConfig
from lowering.runtime.guards import inputs_of
from lowering.runtime.weight_control import norm_conditions

MODELS = ("opteq", "opteq", "opteq-conj", "opteq-conj", "opteq-conv", "geq", "geq",
          "geq-patch", "deep", "deep-multiblock", "mopteq")
#: models whose operators (convolutions, pooling) are costly per application on CPU
HEAVY = ("opteq-conv", "mopteq")
ACTS = ("relu", "tanh", "sigmoid", "leaky_relu", "hardtanh", "identity", "softplus")


@dataclass
class ModuleCase:
    """A derived layer, the options of its module and a stressed input batch."""

    model: str
    derived: Any
    options: dict[str, Any]
    x: torch.Tensor
    magnitude: float
    weight_norm: float
    inject: str = "none"  # none | input-nan | input-inf | weight-nan | weight-inf
    notes: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"ModuleCase({self.model}, ||W||₂={self.weight_norm:g}, |x|~{self.magnitude:g}, "
                f"B={self.x.shape[0]}, inject={self.inject}, options={self.options}, "
                f"notes={self.notes})")

    def module(self) -> Any:
        return self.derived.torch_module(**self.options)


@functools.lru_cache(maxsize=256)
def build_derived(model: str, act: str, norm: float, seed: int) -> tuple[Any, tuple[int, ...]]:
    """A seed model (``convex_eq.models``) with spectral norm ``norm``; returns the derived layer
    and the input shape (without the batch)."""
    if model == "opteq":
        return lowering.lower(models.opteq(n=6, m=5, d=3, activation=act, weight_norm=norm,
                                           seed=seed)), (3,)
    if model == "opteq-conj":
        return lowering.lower(models.opteq(n=5, m=4, d=3, activation=act, form="conjugate",
                                           weight_norm=norm, seed=seed)), (3,)
    if model == "opteq-conv":
        return lowering.lower(models.opteq(conv=(2, 3), image=(1, 4, 4), activation=act,
                                           weight_norm=norm, seed=seed)), (1, 4, 4)
    if model == "geq":
        return lowering.lower(models.geq(n=5, p=4, d=3, activation=act, weight_norm=norm,
                                         seed=seed)), (3,)
    if model == "geq-patch":
        return lowering.lower(models.geq(n=8, p=8, d=3, activation=act, weight_norm=norm,
                                         patch=2, image=(2, 2, 2), h=3, seed=seed)), (3,)
    if model in ("deep", "deep-multiblock"):
        comp = models.deep_opteq(L=2, n=4, m=4, d=3, activation=act, alpha=0.5,
                                 weight_norm=norm, seed=seed)
        form = "multiblock" if model == "deep-multiblock" else "composition"
        return lowering.lower(comp, deep_form=form), (3,)
    if model == "mopteq":
        return lowering.lower(models.mopteq(d=3, activation=act, weight_norm=min(norm, 0.999) / 2,
                                            seed=seed)), (3,)
    raise ValueError(model)


@st.composite
def module_options(draw: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    dt = dtype or draw(st.sampled_from((torch.float32, torch.float64)))
    tol = draw(st.sampled_from((1e-7, 1e-6, 1e-4) if dt == torch.float32
                               else (1e-12, 1e-10, 1e-7, 1e-4)))
    return {
        "dtype": dt,
        "tol": tol,
        "solver": draw(st.sampled_from(("anderson", "plain", "broyden"))),
        "max_iter": draw(st.sampled_from((3, 40, 200))),
        "backward": draw(st.sampled_from(("implicit", "phantom", "unroll"))),
        "on_nonconvergence": draw(st.sampled_from(("raise", "warn"))),
    }


@st.composite
def module_cases(draw: Any, stress: bool = True) -> ModuleCase:
    """A module with stressed inputs: magnitudes 1e8 / 1e-12 / 1e20, ||W||₂ at 0.999,
    float32 near its tolerance limit, batch 1 or 4096, NaN/Inf in inputs or weights."""
    model = draw(st.sampled_from(MODELS))
    act = draw(st.sampled_from(ACTS))
    norm = draw(st.sampled_from((0.999, 0.999, 0.5, 1.05))) if stress else 0.9
    seed = draw(st.integers(0, 3))  # few seeds: derived layers are cached per (model, act, ...)
    derived, in_shape = build_derived(model, act, norm, seed)
    options = draw(module_options())
    batch = draw(st.sampled_from((1, 1, 3, 4096))) if stress else draw(st.integers(1, 3))
    if batch == 4096 or model in HEAVY:
        options["max_iter"] = min(options["max_iter"], 40)
    extra = draw(st.sampled_from(("none", "none", "none", "spectral_norm", "project", "sam")))
    options["weight_control"] = None  # the default ('auto') is exercised by "spectral_norm"
    if extra in ("spectral_norm", "project") and norm_conditions(derived):
        options["weight_control"] = extra
    elif extra == "sam" and len(derived.blocks) == 1 and model not in HEAVY:
        options["sam"] = SAMConfig(SqNorm(derived.blocks[0]) * 0.5, max_iter=200,
                                   tol=draw(st.sampled_from((1e-2, 1e-4))))
        if options["backward"] == "unroll":  # refused by design (typed OptionError, tested)
            options["backward"] = "implicit"
        # SAM stops by its own tol/max_iter (forward solve options are refused with it); the
        # drawn ones go to the adjoint where there is one (phantom gradients solve none and
        # refuse adjoint options)
        for key in ("solver", "tol", "max_iter"):
            value = options.pop(key)
            if options["backward"] == "implicit":
                options[f"backward_{key}"] = value
    mag = draw(st.sampled_from((1.0, 1e8, 1e-12, 1e20, 0.0, 1e-30))) if stress else 1.0
    g = torch.Generator().manual_seed(seed)
    x = (mag * torch.randn(batch, *in_shape, generator=g, dtype=torch.float64)).to(
        options["dtype"])
    inject = draw(st.sampled_from(("none", "none", "none", "input-nan", "input-inf",
                                   "weight-nan", "weight-inf"))) if stress else "none"
    notes: dict[str, Any] = {"act": act, "seed": seed}
    if inject.startswith("input"):
        i = draw(st.integers(0, x.numel() - 1))
        x.view(-1)[i] = math.nan if inject.endswith("nan") else -math.inf
        notes["index"] = i
    return ModuleCase(model, derived, options, x, mag, norm, inject, notes)


def inject_weights(module: Any, case: ModuleCase, draw_index: int) -> str:
    """Put a NaN/Inf into one entry of one learnable weight of ``module``."""
    names = sorted(module.weights.keys())
    name = names[draw_index % len(names)]
    with torch.no_grad():
        w = module.weights[name]
        w.view(-1)[draw_index % w.numel()] = math.nan if case.inject.endswith("nan") else math.inf
    return name


def f64_residual(module: Any, x: torch.Tensor, out: Any) -> tuple[np.ndarray, np.ndarray]:
    """``||T(z) − z||`` and ``||T(z)||`` per sample, recomputed in float64 with the module's
    weights at the returned ``z``."""
    outs = out if isinstance(out, tuple) else (out,)
    z = torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1).detach().to(torch.float64)
    env = {k: v.detach().to(torch.float64) for k, v in module.env().items()}
    inputs = {k: v.to(torch.float64) for k, v in inputs_of(module, x.to(torch.float64)).items()}
    with torch.no_grad():
        tz = module.T(z, inputs, env)
    return (tz - z).norm(dim=1).numpy(), tz.norm(dim=1).numpy()
