"""Measurements of a trained model that the claims read besides its test accuracy (registry
:data:`EVALUATORS`): the objective-derived perturbation against random noise (MOptEq Fig. 3(a)),
accuracy under the derived perturbation (MOptEq Tab. 5), corrupted test sets (GEQ Fig. 2),
feature norms (TPAMI Tab. 3(b)) and the timing and residual of TPAMI Tab. 8.

Each evaluator is ``(model, data, spec) → metrics`` on the run's data set
(:func:`convex_eq_app.table.table_data`); a quantity averaged over the test signals also
reports its variance over them divided by their number (``*_var``), the test-set term of the
comparison's standard error (:mod:`convex_eq_app.reproduce.power`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convex_eq.errors import ConvergenceWarning

from .registry import RunSpec

#: evaluation name → ``(trained model, data set, spec) → metrics``
Evaluator = Callable[[nn.Module, Any, RunSpec], dict[str, Any]]
EVALUATORS: dict[str, Evaluator] = {}


def register_evaluator(name: str) -> Callable[[Evaluator], Evaluator]:
    """``@register_evaluator(name)``: put the decorated evaluator into :data:`EVALUATORS`."""
    def deco(fn: Evaluator) -> Evaluator:
        EVALUATORS[name] = fn
        return fn
    return deco


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _test(data: Any, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    dev = _device(model)
    return data.x_test.to(dev), data.y_test.to(dev)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    from convex_eq_app.training import accuracy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return accuracy(model, x, y)


def _logits_from_layer_input(model: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """The classifier's logits when its layer reads ``u`` in place of ``g(x)`` (every branch
    input of a multi-branch layer gets the same ``u``)."""
    names = model.input_names  # type: ignore[attr-defined]
    feed = u if len(names) == 1 else {n: u for n in names}
    return model.fc(model.pooled_features(model.eq(feed)))  # type: ignore[operator]


def derived_attack(model: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``g(x) − δ`` with ``δ = argmax_{||δ||∞≤ε} G(z*; g(x) − δ) = −ε·sign(∇_u G(z*; u))`` at
    ``u = g(x)`` (the layer's input: the stem's features, or ``x`` without a stem), derived from
    the model's hidden objective (:func:`lowering.perturbation.perturbation`; MOptEq
    Proposition 2), ``z*`` the equilibrium of ``g(x)``; a layer with one input per branch (all
    fed the same ``g(x)``) gets the gradient summed over its inputs, so one ``δ`` perturbs the
    shared features (MOptEq adds δ to ``g(x)``)."""
    from lowering.perturbation import perturbation

    eq = model.eq  # type: ignore[attr-defined]
    pert = perturbation(eq.derived.source, eps)
    env = eq.env()  # the trained (effective) weights
    with torch.no_grad():
        u = model.prepare(x)  # type: ignore[operator]
        names = model.input_names  # type: ignore[attr-defined]
        z = eq(u if len(names) == 1 else {n: u for n in names})
        blocks = z if isinstance(z, tuple) else (z,)
        values = {b.name: t.flatten(1) for b, t in zip(eq.blocks, blocks)}
        values.update({s.name: u.flatten(1) for s in eq.input_syms})
        grad = torch.zeros_like(u.flatten(1))
        for t in pert.terms:
            for g in t.grad(values, env, wrt="input").values():
                grad = grad + g
    return u + eps * torch.sign(grad).reshape(u.shape)


def _attacked_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float,
                       batch: int = 1000) -> float:
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            u = derived_attack(model, x[i:i + batch], eps)
            correct += int((_logits_from_layer_input(model, u).argmax(1)
                            == y[i:i + batch]).sum())
    return correct / max(1, len(x))


def _noisy_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                    noise: Callable[[torch.Tensor], torch.Tensor], batch: int = 1000) -> float:
    """Accuracy with ``noise(g(x))`` added to the layer's input."""
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            u = model.prepare(x[i:i + batch])  # type: ignore[operator]
            correct += int((_logits_from_layer_input(model, u + noise(u)).argmax(1)
                            == y[i:i + batch]).sum())
    return correct / max(1, len(x))


#: perturbation sizes ε (ℓ∞, on the layer's input) of MOptEq Fig. 3(a)'s x axis
EPSILONS = (0.05, 0.1, 0.2, 0.3)
#: ε at which PE's robustness is compared (PE's training ε, MOptEq A.6.1)
EPS_ROBUST = 0.1
#: random directions averaged per ε (MOptEq Fig. 3(a): "averaged for five trials")
TRIALS = 5


@register_evaluator("perturbation")
def _perturbation(model: nn.Module, data: Any, spec: RunSpec) -> dict[str, Any]:
    """Test accuracy under the objective-derived perturbation and under random ±ε (binomial)
    and uniform [−ε, ε] noise of the same ℓ∞ size on the layer's input (mean of ``TRIALS``
    draws), for each ε of ``EPSILONS``."""
    x, y = _test(data, model)
    g = torch.Generator().manual_seed(spec.seed + 1000)
    out: dict[str, Any] = {"eps": list(EPSILONS), "reconstructed": [], "binomial": [],
                           "uniform": []}
    model.eval()
    for eps in EPSILONS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            out["reconstructed"].append(_attacked_accuracy(model, x, y, eps))
            acc_b, acc_u = [], []
            for _ in range(TRIALS):
                def sign(u: torch.Tensor, e: float = eps) -> torch.Tensor:
                    return e * (torch.randint(0, 2, u.shape, generator=g).to(u) * 2 - 1)

                def unif(u: torch.Tensor, e: float = eps) -> torch.Tensor:
                    return e * (torch.rand(u.shape, generator=g).to(u) * 2 - 1)

                acc_b.append(_noisy_accuracy(model, x, y, sign))
                acc_u.append(_noisy_accuracy(model, x, y, unif))
        out["binomial"].append(sum(acc_b) / TRIALS)
        out["uniform"].append(sum(acc_u) / TRIALS)
    return out


@register_evaluator("robustness")
def _robustness(model: nn.Module, data: Any, spec: RunSpec) -> dict[str, Any]:
    """Test accuracy under the objective-derived perturbation of ``g(x)`` at ``EPS_ROBUST``."""
    x, y = _test(data, model)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return {"eps": EPS_ROBUST, "accuracy": _attacked_accuracy(model, x, y, EPS_ROBUST)}


#: corruption levels: Gaussian noise σ (standardized units) and blur σ (positions)
CORRUPTION_LEVELS = {"noise": (0.25, 0.5, 1.0), "blur": (0.5, 1.0, 2.0)}


@register_evaluator("corruptions")
def _corruptions(model: nn.Module, data: Any, spec: RunSpec) -> dict[str, Any]:
    """Test accuracy on the corrupted test sets of :func:`convex_eq_app.data.corrupted`
    (seeded noise, Gaussian blur along the signal) at each level of ``CORRUPTION_LEVELS``."""
    from convex_eq_app.data import corrupted

    dev = _device(model)
    out: dict[str, Any] = {}
    for kind, levels in CORRUPTION_LEVELS.items():
        accs = []
        for level in levels:
            c = corrupted(data, kind, level, seed=0)
            accs.append(_accuracy(model, c.x_test.to(dev), c.y_test.to(dev)))
        out[kind] = accs
    out["levels"] = {k: list(v) for k, v in CORRUPTION_LEVELS.items()}
    return out


@register_evaluator("features")
def _features(model: nn.Module, data: Any, spec: RunSpec) -> dict[str, Any]:
    """Mean ``|z_j|`` and mean ``z_j²`` over every entry of the test equilibria (TPAMI Tab. 3:
    "the mean values are taken on the whole feature tensor"), with the variance over the test
    signals of each signal's mean divided by their number (``*_var``)."""
    x, _ = _test(data, model)
    model.eval()
    per_abs, per_sq = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for i in range(0, len(x), 1000):
            z = model.features(x[i:i + 1000])  # type: ignore[operator]
            z = torch.cat([t.flatten(1) for t in z], 1) if isinstance(z, tuple) else z.flatten(1)
            per_abs.append(z.abs().mean(1).double())
            per_sq.append((z * z).mean(1).double())
    a, s = torch.cat(per_abs), torch.cat(per_sq)
    n = len(a)
    return {"mean_abs": float(a.mean()), "mean_abs_var": float(a.var()) / n,
            "mean_sq": float(s.mean()), "mean_sq_var": float(s.var()) / n}


#: TPAMI Tab. 8 times 80 steps at batch 125; here ``TIMED_BATCHES`` of them
TIMED_BATCH, TIMED_BATCHES = 125, 8


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@register_evaluator("timing")
def _timing(model: nn.Module, data: Any, spec: RunSpec) -> dict[str, Any]:
    """TPAMI Tab. 8: inference time (forward, no gradient) and back-propagation time
    (``loss.backward()`` alone) summed over ``TIMED_BATCHES`` batches of 125, and the relative
    residual ``||T(z) − z||/||T(z)||`` of the returned state, averaged over the test set (with
    its variance over the signals divided by their number)."""
    dev = _device(model)
    x_test, _ = _test(data, model)
    xs = [x_test[i:i + TIMED_BATCH] for i in range(0, len(x_test), TIMED_BATCH)]
    starts = range(0, min(len(data.x_train), TIMED_BATCH * TIMED_BATCHES), TIMED_BATCH)
    xt = [data.x_train[i:i + TIMED_BATCH].to(dev) for i in starts]
    yt = [data.y_train[i:i + TIMED_BATCH].to(dev) for i in starts]
    res, infer, bp = [], 0.0, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.eval()
        with torch.no_grad():
            for x in xs:
                st = model.measure(x)  # type: ignore[operator]
                res.append(st.final_residual.double())
            for x in xs[:TIMED_BATCHES]:
                _sync(dev)
                t0 = time.perf_counter()
                model(x)
                _sync(dev)
                infer += time.perf_counter() - t0
        model.train()
        for x, y in zip(xt, yt):
            loss = nn.functional.cross_entropy(model(x), y)
            _sync(dev)
            t0 = time.perf_counter()
            loss.backward()
            _sync(dev)
            bp += time.perf_counter() - t0
        model.zero_grad()
        model.eval()
    r = torch.cat(res)
    return {"residual": float(r.mean()), "residual_var": float(r.var()) / len(r),
            "infer_s": infer, "backprop_s": bp, "batches": min(len(xs), TIMED_BATCHES)}


__all__ = ["CORRUPTION_LEVELS", "EPSILONS", "EPS_ROBUST", "EVALUATORS", "derived_attack",
           "register_evaluator"]
