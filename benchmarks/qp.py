"""Cases 1 and 2: the OptEq hidden QP — emitted module vs cvxpylayers vs a hand-written loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .common import (
    Config,
    clarabel_crosscheck,
    exact_qp,
    interleave,
    median,
    qp_inputs,
    qp_objective,
    qp_weight,
    rel_err,
)
from .hand import HandDEQ

TOL = 1e-6
MAX_ITER = 100
NORM = 0.9
#: SCS through diffcp, as ``backend="cvxpylayers"`` ships it (eps_abs = eps_rel = 1e-10)
CVX_ARGS: dict[str, Any] = {"eps": 1e-10, "max_iters": 100000}


class Float64Layer(torch.nn.Module):
    """cvxpylayers solves in float64 on the CPU (diffcp/SCS are double, CPU-only): move and cast
    the input there, the output back to the input's device and dtype (with ``--device cuda`` its
    times include these two copies).

    (``backend="cvxpylayers", dtype=torch.float32`` fails: the CvxpyLayer returns float64 and
    ``CvxpyLayerModule.forward`` multiplies it by a float32 ``state_map``.)"""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.layer(q.to("cpu", torch.float64)).to(q.device, q.dtype)


def fwd(layer: Callable[[torch.Tensor], Any], q: torch.Tensor) -> Callable[[], Any]:
    """Inference call (no autograd graph)."""

    def run() -> Any:
        with torch.no_grad():
            return layer(q)

    return run


def fwd_bwd(layer: Callable[[torch.Tensor], Any], q: torch.Tensor, c: torch.Tensor
            ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Forward with autograd plus ``backward`` of ``ℓ = Σ c ⊙ z``; returns ``(z, ∂ℓ/∂q)``."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        qg = q.detach().clone().requires_grad_()
        z = layer(qg)
        (z * c).sum().backward()
        return z.detach(), qg.grad

    return run


def _iters(mod: Any) -> dict[str, float]:
    st, bst = mod.last_stats, getattr(mod, "last_backward_stats", None)
    out = {"iters_mean": st.mean_iterations, "iters_max": int(st.iterations.max()),
           "converged": bool(st.converged.all()), "residual_max": st.max_residual}
    if bst is not None:
        out["bwd_iters_max"] = int(bst.iterations.max())
    return out


def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """All (m, dtype, batch) rows, timings interleaved within each row."""
    import lowering

    rows: list[dict[str, Any]] = []
    refs: dict[str, Any] = {}
    bmax = max(cfg.batches)
    dev = torch.device(cfg.device)
    for m in cfg.ms:
        w64 = qp_weight(m, norm=NORM, seed=cfg.seed)
        obj = qp_objective(w64)
        layer = lowering.lower(obj)
        qa, ca = qp_inputs(bmax, seed=cfg.seed)
        ex2 = exact_qp(w64, qa[:2], ca[:2])
        refs[str(m)] = {"clarabel_vs_exact": clarabel_crosscheck(obj, qa[:2], ex2.z),
                        "formula": layer.formula()}
        t0 = time.perf_counter()
        cvx = Float64Layer(layer.torch_module(backend="cvxpylayers", solver_args=CVX_ARGS,
                                              dtype=torch.float64))
        cvx_build = time.perf_counter() - t0
        for dtype in cfg.dtypes:
            dname = str(dtype).replace("torch.", "")
            mod = layer.torch_module(
                weight_control=None, solver="anderson", backward="implicit", tol=TOL,
                                     max_iter=MAX_ITER, dtype=dtype).to(dev)
            hand = HandDEQ(torch.as_tensor(w64, dtype=dtype), tol=TOL, max_iter=MAX_ITER).to(dev)
            w_used = mod.weights["W"].detach().double().cpu().numpy()
            for b in cfg.batches:
                q = torch.as_tensor(qa[:b], dtype=dtype, device=dev)
                c = torch.as_tensor(ca[:b], dtype=dtype, device=dev)
                ex = exact_qp(w_used, q.double().cpu().numpy(), c.double().cpu().numpy())
                row: dict[str, Any] = {"m": m, "dtype": dname, "batch": b,
                                       "ref_kkt_failures": ex.kkt_failures,
                                       "ref_margin": ex.margin,
                                       "active_fraction": float(ex.active.mean())}
                calls = {"module": mod, "hand": hand, "cvxpylayers": cvx}
                acc: dict[str, dict[str, Any]] = {}
                est: dict[str, float] = {}
                for name, lay in calls.items():
                    fwd(lay, q)()  # warm-up
                    t0 = time.perf_counter()
                    z, g = fwd_bwd(lay, q, c)()
                    est[name] = time.perf_counter() - t0
                    acc[name] = {"z_err": rel_err(z, ex.z), "grad_err": rel_err(g, ex.grad)}
                    if name == "module":
                        acc[name].update(_iters(mod))
                    elif name == "hand":
                        acc[name].update(iters_max=hand.last_iterations,
                                         bwd_iters_max=hand.last_backward_iterations)
                n_cvx = max(1, min(cfg.cvx_reps, int(cfg.cvx_budget / max(est["cvxpylayers"],
                                                                            1e-9))))
                methods = {}
                reps = {}
                for name, lay in calls.items():
                    methods[f"{name}.fwd"] = fwd(lay, q)
                    methods[f"{name}.fwdbwd"] = fwd_bwd(lay, q, c)
                    n = n_cvx if name == "cvxpylayers" else cfg.reps
                    reps[f"{name}.fwd"] = reps[f"{name}.fwdbwd"] = n
                times = interleave(methods, reps)
                for name in calls:
                    acc[name]["fwd_s"] = median(times[f"{name}.fwd"])
                    acc[name]["fwdbwd_s"] = median(times[f"{name}.fwdbwd"])
                    acc[name]["fwd_times"] = times[f"{name}.fwd"]
                    acc[name]["fwdbwd_times"] = times[f"{name}.fwdbwd"]
                row.update(acc)
                row["cvx_build_s"] = cvx_build
                row["speedup_fwd"] = acc["cvxpylayers"]["fwd_s"] / acc["module"]["fwd_s"]
                row["speedup_fwdbwd"] = acc["cvxpylayers"]["fwdbwd_s"] / acc["module"]["fwdbwd_s"]
                row["overhead_fwd"] = acc["module"]["fwd_s"] / acc["hand"]["fwd_s"]
                row["overhead_fwdbwd"] = acc["module"]["fwdbwd_s"] / acc["hand"]["fwdbwd_s"]
                rows.append(row)
                log(f"  qp m={m} {dname} B={b}: module {acc['module']['fwdbwd_s'] * 1e3:.1f} ms, "
                    f"hand {acc['hand']['fwdbwd_s'] * 1e3:.1f} ms, cvxpylayers "
                    f"{acc['cvxpylayers']['fwdbwd_s'] * 1e3:.0f} ms (fwd+bwd; x{n_cvx})")
    return {"rows": rows, "reference": refs, "tol": TOL, "max_iter": MAX_ITER, "norm": NORM,
            "cvx_solver_args": CVX_ARGS, "device": str(dev), "cvxpylayers_device": "cpu"}

