"""Claims of "Optimization Induced Equilibrium Networks" (TPAMI): feature regularisation through
the hidden objective (Tab. 3(b)), the α sweep of deep OptEq (Tab. 3(a)/Tab. 5) and unrolled versus
implicit training (Tab. 8), on the MNIST-1D table's conv OptEq and a two-layer conv deep OptEq of
the same parameter count."""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import plotting
from .power import NOT_RESOLVABLE, Comparison, Stat, Verdict, compare, judged
from .registry import (
    Budget,
    Claim,
    Experiment,
    Results,
    RunSpec,
    register_claim,
    register_experiment,
    run,
)

# ============================================================================ Tab. 3(b): R*_z
REG = "conv OptEq + R*_z"
#: the paper's λ values (TPAMI Tab. 3(b)) and the norm each regulariser lowers
NORM_REG = {"l1": ((0.01, 0.15, 0.5), "mean_abs"), "l2": ((0.01, 1.0, 10.0), "mean_sq")}
#: the paper's mean norms at those λ ("> 5" and "> 10" taken as 5 and 10: the first step's
#: effect is then a lower bound) and accuracies (%)
PAPER_NORMS = {"l1": (5.0, 0.81, 0.34), "l2": (10.0, 1.56, 0.82)}
PAPER_ACC = {"l1": (86.4, 87.7, 86.9), "l2": (87.3, 87.6, 86.7)}


def _norm_runs(b: Budget) -> list[RunSpec]:
    return [run(REG, s, ("features",), reg=reg, reg_lambda=lam)
            for reg, (lams, _) in NORM_REG.items() for lam in lams for s in b.seeds]


def _norm_summary(b: Budget, r: Results) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for reg, (lams, key) in NORM_REG.items():
        norms, logs = [], []
        for lam in lams:
            vals = r.values(REG, b.seeds, lambda m, k=key: m["features"][k], reg=reg,
                            reg_lambda=lam)
            var = r.values(REG, b.seeds, lambda m, k=key: m["features"][f"{k}_var"], reg=reg,
                           reg_lambda=lam)
            norms.append(Stat.of(vals, sum(var) / len(var)))
            logs.append(Stat.log_of(vals, var))
        out[reg] = {"lam": list(lams), "norm": norms, "log_norm": logs,
                    "acc": [r.acc(REG, b.seeds, reg=reg, reg_lambda=lam) for lam in lams]}
    return out


def _norm_plot(ms: dict[str, Any], out: Path) -> str:
    fig, axes = plotting.figure(2)
    for ax, reg, name in zip(axes, ("l1", "l2"), ("mean |z_j| (ℓ1)", "mean z_j² (ℓ2)")):
        m = ms[reg]
        plotting.errorbar(ax, m["lam"], m["norm"], name, color="C0")
        ax.set(xscale="log", yscale="log",
               xlabel=f"λ of R*_z = λ||z||{'₁' if reg == 'l1' else '²'}", ylabel=name)
        ax2 = ax.twinx()
        plotting.errorbar(ax2, m["lam"], m["acc"], "test accuracy", scale=100, color="C1")
        ax2.set_ylabel("test accuracy (%)", color="C1")
    return plotting.save(fig, out, "tpami_norm_reg.png",
                         "TPAMI Tab. 3(b) on MNIST-1D: conv OptEq + R*_z")


register_experiment(Experiment(
    "tpami_norm_reg", "Feature norm regularisation through the hidden objective (TPAMI Tab. 3(b))",
    "The table's conv OptEq + λ||z||₁ or + λ||z||² in its hidden objective at the paper's λ; "
    "mean |z_j| / mean z_j² over every entry of the test equilibria.",
    _norm_runs, _norm_summary, _norm_plot))


def _norm_judge(reg: str) -> Any:
    def judge(ms: dict[str, Any]) -> Verdict:
        m, paper = ms[reg], PAPER_NORMS[reg]
        lams = m["lam"]
        comps = [compare(m["log_norm"][i], m["log_norm"][i + 1],
                         math.log(paper[i] / paper[i + 1]), unit="ratio",
                         labels=(f"λ={lams[i]:g}", f"λ={lams[i + 1]:g}"))
                 for i in range(len(lams) - 1)]
        text = " / ".join(s.num(".3g") for s in m["norm"])
        return judged(f"{text} (λ = {' / '.join(f'{v:g}' for v in lams)})", comps)
    return judge


def _mid_acc_judge(reg: str) -> Any:
    def judge(ms: dict[str, Any]) -> Verdict:
        lo, mid, hi = ms[reg]["acc"]
        p_lo, p_mid, p_hi = PAPER_ACC[reg]
        lams = ms[reg]["lam"]
        return judged(" / ".join(s.pct() for s in (lo, mid, hi)),
                      [compare(mid, lo, (p_mid - p_lo) / 100,
                               labels=(f"λ={lams[1]:g}", f"λ={lams[0]:g}")),
                       compare(mid, hi, (p_mid - p_hi) / 100,
                               labels=(f"λ={lams[1]:g}", f"λ={lams[2]:g}"))])
    return judge


for _reg, _sym in (("l1", "||z||₁"), ("l2", "||z||²")):
    _lams = " / ".join(f"{v:g}" for v in NORM_REG[_reg][0])
    _n = PAPER_NORMS[_reg]
    _a = PAPER_ACC[_reg]
    register_claim(Claim(
        f"tpami_{_reg}_norm", f"a larger λ in R*_z = λ{_sym} lowers the mean feature norm",
        "TPAMI Tab. 3(b)", f"λ = {_lams}: mean {_sym} > {_n[0]:g} / {_n[1]:g} / {_n[2]:g}",
        "the mean norm falls at each step of λ; paper effects the ratios "
        f"×{_n[0] / _n[1]:.3g} (at least) and ×{_n[1] / _n[2]:.3g}",
        "tpami_norm_reg", _norm_judge(_reg)))
    register_claim(Claim(
        f"tpami_{_reg}_acc", f"a suitable λ (the middle one) gives the best accuracy ({_sym})",
        "TPAMI Tab. 3(b)", f"λ = {_lams}: {_a[0]} / {_a[1]} / {_a[2]} %",
        f"the middle λ exceeds both others; paper effects {_a[1] - _a[0]:.1f} and "
        f"{_a[1] - _a[2]:.1f} pt", "tpami_norm_reg", _mid_acc_judge(_reg)))


# ============================================================================ α sweep
UNROLLED, IFT = "deep OptEq (L=2), unrolled", "deep OptEq (L=2)"
ALPHAS = (0.01, 0.1, 0.4, 0.8, 1.0)
#: the paper's accuracies (%) at those α (Tab. 3(a), "no Reg")
PAPER_ALPHA = (58.4, 56.8, 86.9, 87.4, 87.2)
#: unrolled iterations of training and inference (the paper's K on CIFAR-10)
K_TRAIN = 20


@lru_cache(maxsize=4)
def channels(budget: Budget) -> int:
    """``channels`` of the deep OptEq runs: its parameter count closest to the conv OptEq's
    (:func:`convex_eq_app.reproduce.models.deep_channels`)."""
    from .models import deep_channels
    from .runs import dataset

    cfg = budget.table_config()
    return deep_channels(cfg, dataset(cfg).shape)


def _unrolled(b: Budget, alpha: float, k: int) -> dict[str, Any]:
    return {"alpha": alpha, "K": k, "channels": channels(b)}


def _alpha_runs(b: Budget) -> list[RunSpec]:
    return [run(UNROLLED, s, **_unrolled(b, a, K_TRAIN)) for a in ALPHAS for s in b.seeds]


def _alpha_summary(b: Budget, r: Results) -> dict[str, Any]:
    return {"alpha": list(ALPHAS),
            "acc": [r.acc(UNROLLED, b.seeds, **_unrolled(b, a, K_TRAIN)) for a in ALPHAS]}


def _alpha_plot(ms: dict[str, Any], out: Path) -> str:
    fig, (ax,) = plotting.figure()
    plotting.errorbar(ax, ms["alpha"], ms["acc"], "deep OptEq (no Reg)", scale=100)
    ax.set(xlabel="α", ylabel="test accuracy (%)")
    return plotting.save(fig, out, "tpami_alpha.png",
                         f"TPAMI Tab. 3(a) on MNIST-1D: conv deep OptEq (L=2, K={K_TRAIN})")


register_experiment(Experiment(
    "tpami_alpha", "Deep OptEq accuracy versus α (TPAMI Tab. 3(a), Tab. 5 'No Reg')",
    f"The table's deep OptEq (two conv layers) widened to the conv OptEq's parameter count, "
    f"fixed α ∈ {ALPHAS}, trained and run through K = {K_TRAIN} unrolled iterations as in the "
    "paper (no feature regulariser).", _alpha_runs, _alpha_summary, _alpha_plot))


def _alpha_cmp(ms: dict[str, Any], a: float, b: float) -> Comparison:
    acc = dict(zip(ms["alpha"], ms["acc"]))
    paper = dict(zip(ALPHAS, PAPER_ALPHA))
    return compare(acc[a], acc[b], (paper[a] - paper[b]) / 100,
                   labels=(f"α={a:g}", f"α={b:g}"))


def _alpha_safe(ms: dict[str, Any]) -> Verdict:
    return judged(" / ".join(f"{a:g}: {s.pct()}" for a, s in zip(ms["alpha"], ms["acc"])),
                  [_alpha_cmp(ms, a, 0.01) for a in (0.4, 0.8, 1.0)])


def _alpha_dip(ms: dict[str, Any]) -> Verdict:
    acc = dict(zip(ms["alpha"], ms["acc"]))
    return judged(f"α = 0.01: {acc[0.01].pct()}, α = 0.1: {acc[0.1].pct()}",
                  [_alpha_cmp(ms, 0.01, 0.1)])


register_claim(Claim(
    "tpami_alpha_safe", "α ≥ 0.4 is a safe choice: α ∈ {0.4, 0.8, 1.0} all beat α = 0.01 "
    "(≈ one wide layer)", "TPAMI Tab. 3(a) / Tab. 5",
    "α = 0.01 / 0.1 / 0.4 / 0.8 / 1.0: 58.4 / 56.8 / 86.9 / 87.4 / 87.2 %",
    "each of α = 0.4, 0.8, 1.0 exceeds α = 0.01; paper effects 28.5 / 29.0 / 28.8 pt",
    "tpami_alpha", _alpha_safe))
register_claim(Claim(
    "tpami_alpha_dip", "accuracy is not monotone in α: α = 0.1 is below α = 0.01",
    "TPAMI Tab. 3(a) / Tab. 5", "58.4 % (α = 0.01) > 56.8 % (α = 0.1)",
    "α = 0.01 exceeds α = 0.1; paper effect 1.6 pt", "tpami_alpha", _alpha_dip))


# ============================================================================ Tab. 8
KS = (5, 10, 20, 40)
THRESHOLDS = (1e-3, 1e-2)
#: α of the paper's Tab. 8 runs
ALPHA_T8 = 0.8
#: the paper's Tab. 8: K = 5/10/20/40 accuracy (%) and relative residual; IFT at thd 1e-3 and
#: 1e-2: accuracy, inference and back-prop seconds (80 batches)
PAPER_T8_ACC = {5: 83.52, 10: 87.28, 20: 87.71, 40: 87.83}
PAPER_T8_RES = {5: 1.22e-2, 10: 4.88e-3, 20: 4.81e-4, 40: 1.20e-5}
PAPER_IFT = {1e-3: 87.63, 1e-2: 85.95}
PAPER_TIMES = {"infer_s": (3.9, 16.3), "backprop_s": (6.4, 6.7)}  # (K = 20, IFT 1e-3)


def _ift(b: Budget, tol: float) -> dict[str, Any]:
    return {"alpha": ALPHA_T8, "tol": tol, "channels": channels(b)}


def _t8_runs(b: Budget) -> list[RunSpec]:
    return ([run(UNROLLED, s, ("timing",), **_unrolled(b, ALPHA_T8, k))
             for k in KS for s in b.seeds]
            + [run(IFT, s, ("timing",), **_ift(b, t)) for t in THRESHOLDS for s in b.seeds])


def _t8_row(b: Budget, r: Results, model: str, p: dict[str, Any]) -> dict[str, Stat]:
    res = r.values(model, b.seeds, lambda m: m["timing"]["residual"], **p)
    var = r.values(model, b.seeds, lambda m: m["timing"]["residual_var"], **p)
    return {"acc": r.acc(model, b.seeds, **p), "residual": Stat.of(res),
            "log_residual": Stat.log_of(res, var),
            **{k: Stat.of(r.values(model, b.seeds, lambda m, k=k: m["timing"][k], **p))
               for k in ("infer_s", "backprop_s")},
            **{f"log_{k}": Stat.log_of(r.values(model, b.seeds,
                                                lambda m, k=k: m["timing"][k], **p))
               for k in ("infer_s", "backprop_s")}}


def _t8_summary(b: Budget, r: Results) -> dict[str, Any]:
    return {"unroll": {k: _t8_row(b, r, UNROLLED, _unrolled(b, ALPHA_T8, k)) for k in KS},
            "ift": {t: _t8_row(b, r, IFT, _ift(b, t)) for t in THRESHOLDS}}


def _t8_plot(ms: dict[str, Any], out: Path) -> str:
    fig, axes = plotting.figure(3, width=4.0)
    ks = list(ms["unroll"])
    for ax, key, lab in zip(axes, ("residual", "acc", "infer_s"),
                            ("mean relative residual", "test accuracy (%)",
                             "inference time (s)")):
        scale = 100.0 if key == "acc" else 1.0
        plotting.errorbar(ax, ks, [ms["unroll"][k][key] for k in ks], "unrolled K", scale=scale)
        for i, (t, row) in enumerate(ms["ift"].items()):
            ax.axhline(scale * row[key].mean, color=f"C{i + 1}", ls="--", lw=1,
                       label=f"IFT thd {t:g}")
        ax.set(xscale="log", xlabel="K", ylabel=lab)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        if key == "residual":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    return plotting.save(fig, out, "tpami_unroll.png",
                         f"TPAMI Tab. 8 on MNIST-1D: conv deep OptEq (α = {ALPHA_T8})")


register_experiment(Experiment(
    "tpami_unroll", "Unrolled K versus implicit (IFT) training (TPAMI Tab. 8)",
    f"The deep OptEq of the α sweep at α = {ALPHA_T8}: trained through K ∈ {KS} unrolled "
    f"iterations, or implicitly (Anderson forward to the threshold thd ∈ {THRESHOLDS}, at most "
    "the table's iteration cap; implicit adjoint). Times: the forward (inference) and the "
    "loss.backward() alone, summed over 8 batches of 125 after training; residual "
    "||T(z) − z||/||T(z)|| of the returned state over the test set.",
    _t8_runs, _t8_summary, _t8_plot))


#: relative residuals below this are float32 round-off: a K that reaches it cannot fall further
ROUNDOFF = 1e-6


def _t8_residual(ms: dict[str, Any]) -> Verdict:
    u = ms["unroll"]
    text = " / ".join(f"{u[k]['residual'].mean:.2e}" for k in KS) + \
        f" (K = {' / '.join(map(str, KS))})"
    comps = [compare(u[a]["log_residual"], u[b]["log_residual"],
                     math.log(PAPER_T8_RES[a] / PAPER_T8_RES[b]), unit="ratio",
                     labels=(f"K={a}", f"K={b}"))
             for a, b in itertools.pairwise(KS)
             if max(u[a]["residual"].mean, u[b]["residual"].mean) > ROUNDOFF]
    if len(comps) < len(KS) - 1:
        text += f"; steps with both residuals ≤ {ROUNDOFF:g} (float32 round-off) not compared"
    if not comps:
        return Verdict(text + "; every residual at round-off", NOT_RESOLVABLE)
    return judged(text, comps)


def _t8_acc(ms: dict[str, Any]) -> Verdict:
    u = ms["unroll"]
    return judged(" / ".join(u[k]["acc"].pct() for k in KS),
                  [compare(u[40]["acc"], u[5]["acc"],
                           (PAPER_T8_ACC[40] - PAPER_T8_ACC[5]) / 100,
                           labels=("K=40", "K=5"))])


def _t8_vs_acc(ms: dict[str, Any]) -> Verdict:
    un, ift = ms["unroll"][20], ms["ift"][1e-3]
    return judged(f"K=20: {un['acc'].pct()} vs IFT 1e-3: {ift['acc'].pct()} (residual "
                  f"{un['residual'].mean:.1e} vs {ift['residual'].mean:.1e})",
                  [compare(un["acc"], ift["acc"], (PAPER_T8_ACC[20] - PAPER_IFT[1e-3]) / 100,
                           labels=("K=20", "IFT 1e-3"))])


def _t8_time(key: str) -> Any:
    def judge(ms: dict[str, Any]) -> Verdict:
        un, ift = ms["unroll"][20], ms["ift"][1e-3]
        p_un, p_ift = PAPER_TIMES[key]
        return judged(f"K=20: {un[key].num('.3f')} s vs IFT 1e-3: {ift[key].num('.3f')} s",
                      [compare(ift[f"log_{key}"], un[f"log_{key}"], math.log(p_ift / p_un),
                               unit="ratio", labels=("IFT 1e-3", "K=20"))])
    return judge


def _t8_loose(ms: dict[str, Any]) -> Verdict:
    a, b = ms["ift"][1e-3]["acc"], ms["ift"][1e-2]["acc"]
    return judged(f"thd 1e-3: {a.pct()} vs 1e-2: {b.pct()}",
                  [compare(a, b, (PAPER_IFT[1e-3] - PAPER_IFT[1e-2]) / 100,
                           labels=("thd 1e-3", "thd 1e-2"))])


register_claim(Claim(
    "tpami_unroll_residual", "the residual of the unrolled state falls as K grows",
    "TPAMI Tab. 8", "K = 5 / 10 / 20 / 40: 1.22e-2 / 4.88e-3 / 4.81e-4 / 1.20e-5",
    "the mean residual falls at each step of K (steps at float32 round-off, 1e-6, not "
    "compared); paper effects the ratios ×2.5 / ×10.1 / ×40.1", "tpami_unroll", _t8_residual))
register_claim(Claim(
    "tpami_unroll_acc", "more unrolled iterations give a higher accuracy", "TPAMI Tab. 8",
    "K = 5 / 10 / 20 / 40: 83.52 / 87.28 / 87.71 / 87.83 %",
    "K = 40 exceeds K = 5; paper effect 4.31 pt", "tpami_unroll", _t8_acc))
register_claim(Claim(
    "tpami_unroll_vs_ift_acc", "at a comparable residual, unrolling (K = 20) is at least as "
    "accurate as IFT (thd 1e-3)", "TPAMI Tab. 8", "87.71 % vs 87.63 %",
    "K = 20 exceeds IFT 1e-3; paper effect 0.08 pt", "tpami_unroll", _t8_vs_acc))
register_claim(Claim(
    "tpami_unroll_vs_ift_infer", "at a comparable residual, unrolling infers faster than IFT",
    "TPAMI Tab. 8", "inference 3.9 s (K = 20) vs 16.3 s (IFT 1e-3), 80 batches",
    "IFT 1e-3's inference time exceeds K = 20's; paper effect the ratio ×4.18",
    "tpami_unroll", _t8_time("infer_s")))
register_claim(Claim(
    "tpami_unroll_vs_ift_bp", "at a comparable residual, unrolling back-propagates faster "
    "than IFT", "TPAMI Tab. 8", "back-prop 6.4 s (K = 20) vs 6.7 s (IFT 1e-3), 80 batches",
    "IFT 1e-3's back-prop time exceeds K = 20's; paper effect the ratio ×1.05",
    "tpami_unroll", _t8_time("backprop_s")))
register_claim(Claim(
    "tpami_ift_loose", "a loose residual threshold hurts IFT training", "TPAMI Tab. 8",
    "thd 1e-3: 87.63 % vs thd 1e-2: 85.95 %",
    "thd 1e-3 exceeds thd 1e-2; paper effect 1.68 pt", "tpami_unroll", _t8_loose))

__all__ = ["ALPHAS", "KS", "NORM_REG", "THRESHOLDS", "channels"]
