"""``python -m benchmarks.gpu [--out DIR] [--quick]``: the project's GPU command.

On a machine where torch sees a CUDA device it runs, in under 8 minutes: the CUDA tests
(``pytest -m cuda``), then on the GPU the module against the fastest hand-written loop and
torchdeq at B = 256, m = 1024 (fwd+bwd), ``torch.compile(module)`` against the eager module,
and one MNIST-1D training epoch of the conv OptEq against the equal-size CNN.  It writes
``DIR/gpu.json`` (raw timings, machine, versions) and ``DIR/gpu.md``.  Without a CUDA device it
says so and exits 0, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .common import (
    interleave,
    machine_info,
    median,
    paired_ratio,
    qp_inputs,
    qp_objective,
    qp_weight,
    sync,
    use_device,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench_gpu", help="output folder (gpu.json, gpu.md)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the CUDA tests")
    p.add_argument("--device", default="cuda",
                   help="where to run (cpu: a dry run of the command's code paths, no GPU)")
    return p


def run_tests(log: Any) -> dict[str, Any]:
    """``pytest -m cuda`` in a child process: its exit code and last lines."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", "tests"], capture_output=True, text=True,
                          timeout=300)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    log(f"  CUDA tests: exit {proc.returncode} ({time.perf_counter() - t:.0f} s): {tail[-1]}")
    return {"returncode": proc.returncode, "tail": tail, "seconds": time.perf_counter() - t}


def module_vs_hand(quick: bool, log: Any, dev: torch.device, m: int = 1024, b: int = 256
                   ) -> dict[str, Any]:
    """fwd+bwd of ``relu(WᵀWz + q)`` w.r.t. ``q`` on the GPU: the module (defaults), the
    fastest hand loop (plain and Anderson, closed-form ``Jᵀ``) and torchdeq's DEQ."""
    import lowering

    from .hand import HandDEQ
    from .limit import HandLimit
    from .qp import fwd_bwd
    from .solvers import DEQLayer

    w64 = qp_weight(m, norm=0.9, seed=0)
    layer = lowering.lower(qp_objective(w64))
    w = torch.as_tensor(w64, dtype=torch.float32)
    mods = {"module": layer.torch_module(weight_control=None, tol=1e-6, max_iter=200,
                                         backward_tol=1e-6, backward_max_iter=200)
            .requires_grad_(False).to(dev),
            "hand-plain": HandLimit(w, "plain").to(dev),
            "hand-anderson": HandLimit(w, "anderson").to(dev),
            "torchdeq": DEQLayer(HandDEQ(w.to(dev)), 200).to(dev)}
    qa, ca = qp_inputs(b, seed=0)
    q = torch.as_tensor(qa, dtype=torch.float32, device=dev)
    c = torch.as_tensor(ca, dtype=torch.float32, device=dev)
    methods = {k: fwd_bwd(v, q, c) for k, v in mods.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in methods.values():
            fn()
        times = interleave(methods, dict.fromkeys(methods, 5 if quick else 31), warmup=2)
    t = {k: median(v) for k, v in times.items()}
    best = min(("hand-plain", "hand-anderson"), key=lambda k: t[k])
    row = {"m": m, "batch": b, "times_s": t, "all_times": times,
           "module_over_hand": paired_ratio(times["module"], times[best]),
           "torchdeq_over_module": paired_ratio(times["torchdeq"], times["module"]),
           "module_iterations": (mods["module"].last_stats.mean_iterations,
                                 mods["module"].last_backward_stats.mean_iterations)}
    log(f"  m={m} B={b}: module {t['module'] * 1e3:.2f} ms, hand {t[best] * 1e3:.2f} ms "
        f"({best}), torchdeq {t['torchdeq'] * 1e3:.2f} ms; module/hand "
        f"{row['module_over_hand']:.2f}×, torchdeq/module {row['torchdeq_over_module']:.2f}×")
    return row


def compiled(quick: bool, log: Any, dev: torch.device) -> dict[str, Any]:
    """``torch.compile(module)`` against the eager module on the GPU (B = 256, m = 256)."""
    from .common import Config
    from .limit import _compiled

    cfg = Config(quick=quick, device=str(dev))
    qa, ca = qp_inputs(256, seed=0)
    return _compiled(cfg, log, qa, ca)


def mnist1d_epoch(quick: bool, log: Any, dev: torch.device) -> dict[str, Any]:
    """One MNIST-1D training epoch (the train-table's settings) of the conv OptEq and of the
    CNN with its parameter count, on the GPU: the second epoch's seconds (the first warms up)."""
    from convex_eq_app.table import CNN, TableConfig, build, table_data
    from convex_eq_app.training import TrainConfig, fit

    cfg = TableConfig(train_subset=1024 if quick else 0)
    data = table_data(cfg)
    out: dict[str, Any] = {}
    for name in ("conv OptEq", CNN):
        model = build(name, cfg, data.shape, 0)
        tc = TrainConfig(epochs=2, batch=cfg.batch, lr=cfg.lr, seed=0, shift=cfg.shift,
                         device=str(dev))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = fit(model, data, tc, name)
        sync()
        h = res.history[-1]
        out[name] = {"epoch_s": h["seconds"], "accuracy": res.accuracy,
                     "fwd_iters": h.get("fwd_iters"), "bwd_iters": h.get("bwd_iters")}
        log(f"  MNIST-1D {name}: {h['seconds']:.2f} s/epoch")
    out["ratio"] = out["conv OptEq"]["epoch_s"] / out[CNN]["epoch_s"]
    log(f"  conv OptEq / CNN epoch: {out['ratio']:.1f}×")
    return out


def markdown(res: dict[str, Any]) -> str:
    """The report: header (date, commit, versions, machine, command) and one table per part."""
    mi = res["machine"]
    lines = [f"# convex-eq GPU benchmarks{' (quick)' if res['quick'] else ''}", "",
             f"{mi.get('date', '')} · commit {mi.get('git', {}).get('commit', '?')} · "
             f"{res['device']} · torch {mi.get('versions', {}).get('torch')} · "
             f"command `{res['command']}`", ""]
    t = res.get("tests")
    if t is not None:
        lines += ["## CUDA tests", "", f"exit code {t['returncode']}: {t['tail'][-1]}", ""]
    r = res["module_vs_hand"]
    lines += ["## Module vs hand loop vs torchdeq (fwd+bwd, float32)", "",
              "| m | B | module ms | best hand ms | torchdeq ms | module / hand "
              "| torchdeq / module |",
              "|---|---|---|---|---|---|---|"]
    ts = r["times_s"]
    hand = min(ts["hand-plain"], ts["hand-anderson"])
    lines.append(f"| {r['m']} | {r['batch']} | {ts['module'] * 1e3:.2f} | {hand * 1e3:.2f} | "
                 f"{ts['torchdeq'] * 1e3:.2f} | {r['module_over_hand']:.2f}× | "
                 f"{r['torchdeq_over_module']:.2f}× |")
    c = res["compiled"]
    lines += ["", "## torch.compile (fwd+bwd, m = 256)", "", "| B | eager ms | compiled ms | "
              "compiled / eager | first call s |", "|---|---|---|---|---|"]
    for row in c["rows"]:
        lines.append(f"| {row['batch']} | {row['times_s']['eager'] * 1e3:.2f} | "
                     f"{row['times_s']['compiled'] * 1e3:.2f} | {row['compiled_over_eager']:.3f} | "
                     f"{row['first_call_s']:.1f} |")
    e = res["mnist1d"]
    lines += ["", "## One MNIST-1D training epoch", "", "| model | s / epoch | fwd iters | "
              "bwd iters |", "|---|---|---|---|"]
    for k, v in e.items():
        if isinstance(v, dict):
            lines.append(f"| {k} | {v['epoch_s']:.2f} | {v.get('fwd_iters') or '—'} | "
                         f"{v.get('bwd_iters') or '—'} |")
    lines += ["", f"conv OptEq / CNN: {e['ratio']:.1f}×", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: torch sees no CUDA device on this machine; nothing was measured "
              "(run this command on a machine with a GPU)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # the same float32 arithmetic as the CPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(s: str) -> None:
        print(s, flush=True)

    command = " ".join(["python -m benchmarks.gpu", *(argv or sys.argv[1:])])
    use_device(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"
    res: dict[str, Any] = {"quick": args.quick, "device": name,
                           "command": command,
                           "machine": machine_info(torch.get_num_threads())}
    def save() -> None:  # after every part: a run cut short keeps what it measured
        (out / "gpu.json").write_text(json.dumps(res, indent=1, default=str) + "\n")

    if not args.skip_tests and dev.type == "cuda":
        res["tests"] = run_tests(log)
        save()
    log("module vs hand loop vs torchdeq")
    res["module_vs_hand"] = module_vs_hand(args.quick, log, dev)
    save()
    log("MNIST-1D epoch")
    res["mnist1d"] = mnist1d_epoch(args.quick, log, dev)
    save()
    log("torch.compile")
    res["compiled"] = compiled(args.quick, log, dev)
    save()
    (out / "gpu.md").write_text(markdown(res))
    log(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}")
    return 0 if res.get("tests", {}).get("returncode", 0) in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
