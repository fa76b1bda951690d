"""``convex-eq reproduce``: the papers' claims tested on MNIST-1D with statistical power
(docs/reproduce.md).

Every claim is a registered :class:`~convex_eq_app.reproduce.registry.Claim` with its paper
reference, the paper's number and effect, and the comparisons that decide it, fixed before
measuring; the runner trains the runs their experiments list (each distinct model once; the
models of a finished ``train-table`` run are reused with ``from_table``), judges every claim
with the power rule of :mod:`convex_eq_app.reproduce.power` and writes ``reproduce.md`` (claim,
paper effect, measured difference, SE, MDD, verdict; seeds, wall time, machine load, torch
threads, command line), one PNG per experiment and ``results.json``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path
from typing import Any

from . import geq, mopteq, tpami  # noqa: F401  (registers the claims)
from .power import ALPHA, POWER
from .registry import CLAIMS, EXPERIMENTS, Budget, Results, Verdict
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
        log: Callable[[str], None] = print, seeds: Sequence[int] | None = None,
        epochs: int | None = None, progress: bool = True, argv: list[str] | None = None,
        from_table: str | Path | Sequence[str | Path] | None = None) -> dict[str, Any]:
    """Run the selected claims (all by default) and write the report into ``out``; returns
    ``{"verdicts", "measurements", "seconds", "out"}``.  ``resume``: reuse the runs an earlier
    invocation with the same budget finished into ``out/runs.jsonl`` (every finished run is
    appended there); ``seeds``/``epochs`` override the budget's (the report states them);
    ``progress``: a bar counting the epochs of all runs; ``argv``: the command line recorded in
    the report (default: this process's); ``from_table``: the output folder (or folders) of
    finished ``convex-eq train-table`` runs whose runs (same model, seed and training) are
    reused instead of trained (:func:`convex_eq_app.reproduce.from_table.load` refuses a
    table trained differently).  Each model trained here has its ``state_dict`` written to
    ``out/checkpoints/``."""
    import torch

    from convex_eq_app.errors import output_dir
    from convex_eq_app.provenance import collect
    from convex_eq_app.training import resolve_device

    dev = str(resolve_device(device))
    budget = (Budget.quick_budget if quick else Budget.full)(device=dev, workers=workers)
    if seeds:
        budget = replace(budget, seeds=tuple(int(s) for s in seeds))
    if epochs is not None:
        budget = replace(budget, epochs=int(epochs))
    table_runs = None
    if from_table is not None:
        from .from_table import load

        table_runs = load(from_table, budget.table_config())
    out = output_dir(out)
    prov = collect(argv, dev)
    keys = select(only)
    exps = list(dict.fromkeys(CLAIMS[k].experiment for k in keys))
    t0, load0 = time.perf_counter(), os.getloadavg()
    threads = 1 if dev == "cpu" else torch.get_num_threads()
    if quick:
        log(SMOKE)
    log(f"reproduce ({'quick' if quick else 'full'}): {len(keys)} claims, "
        f"{len(exps)} experiments, seeds {budget.seeds}, {budget.epochs} epochs, device {dev}")
    specs = [s for e in exps for s in EXPERIMENTS[e].runs(budget)]
    cache_file = out / "runs.jsonl"
    if not resume and cache_file.exists():
        cache_file.unlink()
    results = execute(specs, budget, log, RunCache(cache_file, budget), progress=progress,
                      checkpoints=out, table=table_runs)
    measurements = {e: EXPERIMENTS[e].summarize(budget, results) for e in exps}
    verdicts = {k: CLAIMS[k].judge(measurements[CLAIMS[k].experiment]) for k in keys}
    plots = {}
    for e in exps:
        if EXPERIMENTS[e].plot is not None:
            plots[e] = EXPERIMENTS[e].plot(measurements[e], out)
    seconds = time.perf_counter() - t0
    origins = list(results.origin.values())
    env = {"seconds": seconds, "load_start": load0, "load_end": os.getloadavg(),
           "cpus": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__,
           "device": dev, "runs": len(results.by_key), "workers": budget.workers,
           "trained_runs": origins.count("trained"), "table_runs": origins.count("table"),
           "from_table": (None if table_runs is None
                          else ", ".join(str(f) for f in table_runs.folders)),
           "reused_runs": len(results.reused), "reused_seconds": sum(results.reused),
           "n_test": results.n_test, "verification": _verifications(results)}
    (out / "reproduce.md").write_text(report(budget, keys, verdicts, measurements, plots, env,
                                             prov), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(
        {"kind": "reproduce", "provenance": prov, "budget": asdict(budget), "environment": env,
         "columns": COLUMNS, "claims": {k: {"statement": CLAIMS[k].statement,
                                            "source": CLAIMS[k].source,
                                            "paper": CLAIMS[k].paper} for k in keys},
         "verdicts": {k: asdict(v) for k, v in verdicts.items()},
         "power": {"alpha": ALPHA, "power": POWER},
         "measurements": measurements, "runs": {repr(k): v for k, v in results.by_key.items()}},
        indent=1, default=_json), encoding="utf-8")
    if quick:
        log(SMOKE)
    log(table(keys, verdicts))
    log(f"wrote {out / 'reproduce.md'} (+ {len(plots)} plots, results.json, checkpoints/) in "
        f"{seconds:.0f} s")
    return {"verdicts": verdicts, "measurements": measurements, "seconds": seconds,
            "out": str(out)}


SMOKE = ("SMOKE RUN (--quick): one seed, one epoch, the table's tiny models on 256 signals. It "
         "runs every claim's code; its verdicts are not evidence.")

#: what each column of the claim table means
COLUMNS = {
    "claim": "the paper's statement, as tested here",
    "paper, table/figure": "where the paper states it",
    "paper's number": "the paper's numbers, quoted as printed (its data sets and model sizes)",
    "paper effect": "the difference the paper reports for each comparison deciding the claim "
                    "(accuracy points, or a ratio ×r compared on the log scale); — where the "
                    "paper prints no number (a curve or bars)",
    "measured here": "the compared quantities on MNIST-1D: mean ± sample standard deviation "
                     "over the seeds",
    "difference": "the measured difference of each comparison (mean over the seeds)",
    "SE": "its standard error: the seed spread (sample std, ddof 1, over the seeds of each "
          "side) and the test set's binomial error p(1 − p)/N combined",
    "MDD": "the minimum detectable difference (t_{1−α/2,df} + t_{1−β,df})·SE at α = 0.05, "
           "power 0.8, df = seeds of both sides − 2",
    "verdict": "yes: the difference exceeds 0 at one-sided level α; no: the data exclude an "
               "effect as large as the paper's; inconclusive: neither; not resolvable here: "
               "the paper's effect is below the MDD (never a no); a claim of several "
               "comparisons is yes only when each is",
}


def _verifications(results: Results) -> dict[str, str]:
    """Each run's verification of its trained layer (the table's, for a reused table run)."""
    return {repr(k): str(m.get("verification", "—")) for k, m in results.by_key.items()}


def _json(o: Any) -> Any:
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    return str(o)


def table(keys: Sequence[str], verdicts: dict[str, Verdict]) -> str:
    """The claim table (:func:`convex_eq_app.results.claims_table`, the columns of
    :data:`COLUMNS`)."""
    from convex_eq_app.results import claims_table

    claims = {k: {"statement": CLAIMS[k].statement, "source": CLAIMS[k].source,
                  "paper": CLAIMS[k].paper} for k in keys}
    return claims_table(keys, claims, {k: asdict(verdicts[k]) for k in keys})


def _verified_lines(env: dict[str, Any]) -> list[str]:
    """How many trained layers passed their verification, and the ones that did not."""
    ver = env["verification"]
    checked = {k: v for k, v in ver.items() if v != "—"}
    bad = {k: v for k, v in checked.items() if not v.endswith(", pass)")}
    lines = [f"Verification of the trained layers: {len(checked) - len(bad)} of {len(checked)} "
             "equilibrium layers pass their docs/theory.md §9 reference (the other runs have no "
             "equilibrium layer); every run's verification is in `results.json`."]
    lines += [f"- not passed: {k}: {v}" for k, v in bad.items()]
    return [*lines, ""]


def report(budget: Budget, keys: Sequence[str], verdicts: dict[str, Verdict],
           measurements: dict[str, Any], plots: dict[str, str | None], env: dict[str, Any],
           prov: dict[str, Any] | None = None) -> str:
    """The Markdown report (provenance, setup, table, column definitions, criteria, plots)."""
    from convex_eq_app.provenance import column_lines, header_lines
    from convex_eq_app.results import reproduce_setup

    lines = [
        "# convex-eq reproduce: the papers' claims on MNIST-1D, with power", "",
        *header_lines(prov or {}, smoke=budget.quick),
        *([f"**{SMOKE}**", ""] if budget.quick else []),
        reproduce_setup(asdict(budget), env), "",
        table(keys, verdicts), "", *column_lines(COLUMNS), *_verified_lines(env),
        "Trained weights (`state_dict`) of every run trained here: `checkpoints/` beside this "
        "report (reused table runs: the table's checkpoints).", "",
        "## Criteria", "",
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


__all__ = ["CLAIMS", "COLUMNS", "EXPERIMENTS", "SMOKE", "Budget", "run", "select", "table"]
