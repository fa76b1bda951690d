"""Progress of the commands that train: one tqdm bar counting the epochs of every run, whether
the runs train in this process or in spawned worker processes (which report each finished epoch
through a queue), and the checkpoints written beside each report."""

from __future__ import annotations

import multiprocessing
import queue
import re
import unicodedata
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

#: where :func:`report_epoch` sends ``(tag, row)``: the bar in this process, or the queue to the
#: parent in a worker process (None: nobody listens)
_sink: Callable[[tuple[str, dict[str, float]]], None] | None = None


def report_epoch(tag: str, row: dict[str, float]) -> None:
    """Called by a run after each epoch (``fit(on_epoch=...)``)."""
    if _sink is not None:
        _sink((tag, row))


def _init_worker(q: Any) -> None:
    global _sink
    _sink = q.put
    import torch

    torch.set_num_threads(1)


def run_all(fn: Callable[[Any], Any], items: Iterable[Any], *, workers: int, epochs: int,
            desc: str, enabled: bool = True, on_done: Callable[[Any, Any], None] | None = None
            ) -> list[Any]:
    """``fn(item)`` for every item (in this process when ``workers`` ≤ 1, else in that many
    spawned processes of one torch thread each), with a tqdm bar on stderr counting ``epochs``
    (the epochs of all runs together, as :func:`report_epoch` reports them); ``on_done(item,
    result)`` is called as each run finishes.  Returns the results in the items' order."""
    global _sink
    from tqdm import tqdm

    items = list(items)
    results: dict[int, Any] = {}
    bar = tqdm(total=epochs, desc=desc, unit="epoch", disable=not enabled, dynamic_ncols=True)

    def epoch(msg: tuple[str, dict[str, float]]) -> None:
        tag, row = msg
        bar.update(1)
        if "loss" in row:
            bar.set_postfix_str(f"{tag}: loss {row['loss']:.3f}", refresh=False)

    try:
        if workers <= 1:
            previous, _sink = _sink, epoch
            try:
                for i, item in enumerate(items):
                    results[i] = fn(item)
                    if on_done is not None:
                        on_done(item, results[i])
            finally:
                _sink = previous
        else:
            ctx = multiprocessing.get_context("spawn")
            q = ctx.Queue()
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                     initargs=(q,)) as pool:
                futs: dict[Future, int] = {pool.submit(fn, it): i for i, it in enumerate(items)}
                pending = set(futs)
                while pending:
                    try:
                        epoch(q.get(timeout=0.2))
                    except queue.Empty:
                        pass
                    for f in [f for f in pending if f.done()]:
                        pending.discard(f)
                        i = futs[f]
                        results[i] = f.result()  # a worker's exception is raised here
                        if on_done is not None:
                            on_done(items[i], results[i])
                while True:  # epochs a worker reported just before its result arrived
                    try:
                        epoch(q.get(timeout=0.5))
                    except queue.Empty:
                        break
    finally:
        bar.close()
    return [results[i] for i in range(len(items))]


def slug(name: str) -> str:
    """A file name for a model name: ``"OptEq + ℓ1"`` → ``"opteq-l1"``."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return re.sub(r"[^0-9a-z]+", "-", ascii_name.lower()).strip("-") or "model"


def save_checkpoint(state: dict[str, Any], out: Path, name: str) -> str:
    """Write ``state`` (a ``state_dict``) to ``out/checkpoints/<slug>.pt``; returns the path
    relative to ``out``."""
    import torch

    folder = Path(out) / "checkpoints"
    folder.mkdir(exist_ok=True)
    rel = f"checkpoints/{slug(name)}.pt"
    torch.save(state, Path(out) / rel)
    return rel


def cpu_state(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` with every tensor copied to the CPU (picklable across processes);
    other entries (a module's extra state) as they are."""
    import torch

    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()}
