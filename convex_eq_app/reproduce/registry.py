"""The claim runner's units: a :class:`RunSpec` (one model trained with one seed), an
:class:`Experiment` (the runs one or more claims need, and how their results are summarised) and a
:class:`Claim` (a paper's statement, its reference and number, and the criterion that decides
whether it holds here — written down before anything is measured).

Experiments and claims are found through the registries :data:`EXPERIMENTS` and :data:`CLAIMS`
(``register_experiment``/``register_claim``); the runner never names a claim.  The verdict rules
are in :func:`greater` and :func:`decreasing` (docs/reproduce.md, "Verdicts").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from convex_eq.errors import OptionError

from ..configs import Budget

#: the verdicts a claim can get (the "holds?" column)
YES, NO, WITHIN, NOT_MEASURED = "yes", "no", "no (within seed spread)", "not measured"


@dataclass(frozen=True)
class RunSpec:
    """One training run: model ``model`` (a key of the model registry) built with ``params``,
    trained with ``seed``; ``evals``: evaluations of the trained model (keys of the evaluator
    registry).  Runs that differ only in ``evals`` are trained once."""

    model: str
    params: tuple[tuple[str, Any], ...]
    seed: int
    evals: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[Any, ...]:
        """Identity of the trained model (evaluations excluded)."""
        return (self.model, self.params, self.seed)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def label(self) -> str:
        p = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.model}({p}) seed {self.seed}"


def run(model: str, seed: int, evals: Sequence[str] = (), **params: Any) -> RunSpec:
    """A :class:`RunSpec` with keyword parameters (stored sorted, so equal runs compare equal)."""
    return RunSpec(model, tuple(sorted(params.items())), int(seed), tuple(evals))


@dataclass
class Results:
    """Metrics of the finished runs, looked up by spec (``get``) or over seeds (``stat``)."""

    by_key: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    #: wall seconds (training + evaluation) of runs reused from an earlier invocation
    reused: list[float] = field(default_factory=list)

    def get(self, spec: RunSpec) -> dict[str, Any]:
        try:
            return self.by_key[spec.key]
        except KeyError:
            raise OptionError(f"no result for run {spec.label()}", term="reproduce",
                              hint="the experiment must list every run it reads in runs()"
                              ) from None

    def stat(self, model: str, seeds: Sequence[int], metric: Callable[[dict[str, Any]], float],
             **params: Any) -> Stat:
        """``metric`` of the runs ``model(**params)`` over ``seeds``, as a :class:`Stat`."""
        return Stat.of([metric(self.get(run(model, s, **params))) for s in seeds])


def accuracy(metrics: dict[str, Any]) -> float:
    """The test accuracy of a run's metrics (for :meth:`Results.stat`)."""
    return float(metrics["accuracy"])


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (ddof = 1; 0 for one value) of ``n`` values."""

    mean: float
    std: float
    n: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        v = [float(a) for a in values]
        if not v:
            raise OptionError("no values to summarise", term="reproduce")
        m = sum(v) / len(v)
        sd = math.sqrt(sum((a - m) ** 2 for a in v) / (len(v) - 1)) if len(v) > 1 else 0.0
        return cls(m, sd, len(v), tuple(v))

    def pct(self) -> str:
        """``"62.3 ± 1.2 %"`` (an accuracy in [0, 1] as a percentage)."""
        if self.n == 1:
            return f"{100 * self.mean:.1f} %"
        return f"{100 * self.mean:.1f} ± {100 * self.std:.1f} %"

    def num(self, fmt: str = ".3g") -> str:
        if self.n == 1:
            return format(self.mean, fmt)
        return f"{format(self.mean, fmt)} ± {format(self.std, fmt)}"


def greater(a: Stat, b: Stat) -> str:
    """Verdict of "a > b": ``yes`` if ``mean_a − mean_b`` exceeds the larger of the two seed
    standard deviations, ``no`` if it is below minus that spread (reversed) or zero with one
    seed, ``no (within seed spread)`` otherwise."""
    diff, spread = a.mean - b.mean, max(a.std, b.std)
    if diff > spread:
        return YES
    if diff < -spread or (spread == 0 and diff <= 0):
        return NO
    return WITHIN


def decreasing(stats: Sequence[Stat]) -> str:
    """Verdict of "strictly decreasing": every consecutive step is a ``greater`` ``yes``; one
    reversed step makes it ``no``, otherwise ``no (within seed spread)``."""
    steps = [greater(a, b) for a, b in pairwise(stats)]
    if all(s == YES for s in steps):
        return YES
    return NO if NO in steps else WITHIN


def all_of(verdicts: Sequence[str]) -> str:
    """Conjunction of verdicts: ``yes`` if all are, ``no`` if one is, else within spread."""
    if all(v == YES for v in verdicts):
        return YES
    return NO if NO in verdicts else WITHIN


@dataclass(frozen=True)
class Verdict:
    """What was measured (one line for the table) and whether the claim holds."""

    measured: str
    holds: str


@dataclass(frozen=True)
class Experiment:
    """The runs some claims share: ``runs(budget)`` lists them, ``summarize(budget, results)``
    turns their metrics into named measurements, ``plot(measurements, out_dir)`` writes a PNG
    and returns its file name (None: no plot)."""

    key: str
    title: str
    setup: str
    runs: Callable[[Budget], list[RunSpec]]
    summarize: Callable[[Budget, Results], dict[str, Any]]
    plot: Callable[[dict[str, Any], Any], str | None] | None = None


@dataclass(frozen=True)
class Claim:
    """A paper's claim in miniature: ``statement``; ``source`` (paper, table/figure);
    ``paper`` (the paper's number, quoted); ``criterion`` (when it holds here, fixed before
    measuring); ``experiment`` (key of the experiment it reads); ``judge`` (measurements →
    :class:`Verdict`)."""

    key: str
    statement: str
    source: str
    paper: str
    criterion: str
    experiment: str
    judge: Callable[[dict[str, Any]], Verdict]


EXPERIMENTS: dict[str, Experiment] = {}
CLAIMS: dict[str, Claim] = {}


def register_experiment(exp: Experiment) -> Experiment:
    if exp.key in EXPERIMENTS:
        raise OptionError(f"experiment {exp.key!r} registered twice", term="reproduce")
    EXPERIMENTS[exp.key] = exp
    return exp


def register_claim(claim: Claim) -> Claim:
    if claim.key in CLAIMS:
        raise OptionError(f"claim {claim.key!r} registered twice", term="reproduce")
    if claim.experiment not in EXPERIMENTS:
        raise OptionError(f"claim {claim.key!r} reads unknown experiment {claim.experiment!r}",
                          term="reproduce", hint="register the experiment first")
    CLAIMS[claim.key] = claim
    return claim
