"""Fixed-point solvers (batched, per-sample statistics) with a registry, torchdeq-style.

Every solver finds ``z = f(z)`` for ``f: (B, N) → (B, N)`` and stops when every sample's relative
residual ``||f(z) - z|| / max(||f(z)||, 1e-30)`` is ≤ ``tol`` (or has become non-finite); it
returns, per sample, the iterate with the smallest residual measured (or the latest within
``tol``) and the exact residual of that returned iterate, so a ``converged`` flag always
describes the returned point.  See ``docs/theory.md`` §8
(training-time equilibrium modes).

Per iteration the residual uses plain norms (cheap); the returned iterate's residual, and any
measurement that came out non-finite, use exact forms (float64 norms of float32/16 states, or
*scaled* norms: both vectors divided by their largest magnitude before squaring), so no finite
iterate can overflow into a residual of 0 ("converged") in any dtype; a NaN/Inf iterate gives a
NaN residual and marks that sample non-finite.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from convex_eq.errors import OptionError

F = Callable[[torch.Tensor], torch.Tensor]

#: dtypes whose reductions (Gram matrices, small linear solves) run in float64
_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
_norm = torch.linalg.vector_norm
#: unit round-off of the dtypes whose plain residuals can stand for the exact ones
#: (:meth:`Tracker._plain_is_exact`)
_EXACT_PLAIN = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
#: per such dtype ``√(tiny/u)``: the smallest ``tol·||fz||`` at which the squares a
#: flush-denormal mode reads as 0 (those below ``tiny``) stay inside the rounding margin
_FLUSH_SAFE = {dt: math.sqrt(torch.finfo(dt).tiny / u) for dt, u in _EXACT_PLAIN.items()}


def _meets(r: torch.Tensor, tol: float) -> torch.Tensor:
    """``r <= tol`` elementwise, exactly: a float32/16 residual is compared in float64, where
    ``tol`` is not rounded (torch rounds a Python scalar to the tensor's dtype, and a ``tol`` that
    float32 rounds up would pass residuals up to one float32 step above it).  The same decision
    as the solvers' stop test, which compares Python floats."""
    return (r if r.dtype == torch.float64 else r.double()) <= tol


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype solver bookkeeping (Gram matrices, small solves) runs in: float64 for
    float32/16 states (their round-off, squared in a Gram matrix, stalls Anderson near 1e-4),
    the state's own dtype otherwise."""
    return torch.float64 if dtype in _LOW_PRECISION else dtype


@dataclass
class SolverStats:
    """Per-sample solver statistics.

    ``residuals[b, k]`` is the relative residual measured at iteration ``k`` (NaN where the
    iterate was not finite, or, inside a compiled chunk whose plain norms over- or
    underflowed, where it is not known); ``converged[b]`` says the returned iterate of
    sample ``b`` meets ``tol``; ``nonfinite[b]`` says sample ``b`` produced NaN/Inf (it is
    then not converged).  ``converged`` given as None is ``returned_residual <= tol`` and
    ``nonfinite`` given as None is all False, each made on first read (a solve whose flags
    nobody reads runs no tensor operation for them)."""

    solver: str
    #: ``(B, K)`` residual history, or the column blocks it is concatenated from on first read
    #: (:attr:`residuals`; a converged solve whose history nobody reads never concatenates)
    residuals_: torch.Tensor | tuple[torch.Tensor, ...]
    #: (B,) iterations until the sample first met tol (or K); None: computed on first access
    iterations_: torch.Tensor | None
    converged: torch.Tensor | None  # (B,) bool (None: from returned_residual, on first read)
    tol: float
    nonfinite: torch.Tensor | None = field(default=None)  # (B,) bool
    #: residual of the returned iterate per sample (None: the minimum of ``residuals``)
    returned_residual: torch.Tensor | None = field(default=None)
    #: True when the solver knows every sample converged (saves a device synchronisation)
    all_converged: bool | None = field(default=None)
    #: (not a field) ``f`` at the returned iterate, as the solver computed it, when it did
    #: (:meth:`Tracker.stats`; None otherwise): the emitted module linearises ``T`` there
    #: without evaluating it again, and drops it (it is never pickled)
    image = None

    def __post_init__(self) -> None:
        if self.converged is None:
            if self.returned_residual is None:
                raise ValueError("SolverStats: converged=None needs returned_residual")
            del self.converged  # made by __getattr__ on first read
        if self.nonfinite is None:
            del self.nonfinite

    def __getattr__(self, name: str) -> Any:
        """The flags given as None, made on first read (only called for missing attributes)."""
        d = self.__dict__
        if name == "nonfinite" and "returned_residual" in d:
            ref = d["returned_residual"]
            if ref is None:
                ref = d["converged"] if "converged" in d else self.residuals[:, 0]
            value = torch.zeros(ref.shape[0], dtype=torch.bool, device=ref.device)
        elif name == "converged" and "returned_residual" in d:
            value = _meets(d["returned_residual"], d["tol"])
            if "nonfinite" in d:
                value = value & ~d["nonfinite"]
        else:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        d[name] = value
        return value

    def __getstate__(self) -> dict[str, Any]:
        """The state with both flags made: a reader of the pickle without :meth:`__getattr__`
        (an earlier release) finds them as attributes."""
        state = self.__dict__.copy()
        state["converged"], state["nonfinite"] = self.converged, self.nonfinite
        state.pop("image", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "residuals" in state:  # pickled before the history became lazy (``residuals_``)
            state["residuals_"] = state.pop("residuals")
        self.__dict__.update(state)

    @property
    def residuals(self) -> torch.Tensor:
        """``(B, K)``: the relative residual of each sample at each iteration."""
        r = self.residuals_
        if not isinstance(r, torch.Tensor):
            r = self.residuals_ = r[0] if len(r) == 1 else torch.cat(r, dim=1)
        return r

    @property
    def iterations(self) -> torch.Tensor:
        """``(B,)`` iterations until each sample first met ``tol`` (``K`` for a sample that did
        not converge)."""
        if self.iterations_ is None:
            res = self.residuals
            b, k = res.shape
            iters = torch.full((b,), k, dtype=torch.long, device=res.device)
            if k:
                met = _meets(res, self.tol)
                first = met.to(torch.int8).argmax(dim=1) + 1
                iters = torch.where(self.converged & met.any(dim=1), first, iters)
            self.iterations_ = iters
        return self.iterations_

    @property
    def final_residual(self) -> torch.Tensor:
        """Residual of the returned iterate of each sample (the best measured; NaN for a sample
        that never produced a finite iterate)."""
        if self.returned_residual is not None:
            r = self.returned_residual
            return torch.where(self.nonfinite, torch.full_like(r, float("nan")), r)
        if self.residuals.shape[1] == 0:
            return torch.zeros(self.residuals.shape[0], dtype=self.residuals.dtype)
        clean = torch.where(torch.isnan(self.residuals),
                            torch.full_like(self.residuals, float("inf")), self.residuals)
        best = clean.min(dim=1).values
        return torch.where(torch.isinf(best) & self.nonfinite, torch.full_like(best, float("nan")),
                           best)

    @property
    def max_residual(self) -> float:
        """Largest final residual over the batch (NaN-aware: NaN if any sample is non-finite)."""
        r = self.final_residual
        if not r.numel():
            return 0.0
        if bool(torch.isnan(r).any()):
            return float("nan")
        return float(r.max())

    @property
    def mean_iterations(self) -> float:
        """Mean over the batch of the iterations until each sample met ``tol``."""
        return float(self.iterations.float().mean())

    @property
    def failed(self) -> torch.Tensor:
        """``(B,)`` bool: samples that did not converge (non-finite ones included)."""
        return ~self.converged

    @property
    def failed_indices(self) -> list[int]:
        """Batch indices of the samples that did not converge."""
        return [int(i) for i in torch.nonzero(self.failed).flatten()]

    @property
    def nonfinite_indices(self) -> list[int]:
        """Batch indices of the samples whose iterates became NaN/Inf."""
        assert self.nonfinite is not None
        return [int(i) for i in torch.nonzero(self.nonfinite).flatten()]

    def __str__(self) -> str:
        extra = (f", {len(self.nonfinite_indices)} non-finite" if self.nonfinite is not None
                 and bool(self.nonfinite.any()) else "")
        return (f"{self.solver}: {int(self.converged.sum())}/{self.converged.numel()} converged"
                f"{extra}, mean iterations {self.mean_iterations:.1f}, max relative residual "
                f"{self.max_residual:.3e} (tol {self.tol:g})")


# the dataclass keeps ``nonfinite``'s default (None) as a class attribute, which would shadow
# ``__getattr__`` once the instance attribute is deleted; the generated ``__init__`` holds its
# own copy of the default
del SolverStats.nonfinite


def scaled_rel_residual(d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
    """``||d|| / max(||fz||, 1e-30)`` per sample, overflow-safe: both are divided by
    ``s = max(max|d|, max|fz|)`` before the norms (``||d/s||, ||fz/s|| ≤ √N``), so the ratio
    is exact up to rounding for every finite input and NaN for a non-finite one.  Half
    precision is computed in float32."""
    if fz.ndim != 2:
        d, fz = d.flatten(1), fz.flatten(1)
    if fz.dtype in (torch.float16, torch.bfloat16):
        d, fz = d.float(), fz.float()
    s = torch.maximum(d.abs().amax(dim=1), fz.abs().amax(dim=1))
    s = torch.where(s > 0, s, torch.ones_like(s))[:, None]
    norm = torch.linalg.vector_norm
    num = norm(d / s, dim=1)
    den = norm(fz / s, dim=1)
    return num / torch.maximum(den, 1e-30 / s[:, 0])


def _extreme_scale(fz: torch.Tensor, tol: float) -> bool:
    """True when plain norms of this state could overflow or underflow: a sample with an entry
    beyond ``sqrt(max)/1e3`` of its dtype (its squared norm can overflow, reading a false 0
    residual), or a nonzero sample whose largest entry is below ``10·sqrt(tiny)/tol`` (the
    squares of a difference at relative size ``tol`` can underflow).  Checked on the first
    iterate's image (one reduction per solve); a solve whose iterates only later reach such
    scales still has every stop confirmed (:meth:`Tracker._confirm`)."""
    a = fz.detach().abs().flatten(1).amax(dim=1)
    mm = torch.aminmax(a)
    lo, hi = float(mm.min), float(mm.max)
    if lo == 0.0:  # samples at exactly 0 have no scale (their 0/0 takes the exact form)
        nonzero = a[a > 0]
        lo = float(nonzero.min()) if nonzero.numel() else 1.0
    return not _scale_ok(lo, hi, fz.dtype, tol)


def _scale_ok(lo: float, hi: float, dtype: torch.dtype, tol: float) -> bool:
    """Plain norms of states whose per-sample largest entries lie in ``[lo, hi]`` can neither
    overflow nor underflow into a false 0 (float16 norms run in float32: judged by its
    range)."""
    low, eps, high = _scale_range(dtype)
    return lo >= low / max(tol, eps) and hi <= high


def _scale_range(dtype: torch.dtype) -> tuple[float, float, float]:
    """:data:`_SCALE_RANGE`'s entry for ``dtype``, made on first use."""
    rng = _SCALE_RANGE.get(dtype)
    if rng is None:
        fi = torch.finfo(torch.float32 if dtype == torch.float16 else dtype)
        rng = _SCALE_RANGE[dtype] = (10 * fi.tiny ** 0.5, fi.eps, fi.max ** 0.5 / 1e3)
    return rng


#: per dtype ``(10·√tiny, eps, √max / 10³)``: the constants of :func:`_scale_ok`
_SCALE_RANGE: dict[torch.dtype, tuple[float, float, float]] = {}


def _norms_in_range(den: torch.Tensor, n: int, dtype: torch.dtype, tol: float,
                    least: float = 0.0) -> bool:
    """:func:`_scale_ok` decided from plain per-sample norms ``den = ||x_b||`` of states with
    ``n`` entries, which bound each sample's largest entry, ``den/√n ≤ max|x_b| ≤ den``
    (``den`` can only fall short of the true norm, by underflow; 2: round-off margin), and
    every norm at least ``least``.  False for a zero or non-finite norm.  One reduction, two
    reads."""
    lo, hi = torch.aminmax(den)
    lo_ = float(lo)
    if not lo_ >= least:
        return False
    # _scale_ok(lo_ / (2√n), hi), inline (asked at the first record and at the stop of a solve)
    low, eps, high = _SCALE_RANGE.get(dtype) or _scale_range(dtype)
    return lo_ / (2.0 * math.sqrt(max(n, 1))) >= low / max(tol, eps) and float(hi) <= high


def _plain_norms(d: torch.Tensor, fz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||fz||, ||d|| / ||fz||)`` per sample ``(B, 1)``, plain norms in the state's dtype
    (what a lean record measures; no floor: 0/0 reads NaN and goes the general way)."""
    den = _norm(fz, dim=1, keepdim=True)
    return den, _norm(d, dim=1, keepdim=True).div_(den)  # in place on the fresh norm


def fast_rel_residual(d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
    """``||d|| / max(||fz||, 1e-30)`` with plain norms accumulated in float64 for float32/16
    states (exact there: ``(3.4e38)² ≪ 1.8e308``); a float64 state whose norm overflows gives a
    non-finite value, which :meth:`Tracker.record` recomputes with
    :func:`scaled_rel_residual`."""
    if fz.ndim != 2:
        d, fz = d.flatten(1), fz.flatten(1)
    acc = torch.float64 if fz.dtype in _LOW_PRECISION else None
    norm = torch.linalg.vector_norm
    den = norm(fz, dim=1, dtype=acc)
    r = norm(d, dim=1, dtype=acc) / den.clamp_min(1e-30)
    # float64: ||fz|| = inf with a finite ||d|| would read 0 ("converged"); inf·0 = NaN sends
    # such a sample to the scaled form instead
    return r if acc is not None else r + den * 0.0


def rel_residual(fz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``||f(z) - z|| / max(||f(z)||, 1e-30)`` per sample (scaled: cannot overflow into 0)."""
    return scaled_rel_residual(fz - z, fz)


class _Replay:
    """What a replayed solve collects: per sample, the iterate (and its image) at the iteration
    where the first run measured that sample's smallest residual."""

    def __init__(self, at: torch.Tensor):
        self.at = at  # (B,) iteration index per sample (-1: keep the first run's last iterate)
        self.last = int(at.max())
        #: taken by the first Tracker of the replayed solve; solves nested in its ``f`` run as
        #: they did the first time (isolated from this replay)
        self.claimed = False
        self.z: torch.Tensor | None = None
        self.fz: torch.Tensor | None = None

    def capture(self, k: int, z: torch.Tensor, fz: torch.Tensor) -> bool:
        """Keep the rows of iteration ``k``; True (stop) once the last one wanted is in."""
        rows = (self.at == k).reshape((-1,) + (1,) * (z.ndim - 1))
        self.z = torch.where(rows, z, z if self.z is None else self.z)
        self.fz = torch.where(rows, fz, fz if self.fz is None else self.fz)
        return k >= self.last


_REPLAY: ContextVar[_Replay | None] = ContextVar("convex_eq_solver_replay", default=None)


class Tracker:
    """Solver state: residual history, the latest iterate, non-finite samples.

    ``record(z, fz)`` measures the residual at ``z`` and returns True once every sample has
    either met ``tol`` or become non-finite; ``record_residual(r)`` appends a residual measured
    elsewhere (a solver that tracks its own iterate, e.g. SAM); ``stats()`` summarises.

    Per iteration the residual is measured with plain norms in the state's dtype (a few tensor
    operations and one host synchronisation); those can lose accuracy only at extreme scales
    (entries beyond ~1e±17 in float32, where squares overflow or underflow).  So the stop is
    *confirmed*: when the plain residuals say every sample is done, either their own norms
    prove them exact enough (:meth:`_plain_is_exact`: a safe scale, and a margin below ``tol``
    wider than their rounding) or the returned iterates' residuals are recomputed exactly
    (float64 norms, :func:`scaled_rel_residual`); if that disagrees, the solve goes on
    measuring exactly.  ``stats()`` reports residuals that meet ``tol`` exactly wherever they
    say so, so a ``converged`` flag never rests on an unchecked plain norm."""

    def __init__(self, name: str, z0: torch.Tensor, tol: float):
        self.name, self.tol = name, tol
        self._best = z0  # read through `best` (a copy while it is still z0)
        self._z0 = z0
        #: set while _per_sample_best replays an unconverged solve to collect per-sample bests
        rep = _REPLAY.get()
        if rep is not None and not rep.claimed:
            rep.claimed = True
        else:
            rep = None
        self._replay = rep
        self._done = False  # the last record was confirmed: every sample meets tol
        self.best_fz: torch.Tensor | None = None  # f(best); replaced, never written into
        self._best_d: torch.Tensor | None = None  # best_fz - best, when record() formed it
        #: residual dtype: the state's (float32 for float16/bfloat16)
        self._rdt = torch.float32 if z0.dtype in (torch.float16, torch.bfloat16) else z0.dtype
        self._best_res: torch.Tensor | None = None  # (B, 1), created when first needed
        self._nonfinite: torch.Tensor | None = None  # (B, 1) bool, created when first needed
        self._any_nonfinite = False
        self._exact = False  # measure every residual exactly (after a failed confirmation)
        #: the next record may take its lean path (a (B, N) state in the residual dtype, not a
        #: replay; then reset by each general record)
        self._lean = rep is None and z0.ndim == 2 and z0.dtype == self._rdt
        self._plain_failed = False  # the last record's plain residual came out non-finite
        self._confirmed: torch.Tensor | None = None  # exact residuals of the returned iterates
        #: the plain ``||fz||`` per sample ``(B, 1)`` of the last record, when it measured plain
        #: norms (None otherwise): what :meth:`_plain_is_exact` checks
        self._den: torch.Tensor | None = None
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
            den, r = _plain_norms(d, fz)
            top = float(r.max())
            if math.isfinite(top) and (self._count or self._first_lean(den, fz)):
                self.hist.append(r)
                self._count += 1
                self._latest(z, fz, r, d, den, top)
                return top <= self.tol and self._confirm()
        if fz.requires_grad:  # solvers run under no_grad: detach only when needed
            fz, z = fz.detach(), z.detach()
        if d is not None:
            d = d.detach()
        top = None
        den = None  # the plain ||fz|| per sample, when measured in the state's dtype
        if self._exact:
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
                if self._exact:
                    r, top, den = self._scaled(d, fz), None, None
        if top is None:
            if self._any_nonfinite:  # finished samples: out of the maximum
                r = r.masked_fill(self.nonfinite, float("inf"))
                top = float(r.masked_fill(self.nonfinite, 0.0).max())
            else:
                top = float(r.max())  # the one host synchronisation
        self._plain_failed = not math.isfinite(top)
        if self._plain_failed:
            # 0/0, an overflow or a non-finite iterate: the exact form; a non-finite z, f(z) or
            # difference makes it NaN (its scale is inf/NaN) and marks the sample non-finite
            r, den = self._scaled(fz - z if d is None else d, fz), None
            self.nonfinite |= ~torch.isfinite(r)
            self._any_nonfinite = bool(self.nonfinite.any())
            r = r.masked_fill(self.nonfinite, float("inf"))
            top = float(r.masked_fill(self.nonfinite, 0.0).max())
        self.hist.append(r)
        self._count += 1
        # the latest iterate, by reference (the solvers never write into an iterate); a solve
        # that ends unconverged gets each sample's best iterate by a replay (_per_sample_best)
        self._best, self.best_fz, self._best_res, self.top, self.worst = z, fz, r, top, top
        self._best_d = d  # fz - z when computed here (the exact residual reuses it)
        self._den = den
        self._confirmed = None
        self._done = False
        # later records may take the lean path: plain norms of a (B, N) state, no sample
        # finished as non-finite, not replaying
        self._lean = (not self._exact and not self._any_nonfinite and self._replay is None
                      and fz.ndim == 2 and fz.dtype == self._rdt)
        done = top <= self.tol and self._confirm()
        replay = self._replay
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
        self._done = self._plain_failed = False

    def plain_loop(self, f: F, z: torch.Tensor, max_iter: int, watch: _AutoWatch | None = None
                   ) -> tuple[torch.Tensor | None, int]:
        """The eager loop of :func:`_plain_phase`: ``z ← f(z)`` recorded into this tracker
        until every sample is done, ``max_iter`` evaluations or ``watch(k)`` says stop; then
        ``(f(z) if watch stopped it else None, k)``.

        Iterations after a lean record, up to the watch's next one (``watch.next``, asked on
        the run's last iterate) and short of the cap (``max_iter``), run as a *run*:
        :meth:`record`'s lean path inlined with nothing else per iteration (the same
        arithmetic, the same history; the latest-iterate bookkeeping is done where it is read:
        at a stop, at the watch, at the cap; the difference ``f(z) − z`` is not kept), ending at
        the first residual that is not above ``tol`` (a stop to confirm, or a non-finite one
        for :meth:`record`).  Every other iteration is one *step* that handles all cases
        (docs/theory.md §8, solver bookkeeping)."""
        tol, norm = self.tol, _norm
        append = self.hist.append
        ask = watch.next if watch is not None else max_iter + 1  # the watch is asked at k ≥ ask
        k = 0
        while k < max_iter:
            # the last iteration a run may take: the watch's next one (asked on the run's last
            # iterate), never the cap's (a step)
            end = ask if ask < max_iter else max_iter - 1
            if k < end and self._lean and self._count:
                k0 = k
                for k in range(k0 + 1, end + 1):  # noqa: B007 (k is read after the loop)
                    fz = f(z)
                    den = norm(fz, 2, 1, True)
                    # (the difference is not kept: one (B, N) buffer less alive per iteration;
                    # the exact residual of a stop forms it again only when it is needed)
                    r = norm(fz - z, 2, 1, True).div_(den)
                    top = float(r.max())
                    if not tol < top < _INF:  # done by plain norms, or not finite (record())
                        break
                    append(r)
                    zp, z = z, fz
                else:  # the whole run recorded, none done
                    self._count += end - k0
                    if end == ask:  # the watch's turn, on the run's last iterate zp, f(zp) = z
                        self.top = top  # (the watch reads top)
                        if watch(end):  # type: ignore[misc]
                            self._latest(zp, z, r, None, den, top)
                            return z, end
                        ask = watch.next  # type: ignore[union-attr]
                    continue
                self._count += k - 1 - k0
                if top <= tol:
                    append(r)
                    self._count += 1
                    self._latest(z, fz, r, None, den, top)
                    if self._confirm():
                        return None, k
                    # a refused stop: measured exactly from now on (a step per iteration)
                elif self.record(z, fz):  # not finite: the general record
                    return None, k
                if k >= ask:  # the run broke on the watch's iterate: its turn, as in a step
                    if watch(k):  # type: ignore[misc]
                        return fz, k
                    ask = watch.next  # type: ignore[union-attr]
                z = fz
                continue
            # one step: iteration k + 1, whatever it needs
            k += 1
            fz = f(z)
            if self._lean and not fz.requires_grad:
                den = norm(fz, 2, 1, True)  # _plain_norms, inline (the difference not kept)
                r = norm(fz - z, 2, 1, True).div_(den)
                top = float(r.max())
                if math.isfinite(top) and (self._count or self._first_lean(den, fz)):
                    append(r)
                    self._count += 1
                    if top <= tol or k == max_iter:
                        self._latest(z, fz, r, None, den, top)
                        if top <= tol and self._confirm():
                            return None, k
                        top = self.top  # (a refused stop: its exact worst)
                    if k >= ask:
                        self.top = top  # (the watch reads top)
                        if watch(k):  # type: ignore[misc]
                            self._latest(z, fz, r, None, den, top)
                            return fz, k
                        ask = watch.next  # type: ignore[union-attr]
                    z = fz
                    continue
            if self.record(z, fz):
                return None, k
            if k >= ask:
                if watch(k):  # type: ignore[misc]
                    return fz, k
                ask = watch.next  # type: ignore[union-attr]
            z = fz
        return None, max_iter

    def _first_lean(self, den: torch.Tensor, fz: torch.Tensor) -> bool:
        """Whether the first record may stay on the lean path: an image of the state's shape
        and dtype at a scale where plain norms are safe (:meth:`_first_scale`'s test).  At an
        extreme scale it switches the solve to exact residuals and returns False (the general
        path then measures this record exactly)."""
        if fz.ndim != 2 or fz.dtype != self._rdt:
            self._lean = False
            return False
        if not _norms_in_range(den, fz.shape[1], fz.dtype, self.tol):
            self._exact = _extreme_scale(fz, self.tol)
            if self._exact:
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
        if not _norms_in_range(den, fz[0].numel(), fz.dtype, self.tol):
            self._exact = _extreme_scale(fz, self.tol)
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
            if fz.dtype in _LOW_PRECISION and not self._any_nonfinite:
                dd, ff = (d, fz) if fz.ndim == 2 else (d.flatten(1), fz.flatten(1))
                # exact: float32/16 squares fit in float64 (norms accumulated there)
                norm, f64 = torch.linalg.vector_norm, torch.float64
                den = norm(ff, dim=1, keepdim=True, dtype=f64).clamp_min(1e-30)
                r = (norm(dd, dim=1, keepdim=True, dtype=f64) / den).to(self._rdt)
            else:
                r = self._scaled(d, fz)
                if self._any_nonfinite:
                    r = r.masked_fill(self.nonfinite, float("inf"))
            self._confirmed = r
        return self._confirmed

    def _plain_is_exact(self) -> bool:
        """Whether the last record's plain residuals already decide the stop exactly, so the
        float64 recomputation can be skipped (docs/theory.md §8, solver bookkeeping): plain
        norms in the state's dtype (float32/64) are exact up to rounding unless squares over- or
        underflow.  Both are ruled out by the norms ``den = ||fz||`` themselves (the bound of
        :meth:`_first_scale`), and the rounding, at most ``(N + 3)·u`` relative for the ratio
        of two norms summed in any order (``u`` the unit round-off), by a worst residual below
        ``tol·(1 − 4(N + 3)u)``.  Then every sample's residual is within ``tol`` exactly too."""
        den = self._den
        if den is None or self._exact or self._any_nonfinite or self.best_fz is None:
            return False
        fz = self.best_fz
        if fz.dtype != self._rdt or fz.dtype not in _EXACT_PLAIN:
            return False
        n = fz.shape[1] if fz.ndim == 2 else math.prod(fz.shape[1:])  # (no indexing op)
        margin = 4.0 * (n + 3) * _EXACT_PLAIN[fz.dtype]
        if margin >= 1e-2 or not self.top <= self.tol * (1.0 - margin):
            return False
        # every ||fz|| ≥ 1e-30: the residual's floor does not apply (the plain ratio is the
        # residual); tol·||fz|| ≥ √(tiny/u): the ≤ n·tiny a flush-denormal mode drops from ||d||²
        # (squares below tiny read 0) stays below the margin's spare u·tol²·||fz||² ≥ tiny
        least = max(1e-30, _FLUSH_SAFE[fz.dtype] / self.tol)
        return _norms_in_range(den, n, fz.dtype, self.tol, least)

    def _confirm(self) -> bool:
        if self._confirmed is None and self._plain_is_exact():
            # the plain residuals: exact enough (above); (_best_res is the record's r here)
            self._confirmed = self._best_res if self._best_res is not None else self.best_res
            self.worst = self.top
            self._done = True
            return True
        r = self._returned_residual()
        worst = float(r.masked_fill(self.nonfinite, 0.0).max() if self._any_nonfinite
                      else r.max())
        self.best_res = r
        self.worst = worst
        if worst <= self.tol:
            self._done = True
            return True
        self._exact = True  # the plain norms were wrong here (extreme scales): go on exactly
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
        # the history's columns, joined when first read (a join here measured 0.6–3.3 % slower
        # fwd+bwd at m = 64, B = 256 and 32, interleaved with the hand loop)
        res = (tuple(self.hist) if self.hist
               else torch.zeros(b, 0, dtype=self._rdt, device=self._best.device))
        if not self._any_nonfinite:  # the flags made when read: best_res <= tol, none non-finite
            st = SolverStats(self.name, res, None, None, self.tol, None, best_res,
                             True if self._done else None)
            st.image = self.best_fz  # f(best), or None when nothing was recorded
            return st
        nonfinite = self.nonfinite[:, 0]
        return SolverStats(self.name, res, None, _meets(best_res, self.tol) & ~nonfinite, self.tol,
                           nonfinite, best_res)


_Tracker = Tracker  # the name used before the solver state became public

SOLVERS: dict[str, Callable[..., tuple[torch.Tensor, SolverStats]]] = {}


def register_solver(name: str) -> Callable[[Callable], Callable]:
    """Decorator adding a solver ``fn(f, z0, tol, max_iter, **options)`` to the registry."""

    def deco(fn: Callable) -> Callable:
        run = _per_sample_best(fn)
        SOLVERS[name] = run
        return run

    return deco


def exact_rel_residual(d: torch.Tensor, fz: torch.Tensor) -> torch.Tensor:
    """``||d|| / max(||fz||, 1e-30)`` per sample, exactly: float64 norms for float32/16 states
    (their squares cannot overflow or underflow in float64), the scaled form otherwise."""
    if fz.ndim != 2:
        d, fz = d.flatten(1), fz.flatten(1)
    if fz.dtype in _LOW_PRECISION:
        norm = torch.linalg.vector_norm
        den = norm(fz, dim=1, dtype=torch.float64).clamp_min(1e-30)
        return norm(d, dim=1, dtype=torch.float64) / den
    return scaled_rel_residual(d, fz)


def _per_sample_best(fn: Callable[..., tuple[torch.Tensor, SolverStats]]
                     ) -> Callable[..., tuple[torch.Tensor, SolverStats]]:
    """A solver that returns, for a solve that ends with unconverged samples, each sample's
    best iterate: the iterations run again (deterministically, same operations) and each
    sample's row is kept at the iteration of its smallest measured residual.  A converged solve
    (the common case) pays nothing: its last iterate meets ``tol`` for every sample."""

    @functools.wraps(fn)
    def run(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, **options: Any
            ) -> tuple[torch.Tensor, SolverStats]:
        if z0.ndim > 2:  # (B, C, H, W, …): every solver iterates on flat (B, N) states
            shape = z0.shape

            def flat(x: torch.Tensor) -> torch.Tensor:
                return f(x.reshape(shape)).flatten(1)

            z, st = run(flat, z0.flatten(1), tol, max_iter, **options)
            return z.reshape(shape), st
        active = _REPLAY.get()
        if active is not None and not active.claimed:  # the solve being replayed: as it was
            return fn(f, z0, tol=tol, max_iter=max_iter, **options)
        if active is not None:  # a solve inside a replayed f: run it as the first time
            token = _REPLAY.set(None)
            try:
                return run(f, z0, tol, max_iter, **options)
            finally:
                _REPLAY.reset(token)
        if z0.ndim and z0.shape[0] == 0:  # an empty batch (e.g. every sample masked out)
            return z0.clone(), _empty_stats(fn.__name__, z0, tol)
        z, st = fn(f, z0, tol=tol, max_iter=max_iter, **options)
        if st.all_converged or st.residuals.shape[1] < 2:
            return z, st
        res = torch.nan_to_num(st.residuals, nan=math.inf)
        best_k = res.argmin(dim=1)
        last = res.shape[1] - 1
        nonfinite = st.nonfinite if st.nonfinite is not None else torch.zeros_like(st.converged)
        need = (best_k != last) & ~nonfinite & (
            res.gather(1, best_k[:, None])[:, 0] < res[:, last])
        if not bool(need.any()):
            return z, st
        rep = _Replay(torch.where(need, best_k, torch.full_like(best_k, -1)))
        token = _REPLAY.set(rep)
        try:  # the same max_iter: a solver may decide by the iterations left (auto)
            fn(f, z0, tol=tol, max_iter=max_iter, **options)
        finally:
            _REPLAY.reset(token)
        assert rep.z is not None and rep.fz is not None
        last_r = (st.final_residual if st.returned_residual is None else st.returned_residual)
        r = exact_rel_residual(rep.fz - rep.z, rep.fz).to(last_r.dtype)
        # keep the replayed row only where it is really better than the last iterate (a replay
        # that did not repeat the first run — a stateful f, a nondeterministic kernel — cannot
        # make a returned point worse)
        need = need & (r < last_r)
        rows = need.reshape((-1,) + (1,) * (z.ndim - 1))
        zb = torch.where(rows, rep.z, z)
        rr = torch.where(need, r, last_r)
        return zb, SolverStats(st.solver, st.residuals, None, _meets(rr, tol) & ~nonfinite, st.tol,
                               st.nonfinite, rr)

    return run


def _empty_stats(name: str, z0: torch.Tensor, tol: float) -> SolverStats:
    """Statistics of a solve over zero samples: nothing iterated, nothing failed."""
    rdt = torch.float32 if z0.dtype in (torch.float16, torch.bfloat16) else z0.dtype
    dev = z0.device
    none = torch.zeros(0, dtype=torch.bool, device=dev)
    return SolverStats(name, torch.zeros(0, 0, dtype=rdt, device=dev),
                       torch.zeros(0, dtype=torch.long, device=dev), none, tol, none.clone(),
                       torch.zeros(0, dtype=rdt, device=dev), True)


def get_solver(name: str) -> Callable[..., tuple[torch.Tensor, SolverStats]]:
    """The registered solver ``name`` (OptionError listing the available ones otherwise)."""
    if name not in SOLVERS:
        raise OptionError(f"unknown solver {name!r}", term="solver",
                          hint=f"available: {', '.join(sorted(SOLVERS))}")
    return SOLVERS[name]


def solve(f: F, z0: torch.Tensor, solver: str = "anderson", tol: float = 1e-6,
          max_iter: int = 100, **options: Any) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``z = f(z)`` with a registered solver."""
    return get_solver(solver)(f, z0, tol=tol, max_iter=max_iter, **options)


class CompiledSteps:
    """Plain iterations ``chunk`` at a time in one ``torch.compile``-d call of
    :func:`_run_steps`: the evaluations of ``f`` and the residual norms of ``chunk`` iterations
    fused, one host synchronisation per chunk.  Each instance compiles its own copy of
    :func:`_run_steps` (a fresh code object per chunk length), so dynamo's per-function
    recompile limit is counted per caller, not shared by every layer of a process; dynamo
    guards on ``f``'s code and on the tensors it reads, so the next call's new plan of the same
    layer reuses the compiled graph."""

    def __init__(self, chunk: int = 8):
        if chunk < 2:
            raise OptionError(f"compiled chunk of {chunk} iterations: need ≥ 2",
                              term="compiled_steps")
        self.chunk = int(chunk)
        #: chunk lengths tried, longest first: ``chunk`` halved down to 4 (the tail of a solve)
        self.sizes = tuple(self.chunk >> i for i in range(self.chunk.bit_length())
                           if self.chunk >> i >= min(4, self.chunk))
        self._fns: dict[int, Callable[..., tuple[torch.Tensor, ...]]] = {}
        #: the compiler failed once (the chunks run eagerly; the statistics say plain)
        self.broken = False

    def __call__(self, f: F, z: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fn = self._fns.get(k)
        if fn is None:
            code = _run_steps.__code__.replace(co_name=f"_run_steps_{k}")
            fn = torch.compile(types.FunctionType(code, _run_steps.__globals__, code.co_name))
            self._fns[k] = fn
        try:
            return fn(f, z, k)
        except Exception as exc:
            from torch._dynamo.exc import BackendCompilerFailed

            if not isinstance(exc, BackendCompilerFailed):
                raise
            # the compiler is unusable here (no C++ compiler, a backend error): the same
            # iterations eagerly from now on, whatever backend the caller's torch.compile used
            first = str(exc).splitlines()[0] if str(exc) else ""
            warnings.warn(f"compiled chunks of plain iterations are off ({type(exc).__name__}: "
                          f"{first}); iterating eagerly (compile_steps=0 skips the attempt)",
                          RuntimeWarning, stacklevel=2)
            self.broken = True
            self._fns = dict.fromkeys(self.sizes, _run_steps)
            return _run_steps(f, z, k)


#: the compiled chunks plain iteration uses (None: eager steps); set by :func:`compiled_steps`
_COMPILED: ContextVar[CompiledSteps | None] = ContextVar("convex_eq_compiled_steps",
                                                         default=None)


class grad_off:  # lower case: used like torch.no_grad
    """``torch.no_grad()`` for the per-call path: gradients off inside, switched only when they
    are on (a first-order backward already runs without them).  Two Python calls against the
    about eight of ``torch.no_grad()`` (a decorator class): 0.4–0.6 against 1.5–3.1 µs a use
    on this machine (two measurements), and the module enters such a region three to four
    times a call."""

    __slots__ = ("on",)

    def __enter__(self) -> None:
        self.on = torch.is_grad_enabled()
        if self.on:
            _set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        if self.on:
            _set_grad_enabled(True)


_set_grad_enabled = torch._C._set_grad_enabled
_INF = math.inf


def compiled_steps_set() -> bool:
    """Whether compiled chunks are set in this context (:class:`compiled_steps`); when not, a
    caller that wants the eager loop need not enter ``compiled_steps(None)``."""
    return _COMPILED.get() is not None


class compiled_steps:  # lower case: used like the function it was
    """Within this context, plain iteration (``plain``, and ``auto`` while it iterates plainly)
    runs in compiled chunks (:class:`CompiledSteps`) while the worst residual's rate predicts
    at least a chunk more iterations, then as eager steps: the same iterates as the eager loop,
    and the same stop unless the rate slows down inside a chunk (then a few iterations more).
    None leaves the eager loop.  The emitted module sets it when it runs inside
    ``torch.compile`` (docs/guide.md, torch.compile).  (A small class rather than a generator:
    entered on every solve, and a no-op when the setting is already ``steps``.)"""

    __slots__ = ("steps", "token")

    def __init__(self, steps: CompiledSteps | None):
        self.steps = steps
        self.token: Any = None

    def __enter__(self) -> None:
        if _COMPILED.get() is not self.steps:
            self.token = _COMPILED.set(self.steps)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _COMPILED.reset(self.token)
            self.token = None


def _run_steps(f: F, z: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` plain iterations from ``z``: ``(z_{k−1}, f(z_{k−1}), r)`` with ``r`` the ``(B, k)``
    plain relative residuals ``||f(z_j) − z_j|| / max(||f(z_j)||, 1e-30)`` of the ``k``
    iterates (:meth:`Tracker.record` confirms the last one exactly when it stops)."""
    rs = []
    for j in range(k):
        fz = f(z)
        # ||d|| / max(||fz||, 1e-30) in the state's dtype, fused into one kernel (with float64
        # norms the compiled module measured 1.40× the eager one fwd+bwd at B = 256, against
        # 0.90–0.97 with these): an exact zero reads 0, not 0/0 = NaN
        norm = torch.linalg.vector_norm
        rs.append(norm((fz - z).flatten(1), dim=1)
                  / norm(fz.flatten(1), dim=1).clamp_min(1e-30))
        if j < k - 1:
            z = fz
    return z, fz, torch.stack(rs, 1)


def _plain_phase(f: F, z0: torch.Tensor, tr: Tracker, max_iter: int,
                 watch: _AutoWatch | None = None) -> tuple[torch.Tensor | None, int]:
    """``z ← f(z)`` from ``z0``, recorded into ``tr``, until every sample is done, ``max_iter``
    evaluations, or ``watch(k)`` (asked after ``k`` evaluations, from ``k ≥ watch.next`` on)
    returns True; then ``(f(z), k)`` (``f(z)`` None unless ``watch`` stopped it).

    Inside :func:`compiled_steps` a group of ``n`` iterations (a chunk length) runs as one
    compiled call when the worst residual's rate over the last group (or the last eager step;
    the first two steps are eager) predicts at least ``n`` more iterations, else one eager
    step: a group is not cut short, and the prediction mostly keeps it from running past the
    iterate where the eager loop stops (when the rate slows down it can run up to a group
    length past it; those iterations only move closer to the fixed point).  A replay
    (``_per_sample_best``) runs the same schedule as eager steps, recording every iterate;
    plain iterates do not depend on the grouping."""
    steps = _COMPILED.get()
    if steps is None:  # the eager loop
        return tr.plain_loop(f, z0, max_iter, watch)
    z, k = z0, 0
    rate = math.nan  # the worst residual's factor per iteration over the last group
    prev = math.nan  # the worst residual one iteration back (eager steps)
    while k < max_iter:
        # no chunks while the rate is unknown, or while the tracker measures exactly (scales
        # where plain norms overflow or underflow)
        need = 0.0 if math.isnan(rate) or tr._exact else _still_needed(tr.top, rate, tr.tol)
        n = next((s for s in steps.sizes if s <= max_iter - k and need >= s), 1)
        prev = tr.top
        if n > 1 and tr._replay is None:
            zp, fz, r = steps(f, z, n)
            if steps.broken:  # the compiler failed: these iterations ran eagerly
                tr.name = tr.name.replace(f"[compiled×{steps.chunk}]", "")
            tr.record_steps(r[:, :-1])
            exact = tr._exact
            done = tr.record(zp, fz, plain=r[:, -1:])
            refused = tr._exact and not exact
            if refused or tr._plain_failed:
                # plain norms over- or underflowed at the chunk's end (a non-finite plain
                # residual, or a false pass the exact residual refused): the same samples'
                # inner residuals may hold a false 0, so they are not known
                bad = ~torch.isfinite(r[:, -1])
                if refused:
                    bad |= tr.best_res[:, 0] > tr.tol
                tr.unknown_steps(n - 1, bad)
            r0 = r[:, :1]  # the group's first residual, finished samples out (as tr.top)
            first = float((r0.masked_fill(tr.nonfinite, 0.0) if tr._any_nonfinite else r0).max())
        else:
            first = math.nan
            for j in range(n):
                fz = f(z)
                done = tr.record(z, fz)
                if j == 0:
                    first = tr.top
                if done:
                    break
                if j < n - 1:
                    z = fz
        if not done:  # the rate over this group (an eager step: over that one iteration)
            rate = _rate(tr.top, first, n - 1) if n > 1 else _rate(tr.top, prev, 1)
        k += n
        if done:
            return None, k
        if watch is not None and watch(k):
            return fz, k
        z = fz
    return None, k


def _rate(now: float, then: float, window: int) -> float:
    """Per-iteration factor of the worst residual from ``then`` to ``now`` (NaN when unknown,
    ≥ 1 when it did not fall)."""
    if not (math.isfinite(now) and math.isfinite(then)) or then <= 0:
        return math.nan
    return (now / then) ** (1.0 / window)


def _still_needed(now: float, rate: float, tol: float) -> float:
    """Iterations to ``tol`` from the worst residual ``now`` at ``rate`` per iteration (inf
    when the rate is unknown or not below 1)."""
    if not math.isfinite(now):
        return math.inf
    if now <= tol:
        return 0.0
    if not rate < 1.0 or rate <= 0.0:
        return math.inf
    return math.log(tol / now) / math.log(rate)


def _compiled_name(name: str) -> str:
    steps = _COMPILED.get()
    return name if steps is None or steps.broken else f"{name}[compiled×{steps.chunk}]"


@register_solver("plain")
def plain(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100,
          damping: float = 1.0) -> tuple[torch.Tensor, SolverStats]:
    """``z ← (1-λ) z + λ f(z)`` (λ = damping)."""
    if not 0 < damping <= 1:
        raise OptionError(f"damping {damping} must lie in (0, 1]", term="solver plain")
    if damping == 1.0:
        tr = Tracker(_compiled_name("plain"), z0, tol)
        _plain_phase(f, z0, tr, max_iter)
        return tr.best, tr.stats()
    tr = Tracker("plain", z0, tol)
    z = z0
    for _ in range(max_iter):
        fz = f(z)
        if tr.record(z, fz):
            break
        z = (1 - damping) * z + damping * fz
    return tr.best, tr.stats()


@register_solver("anderson")
def anderson(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, m: int = 5,
             beta: float = 1.0, lam: float = 1e-8, restart: int | None = None
             ) -> tuple[torch.Tensor, SolverStats]:
    """Anderson acceleration (type II) with the least-squares problem in float64.

    The residual Gram matrix ``GGᵀ`` is kept incrementally (one new row per iteration) in the
    accumulation dtype (float64 for float32/16 states: in float32 the Gram matrix squares the
    round-off and the mixing stalls near a relative residual of 1e-4), with the ridge
    ``lam·||g_i||² + sqrt(tiny)`` on each diagonal entry, put there when the entry's row is
    written; ``α = A⁻¹1 / 1ᵀA⁻¹1`` (docs/theory.md §8, eighth round: a bordered (KKT) form of
    the same problem lost the small entries of a history spanning many scales).
    Safeguard: when the worst sample's best residual has not improved for ``restart``
    iterations (default ``2m``), the history is cleared and the next step is a plain one.
    After ``ANDERSON_FRUITLESS`` such restarts in a row that gain nothing (a stall: on a slow
    contraction Anderson can stay far from the fixed point where plain iteration converges),
    the solve alternates checked phases of plain iteration with Anderson trials
    (:class:`_StallGuard`, docs/theory.md §8); a solve without such a stall runs as without
    it, bit for bit."""
    if m < 1:
        raise OptionError("Anderson history m must be ≥ 1", term="solver anderson")
    return _anderson(f, z0, Tracker("anderson", z0, tol), max_iter, m, beta, lam, restart)


#: Anderson's stall guard (:class:`_StallGuard`) starts after this many restarts in a row that
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


class _StallGuard:
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


def _anderson(f: F, z0: torch.Tensor, tr: Tracker, max_iter: int, m: int, beta: float,
              lam: float, restart: int | None) -> tuple[torch.Tensor, SolverStats]:
    """The Anderson iteration from ``z0`` recording into ``tr`` (see :func:`anderson`)."""
    b, n = z0.shape
    dt, dev = z0.dtype, z0.device
    acc = accumulation_dtype(dt)
    restart = 2 * m if restart is None else int(restart)
    # ring buffers: only the filled slots are ever read (no zero fill); X only for beta ≠ 1
    X = torch.empty(b, m, n, dtype=dt, device=dev) if beta != 1.0 else None
    Fh = torch.empty(b, m, n, dtype=dt, device=dev)
    G = torch.empty(b, m, n, dtype=acc, device=dev)
    # A = GGᵀ + R, R the ridge on the diagonal (written with each row)
    GG = torch.zeros(b, m, m, dtype=acc, device=dev)
    ones = torch.ones(b, m, 1, dtype=acc, device=dev)
    #: mixing Σ α_i f_i as a batched matrix product for long states, as a broadcast sum for
    #: short ones (measured: 21 vs 45 µs at B = 64, N = 480; 112 vs 27 µs at B = 256, N = 64)
    mix_bmm = n >= 256
    lam1, tiny = 1.0 + lam, torch.finfo(acc).tiny ** 0.5
    x = z0
    filled = 0  # number of valid history slots
    slot = 0
    best_worst, stale = float("inf"), 0
    # restarts in a row that gained nothing, and the best worst residual since the last that did
    fruitless, fruitful = 0, float("inf")
    guard: _StallGuard | None = None  # made at a stall (ANDERSON_FRUITLESS)
    for _ in range(max_iter):
        fx = f(x)
        g = fx - x
        if tr.record(x, fx, g):
            break
        # store (x, f(x), g) in the ring buffer and update one row/column of the Gram matrix
        if X is not None:
            X[:, slot] = x
        Fh[:, slot] = fx
        G[:, slot] = g
        filled = min(filled + 1, m)
        # one new row and column of the Gram matrix, a batched matrix–vector product (b,
        # filled, 1); the diagonal entry gets the ridge (1 + lam)·||g||² + sqrt(tiny)
        row = torch.bmm(G[:, :filled], G[:, slot, :, None])
        GG[:, :filled, slot, None] = row
        GG[:, slot, :filled, None] = row
        GG[:, slot, slot].mul_(lam1).add_(tiny)
        if guard is None or guard.phase is None:  # (in a guard's phase: its own tests)
            worst = tr.top  # this run's progress (a continued solve may have a better past)
            if worst < 0.999 * best_worst:
                best_worst, stale = worst, 0
            else:
                stale += 1
            if stale >= restart and filled > 1:  # stalled: clear the history, take a plain step
                # a restart that gained nothing: the best since the restart before is not below
                # ANDERSON_GAIN times the best since the last one that did
                if best_worst < ANDERSON_GAIN * fruitful:
                    fruitless, fruitful = 0, best_worst
                else:
                    fruitless, fruitful = fruitless + 1, min(fruitful, best_worst)
                if guard is None and fruitless >= ANDERSON_FRUITLESS:
                    guard = _StallGuard(2 * m, tr.tol)
                if guard is not None and not guard.dead:  # a plain phase from here
                    guard.start(row[:, slot])
                if X is not None:
                    X[:, 0] = x
                Fh[:, 0], G[:, 0] = fx, g
                GG[:, 0, 0] = row[:, slot, 0] * lam1 + tiny  # (||g||², float64 above)
                filled, slot, stale = 1, 0, 0
                best_worst = worst
                x = fx
                slot = 1 % m
                continue
        slot = (slot + 1) % m
        if filled == 1:  # (never in a guard's phase: one starts at a restart, filled 1 → 2)
            x = fx if beta == 1.0 else beta * fx + (1 - beta) * x
            continue
        # min ||Σ α_i g_i||² + Σ α_i² R_ii s.t. Σ α_i = 1  ⇔  α = A⁻¹1 / (1ᵀA⁻¹1): scale-free
        # (the bordered form [[0, 1ᵀ], [1, A]] pivots on its 1s and loses the small entries)
        w, info = torch.linalg.solve_ex(GG[:, :filled, :filled], ones[:, :filled])
        alpha = w[..., 0] / w[..., 0].sum(dim=1, keepdim=True)
        # singular: the latest plain step for those samples (on an accelerator without the
        # host synchronisation of the test: the stop test is the only one per iteration)
        if not alpha.device.type == "cpu" or bool(info.any()):
            ok = info == 0
            last = torch.zeros_like(alpha)
            last[:, (slot - 1) % m] = 1.0
            alpha = torch.where(ok[:, None], alpha, last)
        a = alpha.to(dt)
        x_new = ((a[:, None] @ Fh[:, :filled])[:, 0] if mix_bmm
                 else (a[:, :, None] * Fh[:, :filled]).sum(1))
        if X is not None:
            x_new = beta * x_new + (1 - beta) * (a[:, None] @ X[:, :filled])[:, 0]
        if guard is not None and guard.phase is not None:
            # the slot just written: row[:, slot before the advance] is ||f(x) − x||²
            nxt = guard.step(fx, row[:, (slot - 1) % m], x_new, tr.hist[-1],
                             tr.nonfinite if tr._any_nonfinite else None)
            if nxt is None:  # the phases ended: Anderson goes on, its stall test afresh
                best_worst, stale = tr.top, 0
            else:
                x_new = nxt
        x = x_new
    return tr.best, tr.stats()


#: ``auto``: Anderson from the start for states of at least this size (there one evaluation of
#: ``T`` costs more than Anderson's bookkeeping, and Anderson needs several times fewer); below
#: it plain iteration, continued by Anderson once the rate observed over ``AUTO_WINDOW``
#: iterations predicts more than ``AUTO_PLAIN_BUDGET`` further iterations (or more than half of
#: those left): a plain iteration of a small state costs ~1/5 of an Anderson one, and Anderson
#: needs ~10–20 here; measured in docs/theory.md §8
AUTO_ANDERSON_STATE = 256
AUTO_PLAIN_BUDGET = 60
AUTO_WINDOW = 4
#: a prediction of at most this many further plain iterations is tested again only
#: ``AUTO_WINDOW`` past its end (not after half of it): see :class:`_AutoWatch`
AUTO_TAIL = 16


@register_solver("auto")
def auto(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, m: int = 5,
         beta: float = 1.0, lam: float = 1e-8, restart: int | None = None
         ) -> tuple[torch.Tensor, SolverStats]:
    """Plain iteration while it converges fast, Anderson otherwise: Anderson from the start for
    states with ``N ≥ AUTO_ANDERSON_STATE``; below that, plain iteration, continued by Anderson
    (from the current iterate, same statistics) once the worst residual's rate since the last
    test predicts more than ``min(AUTO_PLAIN_BUDGET, left / 2)`` further plain iterations
    (tested ``AUTO_WINDOW`` iterations after the first, then after half the iterations the
    last test predicted, or past their end when few: :class:`_AutoWatch`).  The choice depends
    on the residuals only (deterministic); ``stats.solver`` says what ran (``"plain"``,
    ``"anderson"``, ``"plain→anderson"``)."""
    if m < 1:
        raise OptionError("Anderson history m must be ≥ 1", term="solver auto")
    if z0.shape[-1] >= AUTO_ANDERSON_STATE:
        return _anderson(f, z0, Tracker("anderson", z0, tol), max_iter, m, beta, lam, restart)
    if _COMPILED.get() is None:  # the eager loop (what _plain_phase runs), directly
        tr = Tracker("plain", z0, tol)
        fz, k = tr.plain_loop(f, z0, max_iter, _AutoWatch(tr, tol, max_iter))
    else:
        tr = Tracker(_compiled_name("plain"), z0, tol)
        fz, k = _plain_phase(f, z0, tr, max_iter, _AutoWatch(tr, tol, max_iter))
    if fz is None:
        return tr.best, tr.stats()
    tr.name += "→anderson"
    return _anderson(f, fz, tr, max_iter - k, m, beta, lam, restart)


class _AutoWatch:
    """``auto``'s switch test, asked by :func:`_plain_phase` after ``k`` evaluations once
    ``k ≥ next``: the worst residual's rate since the last test (``AUTO_WINDOW`` iterations
    after the first) predicts the further plain iterations; more than ``min(AUTO_PLAIN_BUDGET,
    left / 2)`` switches to Anderson (True).  Otherwise the next test comes after half the
    predicted iterations, at least ``AUTO_WINDOW`` later: a rate that slows down is caught
    within half of what it had predicted.  A prediction of at most ``AUTO_TAIL`` iterations is
    tested again only ``AUTO_WINDOW`` past its end: a solve that ends as predicted is not asked
    again (each test costs as much as an iteration of a small state, cold).  When that test
    finds more than ``AUTO_TAIL`` still to go, the rate slowed down inside its long span, whose
    average includes the faster start: the next test measures it over ``AUTO_WINDOW``
    iterations again."""

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
            # half the predicted iterations, at least AUTO_WINDOW later (a rate that slows down
            # is caught within half of what it had predicted); a prediction of at most
            # AUTO_TAIL more is tested again only AUTO_WINDOW past its end: a solve that ends as
            # predicted asks no more (each test costs about as much as an iteration of a small
            # state, cold), and one that slows down there loses at most AUTO_TAIL + AUTO_WINDOW
            # plain iterations; when such a test finds a long way still to go, the rate slowed
            # down within its span, and the average over that span (the faster start included)
            # underestimates what is left: the next test measures the rate over AUTO_WINDOW
            # (without it a tanh layer's adjoint solve ran 67 plain iterations instead of
            # switching after 29: tests/test_review_s8c.py)
            was_tail, self.tail = self.tail, need <= AUTO_TAIL
            step = int(need) + AUTO_WINDOW if self.tail else \
                AUTO_WINDOW if was_tail else max(AUTO_WINDOW, int(need) // 2)
        self.next, self.then, self.k = k + step, top, k
        return False


@register_solver("broyden")
def broyden(f: F, z0: torch.Tensor, tol: float = 1e-6, max_iter: int = 100, m: int = 30
            ) -> tuple[torch.Tensor, SolverStats]:
    """Limited-memory ("good") Broyden on ``g(z) = f(z) - z`` with inverse-Jacobian estimate
    ``B = -I + Σ u_i v_iᵀ`` (Sherman–Morrison updates), unit step."""
    b, n = z0.shape
    dt, dev = z0.dtype, z0.device
    Us = torch.zeros(b, n, m, dtype=dt, device=dev)
    VTs = torch.zeros(b, m, n, dtype=dt, device=dev)
    tr = Tracker("broyden", z0, tol)
    x = z0
    fx = f(x)
    gx = fx - x
    if tr.record(x, fx, gx) or max_iter <= 1:
        return tr.best, tr.stats()

    def matvec(part_u: torch.Tensor, part_vt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if part_u.shape[-1] == 0:
            return -v
        return -v + (part_u @ (part_vt @ v[..., None]))[..., 0]

    def rmatvec(part_u: torch.Tensor, part_vt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if part_u.shape[-1] == 0:
            return -v
        return -v + ((v[:, None] @ part_u) @ part_vt)[:, 0]

    update = gx
    nstep = 0
    for _ in range(1, max_iter):
        x_new = x + update
        fx_new = f(x_new)
        gx_new = fx_new - x_new
        if tr.record(x_new, fx_new, gx_new):
            break
        dx, dg = x_new - x, gx_new - gx
        x, gx = x_new, gx_new
        k = min(nstep, m)
        pu, pvt = Us[:, :, :k], VTs[:, :k]
        vT = rmatvec(pu, pvt, dx)
        denom = (vT * dg).sum(-1, keepdim=True)
        ok = denom.abs() > 1e-30
        u = (dx - matvec(pu, pvt, dg)) / torch.where(ok, denom, torch.ones_like(denom))
        u = torch.where(ok, u, torch.zeros_like(u))
        vT = torch.where(ok, vT, torch.zeros_like(vT))
        slot = nstep % m
        Us[:, :, slot] = u
        VTs[:, slot] = vT
        nstep += 1
        k = min(nstep, m)
        update = -matvec(Us[:, :, :k], VTs[:, :k], gx)
    return tr.best, tr.stats()
