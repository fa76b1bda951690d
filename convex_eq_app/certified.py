"""Certified accuracy on MNIST-1D (``convex-eq certified``): a conv OptEq and a MON trained under a
declared Lipschitz target (``TrainingSettings(lipschitz_target=…)``, docs/theory.md §9.6), then,
on the test set, clean accuracy, certified accuracy at a few ℓ2 radii (the certified radius of
``EquilibriumClassifier.certified_radius``, which accounts for each equilibrium's a posteriori
error bound) and an ℓ2 projected-gradient attack inside each sample's certified radius, whose
success rate must be 0.

The certificate is evaluated on the trained weights in float64 (the same classifier, its
weights exactly representable): clean accuracy, radii and the attack all read that model.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import lowering
from convex_eq import models
from convex_eq.errors import ConvergenceWarning
from lowering.runtime.classifier import EquilibriumClassifier, TrainingSettings
from verify.bounds import attack_certified

from .data import Dataset, mnist1d
from .training import TrainConfig, fit


@dataclass
class CertifiedConfig:
    """Architecture, Lipschitz target, training budget, radii and attack of the row."""

    channels: int = 16
    kernel: int = 5
    pooled: int = 8
    lipschitz_target: float = 1.0
    contraction_target: float = 0.5
    epochs: int = 8
    batch: int = 64
    lr: float = 1e-2
    tol: float = 1e-4
    max_iter: int = 40
    radii: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
    #: the forward solve's tolerance when certifying and attacking (the error bound of a
    #: tighter solve takes less of each margin)
    certify_tol: float = 1e-8
    certify_max_iter: int = 400
    attack_steps: int = 50
    attack_restarts: int = 3
    models: tuple[str, ...] = ("conv OptEq", "MON")
    seed: int = 0
    train_subset: int = 0  # 0: the whole training part
    test_subset: int = 0  # 0: the whole test part

    @classmethod
    def quick_config(cls) -> CertifiedConfig:
        """The smoke version (well under a minute): tiny layers, one epoch on a subset."""
        return cls(channels=4, kernel=3, pooled=4, epochs=1, train_subset=256, test_subset=48,
                   attack_steps=50, attack_restarts=2, max_iter=30, certify_tol=1e-6)


def _objective(name: str, cfg: CertifiedConfig, shape: tuple[int, ...]) -> Any:
    if name == "conv OptEq":
        return models.opteq(conv=(cfg.channels, cfg.kernel), image=shape, seed=cfg.seed)
    if name == "MON":
        return models.mon(conv=(cfg.channels, cfg.kernel), image=shape, seed=cfg.seed)
    from convex_eq.errors import OptionError

    raise OptionError(f"unknown model {name!r}", term="certified",
                      hint="use 'conv OptEq' or 'MON'")


def build(name: str, cfg: CertifiedConfig, shape: tuple[int, ...]) -> EquilibriumClassifier:
    """The classifier ``name`` with the Lipschitz target kept by weight control."""
    torch.manual_seed(cfg.seed)
    settings = TrainingSettings(tol=cfg.tol, max_iter=cfg.max_iter,
                                lipschitz_target=cfg.lipschitz_target,
                                contraction_target=cfg.contraction_target)
    return EquilibriumClassifier(lowering.lower(_objective(name, cfg, shape)), settings,
                                 pool="max", pooled=cfg.pooled)


@dataclass
class CertifiedRow:
    """One model: clean and certified accuracies (``certified[str(radius)]``), the certified
    Lipschitz bound, the attack, and the time spent."""

    name: str
    clean: float
    certified: dict[str, float]
    lipschitz: float
    median_radius: float
    attacked: int
    attack_changed: int
    train_seconds: float
    certify_seconds: float
    attack_seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def evaluate(model: EquilibriumClassifier, x: torch.Tensor, y: torch.Tensor,
             cfg: CertifiedConfig) -> dict[str, Any]:
    """Clean accuracy, certified accuracies, Lipschitz bound and the attack, in float64 with the
    forward solved to ``cfg.certify_tol``."""
    model.cpu().double().eval()
    model.settings = replace(model.settings, dtype=torch.float64)  # (prepare casts inputs to it)
    fc = model.eq.config.forward  # (the module reads its options on every call)
    fc.tol, fc.max_iter = cfg.certify_tol, cfg.certify_max_iter
    model.eq.config.backward.tol = cfg.tol  # (the attack's gradients: the training accuracy)
    x, y = x.double().cpu(), y.cpu()
    t0 = time.perf_counter()
    certs = [model.certified_radius(x[i:i + 500]) for i in range(0, len(x), 500)]
    pred = torch.cat([c.prediction for c in certs])
    radius = torch.cat([c.radius for c in certs])
    t1 = time.perf_counter()
    rep = attack_certified(model, x, steps=cfg.attack_steps, restarts=cfg.attack_restarts,
                           seed=cfg.seed)
    t2 = time.perf_counter()
    correct = pred == y
    return {"clean": float(correct.double().mean()),
            "certified": {f"{r:g}": float((correct & (radius >= r)).double().mean())
                          for r in cfg.radii},
            "lipschitz": certs[0].lipschitz,
            "median_radius": float(radius[correct].median()) if bool(correct.any()) else 0.0,
            "attacked": rep.attacked, "attack_changed": int(rep.changed.sum()),
            "certify_seconds": t1 - t0, "attack_seconds": t2 - t1}


def run_model(name: str, cfg: CertifiedConfig, data: Dataset) -> CertifiedRow:
    """Train ``name`` under the Lipschitz target, then certify and attack it."""
    model = build(name, cfg, data.shape)
    tc = TrainConfig(epochs=cfg.epochs, batch=cfg.batch, lr=cfg.lr, seed=cfg.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = fit(model, data, tc, name)
        ev = evaluate(model, data.x_test, data.y_test, cfg)
    return CertifiedRow(name, ev["clean"], ev["certified"], ev["lipschitz"],
                        ev["median_radius"], ev["attacked"], ev["attack_changed"],
                        res.train_time, ev["certify_seconds"], ev["attack_seconds"], res.history)


def table(rows: list[CertifiedRow], cfg: CertifiedConfig) -> str:
    """The Markdown table of the rows."""
    head = ["model", "Lip(x ↦ z*) ≤", "clean", *[f"cert. r={r:g}" for r in cfg.radii],
            "median radius", "attack success in radius"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.name, f"{r.lipschitz:.3f}", f"{100 * r.clean:.1f} %",
                 *[f"{100 * r.certified[f'{x:g}']:.1f} %" for x in cfg.radii],
                 f"{r.median_radius:.3f}", f"{r.attack_changed}/{r.attacked}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _subset(data: Dataset, cfg: CertifiedConfig) -> Dataset:
    n, m = cfg.train_subset or len(data.y_train), cfg.test_subset or len(data.y_test)
    return replace(data, x_train=data.x_train[:n], y_train=data.y_train[:n],
                   x_test=data.x_test[:m], y_test=data.y_test[:m])


def run(out: str | Path = "convex_eq_certified", cfg: CertifiedConfig | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Train, certify and attack every model of ``cfg``; write ``certified.md`` and
    ``certified.json`` to ``out`` and return what the JSON holds."""
    cfg = cfg or CertifiedConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = _subset(mnist1d(), cfg)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small layers: thread hand-offs cost more than they give
    try:
        for name in cfg.models:
            rows.append(run_model(name, cfg, data))
            if progress:
                print(f"[{time.perf_counter() - t0:6.0f} s] {name}: clean "
                      f"{100 * rows[-1].clean:.1f} %, attack {rows[-1].attack_changed}/"
                      f"{rows[-1].attacked}", flush=True)
    finally:
        torch.set_num_threads(threads)
    md = table(rows, cfg)
    setup = (f"MNIST-1D, {len(data.y_train)} train / {len(data.y_test)} test; {cfg.epochs} "
             f"epochs; Lipschitz target {cfg.lipschitz_target:g} (contraction target "
             f"{cfg.contraction_target:g}); certified with solves to {cfg.certify_tol:g}; PGD "
             f"{cfg.attack_steps} steps × "
             f"{cfg.attack_restarts} restarts; torch threads 1; load "
             f"{load0:.2f} → {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s")
    (out / "certified.md").write_text(f"{md}\n\n{setup}\n")
    result = {"config": asdict(cfg), "rows": [asdict(r) for r in rows], "setup": setup}
    (out / "certified.json").write_text(json.dumps(result, indent=1, default=float))
    if progress:
        print(md)
        print(setup)
    return result


__all__ = ["CertifiedConfig", "CertifiedRow", "build", "evaluate", "run", "run_model", "table"]
