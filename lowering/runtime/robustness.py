"""Certified ℓ2 robustness of an :class:`~lowering.runtime.classifier.EquilibriumClassifier` and
weight bounds that keep a target Lipschitz constant (docs/theory.md §9.6).

``logits = A·P(o*(x)) + c``: for the predicted class ``k`` and every other class ``j`` the logit
difference ``g_j = f_k − f_j`` is ``||a_k − a_j||₂·Lip(P)·Lip(x ↦ o*)``-Lipschitz, so no input
within ``r = min_j (g_j − ||a_k − a_j||·Lip(P)·ε)/(||a_k − a_j||·Lip(P)·Lip(x ↦ o*))`` of ``x``
changes the prediction of the exact equilibrium classifier; ``ε`` is the a posteriori error bound
of the computed equilibrium (:mod:`lowering.runtime.bounds`), which the computed margin is
corrected by.  ``||a_k − a_j||₂ ≤ √2·||A||₂``: the radius is at least the usual
``margin/(√2·Lip(head∘pool)·Lip(x ↦ o*))``.

``Lip(P)`` of the pooling (:data:`POOL_LIPSCHITZ`): adaptive max pooling is
``√(max_i m_i)``-Lipschitz with ``m_i`` the number of windows that hold position ``i`` (1 for
non-overlapping windows, e.g. 40 positions into 4 or 8); adaptive average pooling
``√(max_i Σ_{w ∋ i} 1/|w|)`` (``1/√k`` for non-overlapping windows of ``k``); flattening is 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from convex_eq.errors import CertificateError

from .bounds import certified_norms, certify, contraction, module_constants
from .weight_control import controlled_conditions, layer_terms


# ----------------------------------------------------------------------------- pooling
def _windows(n: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive windows ``[⌊i·n/out⌋, ⌈(i + 1)·n/out⌉)``."""
    return [((i * n) // out, -((-(i + 1) * n) // out)) for i in range(out)]


def _axis_max(n: int, out: int) -> float:
    """``max_i`` of the number of windows holding position ``i``."""
    cover = [0] * n
    for a, b in _windows(n, out):
        for i in range(a, b):
            cover[i] += 1
    return float(max(cover))


def _axis_avg(n: int, out: int) -> float:
    """``max_i Σ_{w ∋ i} 1/|w|``."""
    cover = [0.0] * n
    for a, b in _windows(n, out):
        for i in range(a, b):
            cover[i] += 1.0 / (b - a)
    return max(cover)


def _adaptive(per_axis: Callable[[int, int], float]) -> Callable[[nn.Module, tuple], float]:
    def lip(layer: nn.Module, shape: tuple[int, ...]) -> float:
        spatial = shape[1:]
        out = layer.output_size  # type: ignore[attr-defined]
        outs = (out,) * len(spatial) if isinstance(out, int) else tuple(out)
        return math.sqrt(math.prod(per_axis(n, o if o is not None else n)
                                   for n, o in zip(spatial, outs)))

    return lip


#: pooling layer type → ``Lip(layer)`` in ℓ2 on a block of shape ``(C, *spatial)``
POOL_LIPSCHITZ: dict[str, Callable[[nn.Module, tuple], float]] = {
    "AdaptiveMaxPool1d": _adaptive(_axis_max),
    "AdaptiveMaxPool2d": _adaptive(_axis_max),
    "AdaptiveAvgPool1d": _adaptive(_axis_avg),
    "AdaptiveAvgPool2d": _adaptive(_axis_avg),
    "Flatten": lambda layer, shape: 1.0,
}


def pool_lipschitz(pool: nn.Module, shape: tuple[int, ...]) -> float:
    """``Lip`` of one block's pooling (a layer of :data:`POOL_LIPSCHITZ` or a Sequential of
    them)."""
    layers = list(pool) if isinstance(pool, nn.Sequential) else [pool]
    out = 1.0
    for layer in layers:
        fn = POOL_LIPSCHITZ.get(type(layer).__name__)
        if fn is None:
            raise CertificateError(f"no Lipschitz constant is known for {type(layer).__name__}",
                                   term="certified_radius",
                                   hint="register one in lowering.runtime.robustness."
                                   "POOL_LIPSCHITZ")
        out *= fn(layer, shape)
    return out


# ----------------------------------------------------------------------------- radius
@dataclass
class Certification:
    """Per sample: the predicted class, its logit margin, the error bound ``ε`` of the
    equilibrium and the certified ℓ2 radius (0 where nothing is certified); the constants used
    (``Lip(x ↦ o*)`` w.r.t. the classifier's input and ``Lip(P)``)."""

    prediction: torch.Tensor
    margin: torch.Tensor
    error: torch.Tensor
    radius: torch.Tensor
    lipschitz: float
    pool_lipschitz: float

    def certified(self, y: torch.Tensor, radius: float) -> torch.Tensor:
        """Correct and certified at ``radius`` (per sample, bool)."""
        return (self.prediction == y.to(self.prediction.device)) & (self.radius >= radius)


def input_lipschitz(model: Any) -> float:
    """``Lip(x ↦ o*)`` w.r.t. the classifier's own input: the layer's bound times ``√k`` when
    ``k`` branch inputs all read the same ``x`` (a reshape is an isometry)."""
    lip = module_constants(model.eq).require("lipschitz")
    return lip.value * math.sqrt(len(model.input_names))


def certified_radius(model: Any, x: torch.Tensor) -> Certification:
    """The certified ℓ2 radius of every sample of ``x`` (module docstring); evaluation mode,
    no gradient."""
    for part, what in (("stem", "a stem before the layer"),
                       ("fusion", "the average fusion of the branches")):
        if getattr(model, part, None) is not None:
            raise CertificateError(f"no Lipschitz constant is derived for {what}",
                                   term="certified_radius",
                                   hint=f"certify a classifier built without {part}=")
    model.eval()
    lx = input_lipschitz(model)
    blocks = model.eq.derived.output_blocks
    lp = max(pool_lipschitz(p, tuple(b.shape)) for p, b in zip(model.pools, blocks))
    with torch.no_grad():
        logits = model(x).double()
        eps = model.eq.error_bound().to(logits.device)
        a = model.fc.weight.detach().double()
    pred = logits.argmax(1)
    diff = logits.gather(1, pred[:, None]) - logits  # (B, classes): f_k − f_j
    rows = (a[pred][:, None, :] - a[None, :, :]).norm(dim=2)  # ||a_k − a_j||
    slope = rows * lp
    other = torch.ones_like(diff, dtype=torch.bool).scatter_(1, pred[:, None], False)
    safe = torch.where(other, (diff - slope * eps[:, None]) / (slope * lx), torch.inf)
    radius = safe.min(dim=1).values.clamp_min(0.0)
    top2 = torch.where(other, diff, torch.inf).min(dim=1).values
    return Certification(pred.cpu(), top2.cpu(), eps.cpu(), radius.cpu(), lx, lp)


# ----------------------------------------------------------------------------- weight bounds
def injection_weights(derived: Any) -> list[tuple[Any, str]]:
    """``(operator, weight name)`` of every linear map applied to an input in the terms of
    ``T`` (``U`` of ``⟨Ux + b, z⟩``), one weight each."""
    out: list[tuple[Any, str]] = []
    for t in layer_terms(derived):
        for a in t.args:
            for e in a.entries:
                if e.symbol.kind != "input" or e.op is None:
                    continue
                ws = [s for s in e.op.symbols() if s.kind == "weight"]
                if len(ws) == 1 and all(ws[0].name != n for _, n in out):
                    out.append((e.op, ws[0].name))
    return out


def _norms(env: dict[str, torch.Tensor], ops: list[tuple[Any, str]]) -> dict[str, float]:
    """Certified ``||op||₂`` of each weight's operator at ``env``."""
    with certified_norms(), torch.no_grad():
        return {name: op.norm(env) for op, name in ops}


def _scaled(env: dict[str, torch.Tensor], now: dict[str, float], norm: Callable[[str], float]
            ) -> dict[str, torch.Tensor]:
    """``env`` with each weight of ``now`` (its norm there) rescaled to norm ``norm(name)``
    (the operators are linear in their weight)."""
    out = dict(env)
    for name, cur in now.items():
        if cur > 0:
            out[name] = env[name] * (norm(name) / cur)
    return out


def lipschitz_weight_bounds(derived: Any, target: float, contraction_target: float = 0.5
                            ) -> dict[str, float]:
    """``weight_bounds`` under which ``Lip(x ↦ o*) ≤ target`` for every weight value that
    satisfies them (docs/theory.md §9.6): the certificate's norm-controlled weights get a
    common fraction ``t`` of their bounds such that ``Lip(T) ≤ contraction_target`` (bisection
    on ``t``; every certified ``Lip(T)`` formula is nondecreasing in the norms), and the
    injection weights ``U_i`` a common norm ``s`` with the resulting Lipschitz bound at most
    ``target`` (it is linear in ``s``).  Layers whose constants need no contraction (monotone
    inclusions) only bound the injections."""
    if not (target > 0 and 0 < contraction_target < 1):
        raise CertificateError(f"target {target} must be > 0 and contraction_target "
                               f"{contraction_target} in (0, 1)", term="lipschitz_target")
    env = {s.name: torch.as_tensor(s.resolve(None), dtype=torch.float64)
           for s in derived.parameters}
    inj = injection_weights(derived)
    if not inj:
        raise CertificateError("no weight applies a linear map to the input",
                               term="lipschitz_target", hint="declare the injection as U @ x")
    controlled = [(op, n, b) for op, n, b in controlled_conditions(derived)
                  if all(n != m for _, m in inj)]
    loose = _unkept(derived, {*(n for _, n in inj), *(n for _, n, _ in controlled)})
    if loose:
        raise CertificateError(f"the weights {loose} move the layer's Lipschitz constant and no "
                               "norm bound keeps them", term="lipschitz_target",
                               hint="a layer whose contraction rests on norm conditions of "
                               "single weights (OptEq, deep OptEq) or a monotone inclusion")
    bounds: dict[str, float] = {}
    if controlled:
        now = _norms(env, [(op, n) for op, n, _ in controlled])
        t = _contraction_fraction(derived, env, now, {n: b for _, n, b in controlled},
                                  contraction_target)
        bounds = {n: t * b for _, n, b in controlled}
        env = _scaled(env, now, bounds.__getitem__)
    unit = certify(derived, _scaled(env, _norms(env, inj), lambda n: 1.0)).require("lipschitz")
    s = target / unit.value
    return {**bounds, **{n: s for _, n in inj}}


def _unkept(derived: Any, kept: set[str]) -> list[str]:
    """Trained weights the layer's constants read that no bound keeps: every weight of the
    objective except biases (added to an argument as they are) — none for a monotone inclusion
    or saddle whose margin holds for every weight (their bound reads ``U`` and ``m`` only)."""
    p = derived.payload
    if type(p).__name__ == "SaddlePayload" or (
            type(p).__name__ == "SplittingPayload" and p.inclusion.margin(None).for_every_weight):
        return []
    out: list[str] = []
    for t in layer_terms(derived):
        for a in t.args:
            for e in a.entries:
                if e.symbol.kind == "input" and (e.op is None or len(
                        [s for s in e.op.symbols() if s.kind == "weight"]) != 1):
                    out.append(f"{e.symbol.name} (not through one weight)")
        biases = {e.symbol.name for a in t.args for e in a.entries
                  if e.symbol.kind == "weight" and e.op is None}
        for s in t.symbols():
            if s.kind == "weight" and s.name not in kept | biases and s.name not in out:
                out.append(s.name)
    return out


def _contraction_fraction(derived: Any, env: dict, now: dict[str, float],
                          bound: dict[str, float], goal: float) -> float:
    """The largest ``t`` (to 2⁻³⁰) with ``Lip(T) ≤ goal`` when every controlled weight (norm
    ``now`` at ``env``) has norm ``t·bound``."""

    def lip(t: float) -> float:
        e = _scaled(env, now, lambda n: t * bound[n])
        with certified_norms(), torch.no_grad():
            return contraction(derived, e).value

    lo, hi = 0.0, 1.0
    if lip(hi) <= goal:
        return hi
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if lip(mid) <= goal else (lo, mid)
    return lo


__all__ = ["POOL_LIPSCHITZ", "Certification", "certified_radius", "injection_weights",
           "input_lipschitz", "lipschitz_weight_bounds", "pool_lipschitz"]
