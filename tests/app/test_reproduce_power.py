"""The power rule of ``convex-eq reproduce`` (convex_eq_app/reproduce/power.py) against an
independent reference: Student-t quantiles from scipy computed here, the standard error written
out by hand from the module docstring's formula, and a worked example with printed t-table
values."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from convex_eq.errors import OptionError
from convex_eq_app.reproduce.power import (
    INCONCLUSIVE,
    NO,
    NOT_RESOLVABLE,
    ONE_SEED,
    YES,
    Stat,
    combine,
    compare,
    judged,
)

N_TEST = 12_000
#: the quantities below are sums and square roots of a handful of doubles: agreement to 1e-12
#: relative is exact arithmetic up to rounding
EXACT = 1e-12


def reference_se(a: list[float], b: list[float], n_test: int) -> float:
    """SE² = s_a²/n_a + s_b²/n_b + p̄_a(1 − p̄_a)/N + p̄_b(1 − p̄_b)/N, with the sample
    standard deviation (ddof 1) of the statistics module."""
    pa, pb = statistics.mean(a), statistics.mean(b)
    return math.sqrt(statistics.stdev(a) ** 2 / len(a) + statistics.stdev(b) ** 2 / len(b)
                     + pa * (1 - pa) / n_test + pb * (1 - pb) / n_test)


def test_accuracy_stat_carries_the_binomial_test_set_variance() -> None:
    s = Stat.accuracy([0.80, 0.82, 0.84], N_TEST)
    assert s.mean == pytest.approx(0.82, rel=EXACT)
    assert s.std == pytest.approx(statistics.stdev([0.80, 0.82, 0.84]), rel=EXACT)
    assert s.sampling == pytest.approx(0.82 * 0.18 / N_TEST, rel=EXACT)


def test_se_and_mdd_match_scipy_t_quantiles_with_pooled_degrees_of_freedom() -> None:
    a, b = [0.80, 0.82, 0.84], [0.70, 0.71, 0.73]
    c = compare(Stat.accuracy(a, N_TEST), Stat.accuracy(b, N_TEST), 0.05)
    se = reference_se(a, b, N_TEST)
    assert c.df == 4
    assert c.se == pytest.approx(se, rel=EXACT)
    mdd = (stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * se
    assert c.mdd == pytest.approx(mdd, rel=EXACT)
    assert c.diff == pytest.approx(statistics.mean(a) - statistics.mean(b), rel=EXACT)


def test_hand_worked_example_with_printed_t_table_values() -> None:
    """Seeds 3 + 3 (df 4) with no test-set term: a = 0.80/0.82/0.84 (s = 0.02), b = 0.70/0.71/
    0.72 (s = 0.01); SE = sqrt(0.02²/3 + 0.01²/3) = 0.012910; t-table: t_.975,4 = 2.776,
    t_.8,4 = 0.941, t_.95,4 = 2.132; MDD = 3.717 · 0.012910 = 0.04799."""
    a, b = Stat.of([0.80, 0.82, 0.84]), Stat.of([0.70, 0.71, 0.72])
    c = compare(a, b, 0.06)
    # the t-table values are printed to 3 decimals: 5e-4 relative
    assert c.se == pytest.approx(0.012910, rel=5e-4)
    assert c.mdd == pytest.approx(0.04799, rel=5e-4)
    # d = 0.11, lower bound 0.11 − 2.132 · 0.0129 = 0.0825 > 0, paper effect 0.06 ≥ MDD
    assert c.verdict == YES


@pytest.mark.parametrize(("a", "b", "effect", "verdict"), [
    # d = 0.11 ≫ 2.132·SE: the effect is there, and 0.06 is above the MDD 0.048
    ([0.80, 0.82, 0.84], [0.70, 0.71, 0.72], 0.06, YES),
    # the paper's effect 0.01 is below the MDD 0.048: never "no", even where d < 0
    ([0.70, 0.71, 0.72], [0.80, 0.82, 0.84], 0.01, NOT_RESOLVABLE),
    # d = −0.11: d + 2.132·SE = −0.0825 < 0.06 (the paper's effect, above the MDD): "no"
    ([0.70, 0.71, 0.72], [0.80, 0.82, 0.84], 0.06, NO),
    # d = 0.0275, SE = 0.01443, MDD = 0.0537 ≤ 0.055: neither 0.0275 − 0.0308 > 0 nor
    # 0.0275 + 0.0308 < 0.055
    ([0.80, 0.82, 0.84], [0.7775, 0.7925, 0.8075], 0.055, INCONCLUSIVE),
    # no paper effect (a curve): "no" when the data exclude any effect in the claimed direction
    ([0.70, 0.71, 0.72], [0.80, 0.82, 0.84], None, NO),
    ([0.80, 0.82, 0.84], [0.7775, 0.7925, 0.8075], None, INCONCLUSIVE),
])
def test_verdict_rule_of_the_docstring(a: list[float], b: list[float], effect: float | None,
                                       verdict: str) -> None:
    c = compare(Stat.of(a), Stat.of(b), effect)
    se = reference_se(a, b, 10 ** 12)  # no test-set term here (N huge: negligible)
    t_a, mdd = stats.t.ppf(0.95, 4), (stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * se
    d = statistics.mean(a) - statistics.mean(b)
    expected = (NOT_RESOLVABLE if effect is not None and effect < mdd else YES
                if d - t_a * se > 0 else NO if d + t_a * se < (effect or 0.0) else INCONCLUSIVE)
    assert expected == verdict  # the case is what its comment says, by the reference
    assert c.verdict == verdict


def test_a_side_with_one_seed_is_never_judged() -> None:
    c = compare(Stat.of([0.9]), Stat.of([0.1, 0.2, 0.3]), 0.05)
    assert c.verdict == ONE_SEED and c.mdd is None


def test_ratio_comparisons_work_on_the_log_scale() -> None:
    """A ratio claim compares ln values: the difference is ln(a/b) of the geometric means, and
    the test-set variance goes through the delta method var(ln m) ≈ var(m)/m²."""
    a, b = [4.0, 5.0, 6.0], [1.0, 1.2, 0.9]
    la, lb = Stat.log_of(a, [0.01] * 3), Stat.log_of(b)
    assert la.sampling == pytest.approx(sum(0.01 / v ** 2 for v in a) / 3, rel=EXACT)
    c = compare(la, lb, math.log(2.0), unit="ratio")
    geo = math.exp(statistics.mean(map(math.log, a)) - statistics.mean(map(math.log, b)))
    assert math.exp(c.diff) == pytest.approx(geo, rel=EXACT)
    with pytest.raises(OptionError, match="positive"):
        Stat.log_of([1.0, 0.0])


def test_a_claim_of_several_comparisons_is_yes_only_when_each_is() -> None:
    yes = compare(Stat.of([0.80, 0.82, 0.84]), Stat.of([0.70, 0.71, 0.72]), 0.06)
    no = compare(Stat.of([0.70, 0.71, 0.72]), Stat.of([0.80, 0.82, 0.84]), 0.06)
    small = compare(Stat.of([0.70, 0.71, 0.72]), Stat.of([0.80, 0.82, 0.84]), 0.01)
    both = compare(Stat.of([0.80, 0.82, 0.84]), Stat.of([0.7775, 0.7925, 0.8075]), 0.055)
    assert combine([yes, yes]) == YES
    assert combine([yes, no, small]) == NO
    assert combine([yes, small]) == NOT_RESOLVABLE
    assert combine([yes, both]) == INCONCLUSIVE
    v = judged("m", [yes, small])
    # the two comparisons differ in effect and difference (both columns list them), not in SE
    # or MDD (the same data: one value)
    assert v.holds == NOT_RESOLVABLE and v.effect == "6.00 pt / 1.00 pt"
    assert " / " in v.difference and " / " not in v.power
    assert f"{100 * yes.se:.2f} pt" in v.se


def test_verdict_text_reports_every_column() -> None:
    c = compare(Stat.accuracy([0.80, 0.82, 0.84], N_TEST),
                Stat.accuracy([0.70, 0.71, 0.73], N_TEST), 0.05, labels=("A", "B"))
    v = judged("A 82 %, B 71 %", [c])
    assert v.effect == "5.00 pt"
    assert v.difference == f"A − B: +{100 * c.diff:.2f} pt"
    assert v.se == f"{100 * c.se:.2f} pt" and v.power == f"{100 * c.mdd:.2f} pt"
