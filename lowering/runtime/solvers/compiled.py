"""Plain iteration in compiled chunks: ``chunk`` iterations and their residual norms fused in one
``torch.compile``-d call, one host synchronisation per chunk (docs/guide.md, torch.compile).

The emitted module passes its :class:`CompiledSteps` to the solver (``compiled=``) when it runs
inside ``torch.compile``; :func:`plain_phase` then groups plain iterations into chunks while the
worst residual's rate predicts at least a chunk more.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable

import torch

from convex_eq.errors import OptionError

from .tracker import F, Tracker, Watch


class CompiledSteps:
    """Plain iterations ``chunk`` at a time in one ``torch.compile``-d call of
    :func:`run_steps`: the evaluations of ``f`` and the residual norms of ``chunk`` iterations
    fused, one host synchronisation per chunk.  Each instance compiles its own copy of
    :func:`run_steps` (a fresh code object per chunk length), so dynamo's per-function
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
            code = run_steps.__code__.replace(co_name=f"run_steps_{k}")
            fn = torch.compile(types.FunctionType(code, run_steps.__globals__, code.co_name))
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
            self._fns = dict.fromkeys(self.sizes, run_steps)
            return run_steps(f, z, k)


def run_steps(f: F, z: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` plain iterations from ``z``: ``(z_{k−1}, f(z_{k−1}), r)`` with ``r`` the ``(B, k)``
    plain relative residuals ``||f(z_j) − z_j|| / max(||f(z_j)||, 1e-30)`` of the ``k``
    iterates (:meth:`Tracker.record` confirms the last one exactly when it stops)."""
    rs = []
    for j in range(k):
        fz = f(z)
        # ||d|| / max(||fz||, 1e-30) in the state's dtype, fused into one kernel (float64 norms
        # made the compiled module slower than the eager one): an exact zero reads 0, not NaN
        norm = torch.linalg.vector_norm
        rs.append(norm((fz - z).flatten(1), dim=1)
                  / norm(fz.flatten(1), dim=1).clamp_min(1e-30))
        if j < k - 1:
            z = fz
    return z, fz, torch.stack(rs, 1)


def plain_phase(f: F, z0: torch.Tensor, tr: Tracker, max_iter: int,
                 watch: Watch | None = None) -> tuple[torch.Tensor | None, int]:
    """``z ← f(z)`` from ``z0``, recorded into ``tr``, until every sample is done, ``max_iter``
    evaluations, or ``watch(k)`` (asked after ``k`` evaluations, from ``k ≥ watch.next`` on)
    returns True; then ``(f(z), k)`` (``f(z)`` None unless ``watch`` stopped it).

    With compiled steps (``tr.compiled``) a group of ``n`` iterations (a chunk length) runs as one
    compiled call when the worst residual's rate over the last group (or the last eager step;
    the first two steps are eager) predicts at least ``n`` more iterations, else one eager
    step: a group is not cut short, and the prediction mostly keeps it from running past the
    iterate where the eager loop stops (when the rate slows down it can run up to a group
    length past it; those iterations only move closer to the fixed point).  A replay
    (:func:`~lowering.runtime.solvers.replay.best_per_sample`) runs the same schedule as eager
    steps, recording every iterate; plain iterates do not depend on the grouping."""
    steps = tr.compiled
    if steps is None:  # the eager loop
        return tr.plain_loop(f, z0, max_iter, watch)
    z, k = z0, 0
    rate = math.nan  # the worst residual's factor per iteration over the last group
    prev = math.nan  # the worst residual one iteration back (eager steps)
    while k < max_iter:
        # no chunks while the rate is unknown, or while the tracker measures exactly (scales
        # where plain norms overflow or underflow)
        need = 0.0 if math.isnan(rate) or tr.exact else still_needed(tr.top, rate, tr.tol)
        n = next((s for s in steps.sizes if s <= max_iter - k and need >= s), 1)
        prev = tr.top
        if n > 1 and tr.replay is None:
            done, fz, first = _record_chunk(tr, steps, f, z, n)
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
            rate = rate_per_iteration(tr.top, first if n > 1 else prev, max(n - 1, 1))
        k += n
        if done:
            return None, k
        if watch is not None and watch(k):
            return fz, k
        z = fz
    return None, k


def _record_chunk(tr: Tracker, steps: CompiledSteps, f: F, z: torch.Tensor, n: int
                  ) -> tuple[bool, torch.Tensor, float]:
    """``n`` plain iterations in one compiled call, recorded into ``tr``: ``(done, f(z_{n−1}),
    the group's first worst residual)``."""
    zp, fz, r = steps(f, z, n)
    if steps.broken:  # the compiler failed: these iterations ran eagerly
        tr.name = tr.name.replace(f"[compiled×{steps.chunk}]", "")
    tr.record_steps(r[:, :-1])
    exact = tr.exact
    done = tr.record(zp, fz, plain=r[:, -1:])
    refused = tr.exact and not exact
    if refused or tr.plain_failed:
        # plain norms over- or underflowed at the chunk's end (a non-finite plain residual, or
        # a false pass the exact residual refused): the same samples' inner residuals may hold
        # a false 0, so they are not known
        bad = ~torch.isfinite(r[:, -1])
        if refused:
            bad |= tr.best_res[:, 0] > tr.tol
        tr.unknown_steps(n - 1, bad)
    r0 = r[:, :1]  # the group's first residual, finished samples out (as tr.top)
    first = float((r0.masked_fill(tr.nonfinite, 0.0) if tr.any_nonfinite else r0).max())
    return done, fz, first


def rate_per_iteration(now: float, then: float, window: int) -> float:
    """Per-iteration factor of the worst residual from ``then`` to ``now`` (NaN when unknown,
    ≥ 1 when it did not fall)."""
    if not (math.isfinite(now) and math.isfinite(then)) or then <= 0:
        return math.nan
    return (now / then) ** (1.0 / window)


def still_needed(now: float, rate: float, tol: float) -> float:
    """Iterations to ``tol`` from the worst residual ``now`` at ``rate`` per iteration (inf
    when the rate is unknown or not below 1)."""
    if not math.isfinite(now):
        return math.inf
    if now <= tol:
        return 0.0
    if not rate < 1.0 or rate <= 0.0:
        return math.inf
    return math.log(tol / now) / math.log(rate)


def compiled_name(name: str, steps: CompiledSteps | None) -> str:
    """``name`` as the statistics report it: with the chunk length of compiled plain
    iterations (``plain[compiled×16]``) when they run."""
    return name if steps is None or steps.broken else f"{name}[compiled×{steps.chunk}]"
