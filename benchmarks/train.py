"""Case "train": the demo's conv OptEq classifier trained step by step, module vs torchdeq.

The model is the demo's ``classifier("OptEq", …)`` (``convex_eq_app.demo``: conv OptEq with 12
channels, kernel 5, on MNIST-1D signals of length 40, max-pooled to 8 positions, linear head;
module options of ``TrainingSettings``: Anderson forward to relative residual 1e-4 or 40
iterations, implicit backward with the adjoint capped at 80, spectral-norm weight control).
MNIST-1D is generated locally by the ``mnist1d`` package, never downloaded.

The torchdeq side is the *same layer*: a copy of the classifier (same weights at the start),
whose equilibrium module supplies the map ``z ↦ T(z, x)`` — its plan (``lowering.runtime.plan``:
the state-free parts such as the injection computed once per step) where the layer has one,
else ``module.T`` — and its weights after weight control (``module.env()``, once per step);
torchdeq's ``get_deq`` solves it with its Anderson forward and its IFT backward (Anderson
adjoint), both stopping on the relative residual at the module's tolerances and caps: once with
torchdeq's Anderson defaults (m = 6, lam = 1e-4; the baseline of the issue's target) and once
with the module's history and nominal ridge (m = 5, lam = 1e-8; for information).  The pooling
and the linear head are the classifier's own.

Every method is trained with Adam at the demo's learning rate (constant: the demo's cosine
schedule is per epoch) on the same batches (seeded per-epoch permutations, batch 64, the partial
last batch dropped), step by step interleaved in one process (the order rotating per step), each
step timed as forward + backward + optimizer step with the device synchronised before each clock
read (``common.timed``).  Solver statistics and losses are read after the clock stops.

The drift target (last window / first window of the module's steps) compares steps taken
minutes apart, and this shared machine drifts between a fast and a slower state over such
spans (the sequential ratio read 1.21–1.36 in runs whose iteration counts were identical).  So
it is judged on an *interleaved replay*: the module and its optimizer are copied at the first
and at the last window's start, and after the run both windows are taken again, step ``i`` of
the one right after step ``i`` of the other (the order alternating), on the same batches, with
the other methods' models and optimizers dropped first (the module alone, as the demo trains
it), ``Config.train_replays`` times from fresh copies (medians over all replayed steps; each
replay's ratio is reported); the replays must repeat the run's iteration counts
(``replay.iters_match``, else no verdict).  The sequential ratio is reported too.
"""

from __future__ import annotations

import copy
import functools
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .common import Config, median, timed

#: torchdeq's Anderson (forward and adjoint) with its defaults (m = 6, lam = 1e-4: the target's
#: baseline), and with the module's history and nominal ridge (information)
DEQ_VARIANTS: dict[str, dict[str, Any]] = {"torchdeq": {},
                                           "torchdeq m=5 lam=1e-8": {"m": 5, "lam": 1e-8}}


def _stats_module(model: Any) -> dict[str, float]:
    """Forward/adjoint iterations of the module's last step (batch max and per-sample mean)."""
    f, b = model.eq.last_stats, model.eq.last_backward_stats
    out = {"fwd_iters": int(f.iterations.max()), "fwd_iters_mean": f.mean_iterations,
           "fwd_capped": not bool(f.converged.all()), "fwd_solver": f.solver}
    if b is not None:
        out.update(bwd_iters=int(b.iterations.max()), bwd_iters_mean=b.mean_iterations,
                   bwd_capped=not bool(b.converged.all()), bwd_solver=b.solver)
    return out


def _stats_deq(info: dict[str, torch.Tensor], tol: float) -> dict[str, float]:
    """The same from a torchdeq solver-statistics dict: ``nstep`` is the step of each sample's
    lowest residual (the last step when it reached ``tol``), ``rel_lowest`` that residual."""
    n, rel = info["nstep"].double(), info["rel_lowest"].double()
    return {"iters": int(n.max()), "iters_mean": float(n.mean()),
            "capped": bool((rel > tol).any()), "solver": "torchdeq-anderson"}


def _anderson(options: dict[str, Any]) -> str:
    """The name of torchdeq's Anderson solver with ``options`` (registered with torchdeq under
    that name when not the default), for ``get_deq``'s forward and backward alike."""
    if not options:
        return "anderson"
    from torchdeq.solver import anderson_solver, register_solver

    name = "anderson(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"
    register_solver(name, functools.partial(anderson_solver, **options))
    return name


class TorchDEQClassifier(nn.Module):
    """The classifier's layer solved by torchdeq: ``fc(pool(z*))`` with ``z* = T(z*, x)``."""

    def __init__(self, model: Any, tol: float, max_iter: int, backward_tol: float,
                 backward_max_iter: int, anderson: dict[str, Any] | None = None):
        from torchdeq import get_deq

        super().__init__()
        self.model = model
        eq = model.eq
        if len(eq.blocks) != 1 or len(eq.input_syms) != 1:
            raise ValueError("the torchdeq baseline handles one state block and one input "
                             f"(this layer: {len(eq.blocks)} blocks, {len(eq.input_syms)} "
                             "inputs)")
        solver = _anderson(anderson or {})
        self.deq = get_deq(f_solver=solver, f_max_iter=max_iter, f_tol=tol, f_stop_mode="rel",
                           b_solver=solver, b_max_iter=backward_max_iter, b_tol=backward_tol,
                           b_stop_mode="rel", ift=True)
        self.info: dict[str, torch.Tensor] = {}
        self.backward_info: dict[str, torch.Tensor] = {}
        self.used = ""

    def _map(self, inputs: dict[str, torch.Tensor], env: dict[str, torch.Tensor], batch: int
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``z ↦ T(z, x)``: the layer's plan at these inputs and weights (built with autograd,
        so its output is differentiable w.r.t. them), or the node tree's ``T``."""
        from lowering.runtime.plan import PlanContext, Root, plan_of

        eq = self.model.eq
        name = eq.blocks[0].name
        plan = plan_of(eq.derived.nodes[name], PlanContext(name, inputs, env, batch))
        if plan is not None:
            self.used = "plan"
            return Root(plan)
        self.used = "T"
        return lambda z: eq.T(z, inputs, env)

    def _backward_writer(self, info: dict[str, torch.Tensor]) -> None:
        self.backward_info = info

    def reset_stats(self) -> None:
        """Forget the solver statistics of the last step."""
        self.info, self.backward_info = {}, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, eq = self.model, self.model.eq
        xin = m.prepare(x)
        b = xin.shape[0]
        inputs = {eq.input_syms[0].name: xin.reshape(b, -1)}
        env = eq.env()
        f = self._map(inputs, env, b)
        self.deq.train(self.training)
        z0 = torch.zeros(b, eq.state_size, dtype=xin.dtype, device=xin.device)
        zs, self.info = self.deq(f, z0, backward_writer=self._backward_writer)
        z = eq.derived.output(zs[-1], inputs, env)
        return m.fc(m.pooled_features(z.reshape(b, *eq.derived.output_blocks[0].shape)))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of the module model and of its optimizer's state, to train again from here."""
    return copy.deepcopy(model), copy.deepcopy(opt.state_dict())


def _replay(snaps: dict[int, tuple[nn.Module, dict[str, Any]]], batches: list[torch.Tensor],
            w: int, xtr: torch.Tensor, ytr: torch.Tensor, lr: float,
            rows: list[dict[str, Any]], dev: torch.device, reps: int = 1) -> dict[str, Any]:
    """The module's first and last ``w`` steps taken again from their snapshots, interleaved
    step by step (the order alternating), ``reps`` times from fresh copies (the first chain
    leading in even repetitions, the other in odd ones): medians over all repetitions, their
    ratio, each repetition's ratio, and the fraction of replayed steps whose forward and
    adjoint iteration counts equal the run's (the same computation)."""
    from convex_eq.errors import ConvergenceWarning

    starts = sorted(snaps)
    start_last = len(batches) - w
    firsts = (starts[0], starts[-1] if len(starts) > 1 else start_last)
    times: list[list[float]] = [[], []]
    per_rep: list[float] = []
    match = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for rep in range(reps):
            chains = []
            for k in firsts:
                m0, state = snaps[k]
                m = copy.deepcopy(m0)
                opt = torch.optim.Adam(m.parameters(), lr=lr)
                # a copy: load_state_dict keeps the given CPU tensors (Adam's moments, its step
                # count), which the steps then update in place, and the next replay would start
                # from this one's end
                opt.load_state_dict(copy.deepcopy(state))
                m.train()
                chains.append((k, m, opt))
            mine: list[list[float]] = [[], []]
            for i in range(w):
                order = (0, 1) if (i + rep) % 2 == 0 else (1, 0)
                for c in order:
                    k, m, opt = chains[c]
                    idx = batches[k + i].to(dev)
                    xb, yb = xtr[idx], ytr[idx]

                    def go(m: nn.Module = m, opt: torch.optim.Optimizer = opt,
                           xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> None:
                        loss = nn.functional.cross_entropy(m(xb), yb)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()

                    m.reset_stats()
                    t = timed(go)
                    times[c].append(t)
                    mine[c].append(t)
                    got, want = _stats_module(m), rows[k + i]
                    match += all(got.get(f) == want.get(f) for f in ("fwd_iters", "bwd_iters"))
            per_rep.append(median(mine[1]) / median(mine[0]))
            chains = m = opt = go = None  # (this repetition's copies, before the next ones)
    first, last = median(times[0]), median(times[1])
    return {"first_s": first, "last_s": last, "last_over_first": last / first,
            "first_times": times[0], "last_times": times[1],
            "iters_match": match / (2 * w * reps), "reps": reps, "rep_ratios": per_rep,
            "starts": list(firsts)}


def _batches(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Index batches of ``steps`` steps: a seeded permutation per epoch, full batches only."""
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        perm = torch.randperm(n, generator=gen)
        out += [perm[i:i + batch] for i in range(0, n - batch + 1, batch)]
    return out[:steps]


def _summary(times: list[float], rows: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """Medians of the first and last ``window`` steps and their ratio, steps/s over the run,
    mean iterations (batch max) per window and the steps that stopped at an iteration cap."""
    first, last = median(times[:window]), median(times[-window:])
    out: dict[str, Any] = {"first_s": first, "last_s": last, "last_over_first": last / first,
                           "total_s": sum(times), "steps_per_s": len(times) / sum(times)}
    for side in ("fwd", "bwd"):
        vals = [r[f"{side}_iters"] for r in rows if f"{side}_iters" in r]
        if not vals:
            continue
        out[f"{side}_iters_first"] = sum(vals[:window]) / len(vals[:window])
        out[f"{side}_iters_last"] = sum(vals[-window:]) / len(vals[-window:])
        out[f"{side}_capped_steps"] = sum(bool(r.get(f"{side}_capped")) for r in rows)
        out[f"{side}_solvers_used"] = sorted({str(r.get(f"{side}_solver")) for r in rows
                                              if f"{side}_iters" in r})
    return out


def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """``cfg.train_steps`` Adam steps of each method, interleaved; per method the median step
    time of the first and last ``cfg.train_window`` steps, iterations, steps/s."""
    import lowering
    from convex_eq.errors import ConvergenceWarning
    from convex_eq_app.demo import DemoConfig, classifier, load_data, objectives

    try:
        import torchdeq  # noqa: F401
        have_deq = True
    except ImportError:
        have_deq = False
    dev = torch.device(cfg.device)
    demo = DemoConfig()
    data = load_data(demo)
    derived = lowering.lower(objectives(demo)["OptEq"])
    torch.manual_seed(cfg.seed)
    model = classifier("OptEq", derived, demo).to(dev)
    mc = model.eq.config  # the tolerances and caps the module trains with (TrainingSettings)
    tol, max_iter = mc.forward.tol, mc.forward.max_iter
    btol, bmax = mc.adjoint_tol, mc.adjoint_max_iter
    models: dict[str, nn.Module] = {"module": model}
    for name, kw in (DEQ_VARIANTS if have_deq else {}).items():
        models[name] = TorchDEQClassifier(copy.deepcopy(model), tol, max_iter, btol, bmax,
                                          kw).to(dev)
    opts = {k: torch.optim.Adam(m.parameters(), lr=demo.lr) for k, m in models.items()}
    xtr, ytr = data.x_train.to(dev), data.y_train.to(dev)
    batches = _batches(len(ytr), demo.batch, cfg.train_steps, cfg.seed)
    times: dict[str, list[float]] = {k: [] for k in models}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in models}
    losses: dict[str, list[float]] = {k: [] for k in models}

    def step(name: str, xb: torch.Tensor, yb: torch.Tensor) -> Callable[[], torch.Tensor]:
        mod, opt = models[name], opts[name]

        def go() -> torch.Tensor:
            loss = nn.functional.cross_entropy(mod(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        return go

    for m in models.values():
        m.train()
    w = min(cfg.train_window, max(1, len(batches) // 2))
    snaps = {0: _snapshot(model, opts["module"])}  # the first window's start (and the last's)
    with warnings.catch_warnings():
        # a solve that stops at its cap is counted from the statistics, not printed per step
        warnings.simplefilter("ignore", ConvergenceWarning)
        for s, idx in enumerate(batches):
            idx = idx.to(dev)
            xb, yb = xtr[idx], ytr[idx]
            if s == len(batches) - w and s:
                snaps[s] = _snapshot(model, opts["module"])
            order = list(models)[s % len(models):] + list(models)[:s % len(models)]
            for name in order:
                out: list[torch.Tensor] = []
                fn = step(name, xb, yb)
                models[name].reset_stats()  # no statistics left over from an earlier step
                times[name].append(timed(lambda fn=fn, out=out: out.append(fn())))
                losses[name].append(float(out[0]))  # after the clock: this reads the device
                if name == "module":
                    rows[name].append(_stats_module(model))
                else:
                    deq = models[name]
                    r = {f"fwd_{k}": v for k, v in _stats_deq(deq.info, tol).items()}
                    if deq.backward_info:
                        r.update({f"bwd_{k}": v for k, v in
                                  _stats_deq(deq.backward_info, btol).items()})
                    rows[name].append(r)
            if s == 0 or (s + 1) % 50 == 0:
                log(f"  train step {s + 1}/{len(batches)}: " + ", ".join(
                    f"{k} {times[k][-1] * 1e3:.0f} ms (loss {losses[k][-1]:.3f})"
                    for k in models))
        # the replay measures the module alone, as the demo trains it: the other methods'
        # models, optimizers and graphs are dropped first (their times and statistics are
        # recorded), so that their heap does not enter the module's two windows
        deq_map = models["torchdeq"].used if have_deq else None
        names = list(models)
        models.clear()
        opts.clear()
        m = fn = out = deq = None  # (the loops' last references to them)
        gc.collect()
        replay = _replay(snaps, batches, w, xtr, ytr, demo.lr, rows["module"], dev,
                         cfg.train_replays)
    res: dict[str, Any] = {
        "steps": len(batches), "window": w, "batch": demo.batch, "lr": demo.lr,
        "tol": tol, "max_iter": max_iter, "backward_tol": btol, "backward_max_iter": bmax,
        "module_solvers": [mc.forward.solver, mc.adjoint_solver],
        "weight_control": demo.settings("OptEq").module_options(derived)["weight_control"],
        "channels": demo.channels, "kernel": demo.kernel, "state_size": model.eq.state_size,
        "device": str(dev), "threads": torch.get_num_threads(), "have_torchdeq": have_deq,
        "torchdeq_map": deq_map,
        "replay": replay, "methods": {}}
    for name in names:
        summ = _summary(times[name], rows[name], w)
        summ.update(times=times[name], losses=losses[name], rows=rows[name],
                    loss_last=sum(losses[name][-w:]) / len(losses[name][-w:]))
        res["methods"][name] = summ
    mo = res["methods"]["module"]
    for name in names:  # module steps/s over each method's (1 for the module itself)
        m = res["methods"][name]
        m["module_speedup"] = mo["steps_per_s"] / m["steps_per_s"]
        m["first_loss_diff"] = abs(losses["module"][0] - losses[name][0])
    if have_deq:
        dq = res["methods"]["torchdeq"]
        res["speedup_steps_per_s"] = dq["module_speedup"]
        res["speedup_first"] = dq["first_s"] / mo["first_s"]
        res["speedup_last"] = dq["last_s"] / mo["last_s"]
        res["first_loss_diff"] = max(m["first_loss_diff"] for m in res["methods"].values())
    else:
        res["torchdeq_note"] = "torchdeq is not installed: the module is timed alone"
    log(f"  train: module {mo['first_s'] * 1e3:.1f} → {mo['last_s'] * 1e3:.1f} ms/step "
        f"(last/first {mo['last_over_first']:.2f}; interleaved replay "
        f"{replay['first_s'] * 1e3:.1f} → {replay['last_s'] * 1e3:.1f} ms/step, "
        f"{replay['last_over_first']:.2f}, iterations repeated in "
        f"{replay['iters_match']:.0%} of its steps)" + "".join(
            f"; {k} {m['first_s'] * 1e3:.1f} → {m['last_s'] * 1e3:.1f} ms/step, module "
            f"{m['module_speedup']:.2f}× its steps/s" for k, m in res["methods"].items()
            if k != "module") + ("" if have_deq else " (torchdeq not installed)"))
    return res
