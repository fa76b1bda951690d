"""Verdicts with power: each claim is decided by two-sample comparisons whose standard error
combines the seed spread and the sampling error of the test set, and a claim whose paper effect
is below the smallest difference the run could detect is "not resolvable here", never "no"
(docs/reproduce.md, "Verdicts and power").

For "a exceeds b" with ``n_a``, ``n_b`` seeds:

    SE² = s_a²/n_a + s_b²/n_b + v_a + v_b,

``s`` the sample standard deviation over the seeds (ddof 1) and ``v`` the variance of the
quantity from the finite test set (for an accuracy ``p`` on ``N`` signals: ``p(1 − p)/N``);
``df = n_a + n_b − 2``; the minimum detectable difference at level ``α`` (two-sided) with power
``1 − β`` is

    MDD = (t_{1−α/2, df} + t_{1−β, df}) · SE.

With the paper's effect ``Δ`` in the claimed direction and ``d = mean_a − mean_b``: ``Δ < MDD``
→ "not resolvable here"; otherwise ``d − t_{1−α, df}·SE > 0`` → "yes"; ``d + t_{1−α, df}·SE <
Δ`` (the data exclude an effect as large as the paper's) → "no"; else "inconclusive".  Where
the paper prints no number (a curve or bars), ``Δ`` is unknown: the resolvability test is
skipped and "no" means the data exclude any effect in the claimed direction
(``d + t·SE < 0``).  A side with one seed has no spread: "not resolvable here (one seed)".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from convex_eq.errors import OptionError

#: significance level (two-sided for the MDD, one-sided for the verdict's bounds) and power
ALPHA, POWER = 0.05, 0.8

YES, NO, INCONCLUSIVE = "yes", "no", "inconclusive"
NOT_RESOLVABLE = "not resolvable here"
ONE_SEED = "not resolvable here (one seed)"
NOT_MEASURED = "not measured"
#: every verdict a claim can get
VERDICTS = (YES, NO, INCONCLUSIVE, NOT_RESOLVABLE, ONE_SEED, NOT_MEASURED)


@dataclass(frozen=True)
class Stat:
    """A quantity over ``n`` seeds: ``mean``, sample standard deviation ``std`` (ddof 1; 0 for
    one value), the per-seed ``values`` and ``sampling``, the variance of the quantity due to
    the finite test set (the ``v`` of the module docstring; 0 where there is none)."""

    mean: float
    std: float
    n: int
    values: tuple[float, ...] = ()
    sampling: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float], sampling: float = 0.0) -> Stat:
        """Mean and sample standard deviation of ``values``."""
        v = [float(a) for a in values]
        if not v:
            raise OptionError("no values to summarise", term="reproduce")
        if not all(math.isfinite(a) for a in v):
            raise OptionError(f"non-finite values {v} cannot be compared", term="reproduce",
                              hint="a run diverged: look at its training history")
        m = sum(v) / len(v)
        sd = math.sqrt(sum((a - m) ** 2 for a in v) / (len(v) - 1)) if len(v) > 1 else 0.0
        return cls(m, sd, len(v), tuple(v), float(sampling))

    @classmethod
    def accuracy(cls, values: Sequence[float], n_test: int) -> Stat:
        """Accuracies on ``n_test`` signals: ``sampling = p̄(1 − p̄)/N`` (binomial)."""
        if n_test < 1:
            raise OptionError(f"test size {n_test} must be ≥ 1", term="reproduce")
        s = cls.of(values)
        return cls(s.mean, s.std, s.n, s.values, s.mean * (1.0 - s.mean) / n_test)

    @classmethod
    def log_of(cls, values: Sequence[float], variances: Sequence[float] = ()) -> Stat:
        """``ln`` of positive per-seed values (ratios become differences); ``variances``: each
        value's test-set variance, carried through the logarithm by the delta method
        (``var(ln m) ≈ var(m)/m²``), averaged over the seeds."""
        v = [float(a) for a in values]
        if not all(a > 0 for a in v):
            raise OptionError(f"values {v} must be positive to compare their logarithms",
                              term="reproduce")
        samp = (sum(var / (a * a) for var, a in zip(variances, v)) / len(v)) if variances \
            else 0.0
        return cls.of([math.log(a) for a in v], samp)

    def pct(self) -> str:
        """``"62.3 ± 1.2 %"`` (an accuracy in [0, 1] as a percentage, ± the seed std)."""
        if self.n == 1:
            return f"{100 * self.mean:.1f} %"
        return f"{100 * self.mean:.1f} ± {100 * self.std:.1f} %"

    def num(self, fmt: str = ".3g") -> str:
        """The mean (± the seed std) in ``fmt``."""
        if self.n == 1:
            return format(self.mean, fmt)
        return f"{format(self.mean, fmt)} ± {format(self.std, fmt)}"

    def exp_num(self, fmt: str = ".3g") -> str:
        """A log-quantity shown as its geometric mean ``e^mean``."""
        return format(math.exp(self.mean), fmt)


#: how a comparison's differences are written: "pt" (an accuracy difference in percentage
#: points) or "ratio" (a difference of logarithms, written as the factor e^d)
UNITS = ("pt", "ratio")


def fmt_effect(value: float | None, unit: str) -> str:
    """A difference (or an MDD) in its unit: ``"1.70 pt"`` or ``"×2.46"``."""
    if value is None:
        return "—"
    if unit == "pt":
        return f"{100 * value:.2f} pt"
    return f"×{math.exp(value):.3g}"


def t_quantile(q: float, df: int) -> float:
    """``t_{q, df}``, the ``q`` quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(q, df))


@dataclass(frozen=True)
class Comparison:
    """"``a`` exceeds ``b``" judged against the paper's effect ``effect`` (None: the paper
    prints no number): the difference ``diff``, its standard error ``se``, ``df``, the
    minimum detectable difference ``mdd`` (None with one seed) and the verdict."""

    a: str
    b: str
    diff: float
    se: float
    df: int
    mdd: float | None
    effect: float | None
    verdict: str
    unit: str = "pt"

    def text(self) -> str:
        """``"a − b = +1.20 pt (SE 0.40 pt)"``."""
        sign = "+" if self.diff >= 0 else "−"
        if self.unit == "pt":
            d = f"{sign}{abs(100 * self.diff):.2f} pt"
            se = f"{100 * self.se:.2f} pt"
        else:
            d, se = f"×{math.exp(self.diff):.3g}", f"{self.se:.2g} in ln"
        return f"{self.a} − {self.b} = {d} (SE {se})"


def compare(a: Stat, b: Stat, effect: float | None, *, unit: str = "pt",
            labels: tuple[str, str] = ("a", "b")) -> Comparison:
    """The verdict of "``a`` exceeds ``b``" (module docstring); ``effect`` in the units of the
    stats (an accuracy difference as a fraction, a log ratio for ``unit="ratio"``)."""
    if unit not in UNITS:
        raise OptionError(f"unknown unit {unit!r}", term="compare", hint=f"one of {UNITS}")
    diff = a.mean - b.mean
    if a.n < 2 or b.n < 2:
        return Comparison(labels[0], labels[1], diff, math.nan, 0, None, effect, ONE_SEED, unit)
    df = a.n + b.n - 2
    se = math.sqrt(a.std ** 2 / a.n + b.std ** 2 / b.n + a.sampling + b.sampling)
    mdd = (t_quantile(1 - ALPHA / 2, df) + t_quantile(POWER, df)) * se
    bound = t_quantile(1 - ALPHA, df) * se
    if effect is not None and effect < mdd:
        verdict = NOT_RESOLVABLE
    elif diff - bound > 0:
        verdict = YES
    elif diff + bound < (effect if effect is not None else 0.0):
        verdict = NO
    else:
        verdict = INCONCLUSIVE
    return Comparison(labels[0], labels[1], diff, se, df, mdd, effect, verdict, unit)


def combine(comparisons: Sequence[Comparison]) -> str:
    """The verdict of a claim made of several comparisons (a curve, "each of …"): with one
    seed, that; "yes" when every comparison is; "no" when one is; otherwise "not resolvable
    here" when one is; otherwise "inconclusive" (docs/reproduce.md)."""
    verdicts = [c.verdict for c in comparisons]
    if not verdicts:
        raise OptionError("a claim needs at least one comparison", term="reproduce")
    if ONE_SEED in verdicts:
        return ONE_SEED
    if all(v == YES for v in verdicts):
        return YES
    if NO in verdicts:
        return NO
    if NOT_RESOLVABLE in verdicts:
        return NOT_RESOLVABLE
    return INCONCLUSIVE


@dataclass(frozen=True)
class Verdict:
    """A claim's outcome: ``measured`` (what was measured, one line), ``holds`` (the verdict),
    and, as text, ``effect`` (the paper's effect), ``difference`` (the measured difference),
    ``se`` (its standard error) and ``power`` (the MDD), one value per comparison it was
    decided by (``comparisons``)."""

    measured: str
    holds: str
    effect: str = "—"
    power: str = "—"
    comparisons: tuple[Comparison, ...] = field(default_factory=tuple)
    difference: str = "—"
    se: str = "—"


def _difference(c: Comparison) -> str:
    """``"a − b: +1.20 pt"`` or, for a ratio, ``"a / b: ×2.46"``."""
    if c.unit == "ratio":
        return f"{c.a} / {c.b}: ×{math.exp(c.diff):.3g}"
    return f"{c.a} − {c.b}: {'+' if c.diff >= 0 else '−'}{abs(100 * c.diff):.2f} pt"


def _se_text(c: Comparison) -> str:
    if math.isnan(c.se):
        return "— (one seed)"
    return f"{100 * c.se:.2f} pt" if c.unit == "pt" else f"{c.se:.2g} in ln"


def judged(measured: str, comparisons: Sequence[Comparison]) -> Verdict:
    """The :class:`Verdict` of ``comparisons`` (:func:`combine`): the paper effects, measured
    differences, standard errors and MDDs of every comparison (one value when they agree,
    otherwise ``" / "``-separated in the comparisons' order), and each comparison's verdict
    after ``measured`` when they differ."""
    cs = tuple(comparisons)
    if not cs:
        raise OptionError("a claim needs at least one comparison", term="reproduce")

    def column(values: list[str]) -> str:
        return values[0] if len(set(values)) == 1 else " / ".join(values)

    effect = column([fmt_effect(c.effect, c.unit) for c in cs])
    power = column([fmt_effect(c.mdd, c.unit) if c.mdd is not None else "— (one seed)"
                    for c in cs])
    diffs = " / ".join(_difference(c) for c in cs)
    se = column([_se_text(c) for c in cs])
    mixed = len({c.verdict for c in cs}) > 1
    detail = "; ".join(f"{c.a} vs {c.b}: {c.verdict}" for c in cs) if mixed else ""
    return Verdict(f"{measured}; {detail}" if detail else measured, combine(cs), effect,
                   power, cs, diffs, se)


__all__ = ["ALPHA", "INCONCLUSIVE", "NO", "NOT_MEASURED", "NOT_RESOLVABLE", "ONE_SEED",
           "POWER", "VERDICTS", "YES", "Comparison", "Stat", "Verdict", "combine", "compare",
           "fmt_effect", "judged"]
