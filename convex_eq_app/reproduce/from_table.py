"""Reusing the runs of finished ``convex-eq train-table`` runs (``convex-eq reproduce --from-table
DIR [DIR ...]``): one training loop, no model trained twice.

A table run is reused for a reproduction run when they are the same model (a table model name,
no variant options), the same seed and the same training: every field of the two
:class:`~convex_eq_app.configs.TableConfig` that changes what is trained is equal
(:func:`training_identity`; the seeds list, the models list, the device, the worker count and
the number of inputs verified do not).  Several tables trained alike (say, some rows on three
seeds and the slower rows in a second run) are read as one; a model and seed trained by two of
them is refused (which one to reuse would be a guess).  Where a table's training differs from
the reproduction's, or the tables together lack one of the reproduction's seeds, :func:`load`
raises a :class:`~convex_eq_app.errors.CLIError` naming the fields and how to align them
(reusing nothing silently would train everything again); a table model no table trained
(``--models``) is trained by the reproduction.  An evaluation that needs the trained model loads
the table's checkpoint (``checkpoints/<model>-seed<k>.pt`` in the folder that trained it) into
the model built by the same builder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..configs import LATER_FIELDS, NOT_TRAINING, TableConfig, training_identity
from ..errors import CLIError


@dataclass
class TableRuns:
    """The finished runs of one or more ``train-table`` output folders trained alike:
    ``rows[(model, seed)]`` (the row of ``results.json``: the
    :class:`~convex_eq_app.training.Result` fields and the checkpoint path relative to its
    folder), ``sources[(model, seed)]`` (the folder that trained it), the folders and the
    tables' config."""

    folders: list[Path]
    config: dict[str, Any]
    rows: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    sources: dict[tuple[str, int], Path] = field(default_factory=dict)

    def row(self, model: str, seed: int, cfg: TableConfig) -> dict[str, Any] | None:
        """The table's row for ``model`` / ``seed`` when its training equals ``cfg``'s."""
        if training_identity(cfg) != training_identity(self.config):
            return None
        return self.rows.get((model, int(seed)))

    def checkpoint(self, row: dict[str, Any]) -> Path:
        """The row's ``state_dict`` file (a typed error when it is missing)."""
        path = self.sources[(str(row["name"]), int(row["seed"]))] / row["checkpoint"]
        if not path.is_file():
            raise CLIError(f"the checkpoint {path} of {row['name']} seed {row['seed']} is "
                           "missing", term="--from-table",
                           hint="pass the complete output folder of convex-eq train-table")
        return path


def _read(p: Path, cfg: TableConfig) -> dict[str, Any]:
    """The ``results.json`` of the table in ``p``, checked to train as ``cfg`` does."""
    doc_path = p / "results.json"
    if not doc_path.is_file():
        hint = ("the table run did not finish (rows.jsonl without results.json): rerun "
                "convex-eq train-table" if (p / "rows.jsonl").is_file()
                else "pass the --out folder of convex-eq train-table")
        raise CLIError(f"no results.json in {p}", term="--from-table", hint=hint)
    doc = json.loads(doc_path.read_text(encoding="utf-8"))
    if doc.get("kind") != "train-table" or "config" not in doc:
        raise CLIError(f"{doc_path} is not the record of a convex-eq train-table run",
                       term="--from-table", hint="pass the --out folder of convex-eq "
                       "train-table")
    mine, theirs = training_identity(cfg), training_identity(doc["config"])
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        told = ", ".join(f"{k}={theirs.get(k)!r}" for k in diff)
        here = ", ".join(f"{k}={mine.get(k)!r}" for k in diff)
        hint = (f"run reproduce with --epochs {theirs['epochs']}"
                if diff == ["epochs"] else "train the table with the reproduction's config")
        raise CLIError(f"the table in {p} was trained with {told}; this reproduction trains "
                       f"with {here}, so none of its runs is the same run",
                       term="--from-table", hint=f"{hint}, or drop --from-table")
    return doc


def load(folders: str | Path | Sequence[str | Path], cfg: TableConfig) -> TableRuns:
    """The table runs in ``folders`` (one folder or several, each the output of a finished
    ``train-table``), checked against the reproduction's config ``cfg``: a typed error when a
    folder holds no finished table, when a table's training differs (the differing fields, and
    how to align them), when two tables trained the same model and seed, or when the tables
    together lack one of the reproduction's seeds."""
    paths = [Path(folders)] if isinstance(folders, (str, Path)) else [Path(f) for f in folders]
    if not paths:
        raise CLIError("no table folder given", term="--from-table",
                       hint="pass the --out folder of one or more convex-eq train-table runs")
    docs = [(p, _read(p, cfg)) for p in paths]
    seeds = sorted({int(s) for _, doc in docs for s in doc["config"].get("seeds", ())})
    missing = sorted(set(cfg.seeds) - set(seeds))
    if missing:
        where = "the table in " + str(paths[0]) if len(paths) == 1 else "the tables"
        raise CLIError(f"{where} {'was' if len(paths) == 1 else 'were'} trained with seeds "
                       f"{seeds}; this reproduction needs seeds {list(cfg.seeds)} and "
                       f"{'the table has' if len(paths) == 1 else 'they have'} none of "
                       f"{missing}", term="--from-table", hint="run reproduce with --seed "
                       f"{' '.join(map(str, seeds))}, train the table with the reproduction's "
                       "seeds, or drop --from-table")
    runs = TableRuns(paths, docs[0][1]["config"])
    for p, doc in docs:
        for r in doc.get("rows", []):
            key = (str(r["name"]), int(r["seed"]))
            if key in runs.sources:
                raise CLIError(f"{key[0]} seed {key[1]} was trained by the tables in both "
                               f"{runs.sources[key]} and {p}", term="--from-table",
                               hint="pass only one of the two folders")
            runs.rows[key], runs.sources[key] = r, p
    return runs


__all__ = ["LATER_FIELDS", "NOT_TRAINING", "TableRuns", "load", "training_identity"]
