"""Each sample's best iterate for a solve that ends with unconverged samples: the iterations run
again (deterministically, the same operations) and each sample's row is kept at the iteration of
its smallest measured residual.  A converged solve, the common case, pays nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .residuals import exact_rel_residual
from .stats import SolverStats, meets
from .tracker import F, Tracker, image_norms

#: a solver's iteration: ``fn(f, z0, tracker, max_iter=…, **options)`` records into the tracker
Iteration = Callable[..., None]


class Replay:
    """What a replayed solve collects: per sample, the iterate (and its image) at the iteration
    where the first run measured that sample's smallest residual."""

    def __init__(self, at: torch.Tensor):
        self.at = at  # (B,) iteration index per sample (-1: keep the first run's last iterate)
        self.last = int(at.max())
        self.z: torch.Tensor | None = None
        self.fz: torch.Tensor | None = None

    def capture(self, k: int, z: torch.Tensor, fz: torch.Tensor) -> bool:
        """Keep the rows of iteration ``k``; True (stop) once the last one wanted is in."""
        rows = (self.at == k).reshape((-1,) + (1,) * (z.ndim - 1))
        self.z = torch.where(rows, z, z if self.z is None else self.z)
        self.fz = torch.where(rows, fz, fz if self.fz is None else self.fz)
        return k >= self.last


def best_per_sample(iterate: Iteration, tr: Tracker, f: F, z0: torch.Tensor, max_iter: int,
                    options: dict[str, Any]) -> tuple[torch.Tensor, SolverStats]:
    """``(z, stats)`` of the solve recorded in ``tr``, with each unconverged sample's row
    replaced by its best iterate where that is better than the last one (found by running
    ``iterate`` again with a replaying tracker)."""
    z, st = tr.best, tr.stats()
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
    rep = Replay(torch.where(need, best_k, torch.full_like(best_k, -1)))
    again = Tracker(tr.name, z0, tr.tol, replay=rep, compiled=tr.compiled)
    # the same max_iter: a solver may decide by the iterations left (auto)
    iterate(f, z0, again, max_iter=max_iter, **options)
    assert rep.z is not None and rep.fz is not None
    last_r = (st.final_residual if st.returned_residual is None else st.returned_residual)
    r = exact_rel_residual(rep.fz - rep.z, rep.fz).to(last_r.dtype)
    # keep the replayed row only where it is really better than the last iterate (a replay
    # that did not repeat the first run — a stateful f, a nondeterministic kernel — cannot make
    # a returned point worse)
    need = need & (r < last_r)
    rows = need.reshape((-1,) + (1,) * (z.ndim - 1))
    zb = torch.where(rows, rep.z, z)
    rr = torch.where(need, r, last_r)
    out = SolverStats(st.solver, st.residuals, None, meets(rr, tr.tol) & ~nonfinite, st.tol,
                      st.nonfinite, rr)
    if st.image_norm is not None:
        out.image_norm = torch.where(need, image_norms(rep.fz), st.image_norm)
    return zb, out
