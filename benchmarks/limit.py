"""Case "limit": the emitted module against the fastest hand-written loop, on an m × B grid.

The layer is the OptEq hidden QP ``z = relu(WᵀW z + q)`` (``W ∈ R^{m×64}``, ``||W||₂ = 0.9``,
float32, tol 1e-6), fwd+bwd of ``ℓ = Σ c ⊙ z`` with respect to ``q``.  The hand loops are what one
would write for this one layer and nothing else:

* the injection ``q`` given once, ``M = WᵀW`` formed once per call (``z ↦ relu(zM + q)``: one
  fused ``addmm`` per iteration, the ReLU in place on its fresh output; the adjoint step
  ``addmm(v, (D g), M)`` likewise);
* the stop test in its fastest form (:func:`benchmarks.hand.done`): the worst residual read
  as a Python float, the division and the ``1e-30`` floor in place on the fresh norms;
* the backward as an ``autograd.Function`` with the analytic transpose Jacobian
  ``Jᵀy = M (D y)``, ``D = diag(1[p > 0])`` (no autograd graph, no ``autograd.grad`` calls);
* plain fixed-point iteration and Anderson (history 5), forward and adjoint; per cell the better
  of the two is "the limit".

Both compute the same gradient, ``∂ℓ/∂q``: the hand loop's ``W`` and the module's weights are
frozen (``requires_grad_(False)``), so neither pays for a weight gradient the other skips (weight
gradients are timed by the training case).
The module runs with its default solver (``auto``), with Anderson and with plain iteration.
Times are medians of interleaved repetitions (one process, equal threads), after three untimed
interleaved rounds of every method (``WARMUP``).  Each cell states two ratios: the ratio of
the medians, and the paired ratio (:func:`~benchmarks.common.paired_ratio`: the median over
rounds of module time / hand time within the same round), which the targets are judged on.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from .common import (
    Config,
    interleave,
    median,
    paired_ratio,
    qp_inputs,
    qp_objective,
    qp_weight,
    timed,
)
from .hand import anderson
from .qp import fwd_bwd

TOL = 1e-6
MAX_ITER = 200
NORM = 0.9
GRID_M = (64, 256, 1024, 4096)
GRID_B = (1, 32, 256)
#: untimed interleaved rounds before each cell's timed ones (common.interleave)
WARMUP = 3


def plain(f: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, tol: float,
          max_iter: int) -> tuple[torch.Tensor, int]:
    """``z ← f(z)`` until every sample's ``||f(z) − z|| ≤ tol·||f(z)||`` (the stop test of
    :func:`benchmarks.hand.done`, written inline: one Python call less per iteration)."""
    z = z0
    norm = torch.linalg.vector_norm
    for k in range(max_iter):
        fz = f(z)
        r = norm(fz - z, dim=1).div_(norm(fz, dim=1).clamp_min_(1e-30))
        z = fz
        if float(r.max()) <= tol:
            return z, k + 1
    return z, max_iter


SOLVE = {"plain": plain, "anderson": anderson}


class _HandFixedPoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, M: torch.Tensor, solver: str) -> torch.Tensor:
        solve = SOLVE[solver]
        # one addmm and the activation in place on its fresh output: 7 % faster fwd+bwd than
        # relu(q + z @ M) on this machine (m = 64–1024, B = 32–256), the limit to measure against
        z, _ = solve(lambda z: torch.relu_(torch.addmm(q, z, M)), torch.zeros_like(q), TOL,
                     MAX_ITER)
        mask = torch.addmm(q, z, M) > 0
        ctx.save_for_backward(M, mask)
        ctx.solver = solver
        return z

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        M, mask = ctx.saved_tensors
        solve = SOLVE[ctx.solver]
        mf = mask.to(v.dtype)
        g, _ = solve(lambda g: torch.addmm(v, g * mf, M), v, TOL, MAX_ITER)
        return g * mf, None, None


class HandLimit(torch.nn.Module):
    """``q ↦ z*`` for ``relu(WᵀW z + q)``: the fastest loop we know how to write (docstring)."""

    def __init__(self, w: torch.Tensor, solver: str):
        super().__init__()
        self.W = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
        self.solver = solver

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        M = self.W.T @ self.W
        return _HandFixedPoint.apply(q, M, self.solver)


def _adjoint_of(mod: Any) -> str:
    """``"<adjoint solver> <iterations>"`` of the module's last backward."""
    st = mod.last_backward_stats
    return f"{st.solver} {int(st.iterations.max())}"


def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Every (m, B) cell: module (Anderson default, plain) vs hand (Anderson, plain)."""
    import lowering

    dev = torch.device(cfg.device)
    grid_m = (64, 256) if cfg.quick else GRID_M
    grid_b = (1, 32) if cfg.quick else GRID_B
    reps = 2 if cfg.quick else 61
    warmup = 0 if cfg.quick else WARMUP
    dtype = torch.float32
    rows: list[dict[str, Any]] = []
    qa, ca = qp_inputs(max(grid_b), seed=cfg.seed)
    for m in grid_m:
        w64 = qp_weight(m, norm=NORM, seed=cfg.seed)
        layer = lowering.lower(qp_objective(w64))
        w = torch.as_tensor(w64, dtype=dtype)
        # auto: the module's defaults (its adjoint method "auto": a direct solve when small,
        # conjugate gradients on this symmetric system, else the solver); anderson / plain:
        # the hand loops' own algorithms forward and adjoint ("iterative": no direct, no CG),
        # so that module plain / hand plain is the module's cost at equal work
        mods = {f"module-{s}": layer.torch_module(
                    weight_control=None, solver=s, tol=TOL, max_iter=MAX_ITER,
                    backward_solver=s, backward_tol=TOL, backward_max_iter=MAX_ITER,
                    backward_adjoint="auto" if s == "auto" else "iterative",
                    dtype=dtype).requires_grad_(False).to(dev)
                for s in ("auto", "anderson", "plain")}
        hands = {f"hand-{s}": HandLimit(w, s).to(dev) for s in ("anderson", "plain")}
        for b in grid_b:
            q = torch.as_tensor(qa[:b], dtype=dtype, device=dev)
            c = torch.as_tensor(ca[:b], dtype=dtype, device=dev)
            methods = {name: fwd_bwd(lay, q, c) for name, lay in {**mods, **hands}.items()}
            outs = {name: fn() for name, fn in methods.items()}  # warm-up and agreement
            ref_z, ref_g = outs["hand-plain"]
            err = {name: max(float((z - ref_z).norm() / ref_z.norm().clamp_min(1e-30)),
                             float((g - ref_g).norm() / ref_g.norm().clamp_min(1e-30)))
                   for name, (z, g) in outs.items()}
            times = interleave(methods, dict.fromkeys(methods, reps), warmup=warmup)
            t = {name: median(ts) for name, ts in times.items()}
            best_hand = min(t["hand-anderson"], t["hand-plain"])
            hand_k = min(("hand-anderson", "hand-plain"), key=lambda k: t[k])
            best_mod = min(mods, key=lambda k: t[k])
            row = {"m": m, "batch": b, "dtype": "float32", "times_s": t, "all_times": times,
                   "rel_diff_vs_hand_plain": err,
                   "ratio_default": t["module-auto"] / best_hand,
                   "ratio_best": min(t[k] for k in mods) / best_hand,
                   "ratio_paired": paired_ratio(times["module-auto"], times[hand_k]),
                   "ratio_paired_best": paired_ratio(times[best_mod], times[hand_k]),
                   # the module at the hand loop's own work (plain forward, plain adjoint)
                   "ratio_paired_same": paired_ratio(times["module-plain"],
                                                     times["hand-plain"]),
                   "adjoint_auto": _adjoint_of(mods["module-auto"])}
            rows.append(row)
            log(f"  limit m={m} B={b}: module {t['module-auto'] * 1e3:.2f} / "
                f"{t['module-anderson'] * 1e3:.2f} / {t['module-plain'] * 1e3:.2f} ms "
                f"(auto/anderson/plain), hand {t['hand-anderson'] * 1e3:.2f} / "
                f"{t['hand-plain'] * 1e3:.2f} ms; ratio {row['ratio_default']:.2f}× (default "
                f"auto), {row['ratio_best']:.2f}× (best solver); paired "
                f"{row['ratio_paired']:.2f}× / {row['ratio_paired_best']:.2f}×; plain/plain "
                f"{row['ratio_paired_same']:.2f}×; auto's adjoint {row['adjoint_auto']}")
    return {"rows": rows, "tol": TOL, "max_iter": MAX_ITER, "norm": NORM, "reps": reps,
            "fixed": _fixed_cost(cfg, log), "weight_control": _weight_control_step(cfg, log),
            "compile": _compiled(cfg, log, qa, ca)}


#: the fixed-cost row: one sample of a 256-state layer (a 256 × 256 ``W``), where what a call
#: costs besides its iterations weighs most
FIXED_N = 256


def _fixed_cost(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """The module with its defaults against the fastest hand loop at ``B = 1``, ``n = m =
    FIXED_N``: forward (no gradient) and forward + backward, paired ratios."""
    import lowering

    n = 64 if cfg.quick else FIXED_N
    dev = torch.device(cfg.device)
    w64 = qp_weight(n, d=n, norm=NORM, seed=cfg.seed)
    layer = lowering.lower(qp_objective(w64))
    w = torch.as_tensor(w64, dtype=torch.float32)
    qa, ca = qp_inputs(1, d=n, seed=cfg.seed)
    q = torch.as_tensor(qa, dtype=torch.float32, device=dev)
    c = torch.as_tensor(ca, dtype=torch.float32, device=dev)
    lays = {"module": layer.torch_module(tol=TOL, max_iter=MAX_ITER, backward_tol=TOL,
                                         backward_max_iter=MAX_ITER).requires_grad_(False)
            .to(dev),
            "hand-plain": HandLimit(w, "plain").to(dev),
            "hand-anderson": HandLimit(w, "anderson").to(dev)}

    def forward_only(lay: Any) -> Callable[[], Any]:
        def go() -> Any:
            with torch.no_grad():
                return lay(q)
        return go

    methods = {f"{k} fwd": forward_only(v) for k, v in lays.items()}
    methods.update({f"{k} fwd+bwd": fwd_bwd(v, q, c) for k, v in lays.items()})
    for fn in methods.values():
        fn()
    reps = 2 if cfg.quick else 61
    times = interleave(methods, dict.fromkeys(methods, reps), warmup=0 if cfg.quick else WARMUP)
    t = {k: median(v) for k, v in times.items()}
    out: dict[str, Any] = {"n": n, "batch": 1, "times_s": t, "all_times": times}
    for what in ("fwd", "fwd+bwd"):
        hand = min(("hand-plain", "hand-anderson"), key=lambda k, w=what: t[f"{k} {w}"])
        out[f"ratio_{what}"] = paired_ratio(times[f"module {what}"], times[f"{hand} {what}"])
        out[f"hand_{what}"] = hand
    log(f"  fixed cost n={n} B=1: module {t['module fwd'] * 1e3:.3f} / "
        f"{t['module fwd+bwd'] * 1e3:.3f} ms (fwd / fwd+bwd), module / hand {out['ratio_fwd']:.2f}"
        f"× / {out['ratio_fwd+bwd']:.2f}×")
    return out


def _weight_control_step(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """A training step (fwd+bwd with the weights' gradients, an Adam step) of the module with its
    default weight control against ``weight_control=None``, on weights that need no control
    (``||W||₂ = 0.9``): paired ratio per step.  Every step changes the weights (what weight
    control must then measure or bound again); the small learning rate keeps the uncontrolled
    module's weights inside the contraction region for all repetitions."""
    import lowering

    m, b = (64, 8) if cfg.quick else (1024, 32)
    dev = torch.device(cfg.device)
    layer = lowering.lower(qp_objective(qp_weight(m, norm=NORM, seed=cfg.seed)))
    qa, ca = qp_inputs(b, seed=cfg.seed)
    q = torch.as_tensor(qa, dtype=torch.float32, device=dev)
    c = torch.as_tensor(ca, dtype=torch.float32, device=dev)
    steps = {}
    for name, wc in (("auto", "auto"), ("none", None)):
        mod = layer.torch_module(weight_control=wc, tol=TOL, max_iter=MAX_ITER).to(dev)
        opt = torch.optim.Adam(mod.parameters(), lr=1e-6)

        def step(mod: Any = mod, opt: Any = opt) -> None:
            opt.zero_grad()
            (mod(q) * c).sum().backward()
            opt.step()

        steps[name] = step
    for fn in steps.values():
        fn()
    reps = 2 if cfg.quick else 61
    times = interleave(steps, dict.fromkeys(steps, reps), warmup=0 if cfg.quick else WARMUP)
    ratio = paired_ratio(times["auto"], times["none"])
    log(f"  weight control per training step m={m} B={b}: auto / None {ratio:.3f}×")
    return {"m": m, "batch": b, "ratio": ratio, "times_s": {k: median(v) for k, v in
                                                             times.items()}}


def _compiled(cfg: Config, log: Callable[[str], None], qa: Any, ca: Any) -> dict[str, Any]:
    """``torch.compile(module)`` against the eager module, fwd+bwd at m = 256 and B ∈ {1, 32,
    256} (the target is judged at B = 256).  Inside ``torch.compile`` the module runs its
    plain iterations in compiled chunks of ``compile_steps`` (its default) iterations; the
    first compiled call's time (at B = 256) is the compile time, then interleaved
    repetitions.  Iteration counts of both are recorded (the chunk schedule is meant to stop
    where the eager loop stops)."""
    import lowering

    m = 64 if cfg.quick else 256
    batches = (8,) if cfg.quick else (256, 32, 1)
    w64 = qp_weight(m, norm=NORM, seed=cfg.seed)
    eager = lowering.lower(qp_objective(w64)).torch_module(
        weight_control=None, tol=TOL, max_iter=MAX_ITER, backward_tol=TOL,
        backward_max_iter=MAX_ITER, dtype=torch.float32).requires_grad_(False)
    dev = torch.device(cfg.device)
    eager = eager.to(dev)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod)
    reps = 2 if cfg.quick else 61
    warmup = 0 if cfg.quick else WARMUP
    rows = []
    compile_s = math.nan
    for b in batches:
        q = torch.as_tensor(qa[:b], dtype=torch.float32, device=dev)
        c = torch.as_tensor(ca[:b], dtype=torch.float32, device=dev)
        methods = {"eager": fwd_bwd(eager, q, c), "compiled": fwd_bwd(compiled, q, c)}
        methods["eager"]()
        first = timed(methods["compiled"])  # the first call at this shape compiles
        if math.isnan(compile_s):
            compile_s = first
        iters = {name: (int(mod.last_stats.iterations.max()),
                        int(mod.last_backward_stats.iterations.max()),
                        mod.last_stats.solver, mod.last_backward_stats.solver)
                 for name, mod in (("eager", eager), ("compiled", compiled_mod))}
        times = interleave(methods, dict.fromkeys(methods, reps), warmup=warmup)
        t = {k: median(v) for k, v in times.items()}
        ratio = paired_ratio(times["compiled"], times["eager"])
        rows.append({"batch": b, "times_s": t, "all_times": times, "compiled_over_eager": ratio,
                     "compiled_over_eager_medians": t["compiled"] / t["eager"],
                     "first_call_s": first, "iterations": iters})
        log(f"  compile m={m} B={b}: eager {t['eager'] * 1e3:.2f} ms, compiled "
            f"{t['compiled'] * 1e3:.2f} ms (compiled/eager paired {ratio:.3f}, medians "
            f"{t['compiled'] / t['eager']:.3f}), first call "
            f"{first:.1f} s; iterations fwd/bwd eager {iters['eager'][:2]}, compiled "
            f"{iters['compiled'][:2]} ({iters['compiled'][2]})")
    target = rows[0]
    return {"m": m, "batch": target["batch"], "times_s": target["times_s"],
            "compiled_over_eager": target["compiled_over_eager"], "first_call_s": compile_s,
            "compile_steps": eager.config.compile_steps, "rows": rows}
