"""``convex-eq bench`` / ``python -m benchmarks.run [--quick] [--out DIR] [--device DEV]``.

Writes ``DIR/bench.md`` (Markdown tables, target verdicts) and ``DIR/bench.json`` (every raw
timing, the machine, versions and date). Cases: (1) OptEq hidden QP vs cvxpylayers, (2) overhead
vs a hand-written loop (2b: the fastest hand loops on an m × B grid), (3) solvers and
torchdeq, (4) lowering/verify cost, (5) memory, (6) training the demo's conv OptEq vs torchdeq.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

CASES = ("qp", "limit", "solvers", "cost", "memory", "train")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="< 60 s smoke version (small sizes, few repetitions)")
    p.add_argument("--out", default="bench_out", help="output folder (bench.md, bench.json)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on small batched layers torch's "
                   "OpenMP hand-off costs more than it saves — the calibration line of the "
                   "report measures it — and cvxpylayers' SCS is single-threaded too)")
    p.add_argument("--only", action="append", choices=CASES,
                   help="run only this case (repeatable); default: all")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N or auto (CUDA when present): where every "
                   "case puts its modules and tensors; timings synchronise the device before "
                   "reading the clock. cvxpylayers (diffcp/SCS) always solves on the CPU")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("bench", help="benchmarks vs cvxpylayers, torchdeq, a hand loop",
                              description=(__doc__ or "").splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=execute)
    return p


def build_parser() -> argparse.ArgumentParser:
    """Stand-alone parser of ``python -m benchmarks.run``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                description=(__doc__ or "").splitlines()[0])
    _add_arguments(p)
    return p


def _clean(x: Any) -> Any:
    """JSON-safe copy: NaN/inf → None, tuples → lists, dtypes → names."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    return str(x).replace("torch.", "")


def write(res: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.md`` into ``out``."""
    from .report import markdown, targets

    out.mkdir(parents=True, exist_ok=True)
    res = dict(res)
    res["targets"] = targets(res)
    pj, pm = out / "bench.json", out / "bench.md"
    pj.write_text(json.dumps(_clean(res), indent=1, allow_nan=False) + "\n")
    pm.write_text(markdown(res))
    return pj, pm


def execute(args: argparse.Namespace) -> int:
    """Run the selected cases; returns 0, or 1 if a case failed (its traceback is in the JSON)."""
    import torch

    from . import common

    dev = common.use_device(common.select_device(args.device))  # DeviceError before any work
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message="Solved/Inaccurate")
    cfg = common.Config.make(args.quick, args.threads, args.seed, str(dev))
    out = Path(args.out)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, flush=True)

    t0 = time.perf_counter()
    info = common.machine_info(args.threads)
    info["calibration"] = common.calibrate(args.threads)
    cfgd = asdict(cfg)
    cfgd["dtypes"] = [str(d).replace("torch.", "") for d in cfg.dtypes]
    res: dict[str, Any] = {"machine": info, "config": cfgd}
    cases = args.only or list(CASES)
    failed = False
    for case in CASES:
        if case not in cases:
            continue
        log(f"[{time.perf_counter() - t0:6.1f}s] case {case}")
        try:
            mod = importlib.import_module(f"benchmarks.{case}")
            res[case] = mod.run(cfg, log)
        except Exception as err:  # keep the other cases; report the failure
            failed = True
            res[f"{case}_error"] = f"{type(err).__name__}: {err}"
            res[f"{case}_traceback"] = traceback.format_exc()
            log(f"  case {case} FAILED: {type(err).__name__}: {err}")
        info["loadavg_end"] = common.load_average()
        res["elapsed_s"] = time.perf_counter() - t0
        write(res, out)
    pj, pm = write(res, out)
    log(f"[{res['elapsed_s']:6.1f}s] wrote {pm} and {pj}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.run``.

    Before torch is first imported, ``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` (unless set):
    with spinning OpenMP workers, a contended 2-core machine turns each small 2-thread kernel
    into a ~25–50 ms stall; passive workers cost a few µs per parallel kernel instead."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    from .common import DeviceError

    try:
        return execute(args)
    except DeviceError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
