"""The verification report: every number with its tolerance, the reference's provenance, and
pass/fail; prints as an aligned plain-text table, writes Markdown with PNG plots."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


def worst(vals: list[float]) -> float | None:
    """NaN-aware maximum: NaN if any value is NaN (Python's ``max`` keeps or drops a NaN
    depending on its position), None for no values."""
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals)


@dataclass(frozen=True)
class Tolerances:
    """Stated tolerances of ``verify.check`` (all relative quantities use ``max(·, floor)``)."""

    rel_error: float = 1e-6  #: ``||z - z_ref|| / max(||z_ref||, scale_floor)`` (convex refs)
    gap: float = 1e-6  #: ``|G(z) - G(z_ref)| / max(1, |G(z_ref)|)``
    residual: float = 1e-8  #: ``||z - T(z)|| / max(1, ||z||)`` (forward-backward residual)
    stationarity: float = 1e-8  #: independent projected-gradient residual ``/ max(1, ||v||)``
    reference_stationarity: float = 1e-8  #: numeric reference's projected gradient
    gradient: float = 1e-4  #: relative error of ``dℓ/dx`` (implicit vs cvxpylayers / FD)
    sam: float = 2e-2  #: SAM (Theorem 5, an asymptotic O(k^-c) statement): rel. error and residual
    #: floor of the denominator of the relative state error: with it the absolute error allowed
    #: near z = 0 is 1e-8, the absolute accuracy of the residual and stationarity checks
    #: (Clarabel at gap 1e-11 lands ~1e-9 off a minimizer that sits on a constraint boundary)
    scale_floor: float = 1e-2
    equilibrium: float = 1e-12  #: relative residual the tight Anderson solve stops at
    #: a state error above this, with the reference's objective value (≤ gap) and independent
    #: stationarity (≤ stationarity), is a second minimizer of a convex objective whose argmin
    #: is not a point — reported, not failed; below it, differences are numerical and checked
    distinct_minimizer: float = 1e-3


@dataclass
class ReferenceInfo:
    """How the reference was obtained (solver, status, tolerances, starts) and whether it is
    usable (a failed or inaccurate solve is never compared)."""

    #: the reference: ``cvxpy``, ``numeric``, ``local``, ``corollary1``, ``inclusion``,
    #: ``sam`` or ``none`` (docs/theory.md §9)
    kind: str
    #: what the reference computes, in words
    description: str
    #: the solver that computed it (e.g. ``CLARABEL``, ``L-BFGS-B``)
    solver: str = ""
    #: the solver's status per sample
    statuses: list[str] = field(default_factory=list)
    #: the solver's tolerances, by name
    tolerances: dict[str, Any] = field(default_factory=dict)
    #: starts of a multi-start (local or numeric) reference
    starts: int = 1
    #: False when the reference failed or is not accurate enough to compare with
    ok: bool = True
    #: why the reference is not usable (when ``ok`` is False)
    failure: str = ""

    @property
    def status(self) -> str:
        """Distinct statuses over the samples (``optimal`` when all solved)."""
        uniq = sorted(set(self.statuses))
        return ", ".join(uniq) if uniq else "n/a"

    def provenance(self) -> str:
        """One line: the reference, its solver, status, tolerances and number of starts."""
        tols = ", ".join(f"{k}={_fmt(v)}" for k, v in self.tolerances.items())
        parts = [self.description]
        if self.solver:
            parts.append(f"solver {self.solver}")
        parts.append(f"status {self.status}")
        if tols:
            parts.append(f"tolerances {tols}")
        if self.kind in ("local", "numeric"):
            parts.append(f"{self.starts} start(s)")
        return "; ".join(parts)


@dataclass
class SampleResult:
    """Per-sample numbers (None: not applicable to this reference)."""

    #: the sample's index in the batch
    index: int
    #: ``||z − z_ref|| / max(||z_ref||, scale_floor)``: the layer's equilibrium against the
    #: reference's state
    rel_error: float | None = None
    #: ``||z − z_ref||``
    abs_error: float | None = None
    #: the objective ``G`` at the layer's equilibrium
    objective: float | None = None
    #: the objective at the reference's point
    reference_objective: float | None = None
    #: normalized ``(G(z) - G_ref) / max(1, |G_ref|)``
    gap: float | None = None
    #: the fixed-point residual ``||z − T(z)|| / max(1, ||z||)`` of the equilibrium verify
    #: solved with the layer's map (tight tolerance)
    residual: float = math.nan
    #: the objective's first-order optimality residual at the layer's equilibrium, measured
    #: independently of the layer
    stationarity: float | None = None
    #: the same residual at the reference's point
    reference_stationarity: float | None = None
    #: the smallest eigenvalue of the objective's Hessian at the equilibrium (second-order
    #: check of the local reference)
    lambda_min: float | None = None
    #: the second-order check's verdict, in words
    second_order: str = ""
    #: what the equilibrium was verified to be (``minimizer``, ``local minimizer``,
    #: ``stationary point``, ...)
    label: str = ""
    #: the reference solver's status for this sample
    status: str = ""
    #: per-block residuals of a multi-block check (deep compositions: Theorem 2), by name
    block_residuals: dict[str, float] = field(default_factory=dict)
    #: relative distance to the wide one-layer solution of Theorem 3 (deep models)
    theorem3_distance: float | None = None
    #: what the check noticed for this sample, in words
    notes: list[str] = field(default_factory=list)
    #: state differs from the reference but objective and stationarity match (convex claims)
    argmin_not_unique: bool = False
    #: the state error is within the error bound of an unconverged tight solve (not compared)
    unresolved: bool = False


@dataclass
class GradientReport:
    """``dℓ/dx`` for ``ℓ(z) = Σ c·z``: every backward mode vs cvxpylayers and central FD."""

    #: the loss differentiated, as text
    loss: str
    #: relative error of ``dℓ/dx`` per comparison (e.g. ``"implicit vs cvxpylayers"``)
    errors: dict[str, float]
    #: the comparisons that must be within ``tolerance`` for the check to pass
    required: list[str]
    #: the tolerance of the required comparisons
    tolerance: float
    #: how the cvxpylayers reference was obtained (or why it is absent)
    cvxpylayers: str
    #: the step of the central finite differences
    fd_step: float
    #: what the comparison noticed, in words
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """``True`` iff every required gradient error is within ``tolerance``."""
        return all(self.errors.get(k, math.inf) <= self.tolerance for k in self.required)


@dataclass
class ModuleJudgement:
    """An emitted module's own forward judged against the verified point (docs/theory.md §9.5):
    per sample, the relative distance of its output to the point judged against and to the
    tight equilibrium, the allowance its tolerance gives, and its own fixed-point residual
    (where the output is the state; it rules where no allowance is available)."""

    description: str
    against: str
    distance: list[float]
    tight_distance: list[float]
    allowance: list[float]
    residual: list[float] | None
    residual_allowance: float | None
    formula: str
    failure: str = ""
    #: what the module itself warned during the forward verify ran
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """``True`` iff the output is within its allowances."""
        return not self.failure

    @property
    def residual_rules(self) -> bool:
        """Whether the residual decides (no distance allowance is available)."""
        return self.residual is not None and not all(map(math.isfinite, self.allowance))


@dataclass
class EquilibriumInfo:
    """The layer's equilibrium solve (history: relative residual per iteration and sample)."""

    #: the solver of verify's own tight equilibrium solve
    solver: str
    #: its tolerance
    tol: float
    #: iterations per sample
    iterations: list[int]
    #: the largest relative residual over the samples
    max_residual: float
    #: True if every sample reached ``tol``
    converged: bool
    #: relative residual per sample (rows) and iteration (columns)
    history: np.ndarray
    #: what the solve noticed, in words
    note: str = ""


@dataclass
class Report:
    """Result of ``verify.check``; ``str(report)`` is a table, ``.passed`` the verdict."""

    #: what was checked (the layer or module, in words)
    target: str
    #: the claim's kind (``minimizer``, ``modified minimizer``, ``stationary point``, ...)
    claim: str
    #: the claim in words
    claim_statement: str
    #: what the equilibrium was verified to be (never ``minimizer`` without a certificate)
    label: str
    #: the certificate at the checked weights, as one line
    certificate: str
    #: True if the objective is certified convex at the checked weights
    certified: bool
    #: the certificate's conditions that fail at the checked weights
    violated: list[str]
    #: how the reference was obtained
    reference: ReferenceInfo
    #: the tolerances the checks were judged against
    tolerances: Tolerances
    #: per-sample numbers
    samples: list[SampleResult]
    #: verify's own tight equilibrium solve
    equilibrium: EquilibriumInfo
    #: the layer's equilibria, ``(B, N)``
    z_layer: np.ndarray
    #: the reference's states, ``(B, N)`` (None where the reference gives no point)
    z_reference: np.ndarray | None = None
    #: names of the state blocks, in the order of the stacked state
    block_names: list[str] = field(default_factory=list)
    #: the gradient comparison (``check(..., gradients=True)``)
    gradients: GradientReport | None = None
    #: why the check failed (empty when it passed)
    failures: list[str] = field(default_factory=list)
    #: what the check noticed, in words
    notes: list[str] = field(default_factory=list)
    #: each judged rule and whether it held
    pass_rules: dict[str, bool] = field(default_factory=dict)
    #: wall seconds of the check
    elapsed: float = 0.0
    #: the module's own forward judged against the verified point (docs/theory.md §9.5)
    module: ModuleJudgement | None = None

    # ------------------------------------------------------------------ verdict
    @property
    def passed(self) -> bool:
        """True iff every stated check holds (no failures)."""
        return not self.failures

    @property
    def status(self) -> str:
        """One line: ``verified: …`` / ``claim not certified here: …`` / ``reference solver
        failed: …`` / ``FAILED: …``."""
        for f in self.failures:
            if f.startswith("claim not certified here"):
                return f
        for f in self.failures:
            if f.startswith("reference solver failed") or f.startswith("reference unavailable"):
                return f
        if self.failures:
            return "FAILED: " + "; ".join(self.failures)
        return f"verified: {self.label} ({self.reference.kind} reference)"

    # ------------------------------------------------------------------ aggregates
    def _max(self, attr: str) -> float | None:
        """Largest ``|value|`` over the samples; NaN if any sample's value is NaN (a NaN sample
        is never dropped from a maximum: the table must show what the failure says)."""
        return worst([abs(v) for s in self.samples if (v := getattr(s, attr)) is not None])

    @property
    def max_rel_error(self) -> float | None:
        """Worst ``||z − z_ref|| / max(||z_ref||, floor)`` over the samples."""
        return self._max("rel_error")

    @property
    def max_gap(self) -> float | None:
        """Worst ``|G(z) − G(z_ref)| / max(1, |G_ref|)`` over the samples."""
        return self._max("gap")

    @property
    def max_residual(self) -> float | None:
        """Worst optimality residual ``||z − T(z)|| / max(1, ||z||)`` over the samples."""
        return self._max("residual")

    @property
    def max_stationarity(self) -> float | None:
        """Worst independent stationarity residual of the layer's state."""
        return self._max("stationarity")

    @property
    def max_reference_stationarity(self) -> float | None:
        """Worst stationarity residual of the reference's state."""
        return self._max("reference_stationarity")

    @property
    def min_lambda(self) -> float | None:
        """Smallest Hessian eigenvalue seen by the local second-order check."""
        vals = [s.lambda_min for s in self.samples if s.lambda_min is not None]
        return min(vals) if vals else None

    def max_block_residual(self, key: str) -> float | None:
        """Worst per-block residual ``key`` over the samples (deep models, docs/theory.md §5)."""
        return worst([s.block_residuals[key] for s in self.samples if key in s.block_residuals])

    # ------------------------------------------------------------------ table
    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(quantity, value, tolerance, verdict)`` rows of the table."""
        t = self.tolerances
        r: list[tuple[str, str, str, str]] = []

        def add(name: str, value: Any, tol: str = "", rule: str | None = None) -> None:
            verdict = "" if rule is None else ("ok" if self.pass_rules.get(rule, True)
                                               else "FAIL")
            if rule is not None and rule not in self.pass_rules:
                verdict = "info"
            r.append((name, value if isinstance(value, str) else _fmt(value), tol, verdict))

        add("target", self.target)
        add("claim (lowering)", f"{self.claim}: {self.claim_statement}")
        add("certificate at these weights", self.certificate, "", "certificate")
        add("reference", self.reference.provenance(), "", "reference")
        eq = self.equilibrium
        add("equilibrium solve", f"{eq.solver}, tol {_fmt(eq.tol)}, iterations "
            f"{min(eq.iterations, default=0)}-{max(eq.iterations, default=0)}, "
            f"max rel. residual {_fmt(eq.max_residual)}", "", "equilibrium")
        add("samples", str(len(self.samples)))
        res_tol = t.sam if self.reference.kind == "sam" else t.residual
        add("max optimality residual ||z - T(z)||/max(1,||z||)", self.max_residual,
            f"≤ {_fmt(res_tol)}", "residual")
        if self.max_stationarity is not None:
            add("max independent stationarity residual", self.max_stationarity,
                f"≤ {_fmt(t.stationarity)}", "stationarity")
        if self.max_rel_error is not None:
            rel_tol = t.sam if self.reference.kind == "sam" else t.rel_error
            add("max rel. error ||z - z_ref||/max(||z_ref||, floor)", self.max_rel_error,
                f"≤ {_fmt(rel_tol)}" if "rel_error" in self.pass_rules else "(local: info)",
                "rel_error")
        if self.max_gap is not None:
            add("max |objective gap| / max(1, |G_ref|)", self.max_gap,
                f"≤ {_fmt(t.gap)}" if "gap" in self.pass_rules else "(local: info)", "gap")
        if self.max_reference_stationarity is not None:
            add("max reference stationarity (projected gradient)",
                self.max_reference_stationarity, f"≤ {_fmt(t.reference_stationarity)}",
                "reference_stationarity")
        if self.min_lambda is not None:
            verdicts = sorted({s.second_order for s in self.samples if s.second_order})
            add("second-order check: min λ(reduced Hessian)",
                f"{_fmt(self.min_lambda)} ({', '.join(verdicts)})", "", "second_order")
        for key in ("prox-form", "gradient-form"):
            v = self.max_block_residual(key)
            if v is not None:
                add(f"max Theorem 2 block residual ({key})", v, f"≤ {_fmt(t.residual)}",
                    f"inclusion_{key}")
        th3 = self._max("theorem3_distance")
        if th3 is not None:
            add("Theorem 3: rel. distance of blocks to the wide solution (→0 as α→0)", th3)
        if self.gradients is not None:
            g = self.gradients
            add("gradient loss", g.loss)
            add("cvxpylayers reference", g.cvxpylayers)
            for k, v in g.errors.items():
                req = k in g.required
                r.append((f"rel. error dℓ/dx: {k}", _fmt(v),
                          f"≤ {_fmt(g.tolerance)}" if req else "(approximate by design)",
                          ("ok" if v <= g.tolerance else "FAIL") if req else "info"))
        r += module_rows(self.module, self.pass_rules)
        add("label", self.label)
        add("status", self.status)
        add("passed", "yes" if self.passed else "NO")
        return r

    def __str__(self) -> str:
        """The table in at most ``TABLE_WIDTH`` columns: long cells wrap onto more lines."""
        return console_table([("quantity", "value", "tolerance", "verdict"), *self.rows()],
                             caps=(32, None, 14, 7), notes=[
                                 *(f"note: {n}" for n in self.notes),
                                 *(f"failure: {f}" for f in self.failures)])

    def __repr__(self) -> str:
        return f"<Report {self.status}>"

    # ------------------------------------------------------------------ markdown & plots
    def to_markdown(self, path: str | Path, plots: bool = True) -> Path:
        """Write a Markdown report (and PNG plots next to it: solver residual history, layer vs
        reference scatter); returns the Markdown path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"# Verification report: {self.target}", "",
                 f"**Status:** {self.status}  ", f"**Passed:** {'yes' if self.passed else 'no'}",
                 "", "| quantity | value | tolerance | verdict |", "|---|---|---|---|"]
        for row in self.rows():
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines += ["", "## Per-sample results", "",
                  "| # | label | rel. error | gap | residual | stationarity | ref. status |",
                  "|---|---|---|---|---|---|---|"]
        for s in self.samples:
            lines.append(f"| {s.index} | {s.label} | {_fmt(s.rel_error)} | {_fmt(s.gap)} | "
                         f"{_fmt(s.residual)} | {_fmt(s.stationarity)} | {s.status} |")
        if self.notes or self.failures:
            lines += ["", "## Notes", ""]
            lines += [f"- {n}" for n in self.notes] + [f"- **failure:** {f}" for f in self.failures]
        tol = self.tolerances
        lines += ["", "## Tolerances", "", *[f"- `{k}` = {_fmt(v)}" for k, v in
                                           vars(tol).items()]]
        if plots:
            images = self._plots(path)
            if images:
                lines += ["", "## Plots", ""]
                lines += [f"![{title}]({img.name})" for title, img in images]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    def _plots(self, path: Path) -> list[tuple[str, Path]]:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        out = []
        hist = self.equilibrium.history
        if hist.size:
            fig = Figure(figsize=(5.5, 3.6))
            FigureCanvasAgg(fig)
            ax = fig.add_subplot(111)
            rows = np.atleast_2d(hist)
            style = {"marker": "o", "ms": 3} if rows.shape[1] <= 15 else {}
            for i, row in enumerate(rows):
                vals = np.where(row > 0, row, np.nan)
                k = np.arange(1, len(row) + 1)
                # the solver returns its best iterate: plot the running minimum, and the k-th
                # iterate itself (dotted) where it rose visibly above it
                best = np.fmin.accumulate(vals)
                (line,) = ax.semilogy(k, best, lw=1, label="returned iterate" if i == 0 else None,
                                      **style)
                if np.any(vals > 1.5 * best):
                    ax.semilogy(k, vals, lw=0.8, ls=":", color=line.get_color(),
                                label="k-th iterate itself" if i == 0 else None)
            ax.axhline(self.equilibrium.tol, color="k", ls="--", lw=0.8,
                       label=f"tol {self.equilibrium.tol:.0e}")
            ax.set_xlabel("iteration k")
            ax.set_ylabel("relative residual ||T(z) - z|| / ||T(z)||")
            ax.set_title(f"equilibrium solve: {self.equilibrium.solver}, {hist.dtype}, "
                         f"{rows.shape[0]} sample(s)", fontsize=10)
            ax.legend(fontsize=7)
            fig.tight_layout()
            img = path.with_name(path.stem + "_residuals.png")
            fig.savefig(img, dpi=110)
            out.append(("residual history", img))
        if self.z_reference is not None:
            fig = Figure(figsize=(4.2, 4.2))
            FigureCanvasAgg(fig)
            ax = fig.add_subplot(111)
            a, b = self.z_reference.reshape(-1), self.z_layer.reshape(-1)
            ax.scatter(a, b, s=8)
            lo = float(min(a.min(initial=0), b.min(initial=0)))
            hi = float(max(a.max(initial=0), b.max(initial=0)))
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xlabel(f"reference ({self.reference.kind})")
            ax.set_ylabel("layer equilibrium")
            ax.set_title(f"max rel. error {_fmt(self.max_rel_error)}")
            fig.tight_layout()
            img = path.with_name(path.stem + "_scatter.png")
            fig.savefig(img, dpi=110)
            out.append(("layer vs reference", img))
        return out


@dataclass
class InclusionReport:
    """Result of ``verify.check_inclusion``: per-sample measures, failures and notes."""

    #: what was checked (the layer or module, in words)
    target: str
    #: the claim in words (the inclusion or saddle point the layer solves)
    claim: str
    #: the monotonicity certificate, as one line
    certificate: str
    #: the references computed (gap function, LCP, duality gap, best response)
    references: list[str]
    #: the tolerance the measures are judged against
    tolerance: float
    #: each measure per sample, by name (e.g. ``"gap"``, ``"lcp rel. error"``)
    measures: dict[str, list[float]] = field(default_factory=dict)
    #: why the check failed (empty when it passed)
    failures: list[str] = field(default_factory=list)
    #: what the check noticed, in words
    notes: list[str] = field(default_factory=list)
    #: the layer's solutions, ``(B, N)``
    z_layer: np.ndarray | None = None
    #: the reference's solutions where one gives a point
    z_reference: np.ndarray | None = None
    #: verify's own tight solve of the layer
    equilibrium: EquilibriumInfo | None = None
    #: the fixed-point residual ``||z − T(z)|| / max(1, ||z||)`` of verify's solution of the
    #: layer's map, per sample
    residuals: list[float] = field(default_factory=list)
    #: the claim's kind
    claim_kind: str = "inclusion"
    #: True if the monotonicity certificate holds at the checked weights
    certified: bool = True
    #: names of the state blocks, in the order of the stacked state
    block_names: list[str] = field(default_factory=list)
    #: the solver of verify's tight solve
    solver: str = ""
    #: wall seconds of the check
    elapsed: float = 0.0
    #: the module's own forward judged against the verified point (docs/theory.md §9.5)
    module: ModuleJudgement | None = None

    @property
    def passed(self) -> bool:
        """``True`` iff no reference, and no judgement of the module's output, failed."""
        return not self.failures

    def as_report(self) -> Report:
        """The same result as a :class:`verify.report.Report` (what ``verify.check`` returns):
        per sample, ``rel_error`` is the LCP solution's relative error or the gap's distance
        bound (the larger where both apply) or the best-response error of a saddle, ``gap``
        the regularised gap or the relative duality gap."""
        bsz = len(self.residuals)
        samples = []
        for b in range(bsz):
            errs = [self.measures[k][b] for k in ("lcp rel. error", "distance bound",
                                                  "best-response rel. error")
                    if k in self.measures and not math.isnan(self.measures[k][b])]
            gaps = [self.measures[k][b] for k in ("gap", "duality gap")
                    if k in self.measures and not math.isnan(self.measures[k][b])]
            samples.append(SampleResult(b, rel_error=max(errs) if errs else None,
                                        gap=gaps[0] if gaps else None,
                                        residual=self.residuals[b], label=self.claim_kind))
        failed = bool(self.failures)
        ref = ReferenceInfo(", ".join(self.references) or "none",
                            "docs/monotone.md §6: " + ", ".join(self.references),
                            solver=self.solver, ok=not failed,
                            failure="; ".join(self.failures)[:200])
        rules = {"equilibrium": self.equilibrium is not None and self.equilibrium.converged,
                 "certificate": self.certified, "reference": not failed,
                 "residual": all(r <= Tolerances().residual for r in self.residuals),
                 "rel_error": not failed, "gap": not failed}
        if self.module is not None:
            rules["module_output"] = self.module.passed
        eq = self.equilibrium or EquilibriumInfo("none", 0.0, [], math.nan, False,
                                                 np.zeros((bsz, 0)))
        return Report(target=self.target, claim=self.claim_kind, claim_statement=self.claim,
                      label=self.claim_kind, certificate=self.certificate,
                      certified=self.certified, violated=[] if self.certified else
                      [self.certificate], reference=ref,
                      tolerances=Tolerances(rel_error=self.tolerance, gap=self.tolerance),
                      samples=samples, equilibrium=eq,
                      z_layer=self.z_layer if self.z_layer is not None else np.zeros((bsz, 0)),
                      z_reference=self.z_reference, block_names=self.block_names,
                      failures=list(self.failures), notes=list(self.notes), pass_rules=rules,
                      elapsed=self.elapsed, module=self.module)

    def worst(self, name: str) -> float:
        """The largest finite value of measure ``name`` over the samples (NaN if none)."""
        vals = [v for v in self.measures.get(name, []) if not math.isnan(v)]
        return max(vals) if vals else math.nan

    def __str__(self) -> str:
        lines = [f"verify (inclusion): {self.target}", f"  claim: {self.claim}",
                 f"  certificate: {self.certificate}",
                 f"  references: {', '.join(self.references)}"]
        for k in self.measures:
            lines.append(f"  worst {k}: {self.worst(k):.3e}")
        rules = {"module_output": self.module is None or self.module.passed}
        lines += [f"  {name}: {value} {tol} {verdict}".rstrip()
                  for name, value, tol, verdict in module_rows(self.module, rules)]
        lines.append(f"  {'PASS' if self.passed else 'FAIL'} (tolerance {self.tolerance:g})")
        lines += [f"  failure: {f}" for f in self.failures] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def module_rows(m: ModuleJudgement | None, rules: dict[str, bool]
                ) -> list[tuple[str, str, str, str]]:
    """The report rows of a module's own output (none for a derived layer)."""
    if m is None:
        return []
    verdict = "ok" if rules.get("module_output", True) else "FAIL"
    rows = [("module forward (as configured)", m.description, "", verdict)]
    if not m.distance:
        return rows
    finite = [a for a in m.allowance if math.isfinite(a)]
    rows.append((f"module output vs {m.against}: max rel. distance", _fmt(worst(m.distance)),
                 f"≤ {_fmt(max(finite))}" if finite else "(no bound: residual rules)",
                 verdict if finite else "info"))
    rows.append(("module output vs tight equilibrium: max rel. distance",
                 _fmt(worst(m.tight_distance)), "", "info"))
    if m.residual is not None:
        rows.append(("module output residual ||T(o) − o||/||T(o)||", _fmt(worst(m.residual)),
                     f"≤ {_fmt(m.residual_allowance)}" if m.residual_rules else "",
                     verdict if m.residual_rules else "info"))
    rows.append(("module output allowance", m.formula, "", "info"))
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.3e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4) else f"{v:.4g}"
    return str(v)


#: console tables (``str(report)``, ``convex-eq verify``) fit this many columns
TABLE_WIDTH = 100


def console_table(rows: Sequence[tuple[str, ...]], caps: tuple[int | None, ...],
                  notes: Sequence[str] = (), width: int = TABLE_WIDTH) -> str:
    """Rows (the first is the header) as aligned columns of at most ``width`` characters:
    column ``i`` is at most ``caps[i]`` wide (``None``: what is left), cells wrap at spaces
    (a word longer than its column is split); notes wrap with a hanging indent."""
    sep = "  "
    fixed = [min(max(len(r[i]) for r in rows), c) for i, c in enumerate(caps) if c is not None]
    free = width - sum(fixed) - len(sep) * (len(caps) - 1)
    widths, it = [], iter(fixed)
    for i, c in enumerate(caps):
        widths.append(next(it) if c is not None else
                      max(8, min(free, max(len(r[i]) for r in rows))))
    lines = []
    for k, row in enumerate(rows):
        cells = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""]
                 for cell, w in zip(row, widths)]
        for j in range(max(len(c) for c in cells)):
            parts = [(c[j] if j < len(c) else "").ljust(w) for c, w in zip(cells, widths)]
            lines.append(sep.join(parts).rstrip())
        if k == 0:
            lines.append(sep.join("-" * w for w in widths))
    for n in notes:
        lines += textwrap.wrap(n, width, subsequent_indent="    ", break_on_hyphens=False)
    return "\n".join(lines)
