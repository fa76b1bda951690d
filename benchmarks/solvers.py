"""Case 3: plain / Anderson / Broyden of the emitted module and torchdeq's Anderson on one layer."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .common import (
    Config,
    exact_qp,
    interleave,
    median,
    qp_inputs,
    qp_objective,
    qp_weight,
    rel_err,
)
from .hand import HandDEQ
from .qp import fwd, fwd_bwd

TOL = 1e-6
MAX_ITER = 1000
SOLVERS = ("plain", "anderson", "broyden")
#: torchdeq's Anderson with its defaults, and with the module's history and nominal ridge
DEQ_VARIANTS: dict[str, dict[str, Any]] = {"torchdeq-anderson": {},
                                           "torchdeq-anderson m=5 lam=1e-8": {"m": 5, "lam": 1e-8}}


def _deq(max_iter: int) -> Any:
    """torchdeq's DEQ: its Anderson (defaults m=6, lam=1e-4) forward, Anderson IFT backward, both
    stopping on the relative residual at 1e-6 (the library default stops on 'abs' at 1e-3)."""
    from torchdeq import get_deq

    return get_deq(f_solver="anderson", f_max_iter=max_iter, f_tol=TOL, f_stop_mode="rel",
                   b_solver="anderson", b_max_iter=100, b_tol=TOL, b_stop_mode="rel", ift=True)


class DEQLayer(torch.nn.Module):
    """``q ↦ z*`` through torchdeq on the hand-written ``relu(Wᵀ(Wz) + q)``."""

    def __init__(self, hand: HandDEQ, max_iter: int, solver_kwargs: dict | None = None):
        super().__init__()
        self.hand = hand
        self.deq = _deq(max_iter)
        self.solver_kwargs = dict(solver_kwargs or {})
        self.info: dict[str, Any] = {}

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        self.deq.train(torch.is_grad_enabled())
        zs, self.info = self.deq(lambda z: self.hand.f(z, q), torch.zeros_like(q),
                                 solver_kwargs=dict(self.solver_kwargs))
        return zs[-1]


def _solver_row(mod: Any, q: torch.Tensor) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            _, st = mod(q, return_stats=True)
    return {"iters_max": int(st.iterations.max()), "iters_mean": st.mean_iterations,
            "reached_tol": bool(st.converged.all()), "residual_max": st.max_residual}


def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Iterations/time to 1e-6 per solver and ||W||₂; module vs torchdeq fwd(+bwd) at 0.9."""
    import lowering

    try:
        import torchdeq  # noqa: F401
        have_deq = True
    except ImportError:
        have_deq = False
    rows: list[dict[str, Any]] = []
    dev = torch.device(cfg.device)
    qa, _ = qp_inputs(max(cfg.solver_batch, *cfg.deq_batches), seed=cfg.seed)
    for norm in cfg.norms:
        w64 = qp_weight(cfg.solver_m, norm=norm, seed=cfg.seed)
        layer = lowering.lower(qp_objective(w64))
        for dtype in cfg.dtypes:
            dname = str(dtype).replace("torch.", "")
            q = torch.as_tensor(qa[:cfg.solver_batch], dtype=dtype, device=dev)
            mods = {s: layer.torch_module(
                weight_control=None, solver=s, tol=TOL, max_iter=MAX_ITER, dtype=dtype,
                                          on_nonconvergence="warn").to(dev) for s in SOLVERS}
            methods: dict[str, Callable[[], Any]] = {}
            stats: dict[str, dict[str, Any]] = {}
            for s, mod in mods.items():
                stats[s] = _solver_row(mod, q)
                methods[s] = fwd(mod, q)
            for name, kw in (DEQ_VARIANTS if have_deq else {}).items():
                deq = DEQLayer(HandDEQ(torch.as_tensor(w64, dtype=dtype)), MAX_ITER, kw).to(dev)
                with torch.no_grad():
                    deq(q)
                info = deq.info
                rel = info["rel_lowest"]
                stats[name] = {
                    "iters_max": int(info["nstep"].max()),
                    "iters_mean": float(info["nstep"].float().mean()),
                    "reached_tol": bool(rel.max() <= TOL), "residual_max": float(rel.max())}
                methods[name] = fwd(deq, q)
            times = interleave(methods, dict.fromkeys(methods, cfg.reps))
            for name, st in stats.items():
                st.update(norm=norm, dtype=dname, solver=name, time_s=median(times[name]),
                          times=times[name], batch=cfg.solver_batch, m=cfg.solver_m)
                rows.append(st)
            log(f"  solvers ||W||={norm} {dname}: " + ", ".join(
                f"{k} {v['iters_max']} it" for k, v in stats.items()))
    return {"rows": rows, "deq": _vs_deq(cfg, log) if have_deq else [], "tol": TOL,
            "max_iter": MAX_ITER, "have_torchdeq": have_deq, "device": str(dev)}


def _vs_deq(cfg: Config, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Module vs torchdeq, forward and forward+backward, ||W||₂ = 0.9, float32."""
    import lowering

    out = []
    w64 = qp_weight(cfg.solver_m, norm=0.9, seed=cfg.seed)
    layer = lowering.lower(qp_objective(w64))
    dtype, dev = torch.float32, torch.device(cfg.device)
    mod = layer.torch_module(
                weight_control=None, solver="anderson", tol=TOL, max_iter=100, dtype=dtype).to(dev)
    deq = DEQLayer(HandDEQ(torch.as_tensor(w64, dtype=dtype)), 100).to(dev)
    qa, ca = qp_inputs(max(cfg.deq_batches), seed=cfg.seed)
    w_used = mod.weights["W"].detach().double().cpu().numpy()
    for b in cfg.deq_batches:
        q = torch.as_tensor(qa[:b], dtype=dtype, device=dev)
        c = torch.as_tensor(ca[:b], dtype=dtype, device=dev)
        ex = exact_qp(w_used, q.double().cpu().numpy(), c.double().cpu().numpy())
        row: dict[str, Any] = {"batch": b, "m": cfg.solver_m, "dtype": "float32", "norm": 0.9}
        methods: dict[str, Callable[[], Any]] = {}
        for name, lay in (("module", mod), ("torchdeq", deq)):
            z, g = fwd_bwd(lay, q, c)()
            row[name] = {"z_err": rel_err(z, ex.z), "grad_err": rel_err(g, ex.grad)}
            methods[f"{name}.fwd"] = fwd(lay, q)
            methods[f"{name}.fwdbwd"] = fwd_bwd(lay, q, c)
        times = interleave(methods, dict.fromkeys(methods, cfg.reps))
        for name in ("module", "torchdeq"):
            for kind in ("fwd", "fwdbwd"):
                row[name][f"{kind}_s"] = median(times[f"{name}.{kind}"])
                row[name][f"{kind}_times"] = times[f"{name}.{kind}"]
        row["speedup_fwd"] = row["torchdeq"]["fwd_s"] / row["module"]["fwd_s"]
        row["speedup_fwdbwd"] = row["torchdeq"]["fwdbwd_s"] / row["module"]["fwdbwd_s"]
        out.append(row)
        log(f"  torchdeq B={b}: module/torchdeq fwd+bwd speedup {row['speedup_fwdbwd']:.1f}x")
    return out
