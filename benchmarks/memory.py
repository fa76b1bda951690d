"""Case 5: memory of implicit vs unrolled backward (the shape of TPAMI Table 8).

Two measures, both over one forward + backward of ``ℓ = Σ c ⊙ z``:

* **graph**: bytes of the tensors autograd saves for backward during the forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once). This is the memory a
  backward mode keeps alive between forward and backward — what grows with K when unrolling.
* **peak**: the peak of torch's CPU allocator over forward + backward, from
  ``torch.profiler.profile(profile_memory=True)``: the running sum of the ``[memory]``
  allocation/free events (bytes above what was live when profiling started). It includes
  transient buffers such as the Anderson histories of the forward and adjoint solves.

(``tracemalloc`` does not see torch's CPU allocator, so it is not used.)
"""

from __future__ import annotations

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
from .qp import fwd_bwd

TOL = 1e-6


def saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes of distinct storages saved for backward while ``run()`` builds its graph."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def profiler_peak(run: Callable[[], Any], device: torch.device | None = None) -> int:
    """Peak bytes allocated by torch on the CPU during ``run()`` (profiler memory events); on a
    CUDA ``device``, the peak of its caching allocator above what was allocated before."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Implicit (Anderson to 1e-6) and unrolled K steps: graph bytes, peak bytes, residual, time."""
    import lowering

    m, b, dtype = cfg.solver_m, cfg.mem_batch, torch.float32
    dev = torch.device(cfg.device)
    w64 = qp_weight(m, norm=0.9, seed=cfg.seed)
    layer = lowering.lower(qp_objective(w64))
    qa, ca = qp_inputs(b, seed=cfg.seed)
    q = torch.as_tensor(qa, dtype=dtype, device=dev)
    c = torch.as_tensor(ca, dtype=dtype, device=dev)
    mods = {"implicit": layer.torch_module(
                weight_control=None, solver="anderson", backward="implicit", tol=TOL,
                                           max_iter=100, dtype=dtype).to(dev)}
    for k in cfg.mem_ks:
        mods[f"unroll K={k}"] = layer.torch_module(
                weight_control=None, backward="unroll", unroll_steps=k, tol=TOL,
                                                   dtype=dtype).to(dev)
    w_used = mods["implicit"].weights["W"].detach().double().cpu().numpy()
    ex = exact_qp(w_used, qa, ca)
    wt = torch.as_tensor(w_used, dtype=dtype, device=dev)
    rows = []
    for name, mod in mods.items():
        run_ = fwd_bwd(mod, q, c)

        def forward_only(mod: Any = mod) -> None:
            mod(q.detach().clone().requires_grad_())

        graph = saved_bytes(forward_only)
        peak = profiler_peak(run_, dev)
        z, g = run_()
        with torch.no_grad():
            fz = torch.relu(q + (z @ wt.T) @ wt)
            res = float(((fz - z).norm(dim=1) / fz.norm(dim=1).clamp_min(1e-30)).max())
        rows.append({"method": name, "graph_bytes": graph, "peak_bytes": peak,
                     "residual_max": res, "z_err": rel_err(z, ex.z),
                     "grad_err": rel_err(g, ex.grad), "m": m, "batch": b, "dtype": "float32"})
    times = interleave({r["method"]: fwd_bwd(mods[r["method"]], q, c) for r in rows},
                       {r["method"]: cfg.reps for r in rows})
    for r in rows:
        r["fwdbwd_s"], r["fwdbwd_times"] = median(times[r["method"]]), times[r["method"]]
        log(f"  memory {r['method']}: graph {r['graph_bytes'] / 2**20:.2f} MiB, peak "
            f"{r['peak_bytes'] / 2**20:.2f} MiB, residual {r['residual_max']:.1e}")
    return {"rows": rows, "method_note": (__doc__ or "").strip(), "device": str(dev)}
