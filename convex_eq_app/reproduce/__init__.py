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
from dataclasses import asdict, is_dataclass, replace
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
        log: Callable[[str], None] = print, seeds: Sequence[int] | None = None,
        epochs: int | None = None, progress: bool = True, argv: list[str] | None = None
        ) -> dict[str, Any]:
    """Run the selected claims (all by default) and write the report into ``out``; returns
    ``{"verdicts", "measurements", "seconds", "out"}``.  ``resume``: reuse the runs an earlier
    invocation with the same budget finished into ``out/runs.jsonl`` (every finished run is
    appended there); ``seeds``/``epochs`` override the budget's (the report states them);
    ``progress``: a bar counting the epochs of all runs; ``argv``: the command line recorded in
    the report (default: this process's).  Each trained model's ``state_dict`` is written to
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
                      checkpoints=out)
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
    (out / "reproduce.md").write_text(report(budget, keys, verdicts, measurements, plots, env,
                                             prov), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(
        {"kind": "reproduce", "provenance": prov, "budget": asdict(budget), "environment": env,
         "columns": COLUMNS, "claims": {k: {"statement": CLAIMS[k].statement,
                                            "source": CLAIMS[k].source,
                                            "paper": CLAIMS[k].paper} for k in keys},
         "verdicts": {k: asdict(v) for k, v in verdicts.items()},
         "measurements": measurements, "runs": {repr(k): v for k, v in results.by_key.items()}},
        indent=1, default=_json), encoding="utf-8")
    if quick:
        log(SMOKE)
    log(table(keys, verdicts))
    log(f"wrote {out / 'reproduce.md'} (+ {len(plots)} plots, results.json, checkpoints/) in "
        f"{seconds:.0f} s")
    return {"verdicts": verdicts, "measurements": measurements, "seconds": seconds,
            "out": str(out)}


SMOKE = ("SMOKE RUN (--quick): one seed, one epoch, 12-wide layers on 384 signals. It runs "
         "every claim's code; its verdicts are not evidence.")

#: what each column of the claim table means
COLUMNS = {
    "claim": "the paper's statement, as tested here",
    "paper, table/figure": "where the paper states it",
    "paper's number": "the paper's number, quoted as printed (its data sets and model sizes)",
    "measured here": "the same quantity on MNIST-1D in miniature: mean ± sample standard "
                     "deviation over the seeds",
    "holds?": "the verdict of the criterion fixed before measuring: yes; no; or no (within "
              "seed spread), when the measured difference is smaller than the seed spread",
}


def _json(o: Any) -> Any:
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    return str(o)


def table(keys: Sequence[str], verdicts: dict[str, Verdict]) -> str:
    """``claim | paper, table/figure | paper's number | measured here | holds?``."""
    from convex_eq_app.results import claims_table

    claims = {k: {"statement": CLAIMS[k].statement, "source": CLAIMS[k].source,
                  "paper": CLAIMS[k].paper} for k in keys}
    return claims_table(keys, claims, {k: asdict(verdicts[k]) for k in keys})


def report(budget: Budget, keys: Sequence[str], verdicts: dict[str, Verdict],
           measurements: dict[str, Any], plots: dict[str, str | None], env: dict[str, Any],
           prov: dict[str, Any] | None = None) -> str:
    """The Markdown report (provenance, setup, table, column definitions, criteria, plots)."""
    from convex_eq_app.provenance import column_lines, header_lines
    from convex_eq_app.results import reproduce_setup

    lines = [
        "# convex-eq reproduce: the papers' claims in miniature", "",
        *header_lines(prov or {}, smoke=budget.quick),
        reproduce_setup(asdict(budget), env), "",
        "A claim holds when its criterion (fixed before measuring) is met: a difference counts "
        "only when it is larger than the seed standard deviation of either side; "
        "'no (within seed spread)' means the measured difference is smaller than that.", "",
        table(keys, verdicts), "", *column_lines(COLUMNS),
        "Trained weights (`state_dict`) of every run: `checkpoints/` beside this report.", "",
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


__all__ = ["CLAIMS", "EXPERIMENTS", "Budget", "run", "select", "table"]
