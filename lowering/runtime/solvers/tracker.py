"""The bookkeeping of a fixed-point solve: residual history, the returned iterate, non-finite
samples, the confirmed stop (:class:`Tracker`; docs/theory.md §8, solver bookkeeping).

Every solver records its iterates here; the tracker decides the stop and makes the
statistics, so that a ``converged`` flag never rests on an unchecked plain norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .residuals import (
    EXACT_PLAIN,
    FLUSH_SAFE,
    LOW_PRECISION,
    extreme_scale,
    norm,
    norms_in_range,
    plain_norms,
    scaled_rel_residual,
)
from .stats import SolverStats, meets

F = Callable[[torch.Tensor], torch.Tensor]
_INF = math.inf


def image_norms(fz: torch.Tensor) -> torch.Tensor:
    """``||f(z)||₂`` per sample ``(B,)``, accumulated in float64 (one reduction, no host
    synchronisation): what turns the relative residual into the absolute one."""
    return torch.linalg.vector_norm(fz.detach().reshape(fz.shape[0], -1), dim=1,
                                    dtype=torch.float64)


class Watch(Protocol):
    """Asked after ``k`` plain iterations once ``k ≥ next``: True stops the plain loop (e.g.
    ``auto``'s switch to Anderson)."""

    next: int

    def __call__(self, k: int) -> bool: ...


class Capture(Protocol):
    """A replay's collector (:class:`~lowering.runtime.solvers.replay.Replay`): keeps the rows
    of iteration ``k``; True once the last one wanted is in."""

    def capture(self, k: int, z: torch.Tensor, fz: torch.Tensor) -> bool: ...


class Tracker:
    """Solver state: residual history, the latest iterate, non-finite samples.

    ``record(z, fz)`` measures the residual at ``z`` and returns True once every sample has
    either met ``tol`` or become non-finite; ``record_residual(r)`` appends a residual measured
    elsewhere (a solver that tracks its own iterate, e.g. SAM); ``stats()`` summarises.

    Per iteration the residual is measured with plain norms in the state's dtype (a few tensor
    operations and one host synchronisation); those can lose accuracy only at extreme scales
    (entries beyond ~1e±17 in float32, where squares overflow or underflow).  So the stop is
    *confirmed*: when the plain residuals say every sample is done, either their own norms
    prove them exact enough (:meth:`plain_is_exact`: a safe scale, and a margin below ``tol``
    wider than their rounding) or the returned iterates' residuals are recomputed exactly
    (float64 norms, :func:`scaled_rel_residual`); if that disagrees, the solve goes on
    measuring exactly.  ``stats()`` reports residuals that meet ``tol`` exactly wherever they
    say so, so a ``converged`` flag never rests on an unchecked plain norm."""

    def __init__(self, name: str, z0: torch.Tensor, tol: float, *,
                 replay: Capture | None = None, compiled: Any = None):
        self.name, self.tol = name, tol
        self._best = z0  # read through `best` (a copy while it is still z0)
        self._z0 = z0
        #: a second run of an unconverged solve collecting each sample's best iterate
        #: (:func:`~lowering.runtime.solvers.replay.best_per_sample`), or None
        self.replay = replay
        #: compiled chunks of plain iterations (a ``compiled.CompiledSteps``, inside
        #: ``torch.compile``), or None: eager
        self.compiled = compiled
        self._done = False  # the last record was confirmed: every sample meets tol
        self.best_fz: torch.Tensor | None = None  # f(best); replaced, never written into
        self._best_d: torch.Tensor | None = None  # best_fz - best, when record() formed it
        #: residual dtype: the state's (float32 for float16/bfloat16)
        self._rdt = torch.float32 if z0.dtype in (torch.float16, torch.bfloat16) else z0.dtype
        self._best_res: torch.Tensor | None = None  # (B, 1), created when first needed
        self._nonfinite: torch.Tensor | None = None  # (B, 1) bool, created when first needed
        self.any_nonfinite = False
        self.exact = False  # measure every residual exactly (after a failed confirmation)
        #: the next record may take its lean path (a (B, N) state in the residual dtype, not a
        #: replay; then reset by each general record)
        self._lean = replay is None and z0.ndim == 2 and z0.dtype == self._rdt
        self.plain_failed = False  # the last record's plain residual came out non-finite
        self._confirmed: torch.Tensor | None = None  # exact residuals of the returned iterates
        #: the plain ``||fz||`` per sample ``(B, 1)`` of the last record, when it measured plain
        #: norms (None otherwise): what :meth:`plain_is_exact` checks
        self._den: torch.Tensor | None = None
        #: a lean step's bookkeeping, made the latest where it is read (:meth:`plain_loop`)
        self._deferred: tuple | None = None
        self.hist: list[torch.Tensor] = []  # (B, k) blocks of residual columns
        self._count = 0  # residual columns recorded (iterations)
        self.worst = float("inf")  # the returned iterate's worst-sample residual
        self.top = float("inf")  # the last recorded iterate's worst-sample residual

    @property
    def iterations(self) -> int:
        """Residuals recorded so far."""
        return self._count

    @property
    def best(self) -> torch.Tensor:
        """The returned iterate: the latest recorded one (never the caller's tensor: a warm
        start's ``z0`` is copied when it is what is returned)."""
        b, z0 = self._best, self._z0
        if b is z0 or (b.data_ptr() == z0.data_ptr() and b.numel() and b.shape == z0.shape):
            self._best = b.detach().clone()
        return self._best

    @best.setter
    def best(self, z: torch.Tensor) -> None:
        self._best = z

    @property
    def best_res(self) -> torch.Tensor:
        """``(B, 1)`` residual of the returned iterate per sample (inf before any record)."""
        if self._best_res is None:
            self._best_res = torch.full((self._best.shape[0], 1), float("inf"),
                                        dtype=self._rdt, device=self._best.device)
        return self._best_res

    @best_res.setter
    def best_res(self, r: torch.Tensor) -> None:
        self._best_res = r

    @property
    def nonfinite(self) -> torch.Tensor:
        """``(B, 1)`` bool: samples whose iterates became NaN/Inf."""
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(self._best.shape[0], 1, dtype=torch.bool,
                                          device=self._best.device)
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, m: torch.Tensor) -> None:
        self._nonfinite = m

    def record(self, z: torch.Tensor, fz: torch.Tensor, d: torch.Tensor | None = None,
               plain: torch.Tensor | None = None) -> bool:
        """Measure ``||fz - z|| / ||fz||`` (``d = fz - z`` when the caller has it; ``plain``:
        that residual ``(B, 1)`` already measured with plain norms, e.g. inside a compiled
        chunk); True once every sample has met ``tol`` (confirmed, :meth:`_confirm`) or become
        non-finite."""
        if self._lean and plain is None and not fz.requires_grad and (
                d is None or not d.requires_grad):
            # the common iteration, in as few steps as possible: plain norms of a (B, N) state
            # in its own dtype, finite; anything else takes the general path below
            if d is None:
                d = fz - z
            den, r = plain_norms(d, fz)
            top = float(r.max())
            if math.isfinite(top) and (self._count or self._first_lean(den, fz)):
                self.hist.append(r)
                self._count += 1
                self._latest(z, fz, r, d, den, top)
                return top <= self.tol and self.confirm()
        if fz.requires_grad:  # solvers run under no_grad: detach only when needed
            fz, z = fz.detach(), z.detach()
        if d is not None:
            d = d.detach()
        top = None
        den = None  # the plain ||fz|| per sample, when measured in the state's dtype
        if self.exact:
            d = fz - z if d is None else d
            r = self._scaled(d, fz)
        elif plain is not None:
            r = plain if plain.dtype == self._rdt else plain.to(self._rdt)
        else:
            d = fz - z if d is None else d
            norm = torch.linalg.vector_norm
            dd, ff = (d, fz) if fz.ndim == 2 else (d.flatten(1), fz.flatten(1))
            if dd.dtype == self._rdt:
                den = norm(ff, dim=1, keepdim=True)
                r = norm(dd, dim=1, keepdim=True) / den
            else:  # half precision: float32 norms (a float16 norm overflows past 65504)
                den = norm(ff, dim=1, keepdim=True, dtype=self._rdt)
                r = norm(dd, dim=1, keepdim=True, dtype=self._rdt) / den
            if self._count == 0:  # the scale check, in the same synchronisation as the stop
                top = self._first_scale(r, den, fz)
                if self.exact:
                    r, top, den = self._scaled(d, fz), None, None
        if top is None:
            if self.any_nonfinite:  # finished samples: out of the maximum
                r = r.masked_fill(self.nonfinite, float("inf"))
                top = float(r.masked_fill(self.nonfinite, 0.0).max())
            else:
                top = float(r.max())  # the one host synchronisation
        self.plain_failed = not math.isfinite(top)
        if self.plain_failed:
            # 0/0, an overflow or a non-finite iterate: the exact form; a non-finite z, f(z) or
            # difference makes it NaN (its scale is inf/NaN) and marks the sample non-finite
            r, den = self._scaled(fz - z if d is None else d, fz), None
            self.nonfinite |= ~torch.isfinite(r)
            self.any_nonfinite = bool(self.nonfinite.any())
            r = r.masked_fill(self.nonfinite, float("inf"))
            top = float(r.masked_fill(self.nonfinite, 0.0).max())
        self.hist.append(r)
        self._count += 1
        # the latest iterate, by reference (the solvers never write into an iterate); a solve
        # that ends unconverged gets each sample's best iterate by a replay (replay.best_per_sample)
        self._best, self.best_fz, self._best_res, self.top, self.worst = z, fz, r, top, top
        self._best_d = d  # fz - z when computed here (the exact residual reuses it)
        self._den = den
        self._confirmed = None
        self._done = False
        # later records may take the lean path: plain norms of a (B, N) state, no sample
        # finished as non-finite, not replaying
        self._lean = (not self.exact and not self.any_nonfinite and self.replay is None
                      and fz.ndim == 2 and fz.dtype == self._rdt)
        done = top <= self.tol and self.confirm()
        replay = self.replay
        if replay is not None:  # the same evolution as the first run; stop once all is kept
            return replay.capture(self._count - 1, z, fz) or done
        return done

    def _latest(self, z: torch.Tensor, fz: torch.Tensor, r: torch.Tensor, d: torch.Tensor,
                den: torch.Tensor, top: float) -> None:
        """Make the iterate ``z`` (``fz = f(z)``, ``d = fz − z``, plain norms ``den`` and
        residuals ``r``, worst ``top``) the latest recorded one (a lean record's bookkeeping)."""
        self._best, self.best_fz, self._best_res, self._best_d, self._den = z, fz, r, d, den
        self.top = self.worst = top
        self._confirmed = None
        self._done = self.plain_failed = False

    def plain_loop(self, f: F, z: torch.Tensor, max_iter: int, watch: Watch | None = None
                   ) -> tuple[torch.Tensor | None, int]:
        """``z ← f(z)`` recorded into this tracker until every sample is done, ``max_iter``
        evaluations or ``watch(k)`` says stop; then ``(f(z) if watch stopped it else None, k)``.

        Iterations after a lean record, up to the watch's next test (``watch.next``) and short of
        the cap, run as a *run* (:meth:`_lean_run`: the lean record inlined, its bookkeeping
        done where it is read); every other iteration is one *step* (:meth:`_step`) that
        handles all cases (docs/theory.md §8, solver bookkeeping)."""
        ask = watch.next if watch is not None else max_iter + 1  # the watch is asked at k ≥ ask
        k = 0
        while k < max_iter:
            # a run may go up to the watch's next test, never to the cap (a step)
            end = ask if ask < max_iter else max_iter - 1
            if k < end and self._lean and self._count:
                complete, k, z, fz, latest = self._lean_run(f, z, k, end)
                if complete:
                    if end == ask:  # the watch's turn, on the run's last iterate
                        if watch(end):  # type: ignore[misc]
                            self._latest(*latest)
                            return z, end
                        ask = watch.next  # type: ignore[union-attr]
                    continue
                if self._stop(z, fz, latest):
                    return None, k
                latest = None
            else:
                k += 1
                fz = f(z)
                if self._step(z, fz, k == max_iter):
                    return None, k
                latest = self._deferred
            if k >= ask:
                if watch(k):  # type: ignore[misc]
                    if latest is not None:
                        self._latest(*latest)
                    return fz, k
                ask = watch.next  # type: ignore[union-attr]
            z = fz
        return None, max_iter

    def _lean_run(self, f: F, z: torch.Tensor, k0: int, end: int
                  ) -> tuple[bool, int, torch.Tensor, torch.Tensor, tuple]:
        """Iterations ``k0 + 1 … end`` with nothing but plain norms and the history per
        iteration, until a residual is not above ``tol`` (a stop to confirm, or a non-finite
        one).  Returns ``(complete, k, z, f(z), latest)``: ``complete`` when every iteration was
        recorded (then ``z`` is the last image, the next iterate), else ``z`` is the iterate
        whose residual broke the run; ``latest``: the arguments of :meth:`_latest`."""
        tol, append = self.tol, self.hist.append
        zp = fz = r = den = None
        top = _INF
        for k in range(k0 + 1, end + 1):
            fz = f(z)
            den = norm(fz, 2, 1, True)
            # (the difference is not kept: one (B, N) buffer less alive per iteration)
            r = norm(fz - z, 2, 1, True).div_(den)
            top = float(r.max())
            if not tol < top < _INF:  # done by plain norms, or not finite (record())
                self._count += k - 1 - k0
                self.top = top
                return False, k, z, fz, (z, fz, r, None, den, top)
            append(r)
            zp, z = z, fz
        self._count += end - k0
        self.top = top  # (the watch reads top)
        return True, end, z, z, (zp, z, r, None, den, top)

    def _stop(self, z: torch.Tensor, fz: torch.Tensor, latest: tuple) -> bool:
        """The iterate that broke a run: a stop to confirm (True when confirmed), or a
        non-finite residual for :meth:`record`."""
        r, top = latest[2], latest[5]
        if top <= self.tol:
            self.hist.append(r)
            self._count += 1
            self._latest(*latest)
            return self.confirm()  # refused: measured exactly from now on
        return self.record(z, fz)

    def _step(self, z: torch.Tensor, fz: torch.Tensor, at_cap: bool) -> bool:
        """One recorded iteration, whatever it needs; True when the solve is done.  A lean
        record leaves its bookkeeping in ``_deferred`` (made the latest where it is read)."""
        self._deferred = None
        if self._lean and not fz.requires_grad:
            den = norm(fz, 2, 1, True)  # plain_norms, inline (the difference not kept)
            r = norm(fz - z, 2, 1, True).div_(den)
            top = float(r.max())
            if math.isfinite(top) and (self._count or self._first_lean(den, fz)):
                self.hist.append(r)
                self._count += 1
                if top <= self.tol or at_cap:
                    self._latest(z, fz, r, None, den, top)
                    if top <= self.tol and self.confirm():
                        return True
                    top = self.top  # (a refused stop: its exact worst)
                self.top = top  # (the watch reads top)
                self._deferred = (z, fz, r, None, den, top)
                return False
        return self.record(z, fz)

    def _first_lean(self, den: torch.Tensor, fz: torch.Tensor) -> bool:
        """Whether the first record may stay on the lean path: an image of the state's shape
        and dtype at a scale where plain norms are safe (:meth:`_first_scale`'s test).  At an
        extreme scale it switches the solve to exact residuals and returns False (the general
        path then measures this record exactly)."""
        if fz.ndim != 2 or fz.dtype != self._rdt:
            self._lean = False
            return False
        if not norms_in_range(den, fz.shape[1], fz.dtype, self.tol):
            self.exact = extreme_scale(fz, self.tol)
            if self.exact:
                self._lean = False
                return False
        return True

    def _first_scale(self, r: torch.Tensor, den: torch.Tensor, fz: torch.Tensor) -> float:
        """The first record's worst residual, and whether plain norms are safe at this scale
        (else ``_exact``): the plain norms ``den = ||fz||`` bound
        each sample's largest entry, ``den/√N ≤ max|fz_i| ≤ den`` (``den`` can only fall short
        of the true norm, by underflow), so ``[min den / (2√N), max den]`` inside the safe
        range (:func:`_scale_ok`; 2: round-off margin) proves :func:`_extreme_scale` False.
        Anything else — a zero or non-finite ``den``, a scale near the edges — takes the
        exact check (:func:`_norms_in_range`)."""
        top = float(r.max())
        if not norms_in_range(den, fz[0].numel(), fz.dtype, self.tol):
            self.exact = extreme_scale(fz, self.tol)
        return top

    def _scaled(self, d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
        return scaled_rel_residual(d, fz)[:, None].to(self._rdt)

    def _returned_residual(self) -> torch.Tensor:
        """Exact residual of each returned iterate ``(B, 1)`` (inf for non-finite samples):
        float64 norms of a float32/16 state (exact: its squares cannot overflow or underflow
        there; finite, as the returned iterate's plain residual was), the scaled form
        otherwise."""
        if self._confirmed is None:
            if self.best_fz is None:  # nothing recorded by record(): the plain residuals
                return self.best_res
            fz, d = self.best_fz, self._best_d
            if d is None:
                d = fz - self._best
            if fz.dtype in LOW_PRECISION and not self.any_nonfinite:
                dd, ff = (d, fz) if fz.ndim == 2 else (d.flatten(1), fz.flatten(1))
                # exact: float32/16 squares fit in float64 (norms accumulated there)
                norm, f64 = torch.linalg.vector_norm, torch.float64
                den = norm(ff, dim=1, keepdim=True, dtype=f64).clamp_min(1e-30)
                r = (norm(dd, dim=1, keepdim=True, dtype=f64) / den).to(self._rdt)
            else:
                r = self._scaled(d, fz)
                if self.any_nonfinite:
                    r = r.masked_fill(self.nonfinite, float("inf"))
            self._confirmed = r
        return self._confirmed

    def plain_is_exact(self) -> bool:
        """Whether the last record's plain residuals already decide the stop exactly, so the
        float64 recomputation can be skipped (docs/theory.md §8, solver bookkeeping): plain
        norms in the state's dtype (float32/64) are exact up to rounding unless squares over- or
        underflow.  Both are ruled out by the norms ``den = ||fz||`` themselves (the bound of
        :meth:`_first_scale`), and the rounding, at most ``(N + 3)·u`` relative for the ratio
        of two norms summed in any order (``u`` the unit round-off), by a worst residual below
        ``tol·(1 − 4(N + 3)u)``.  Then every sample's residual is within ``tol`` exactly too."""
        den = self._den
        if den is None or self.exact or self.any_nonfinite or self.best_fz is None:
            return False
        fz = self.best_fz
        if fz.dtype != self._rdt or fz.dtype not in EXACT_PLAIN:
            return False
        n = fz.shape[1] if fz.ndim == 2 else math.prod(fz.shape[1:])  # (no indexing op)
        margin = 4.0 * (n + 3) * EXACT_PLAIN[fz.dtype]
        if margin >= 1e-2 or not self.top <= self.tol * (1.0 - margin):
            return False
        # every ||fz|| ≥ 1e-30: the residual's floor does not apply (the plain ratio is the
        # residual); tol·||fz|| ≥ √(tiny/u): the ≤ n·tiny a flush-denormal mode drops from ||d||²
        # (squares below tiny read 0) stays below the margin's spare u·tol²·||fz||² ≥ tiny
        least = max(1e-30, FLUSH_SAFE[fz.dtype] / self.tol)
        return norms_in_range(den, n, fz.dtype, self.tol, least)

    def confirm(self) -> bool:
        if self._confirmed is None and self.plain_is_exact():
            # the plain residuals: exact enough (above); (_best_res is the record's r here)
            self._confirmed = self._best_res if self._best_res is not None else self.best_res
            self.worst = self.top
            self._done = True
            return True
        r = self._returned_residual()
        worst = float(r.masked_fill(self.nonfinite, 0.0).max() if self.any_nonfinite
                      else r.max())
        self.best_res = r
        self.worst = worst
        if worst <= self.tol:
            self._done = True
            return True
        self.exact = True  # the plain norms were wrong here (extreme scales): go on exactly
        self._lean = False
        self.hist[-1], self.top = r, worst  # and the history keeps no false pass
        return False

    def record_residual(self, r: torch.Tensor) -> None:
        """Append a residual measured by the caller (no best-iterate bookkeeping)."""
        self.hist.append(r.detach().reshape(-1, 1).to(self.best_res.dtype))
        self._count += 1

    def unknown_steps(self, k: int, rows: torch.Tensor) -> None:
        """Mark the ``k`` residuals of samples ``rows`` recorded by the last
        :meth:`record_steps` as not known (NaN: never read as a pass)."""
        if k:
            i = len(self.hist) - 2  # the block before the column record() appended
            self.hist[i] = self.hist[i].masked_fill(rows[:, None], math.nan)

    def record_steps(self, r: torch.Tensor) -> None:
        """Append the ``(B, k)`` residuals of ``k`` iterations run inside one compiled call
        (:func:`compiled_steps`); the iterate after them is recorded by :meth:`record`."""
        if r.shape[1]:
            self.hist.append(r if r.dtype == self._rdt else r.to(self._rdt))
            self._count += r.shape[1]

    def stats(self) -> SolverStats:
        """Per-sample :class:`SolverStats` of the iterates recorded so far (the returned
        iterates' residuals measured exactly; iteration counts computed on access)."""
        b = self._best.shape[0]
        best_res = self._returned_residual()[:, 0]
        # the history's columns, joined when first read (most solves' histories are never read)
        res = (tuple(self.hist) if self.hist
               else torch.zeros(b, 0, dtype=self._rdt, device=self._best.device))
        if not self.any_nonfinite:  # the flags made when read: best_res <= tol, none non-finite
            st = SolverStats(self.name, res, None, None, self.tol, None, best_res,
                             True if self._done else None)
            st.image = self.best_fz  # f(best), or None when nothing was recorded
        else:
            nonfinite = self.nonfinite[:, 0]
            st = SolverStats(self.name, res, None, meets(best_res, self.tol) & ~nonfinite,
                             self.tol, nonfinite, best_res)
        if self.best_fz is not None:
            st.image_norm = image_norms(self.best_fz)
        return st
