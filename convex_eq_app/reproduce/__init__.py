"""``convex-eq reproduce``: the papers' claims in miniature (docs/reproduce.md).

Every claim is a registered :class:`~convex_eq_app.reproduce.registry.Claim` with its paper
reference, the paper's number and a criterion fixed before measuring; the runner trains the runs
their experiments list (each distinct model once), judges every claim and writes ``reproduce.md``
(the table ``claim | paper, table/figure | paper's number | measured here | holds?``, the setup,
seeds and wall time), one PNG per experiment and ``results.json``.  A claim that does not hold
here is reported as such.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from . import geq, mopteq, tpami  # noqa: F401  (registers the claims)
from .registry import CLAIMS, EXPERIMENTS, Budget, Verdict
from .runs import RunCache, execute


def select(only: Sequence[str] | None = None) -> list[str]:
    """Claim keys to run: all, or those named (a key or a prefix such as ``tpami``)."""
    if not only:
        return list(CLAIMS)
    keys = [k for k in CLAIMS if any(k == o or k.startswith(o) for o in only)]
    if not keys:
        from convex_eq.errors import OptionError

        raise OptionError(f"no claim matches {list(only)}", term="reproduce --only",
                          hint=f"claim keys: {', '.join(CLAIMS)}")
    return keys


def run(out: str | Path = "reproduce_out", quick: bool = False, device: str = "cpu",
        workers: int = 1, only: Sequence[str] | None = None, resume: bool = False,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the selected claims (all by default) and write the report into ``out``; returns
    ``{"verdicts", "measurements", "seconds", "out"}``.  ``resume``: reuse the runs an earlier
    invocation with the same budget finished into ``out/runs.jsonl`` (every finished run is
    appended there)."""
    import torch

    from convex_eq_app.training import resolve_device

    dev = str(resolve_device(device))
    budget = (Budget.quick_budget if quick else Budget.full)(device=dev, workers=workers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    keys = select(only)
    exps = list(dict.fromkeys(CLAIMS[k].experiment for k in keys))
    t0, load0 = time.perf_counter(), os.getloadavg()
    threads = 1 if dev == "cpu" else torch.get_num_threads()
    log(f"reproduce ({'quick' if quick else 'full'}): {len(keys)} claims, "
        f"{len(exps)} experiments, seeds {budget.seeds}, {budget.epochs} epochs, device {dev}")
    specs = [s for e in exps for s in EXPERIMENTS[e].runs(budget)]
    cache_file = out / "runs.jsonl"
    if not resume and cache_file.exists():
        cache_file.unlink()
    results = execute(specs, budget, log, RunCache(cache_file, budget))
    measurements = {e: EXPERIMENTS[e].summarize(budget, results) for e in exps}
    verdicts = {k: CLAIMS[k].judge(measurements[CLAIMS[k].experiment]) for k in keys}
    plots = {}
    for e in exps:
        if EXPERIMENTS[e].plot is not None:
            plots[e] = EXPERIMENTS[e].plot(measurements[e], out)
    seconds = time.perf_counter() - t0
    env = {"seconds": seconds, "load_start": load0, "load_end": os.getloadavg(),
           "torch_threads": threads, "torch": torch.__version__, "device": dev,
           "runs": len(results.by_key), "workers": budget.workers,
           "reused_runs": len(results.reused), "reused_seconds": sum(results.reused)}
    (out / "reproduce.md").write_text(report(budget, keys, verdicts, measurements, plots, env))
    (out / "results.json").write_text(json.dumps(
        {"budget": asdict(budget), "environment": env,
         "verdicts": {k: asdict(v) for k, v in verdicts.items()},
         "measurements": measurements, "runs": {repr(k): v for k, v in results.by_key.items()}},
        indent=1, default=_json))
    log(table(keys, verdicts))
    log(f"wrote {out / 'reproduce.md'} (+ {len(plots)} plots, results.json) in {seconds:.0f} s")
    return {"verdicts": verdicts, "measurements": measurements, "seconds": seconds,
            "out": str(out)}


def _reused(env: dict[str, Any]) -> str:
    if not env["reused_runs"]:
        return ""
    return (f" ({env['reused_runs']} runs reused from an earlier invocation, their own "
            f"training + evaluation {env['reused_seconds']:.0f} s)")


def _json(o: Any) -> Any:
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    return str(o)


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped (``||z||`` would split the row)."""
    return text.replace("|", "\\|")


def table(keys: Sequence[str], verdicts: dict[str, Verdict]) -> str:
    """``claim | paper, table/figure | paper's number | measured here | holds?``."""
    rows = ["| claim | paper, table/figure | paper's number | measured here | holds? |",
            "|---|---|---|---|---|"]
    for k in keys:
        c, v = CLAIMS[k], verdicts[k]
        rows.append("| " + " | ".join(_cell(t) for t in (
            c.statement, c.source, c.paper, v.measured, f"**{v.holds}**")) + " |")
    return "\n".join(rows)


def report(budget: Budget, keys: Sequence[str], verdicts: dict[str, Verdict],
           measurements: dict[str, Any], plots: dict[str, str | None], env: dict[str, Any]
           ) -> str:
    """The Markdown report (table, setup, criteria, plots)."""
    mode = "quick (CI smoke run: one seed, one epoch — not evidence)" if budget.quick else "full"
    data = (f"MNIST-1D (generated locally by the mnist1d package), "
            f"{budget.train or 4000} train / {budget.test or 1000} test signals")
    lines = [
        "# convex-eq reproduce: the papers' claims in miniature", "",
        f"Mode: {mode}. Data: {data}. Seeds: {', '.join(map(str, budget.seeds))} (mean ± sample "
        f"std over seeds). Training: Adam lr {budget.lr:g}, cosine schedule, {budget.epochs} "
        f"epochs, batch {budget.batch}; dense layers of width {budget.width}. Device "
        f"{env['device']}, torch {env['torch']}, {env['torch_threads']} torch thread(s) per "
        f"run, {env['workers']} worker process(es); {env['runs']} trained models; wall time "
        f"{env['seconds']:.0f} s{_reused(env)}; load average {env['load_start'][0]:.1f} at the "
        f"start, {env['load_end'][0]:.1f} at the end.", "",
        "A claim holds when its criterion (fixed before measuring) is met: a difference counts "
        "only when it is larger than the seed standard deviation of either side; "
        "'no (within seed spread)' means the measured difference is smaller than that.", "",
        table(keys, verdicts), "", "## Criteria", "",
    ]
    for k in keys:
        lines.append(f"- `{k}`: {CLAIMS[k].criterion}.")
    lines += ["", "## Experiments", ""]
    for e in measurements:
        exp = EXPERIMENTS[e]
        lines += [f"### {exp.title}", "", exp.setup, ""]
        if plots.get(e):
            lines += [f"![{e}]({plots[e]})", ""]
    return "\n".join(lines)


__all__ = ["CLAIMS", "EXPERIMENTS", "Budget", "run", "select", "table"]
