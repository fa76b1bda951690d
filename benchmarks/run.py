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
import pickle
import subprocess
import sys
import tempfile
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
    p.add_argument("--same-process", action="store_true",
                   help="run every case in this process (default: each case in a fresh "
                   "interpreter, so that one case's imports, heap and caches do not slow the "
                   "next one's timings)")
    # internal: a child process runs its one case and pickles the result to this path
    p.add_argument("--case-result", help=argparse.SUPPRESS)


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


def _run_case(case: str, cfg: Any, log: Any) -> dict[str, Any]:
    """``{"result": …}`` of case ``case`` in this process, or ``{"error", "traceback"}``."""
    try:
        mod = importlib.import_module(f"benchmarks.{case}")
        return {"result": mod.run(cfg, log)}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def _run_case_isolated(case: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """:func:`_run_case` in a fresh interpreter (``python -m benchmarks.run --only case``): a
    case's timings do not depend on what the cases before it imported and allocated (after
    the cvxpylayers case, the m × B grid in the same process measured about 3 % slower)."""
    root = Path(__file__).resolve().parent.parent  # benchmarks/ is a script folder, not installed
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "case.pkl"
        cmd = [sys.executable, "-m", "benchmarks.run", "--only", case, "--case-result",
               str(result), "--threads", str(args.threads), "--seed", str(args.seed),
               "--device", device, "--out", tmp]
        cmd += ["--quick"] * args.quick + ["--quiet"] * args.quiet
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode != 0 or not result.exists():
            return {"error": f"the process of case {case} exited with status {proc.returncode} "
                    "before writing its result", "traceback": "command: " + " ".join(cmd)}
        with open(result, "rb") as fh:
            return pickle.load(fh)


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
    if args.case_result:  # a child of _run_case_isolated: its one case, pickled
        if not args.only or len(args.only) != 1:
            raise SystemExit("--case-result runs exactly one case: pass one --only CASE")
        got = _run_case(args.only[0], cfg, lambda msg: None if args.quiet else print(msg,
                                                                                   flush=True))
        with open(args.case_result, "wb") as fh:
            pickle.dump(got, fh)
        return 0

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
        got = _run_case(case, cfg, log) if args.same_process else \
            _run_case_isolated(case, args, str(dev))
        if "error" in got:  # keep the other cases; report the failure
            failed = True
            res[f"{case}_error"] = got["error"]
            res[f"{case}_traceback"] = got["traceback"]
            log(f"  case {case} FAILED: {got['error']}")
        else:
            res[case] = got["result"]
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
