"""Training, verifying and evaluating the runs of the claim runner.

Every run is trained the way ``convex-eq train-table`` trains a model
(:func:`convex_eq_app.table.run_job`'s recipe): its model built by
:func:`convex_eq_app.reproduce.models.build` from the budget's
:class:`~convex_eq_app.configs.TableConfig`, the shared loop :func:`convex_eq_app.training.fit`
on :func:`convex_eq_app.table.table_data`, then its equilibrium layer verified against its
docs/theory.md §9 reference (:func:`convex_eq_app.training.verify_layer`) and measured by the
evaluators its runs ask for.  A run is reused instead when an earlier invocation finished it
(``--resume``, :class:`RunCache`) or a finished table trained it (``--from-table``,
:mod:`convex_eq_app.reproduce.from_table`: its metrics are read, its checkpoint loaded where an
evaluation needs the model).  Runs go to ``budget.workers`` spawned processes (one torch thread
each) or run in this process.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from convex_eq.errors import ConvergenceWarning, OptionError

from ..configs import Budget, TableConfig
from .evaluators import EVALUATORS
from .from_table import TableRuns, training_identity
from .models import build
from .registry import Results, RunSpec

_DATA: dict[str, Any] = {}


def dataset(cfg: TableConfig) -> Any:
    """The table's data set for ``cfg`` (:func:`convex_eq_app.table.table_data`), built once
    per process and config."""
    from ..table import table_data

    key = json.dumps(training_identity(cfg))
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = table_data(cfg)
    return _DATA[key]


def steps_of(cfg: TableConfig, n_train: int) -> int:
    """Optimiser steps of one run: ``epochs · ⌈n_train / batch⌉``."""
    return cfg.epochs * math.ceil(n_train / cfg.batch)


def result_metrics(res: dict[str, Any], cfg: TableConfig, n_train: int) -> dict[str, Any]:
    """A run's metrics from its :class:`~convex_eq_app.training.Result` (as a dict, the form
    the table's ``results.json`` rows have): accuracy, size, time, solver statistics, the share
    of training steps whose forward solve stopped at its iteration cap, the verification."""
    steps = steps_of(cfg, n_train)
    capped = [int(c) for c in res.get("nonconvergence") or (0, 0)]
    hist = res.get("history") or []
    return _finite({
        "accuracy": float(res["accuracy"]), "params": int(res["params"]),
        "train_time": float(res["train_time"]),
        "epoch_seconds": [float(h["seconds"]) for h in hist],
        "fwd_iters": res.get("mean_iterations"), "final_residual": res.get("final_residual"),
        "capped_steps": capped, "steps": steps, "capped_fraction": capped[0] / steps,
        "verification": res.get("verification") or "—",
        "last_epoch": hist[-1] if hist else {}})


def _finite(v: Any) -> Any:
    """NaN → None (JSON-safe), recursively."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(a) for k, a in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(a) for a in v]
    return v


def _model(spec: RunSpec, budget: Budget) -> tuple[Any, TableConfig, Any]:
    if budget.device == "cpu":
        torch.set_num_threads(1)
    data = dataset(budget.table_config())
    model, cfg = build(spec.model, budget.table_config(), data.shape, spec.seed, **spec.kwargs)
    return model, cfg, data


def _evaluate(model: Any, data: Any, spec: RunSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in spec.evals:
        if e not in EVALUATORS:
            raise OptionError(f"unknown evaluation {e!r}", term="reproduce",
                              hint=f"one of {sorted(EVALUATORS)}")
        out[e] = EVALUATORS[e](model, data, spec)
    return _finite(out)


def verify(model: Any, data: Any, cfg: TableConfig) -> str:
    """The trained layer's verification as the table reports it (a model without an
    equilibrium layer: "—"; a reference that fails to run: "not verified: …", never a pass)."""
    from lowering.runtime.classifier import EquilibriumClassifier

    from ..training import verify_layer

    if not isinstance(model, EquilibriumClassifier):
        return "—"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        try:
            return verify_layer(model, data.x_test, cfg.verify_inputs)
        except Exception as err:  # reported in the report's run table, never a pass
            return f"not verified: {type(err).__name__}: {err}"[:160]


def train_one(spec: RunSpec, budget: Budget, state: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Build, train (the shared loop, the table's recipe), evaluate and verify one run; returns
    its metrics (picklable) and fills ``state`` with the trained ``state_dict`` when given."""
    from ..progress import cpu_state, report_epoch
    from ..training import TrainConfig, fit

    model, cfg, data = _model(spec, budget)
    tc = TrainConfig(epochs=cfg.epochs, batch=cfg.batch, lr=cfg.lr, seed=spec.seed,
                     weight_decay=cfg.weight_decay, shift=cfg.shift, device=cfg.device)
    res = fit(model, data, tc, spec.label(),
              on_epoch=lambda row: report_epoch(spec.label(), row))
    evals = _evaluate(model, data, spec)
    res.verification = verify(model, data, cfg)
    if state is not None:
        state.update(cpu_state(model))
    return {**result_metrics(asdict(res), cfg, len(data.y_train)), **evals}


def evaluate_checkpoint(spec: RunSpec, budget: Budget, checkpoint: Path) -> dict[str, Any]:
    """The evaluations of ``spec`` on the model built by the same builder with the trained
    weights of ``checkpoint`` loaded (a reused table run)."""
    model, cfg, data = _model(spec, budget)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu"))
    model.to(torch.device(cfg.device))
    return _evaluate(model, data, spec)


def merge(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """One spec per trained model, with the union of the evaluations asked for (first-seen
    order)."""
    out: dict[tuple[Any, ...], RunSpec] = {}
    for s in specs:
        if s.key in out:
            old = out[s.key]
            evals = old.evals + tuple(e for e in s.evals if e not in old.evals)
            out[s.key] = replace(old, evals=evals)
        else:
            out[s.key] = s
    return list(out.values())


def budget_identity(budget: Budget) -> str:
    """What a finished run depends on besides its spec: the training config (JSON)."""
    return json.dumps(training_identity(budget.table_config()), sort_keys=True)


class RunCache:
    """Finished runs appended to ``path`` (one JSON line each: the budget's identity, the run's
    key and evaluations, its metrics and wall seconds), so that an interrupted or split full run
    can be resumed (``convex-eq reproduce --resume``): a run is reused only for the same
    training config and when it holds every evaluation asked for."""

    def __init__(self, path: Path | None, budget: Budget):
        self.path = path
        self.ident = budget_identity(budget)
        self.entries: dict[str, dict[str, Any]] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e.get("budget") == self.ident:
                    self.entries[e["key"]] = e

    def get(self, spec: RunSpec) -> dict[str, Any] | None:
        e = self.entries.get(repr(spec.key))
        if e is None or not set(spec.evals) <= set(e["evals"]):
            return None
        return e

    def put(self, spec: RunSpec, metrics: dict[str, Any], seconds: float) -> None:
        if self.path is None:
            return
        e = {"budget": self.ident, "key": repr(spec.key), "evals": list(spec.evals),
             "metrics": metrics, "seconds": seconds}
        with self.path.open("a") as f:
            f.write(json.dumps(e) + "\n")


def _job(job: tuple[str, RunSpec, Budget, Any]) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """``("train", spec, budget, None)`` or ``("evaluate", spec, budget, (row, checkpoint))``
    → ``(metrics, wall seconds, state_dict or {})``."""
    kind, spec, budget, extra = job
    t0 = time.perf_counter()
    state: dict[str, Any] = {}
    if kind == "train":
        m = train_one(spec, budget, state)
    else:
        row, ckpt = extra
        cfg = budget.table_config()
        n_train = len(dataset(cfg).y_train)
        m = {**result_metrics(row, cfg, n_train), **evaluate_checkpoint(spec, budget, ckpt)}
    return m, time.perf_counter() - t0, state


def _table_row(spec: RunSpec, budget: Budget, table: TableRuns | None) -> dict[str, Any] | None:
    """The table's row of ``spec`` when the table trained this very run (a table model with
    no parameters, same seed, same training)."""
    if table is None or spec.params:
        return None
    return table.row(spec.model, spec.seed, budget.table_config())


def execute(specs: Sequence[RunSpec], budget: Budget, log: Callable[[str], None] = print,
            cache: RunCache | None = None, progress: bool = True,
            checkpoints: Path | None = None, table: TableRuns | None = None) -> Results:
    """Train every run that is neither in ``cache`` nor in ``table`` (in ``budget.workers``
    processes when > 1, a progress bar counting epochs) and evaluate the reused table runs from
    their checkpoints; logs one line per run and, with ``checkpoints`` (a folder), writes each
    model trained here to ``checkpoints/checkpoints/<run>.pt``."""
    from ..progress import run_all, save_checkpoint

    cfg = budget.table_config()
    cache = cache or RunCache(None, budget)
    results = Results(n_test=len(dataset(cfg).y_test))
    jobs: list[tuple[str, RunSpec, Budget, Any]] = []
    for s in merge(specs):
        hit = cache.get(s)
        row = _table_row(s, budget, table)
        if hit is not None:
            results.by_key[s.key] = hit["metrics"]
            results.origin[s.key] = "resumed"
            results.reused.append(hit["seconds"])
        elif row is not None and not s.evals:
            results.by_key[s.key] = result_metrics(row, cfg, len(dataset(cfg).y_train))
            results.origin[s.key] = "table"
            results.by_key[s.key]["checkpoint"] = str(table.checkpoint(row))  # type: ignore[union-attr]
        elif row is not None:
            jobs.append(("evaluate", s, budget, (row, table.checkpoint(row))))  # type: ignore[union-attr]
        else:
            jobs.append(("train", s, budget, None))
    if results.reused:
        log(f"reusing {len(results.reused)} finished runs from {cache.path}")
    n_table = sum(1 for j in jobs if j[0] == "evaluate") + \
        sum(1 for o in results.origin.values() if o == "table")
    if table is not None:
        log(f"reusing {n_table} runs of the table(s) in "
            f"{', '.join(str(f) for f in table.folders)}")
    t0 = time.perf_counter()
    count = [0]

    def done(job: tuple[str, RunSpec, Budget, Any],
             res: tuple[dict[str, Any], float, dict[str, Any]]) -> None:
        kind, spec = job[0], job[1]
        m, sec, state = res
        count[0] += 1
        results.by_key[spec.key] = m
        results.origin[spec.key] = "trained" if kind == "train" else "table"
        if kind == "train" and checkpoints is not None:
            m["checkpoint"] = save_checkpoint(state, checkpoints, spec.label())
        elif kind == "evaluate":
            m["checkpoint"] = str(job[3][1])
        cache.put(spec, m, sec)  # after the checkpoint: a resumed run keeps its provenance
        what = "trained" if kind == "train" else "evaluated (table run)"
        log(f"[{count[0]:3d}/{len(jobs)} {time.perf_counter() - t0:6.0f} s] {spec.label()}: "
            f"{what}, acc {100 * m['accuracy']:.1f} % ({sec:.1f} s)")

    run_all(_job, jobs, workers=budget.workers,
            epochs=sum(cfg.epochs for j in jobs if j[0] == "train"), desc="reproduce",
            enabled=progress, on_done=done)
    return results


__all__ = ["RunCache", "dataset", "execute", "merge", "result_metrics", "train_one", "verify"]
