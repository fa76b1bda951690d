"""``auto``: plain iteration while it converges fast, Anderson otherwise (docs/theory.md §8,
solver choice)."""

from __future__ import annotations

import math

import torch

from convex_eq.errors import OptionError

from .anderson import iterate as anderson_iterate  # (the module, not the registered name)
from .compiled import compiled_name, plain_phase
from .tracker import F, Tracker

#: ``auto``: Anderson from the start for states of at least this size in batches of at least
#: ``AUTO_ANDERSON_WORK`` entries (there one evaluation of ``T`` costs more than Anderson's
#: bookkeeping, and Anderson needs several times fewer); otherwise (small batches of large
#: states too: there Anderson's fixed costs per iteration dominate) plain iteration, continued
#: by Anderson once the rate observed over ``AUTO_WINDOW``
#: iterations predicts more than ``AUTO_PLAIN_BUDGET`` further iterations (or more than half of
#: those left): a plain iteration of a small state costs a fraction of an Anderson one
#: (docs/performance.md)
AUTO_ANDERSON_STATE = 256
AUTO_ANDERSON_WORK = 256 * 32
AUTO_PLAIN_BUDGET = 60
AUTO_WINDOW = 4
#: a prediction of at most this many further plain iterations is tested again only
#: ``AUTO_WINDOW`` past its end (not after half of it): see :class:`AutoWatch`
AUTO_TAIL = 16


def auto(f: F, z0: torch.Tensor, tr: Tracker, *, max_iter: int = 100, m: int = 5,
         beta: float = 1.0, lam: float = 1e-8, restart: int | None = None) -> None:
    """Plain iteration while it converges fast, Anderson otherwise: Anderson from the start for
    states with ``N ≥ AUTO_ANDERSON_STATE`` in batches with ``B·N ≥ AUTO_ANDERSON_WORK``;
    otherwise plain iteration, continued by Anderson
    (from the current iterate, same statistics) once the worst residual's rate since the last
    test predicts more than ``min(AUTO_PLAIN_BUDGET, left / 2)`` further plain iterations
    (:class:`AutoWatch`).  The choice depends on the residuals only (deterministic);
    ``stats.solver`` says what ran (``"plain"``, ``"anderson"``, ``"plain→anderson"``)."""
    if m < 1:
        raise OptionError("Anderson history m must be ≥ 1", term="solver auto")
    if z0.shape[-1] >= AUTO_ANDERSON_STATE and z0.numel() >= AUTO_ANDERSON_WORK:
        tr.name = "anderson"
        anderson_iterate(f, z0, tr, max_iter, m, beta, lam, restart)
        return
    tr.name = compiled_name("plain", tr.compiled)
    fz, k = plain_phase(f, z0, tr, max_iter, AutoWatch(tr, tr.tol, max_iter))
    if fz is not None:
        tr.name += "→anderson"
        anderson_iterate(f, fz, tr, max_iter - k, m, beta, lam, restart)


class AutoWatch:
    """``auto``'s switch test, asked by
    :func:`~lowering.runtime.solvers.compiled.plain_phase` after ``k`` evaluations once
    ``k ≥ next``: the worst residual's rate since the last test (``AUTO_WINDOW`` iterations
    after the first) predicts the further plain iterations; more than
    ``min(AUTO_PLAIN_BUDGET, left / 2)`` switches to Anderson (True). Otherwise the next
    test comes after half the predicted iterations, at least ``AUTO_WINDOW`` later: a rate
    that slows down is caught within half of what it had predicted. A prediction of at most
    ``AUTO_TAIL`` iterations is tested again only ``AUTO_WINDOW`` past its end: a solve that
    ends as predicted is not asked again (each test costs as much as an iteration of a small
    state, cold). When that test finds more than ``AUTO_TAIL`` still to go, the rate slowed
    down inside its long span, whose average includes the faster start: the next test
    measures it over ``AUTO_WINDOW`` iterations again."""

    __slots__ = ("k", "max_iter", "next", "tail", "then", "tol", "tr")

    def __init__(self, tr: Tracker, tol: float, max_iter: int):
        self.tr, self.tol, self.max_iter = tr, tol, max_iter
        self.next, self.then, self.k = 1, math.nan, 0
        self.tail = False  # the last test predicted a short tail (≤ AUTO_TAIL)

    def __call__(self, k: int) -> bool:
        if k < self.next:
            return False
        top = self.tr.top
        step = AUTO_WINDOW
        if self.k:
            # the further plain iterations the worst residual's rate from ``then`` to ``top``
            # (k − self.k iterations apart) predicts, log(tol/top) / log(rate): infinite for a
            # rate ≥ 1, 0 when done or not finite (non-finite samples are the tracker's
            # business); inline, as the test is asked several times a solve
            then = self.then
            if not (math.isfinite(top) and math.isfinite(then)) or top <= 0:
                need = 0.0
            elif top >= then:
                need = math.inf
            elif top <= self.tol:
                need = 0.0
            else:
                rate = (top / then) ** (1.0 / (k - self.k))
                need = math.log(self.tol / top) / math.log(rate)
            if need > min(AUTO_PLAIN_BUDGET, (self.max_iter - k) / 2):
                return True
            # the next test: after half the predicted iterations, at least AUTO_WINDOW later;
            # after a short predicted tail, AUTO_WINDOW past its end; after a tail that turned
            # out long (the rate slowed down inside it), AUTO_WINDOW later again (class doc)
            was_tail, self.tail = self.tail, need <= AUTO_TAIL
            step = int(need) + AUTO_WINDOW if self.tail else \
                AUTO_WINDOW if was_tail else max(AUTO_WINDOW, int(need) // 2)
        self.next, self.then, self.k = k + step, top, k
        return False
