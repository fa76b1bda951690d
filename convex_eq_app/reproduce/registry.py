"""The claim runner's units: a :class:`RunSpec` (one model trained with one seed), an
:class:`Experiment` (the runs one or more claims need, and how their results are summarised) and a
:class:`Claim` (a paper's statement, its reference, its number and effect, and the comparisons
that decide it — written down before anything is measured).

Experiments and claims are found through the registries :data:`EXPERIMENTS` and :data:`CLAIMS`
(``register_experiment``/``register_claim``); the runner never names a claim.  The verdict rule
(power, minimum detectable difference) is in :mod:`convex_eq_app.reproduce.power`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from convex_eq.errors import OptionError

from ..configs import Budget
from .power import Stat, Verdict


@dataclass(frozen=True)
class RunSpec:
    """One training run: model ``model`` (a table model or a variant of
    :mod:`convex_eq_app.reproduce.models`) built with ``params``, trained with ``seed``;
    ``evals``: evaluations of the trained model (keys of the evaluator registry).  Runs that
    differ only in ``evals`` are trained once."""

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
        return f"{self.model}{f' ({p})' if p else ''} seed {self.seed}"


def run(model: str, seed: int, evals: Sequence[str] = (), **params: Any) -> RunSpec:
    """A :class:`RunSpec` with keyword parameters (stored sorted, so equal runs compare equal)."""
    return RunSpec(model, tuple(sorted(params.items())), int(seed), tuple(evals))


@dataclass
class Results:
    """Metrics of the finished runs, looked up by spec (``get``) or over seeds (``stat``,
    ``acc``); ``n_test``: the test signals every accuracy is measured on."""

    n_test: int = 0
    by_key: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    #: where each run came from: "trained", "resumed" (an earlier invocation) or "table"
    origin: dict[tuple[Any, ...], str] = field(default_factory=dict)
    #: wall seconds (training + evaluation) of runs reused from an earlier invocation
    reused: list[float] = field(default_factory=list)

    def get(self, spec: RunSpec) -> dict[str, Any]:
        try:
            return self.by_key[spec.key]
        except KeyError:
            raise OptionError(f"no result for run {spec.label()}", term="reproduce",
                              hint="the experiment must list every run it reads in runs()"
                              ) from None

    def values(self, model: str, seeds: Sequence[int], metric: Callable[[dict[str, Any]], float],
               **params: Any) -> list[float]:
        """``metric`` of the runs ``model(**params)`` for each of ``seeds``."""
        return [float(metric(self.get(run(model, s, **params)))) for s in seeds]

    def stat(self, model: str, seeds: Sequence[int], metric: Callable[[dict[str, Any]], float],
             sampling: float = 0.0, **params: Any) -> Stat:
        """``metric`` over ``seeds`` as a :class:`Stat` (``sampling``: its test-set
        variance)."""
        return Stat.of(self.values(model, seeds, metric, **params), sampling)

    def acc(self, model: str, seeds: Sequence[int],
            metric: Callable[[dict[str, Any]], float] | None = None, **params: Any) -> Stat:
        """An accuracy (the test accuracy, or ``metric``) over ``seeds``, with the binomial
        variance of the ``n_test`` test signals."""
        return Stat.accuracy(self.values(model, seeds, metric or accuracy, **params),
                             self.n_test)


def accuracy(metrics: dict[str, Any]) -> float:
    """The test accuracy of a run's metrics."""
    return float(metrics["accuracy"])


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
    """A paper's claim: ``statement``; ``source`` (paper, table/figure); ``paper`` (the paper's
    numbers, quoted as printed); ``criterion`` (the comparisons that decide it and the paper
    effect each is held to, fixed before measuring); ``experiment`` (key of the experiment it
    reads); ``judge`` (measurements → :class:`~convex_eq_app.reproduce.power.Verdict`)."""

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
