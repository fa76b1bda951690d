"""The results page: ``convex-eq results --from DIR... --out docs/results.md``.

Reads the ``results.json`` that ``convex-eq demo``, ``train-table`` and ``reproduce`` write and
renders one Markdown section per run, headed by the run's own provenance record (date, commit,
versions, machine, command; :mod:`convex_eq_app.provenance`).  The tables are rendered by the
functions the commands' own reports use (:func:`demo_table`, :func:`mnist1d_table`,
:func:`claims_table`), so the page and the reports cannot disagree.  Standard library only.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .configs import training_identity
from .errors import CLIError
from .provenance import column_lines, header_lines

#: test accuracies published by the MNIST-1D authors (no shuffling), in %
PUBLISHED = {"logistic regression": 32.0, "MLP": 68.0, "CNN": 94.0, "GRU": 91.0, "human": 96.0}

TITLES = {"demo": "Demo: derived layers on MNIST-1D (`convex-eq demo`)",
          "train-table": "The seed models on MNIST-1D (`convex-eq train-table`)",
          "reproduce": "The papers' claims in miniature (`convex-eq reproduce`)"}


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, fmt)


# ----------------------------------------------------------------------------- tables
def demo_table(rows: Sequence[dict[str, Any]]) -> str:
    """The demo's table from its result rows (``name``, ``accuracy``, ``params``,
    ``mean_iterations``, ``final_residual``, ``verification``, ``train_time``)."""
    lines = ["| model | test acc. | params | mean fwd iters | final rel. residual | "
             "verification | train time (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {100 * r['accuracy']:.2f} % | {r['params']} | "
                     f"{_num(r.get('mean_iterations'), '.1f')} | "
                     f"{_num(r.get('final_residual'), '.1e')} | {r.get('verification') or '—'} "
                     f"| {r['train_time']:.1f} |")
    return "\n".join(lines)


def mnist1d_table(rows: Sequence[dict[str, Any]], cfg: dict[str, Any],
                  wall_seconds: float, cpus: int | None) -> str:
    """The train-table's table from its rows (one per model and seed, the fields of
    :class:`~convex_eq_app.training.Result` plus ``seed``): accuracy as mean ± sample standard
    deviation over the seeds, solver statistics, the published baselines, and the settings
    under it."""
    part = "validation (10 % of train)" if cfg.get("val") else "test"
    large = cfg.get("dataset") == "mnist1d-large-test"
    sizes = ("3600 train / 400 validation" if cfg.get("val") else
             "4000 train / 12 000 test drawn apart" if large else "4000 train / 1000 test")
    if cfg.get("train_subset"):
        sizes = f"quick mode: the first {cfg['train_subset']} signals of each part"
    lines = [f"| model | {part} acc. (%) | seeds | params | mean fwd iters (test) | "
             "iters per training step, last epoch (fwd / adjoint) | "
             "steps at iteration cap (fwd / adjoint) | s / epoch | verification of the trained "
             "layer |", "|---|---|---|---|---|---|---|---|---|"]
    epochs = int(cfg["epochs"])
    for name in dict.fromkeys(r["name"] for r in rows):
        rs = [r for r in rows if r["name"] == name]
        accs = [100 * r["accuracy"] for r in rs]
        mean = sum(accs) / len(accs)
        spread = (f" ± {math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)):.1f}"
                  if len(accs) > 1 else "")
        its = [r.get("mean_iterations") for r in rs]
        eq = all(i is not None and not math.isnan(i) for i in its)
        it = f"{sum(its) / len(its):.1f}" if eq else "—"  # type: ignore[arg-type]
        capped = (f"{sum(r['nonconvergence'][0] for r in rs)} / "
                  f"{sum(r['nonconvergence'][1] for r in rs)}") if eq else "—"
        step_its = _step_iterations(rs) if eq else "—"
        per_epoch = sum(r["train_time"] for r in rs) / max(1, epochs * len(rs))
        ver = "; ".join(r.get("verification") or "—" for r in rs)
        lines.append(f"| {name} | {sum(accs) / len(accs):.1f}{spread} | "
                     f"{','.join(str(r['seed']) for r in rs)} | {rs[0]['params']} | {it} | "
                     f"{step_its} | {capped} | {per_epoch:.1f} | {ver} |")
    for name, acc in PUBLISHED.items():
        lines.append(f"| {name} (published by the MNIST-1D authors) | {acc:.0f} | — | — | — | — "
                     "| — | — | — |")
    if "zeta" in cfg:
        mb = (f"Multi-branch models: a stem conv(1→{cfg['stem']}, 3) + ReLU, two branches, "
              f"||W_i||₂ ≤ ζ = {cfg['zeta']:g}; D: λ = {cfg['lam']:g}, Huber width "
              f"{cfg['width']:g} (smoothed); PE ε = {cfg['pe_eps']:g}; GEQ fixed γ = "
              f"{cfg['gamma']:g}. ")
    else:  # a record of the earlier single MOptEq row
        mb = (f"MOptEq fusion: {cfg['mopteq_fusion']}, λ = {cfg['lam']:g}, PE ε = "
              f"{cfg['pe_eps']:g}. ")
    lines += ["", mb + f"MNIST-1D generated locally ({sizes}), {epochs} epoch(s), "
              f"{cfg['channels']} channels, kernel {cfg['kernel']}, Adam lr {cfg['lr']:g} "
              f"(cosine), batch {cfg['batch']}, shift augmentation ±{cfg['shift']} for every "
              f"model, seeds {list(cfg['seeds'])}; equilibrium layers: tol {cfg['tol']:g}, at "
              f"most {cfg['max_iter']} iterations (adjoint {2 * cfg['max_iter']}). Wall time "
              f"{wall_seconds:.0f} s with {cfg['workers']} worker process(es) of one torch "
              f"thread on {cpus} CPUs.{_evaluations(cfg)}{_levers(cfg)}"]
    return "\n".join(lines)


def _step_iterations(rows: Sequence[dict[str, Any]]) -> str:
    """Mean forward / adjoint iterations per training step in the last epoch, mean over the
    seeds (``—`` where the history has none)."""
    last = [r["history"][-1] for r in rows if r.get("history")]
    out = []
    for key in ("fwd_iters", "bwd_iters"):
        xs = [h[key] for h in last if isinstance(h.get(key), (int, float))
              and math.isfinite(h[key])]
        out.append(f"{sum(xs) / len(xs):.1f}" if xs and len(xs) == len(rows) else "—")
    return " / ".join(out)


def _lever_list(cfg: dict[str, Any], long: bool) -> list[str]:
    """The iteration levers a train-table run's equilibrium rows used (``long``: as the
    settings sentence words them, else as a section title does)."""
    on = []
    if cfg.get("warm_start"):
        on.append("warm starts" + (" from each signal's equilibrium of the epoch before"
                                   if long else ""))
    if cfg.get("jacobian_reg"):
        on.append(f"Jacobian regularisation γ = {cfg['jacobian_reg']:g}")
    if cfg.get("tol_schedule"):
        a, b = cfg["tol_schedule"]
        on.append(f"tolerance schedule {a:g} → {b:g}"
                  + (" (geometric over the epochs)" if long else ""))
    if cfg.get("backward", "implicit") != "implicit":
        on.append(f"{cfg['backward']} gradients" + (" in the convex rows" if long else ""))
    if cfg.get("backward_solver"):
        on.append(f"adjoint solver {cfg['backward_solver']}" if long else
                  f"the {cfg['backward_solver']} adjoint solver")
    if cfg.get("anderson_m") is not None:
        on.append(f"Anderson memory m = {cfg['anderson_m']}"
                  + (" in the forward solve" if long else ""))
    return on


def _levers(cfg: dict[str, Any]) -> str:
    """The equilibrium rows' iteration levers, where any was on (the settings sentence)."""
    on = _lever_list(cfg, long=True)
    return f" Equilibrium rows trained with {'; '.join(on)}." if on else ""


def _lever_names(cfg: dict[str, Any]) -> str:
    """`` — with …`` naming the iteration levers a train-table run used (a section title)."""
    on = _lever_list(cfg, long=False)
    return f" — with {', '.join(on)}" if on else ""


def _evaluations(cfg: dict[str, Any]) -> str:
    """When the held-out accuracy was measured (``eval_every``; records without it: after
    every epoch)."""
    every, epochs = int(cfg.get("eval_every", 1)), int(cfg["epochs"])
    at = sorted({e for e in range(every, epochs + 1, every)} | {epochs})
    if at == list(range(1, epochs + 1)):
        return " Held-out accuracy measured after every epoch."
    if at == [epochs]:
        return " Held-out accuracy measured after the last epoch only."
    return (f" Held-out accuracy measured after epoch(s) {', '.join(map(str, at))} only "
            f"(every {every}, and the last).")


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped (``||z||`` would split the row)."""
    return str(text).replace("|", "\\|")


#: the claim table's columns and the verdict field each shows, for records with the power
#: column (a record written before it has no ``se``: the first five columns)
POWER_COLUMNS = (("paper effect", "effect"), ("measured here", "measured"),
                 ("difference", "difference"), ("SE", "se"), ("MDD", "power"),
                 ("verdict", "holds"))
_PLAIN_COLUMNS = (("measured here", "measured"), ("holds?", "holds"))


def claims_table(keys: Sequence[str], claims: dict[str, dict[str, str]],
                 verdicts: dict[str, dict[str, Any]]) -> str:
    """``claim | paper, table/figure | paper's number | paper effect | measured here |
    difference | SE | MDD | verdict`` (a record without the power column: ``... | measured
    here | holds?``)."""
    power = any("se" in verdicts[k] for k in keys)
    cols = POWER_COLUMNS if power else _PLAIN_COLUMNS
    head = ["claim", "paper, table/figure", "paper's number", *(c for c, _ in cols)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        c, v = claims[k], verdicts[k]
        cells = [c["statement"], c["source"], c["paper"],
                 *(str(v.get(f, "—")) for _, f in cols)]
        cells[-1] = f"**{cells[-1]}**"
        rows.append("| " + " | ".join(_cell(t) for t in cells) + " |")
    return "\n".join(rows)


def reproduce_setup(budget: dict[str, Any], env: dict[str, Any]) -> str:
    """The reproduce run's setup in one paragraph (a record of the earlier dense-layer
    reproduction, whose budget names a ``width``: :func:`_dense_setup`)."""
    if "width" in budget:
        return _dense_setup(budget, env)
    mode = "quick (smoke run: not evidence)" if budget["quick"] else "full"
    data = ("MNIST-1D (generated locally by the mnist1d package): 256 signals of the 4000 for "
            "training and testing (the table's quick config)" if budget["quick"] else
            "MNIST-1D (generated locally by the mnist1d package): the 4000 training signals, "
            f"tested on {env.get('n_test', 12000)} held-out signals drawn apart")
    table = (f"; {env['table_runs']} runs reused from the train-table run(s) in "
             f"{env['from_table']}" if env.get("from_table") else "")
    reused = (f"; {env['reused_runs']} runs reused from an earlier invocation (their own "
              f"training + evaluation {env['reused_seconds']:.0f} s)"
              if env.get("reused_runs") else "")
    return (f"Mode: {mode}. Data: {data}. Seeds: {', '.join(map(str, budget['seeds']))} (mean ± "
            f"sample std over the seeds). Training: the MNIST-1D table's models and recipe "
            f"(`convex-eq train-table`), {budget['epochs']} epochs. Device {env['device']}, "
            f"{env['torch_threads']} torch thread(s) per run, {env['workers']} worker "
            f"process(es), {env.get('cpus', '?')} CPUs (the machine's state at the start: "
            f"the header); {env['runs']} models ({env.get('trained_runs', 0)} "
            f"trained here{table}{reused}); wall time {env['seconds']:.0f} s.")


def _dense_setup(budget: dict[str, Any], env: dict[str, Any]) -> str:
    """The setup paragraph of a record of the earlier dense-layer reproduction."""
    mode = "quick (smoke run: not evidence)" if budget["quick"] else "full"
    data = (f"MNIST-1D (generated locally by the mnist1d package), "
            f"{budget.get('train') or 4000} train / {budget.get('test') or 1000} test signals")
    reused = (f" ({env['reused_runs']} runs reused from an earlier invocation, their own "
              f"training + evaluation {env['reused_seconds']:.0f} s)"
              if env.get("reused_runs") else "")
    return (f"Mode: {mode}. Data: {data}. Seeds: {', '.join(map(str, budget['seeds']))} (mean ± "
            f"sample std over seeds). Training: Adam lr {budget['lr']:g}, cosine schedule, "
            f"{budget['epochs']} epochs (the multi-branch runs at most {min(budget['epochs'], 8)}"
            f" on at most 1000 signals), batch {budget['batch']}; dense layers of width "
            f"{budget['width']}. Device {env['device']}, {env['torch_threads']} torch thread(s) "
            f"per run, {env['workers']} worker process(es); {env['runs']} trained models; wall "
            f"time {env['seconds']:.0f} s{reused}.")


# ----------------------------------------------------------------------------- the page
def load(source: str | Path) -> dict[str, Any]:
    """The run record at ``source`` (a ``results.json`` or the folder holding one)."""
    p = Path(source)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise CLIError(f"no results.json at {source}", term="--from",
                       hint="pass the --out folder of a demo, train-table or reproduce run")
    doc = json.loads(p.read_text(encoding="utf-8"))
    if doc.get("kind") not in TITLES or "provenance" not in doc:
        raise CLIError(f"{p} is not a results.json with a provenance record", term="--from",
                       hint="rerun the command (convex-eq demo, train-table or reproduce): its "
                       "results.json names its kind, date, commit, versions, machine and command")
    return doc


def section(doc: dict[str, Any], images: Sequence[str] = ()) -> list[str]:
    """The page's Markdown lines for one run record (``images``: links to the run's plots,
    relative to the page)."""
    kind = doc["kind"]
    smoke = bool(doc.get("config", doc.get("budget", {})).get("quick"))
    levers = _lever_names(doc.get("config", {})) if kind == "train-table" else ""
    epochs = doc.get("config", {}).get("epochs") if kind == "train-table" else None
    budget = f", {epochs} epoch{'s' if epochs != 1 else ''}" if epochs else ""
    lines = [f"## {TITLES[kind]}{budget}{levers}{' — smoke run' if smoke else ''}", "",
             *header_lines(doc["provenance"], smoke=smoke)]
    if kind == "demo":
        lines += [doc.get("setup", ""), "", demo_table(doc["results"]), "",
                  *column_lines(doc["columns"])]
        lines += [f"![{Path(img).stem.replace('_', ' ')}]({img})\n" for img in images]
    elif kind == "train-table":
        lines += [mnist1d_table(doc["rows"], doc["config"], doc["wall_seconds"], doc["cpus"]),
                  "", *column_lines(doc["columns"])]
    else:
        keys = list(doc["verdicts"])
        held = sum(doc["verdicts"][k]["holds"] == "yes" for k in keys)
        lines += [reproduce_setup(doc["budget"], doc["environment"]), "",
                  claims_table(keys, doc["claims"], doc["verdicts"]), "",
                  ("A smoke run: its verdicts exercise the code and are not evidence."
                   if smoke else f"{held} of {len(keys)} claims hold here."), "",
                  *column_lines(doc["columns"])]
        lines += [f"![{Path(img).stem.replace('_', ' ')}]({img})\n" for img in images]
    return lines


def images_of(source: str | Path, page: str | Path, root: str | Path = ".") -> list[str]:
    """The PNG plots in the run folder ``source`` (relative to ``root``), as links relative to
    the folder of the page."""
    folder = Path(root) / source
    folder = folder if folder.is_dir() else folder.parent
    return [Path(os.path.relpath(p, Path(root, page).parent)).as_posix()
            for p in sorted(folder.glob("*.png"))]


def render(docs: Sequence[dict[str, Any]], sources: Sequence[str],
           images: Sequence[Sequence[str]] | None = None) -> str:
    """The whole page: an introduction, then one section per run (demo, train-table,
    reproduce, in that order, each kind in the order given); ``images[i]``: the plot links of
    ``docs[i]``."""
    order = {k: i for i, k in enumerate(TITLES)}
    plots = list(images) if images is not None else [[] for _ in docs]
    lines = ["# Results", "",
             "Generated by `convex-eq results` from the `results.json` files the commands wrote "
             "(do not edit by hand; rerun the commands and this one instead). Each section is "
             "headed by the date, commit, package versions, machine and command of its run. "
             "The settings and the criteria of the claims are explained in the "
             "[user guide](guide.md), [the reproduce page](reproduce.md) and "
             "[the performance page](performance.md).", "",
             f"Sources: {', '.join(f'`{s}`' for s in sources)}.", ""]
    ranked = sorted(range(len(docs)), key=lambda i: order[docs[i]["kind"]])
    for j, i in enumerate(ranked):
        lines += section(docs[i], plots[i])
        last_table = docs[i]["kind"] == "train-table" and (
            j + 1 == len(ranked) or docs[ranked[j + 1]]["kind"] != "train-table")
        if last_table:
            tables = [docs[k] for k in ranked], [sources[k] for k in ranked]
            lines += combined_tables(*tables) + lever_summary(*tables)
    return "\n".join(lines).rstrip() + "\n"


def combined_tables(docs: Sequence[dict[str, Any]], sources: Sequence[str]) -> list[str]:
    """One table per training (the fields that decide what is trained,
    :func:`~convex_eq_app.configs.training_identity`) whose rows are spread over several
    train-table runs, such as the slow rows trained in a run of their own: each model's seeds
    gathered from those runs in page order (a model and seed trained by two runs is taken from
    the first, which the table names); nothing where one run holds every row of its training."""
    groups: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for d, s in zip(docs, sources):
        if d["kind"] == "train-table" and not d["config"].get("quick"):
            key = json.dumps(training_identity(d["config"]), sort_keys=True)
            groups.setdefault(key, []).append((d, s))
    lines: list[str] = []
    for runs in groups.values():
        rows: dict[tuple[str, int], tuple[dict[str, Any], str]] = {}
        for d, s in runs:
            for r in d["rows"]:
                rows.setdefault((r["name"], int(r["seed"])), (r, s))
        whole = any(set(rows) <= {(r["name"], int(r["seed"])) for r in d["rows"]}
                    for d, _ in runs)
        if not whole:
            lines += _combined_table(rows, runs[0][0]["config"])
    return lines


def _verified(rows: Sequence[dict[str, Any]]) -> str:
    """How many of the rows' trained layers passed, failed or could not be verified (— without
    a layer); only a verdict that reads "pass" counts as one."""
    ver = [v for r in rows if (v := r.get("verification") or "—") != "—"]
    if not ver:
        return "—"
    passed = sum(v.endswith(", pass)") for v in ver)
    failed = sum("FAIL" in v for v in ver)
    counts = (("pass", passed), ("FAIL", failed), ("not verified", len(ver) - passed - failed))
    return ", ".join(f"{name} ×{n}" for name, n in counts if n)


def _combined_table(rows: dict[tuple[str, int], tuple[dict[str, Any], str]],
                    cfg: dict[str, Any]) -> list[str]:
    epochs = int(cfg["epochs"])
    seeds = sorted({seed for _, seed in rows})
    lines = [f"### Every row trained alike, {epochs} epoch{'s' if epochs != 1 else ''}: the "
             "runs above in one table", "",
             "The rows of the train-table runs above that share one training (same data, "
             "sizes, recipe and levers), gathered per model over the seeds; each run's "
             "provenance heads its section.", "",
             "| model | test acc. (%) | per seed (%) | params | forward steps at the iteration "
             "cap | trained layer verified | from |", "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(n for n, _ in rows):
        got = sorted((seed, r, s) for (n, seed), (r, s) in rows.items() if n == name)
        accs = [100 * r["accuracy"] for _, r, _ in got]
        mean = sum(accs) / len(accs)
        sd = (f" ± {math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)):.1f}"
              if len(accs) > 1 else "")
        per = " / ".join(f"{a:.1f}" for a in accs)
        its = [r.get("mean_iterations") for _, r, _ in got]
        eq = all(isinstance(i, (int, float)) and math.isfinite(i) for i in its)
        capped = str(sum(r["nonconvergence"][0] for _, r, _ in got)) if eq else "—"
        src = ", ".join(f"`{s}` (seed{'s' if k > 1 else ''} "
                        f"{', '.join(str(x) for x, _, y in got if y == s)})"
                        for s, k in Counter(y for _, _, y in got).items())
        lines.append(f"| {name} | {mean:.1f}{sd} | {per} (seed{'s' if len(got) > 1 else ''} "
                     f"{', '.join(str(x) for x, _, _ in got)}) | {got[0][1]['params']} | "
                     f"{capped} | {_verified([r for _, r, _ in got])} | {src} |")
    for name, acc in PUBLISHED.items():
        lines.append(f"| {name} (published by the MNIST-1D authors) | {acc:.0f} | — | — | — | — "
                     "| — |")
    lines += ["", f"Seeds over all rows: {', '.join(map(str, seeds))}; accuracy: mean ± sample "
              "standard deviation over a model's seeds; forward steps at the cap: summed over "
              "its seeds' training steps.", ""]
    return lines


#: the equilibrium row the iteration levers are compared on, and its yardstick
LEVER_MODEL, YARDSTICK = "conv OptEq", "CNN (same #params)"


def lever_summary(docs: Sequence[dict[str, Any]], sources: Sequence[str]) -> list[str]:
    """One table per training budget (epochs and seeds) comparing the conv OptEq row across
    the train-table runs that trained it with that budget (the iteration levers each run used;
    none: the baseline); nothing for a budget with fewer than two such runs."""
    groups: dict[tuple, list[tuple[dict[str, Any], str]]] = {}
    for d, s in zip(docs, sources):
        if d["kind"] == "train-table" and any(r["name"] == LEVER_MODEL for r in d["rows"]):
            key = (int(d["config"]["epochs"]), tuple(d["config"]["seeds"]))
            groups.setdefault(key, []).append((d, s))
    lines: list[str] = []
    for (epochs, seeds), runs in groups.items():
        if len(runs) >= 2:
            lines += _lever_table(runs, epochs, seeds)
    return lines


def _lever_table(runs: Sequence[tuple[dict[str, Any], str]], epochs: int,
                 seeds: Sequence[int]) -> list[str]:
    lines = [f"### Iteration levers on the {LEVER_MODEL} row, {epochs} epoch"
             f"{'s' if epochs != 1 else ''}, seeds {', '.join(map(str, seeds))}", "",
             f"The {LEVER_MODEL} rows of the train-table runs above with this budget, side by "
             "side (each run's provenance heads its section; same data, epochs and seeds).", "",
             "| run | levers | test acc. (%) | fwd / adjoint iters per step (all epochs) | "
             "s per training epoch | × the CNN's |", "|---|---|---|---|---|---|"]
    for d, src in runs:
        rs = [r for r in d["rows"] if r["name"] == LEVER_MODEL]
        accs = [100 * r["accuracy"] for r in rs]
        mean = sum(accs) / len(accs)
        sd = (math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1))
              if len(accs) > 1 else 0.0)
        hist = [h for r in rs for h in r.get("history", [])]
        its = " / ".join(_mean_of(hist, k) for k in ("fwd_iters", "bwd_iters"))
        sec = _training_epoch_seconds(rs, d["config"])
        cnn = _training_epoch_seconds([r for r in d["rows"] if r["name"] == YARDSTICK],
                                      d["config"])
        ratio = f"{sec / cnn:.1f}" if sec and cnn else "—"
        levers = _lever_names(d["config"]).removeprefix(" — with ") or "none (baseline)"
        lines.append(f"| `{src}` | {levers} | {mean:.1f} ± {sd:.1f} | {its} | "
                     f"{sec:.2f} | {ratio} |" if sec else
                     f"| `{src}` | {levers} | {mean:.1f} ± {sd:.1f} | {its} | — | — |")
    lines += ["", "Columns: **s per training epoch**: median wall seconds of the epochs without a "
              "held-out evaluation, over the seeds; **× the CNN's**: that median over the "
              f"{YARDSTICK}'s in the same run (— where the run trained no CNN); iterations: "
              "mean per training step over every epoch and seed (— for an adjoint the run "
              "did not solve).", ""]
    return lines


def _mean_of(hist: Sequence[dict[str, Any]], key: str) -> str:
    xs = [h[key] for h in hist if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
    return f"{sum(xs) / len(xs):.2f}" if xs else "—"


def _training_epoch_seconds(rows: Sequence[dict[str, Any]], cfg: dict[str, Any]) -> float:
    """Median seconds of the epochs without a held-out evaluation (0.0 where there are none)."""
    every, epochs = int(cfg.get("eval_every", 1)), int(cfg["epochs"])
    evaluated = set(range(every, epochs + 1, every)) | {epochs}
    xs = sorted(h["seconds"] for r in rows for h in r.get("history", [])
                if h.get("epoch") not in evaluated and "seconds" in h)
    if not xs:
        return 0.0
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def write_page(sources: Sequence[str | Path], out: str | Path) -> Path:
    """Render the records at ``sources`` into the Markdown page ``out``; returns its path."""
    docs = [load(s) for s in sources]
    out = Path(out)
    images = [images_of(s, out) for s in sources]
    out.write_text(render(docs, [str(s) for s in sources], images), encoding="utf-8")
    return out
