"""Reusing the runs of a finished ``convex-eq train-table`` (``convex-eq reproduce --from-table
DIR``): one training loop, no model trained twice.

A table run is reused for a reproduction run when they are the same model (a table model name,
no variant options), the same seed and the same training: every field of the two
:class:`~convex_eq_app.configs.TableConfig` that changes what is trained is equal
(:func:`training_identity`; the seeds list, the models list, the device, the worker count and
the number of inputs verified do not).  Where the table's training differs from the
reproduction's, or the table lacks one of the reproduction's seeds, :func:`load` raises a
:class:`~convex_eq_app.errors.CLIError` naming the fields and how to align them (reusing nothing
silently would train everything again); a table model the table did not train (``--models``) is
trained by the reproduction.  An evaluation that needs the trained model loads the table's
checkpoint (``checkpoints/<model>-seed<k>.pt``) into the model built by the same builder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..configs import TableConfig
from ..errors import CLIError

#: TableConfig fields that do not change what a run trains (``eval_every``: how often the
#: held-out accuracy is logged during training, a field of later table configs)
NOT_TRAINING = frozenset({"seeds", "models", "workers", "device", "quick", "verify_inputs",
                          "eval_every"})


def training_identity(cfg: TableConfig | dict[str, Any]) -> dict[str, Any]:
    """The fields of a table config that decide what is trained, JSON-normalised (tuples as
    lists), so that a config and one read back from ``results.json`` compare equal."""
    d = asdict(cfg) if isinstance(cfg, TableConfig) else dict(cfg)
    return json.loads(json.dumps({k: v for k, v in sorted(d.items()) if k not in NOT_TRAINING}))


@dataclass
class TableRuns:
    """The finished runs of one ``train-table`` output folder: ``rows[(model, seed)]`` (the
    row of ``results.json``: the :class:`~convex_eq_app.training.Result` fields and the
    checkpoint path), the folder and the table's config."""

    folder: Path
    config: dict[str, Any]
    rows: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    def row(self, model: str, seed: int, cfg: TableConfig) -> dict[str, Any] | None:
        """The table's row for ``model`` / ``seed`` when its training equals ``cfg``'s."""
        if training_identity(cfg) != training_identity(self.config):
            return None
        return self.rows.get((model, int(seed)))

    def checkpoint(self, row: dict[str, Any]) -> Path:
        """The row's ``state_dict`` file (a typed error when it is missing)."""
        path = self.folder / row["checkpoint"]
        if not path.is_file():
            raise CLIError(f"the checkpoint {path} of {row['name']} seed {row['seed']} is "
                           "missing", term="--from-table",
                           hint="pass the complete output folder of convex-eq train-table")
        return path


def load(folder: str | Path, cfg: TableConfig) -> TableRuns:
    """The table runs in ``folder`` (its ``results.json``), checked against the reproduction's
    config ``cfg``: a typed error when the folder holds no finished table or when its training
    differs (the differing fields, and how to align them)."""
    p = Path(folder)
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
    missing = sorted(set(cfg.seeds) - {int(s) for s in doc["config"].get("seeds", ())})
    if missing:
        raise CLIError(f"the table in {p} was trained with seeds "
                       f"{list(doc['config'].get('seeds', ()))}; this reproduction needs seeds "
                       f"{list(cfg.seeds)} and the table has none of {missing}",
                       term="--from-table", hint="run reproduce with --seed "
                       f"{' '.join(map(str, doc['config'].get('seeds', ())))}, train the table "
                       "with the reproduction's seeds, or drop --from-table")
    runs = TableRuns(p, doc["config"])
    for r in doc.get("rows", []):
        runs.rows[(str(r["name"]), int(r["seed"]))] = r
    return runs


__all__ = ["NOT_TRAINING", "TableRuns", "load", "training_identity"]
