"""Anderson's stall guard: checked phases of plain iteration and Anderson trials after a stall
(docs/theory.md §8, Anderson acceleration)."""

from __future__ import annotations

import math

import torch

#: Anderson's stall guard (:class:`StallGuard`) starts after this many restarts in a row that
#: gain nothing: each one's best worst residual since the restart before stays above
#: ``ANDERSON_GAIN`` times the best of those since the last restart that did gain (not only the
#: one before: a stall that alternates between two levels gains 2× every other restart)
ANDERSON_FRUITLESS = 3
ANDERSON_GAIN = 0.5
#: in a plain phase, an unconverged sample whose ``||f(z) − z||`` exceeds this factor times its
#: value at the phase's start is given up (it takes Anderson steps from then on): plain iteration
#: does not shrink its residual there (on a contraction in the 2-norm the residual never grows;
#: where plain iteration diverges it grows geometrically).  32: room for the transient of a
#: non-normal map whose plain iteration converges, e.g. ``0.9·I + 0.12·S`` (S the shift), whose
#: powers peak at 16.6 (with 4 its samples were given up and Anderson stalled there again)
ANDERSON_PLAIN_GROWTH = 32.0
#: an Anderson trial wins for a sample whose best ``||f(z) − z||`` in it falls below this factor
#: times the value plain iteration would have reached at the rate the phase before measured
ANDERSON_TRIAL_GAIN = 0.5


class StallGuard:
    """Anderson after a stall (docs/theory.md §8): phases of plain iteration, each followed by an
    Anderson trial of ``span`` iterations from where the phase ended (its history: the phase's
    last steps), judged per sample at its end.  A sample that took plain steps in the phase
    wins its trial where the trial's best ``||f(z) − z||`` beat ``ANDERSON_TRIAL_GAIN`` times
    the value the phase's plain rate predicts; a sample that took Anderson steps, where the
    trial's best beat ``ANDERSON_TRIAL_GAIN`` times its value at the trial's start; a sample
    that has met ``tol`` wins.  Losers take plain steps in the next phase, twice as long: from
    the phase's last iterate where they took plain steps (the trial is discarded for them), from
    the trial's best iterate otherwise; winners go on with Anderson.  When every sample won, the
    phases end and the solve goes on as plain Anderson (its next stall starts a phase again).

    Each phase checks that plain steps do not make things worse: an unconverged sample whose
    ``||f(z) − z||`` grows past ``ANDERSON_PLAIN_GROWTH`` times its value at the phase's start
    is given up (plain iteration diverges there): it takes Anderson steps for the rest of the
    solve.  When every unconverged sample has been given up, the guard ends for good (Anderson
    goes on with its restarts alone).

    Residuals here are ``||f(z) − z||²`` per sample, the new Gram row's own entry (no
    extra reduction); the work (a few ``(B, 1)`` comparisons and selections per iteration, one
    host synchronisation per phase) is only done once a stall has been detected."""

    __slots__ = ("best", "best_f", "dead", "gaveup", "left", "phase", "plain", "plain_len", "ref",
                 "rp", "span", "thr", "tol", "zp_f")

    def __init__(self, span: int, tol: float):
        self.span, self.tol = span, tol
        self.plain_len = span // 2  # doubled by each phase: the first one is ``span`` long
        self.phase: str | None = None  # "plain", "trial", or None (plain Anderson)
        self.dead = False  # every unconverged sample was given up: no more phases
        self.gaveup: torch.Tensor | None = None  # (B, 1): plain iteration diverges there

    def start(self, r2: torch.Tensor) -> None:
        """A plain phase from the current iterate (``r2``: its ``||f(z) − z||²``) for every
        sample not given up."""
        if self.gaveup is None:
            self.gaveup = torch.zeros_like(r2, dtype=torch.bool)
        self.plain_len *= 2
        self.phase, self.left = "plain", self.plain_len
        self.plain, self.ref = ~self.gaveup, r2.clone()  # (kept: the caller's may change)

    def step(self, fz: torch.Tensor, r2: torch.Tensor, z_aa: torch.Tensor, rel: torch.Tensor,
             retired: torch.Tensor | None = None) -> torch.Tensor | None:
        """The next iterate after the recorded one (``fz`` its image, ``r2`` its
        ``||f(z) − z||²``, ``rel`` its relative residual ``(B, 1)``; ``z_aa`` the Anderson
        step), or None where the guard's phases end (Anderson goes on: take ``z_aa``)."""
        self.left -= 1
        active = rel > self.tol  # (a converged sample's residual may wander at round-off)
        if self.phase == "plain":
            grew = self.plain & active & ~(r2 <= ANDERSON_PLAIN_GROWTH ** 2 * self.ref)  # NaN too
            self.gaveup = self.gaveup | grew  # type: ignore[operator]
            self.plain = self.plain & ~grew
            if self.left > 0:
                return torch.where(self.plain, fz, z_aa)
            if not bool((active & ~self.gaveup).any()):  # type: ignore[operator]
                self.phase, self.dead = None, True
                return None
            # the trial: plain samples against what plain iteration would reach in ``span``
            # more at this phase's rate, Anderson samples against their residual now
            rate = (r2 / self.ref).clamp(max=1.0) ** (self.span / self.plain_len)
            self.thr = ANDERSON_TRIAL_GAIN ** 2 * r2 * torch.where(self.plain, rate, 1.0)
            self.zp_f, self.rp = fz, r2.clone()  # (kept as it is now)
            self.best, self.best_f = torch.full_like(r2, math.inf), fz
            self.phase, self.left = "trial", self.span
            return z_aa
        better = r2 < self.best
        self.best = torch.where(better, r2, self.best)
        self.best_f = torch.where(better, fz, self.best_f)
        if self.left > 0:
            return z_aa
        lost = active & ~self.gaveup & ~(self.best < self.thr)  # type: ignore[operator]
        if retired is not None:  # rows the tracker found non-finite stay where they are: a
            lost = lost & ~retired  # jump back to a finite point would contradict their flags
        if not bool(lost.any()):
            self.phase = None
            return None
        # a longer plain phase for the losers: from the phase's last iterate where they took
        # plain steps, from the trial's best one where they took Anderson steps
        was = self.plain
        self.plain_len *= 2
        self.phase, self.left = "plain", self.plain_len
        self.plain = lost
        self.ref = torch.where(was, self.rp, self.best)
        return torch.where(lost, torch.where(was, self.zp_f, self.best_f), z_aa)
