"""The one failure policy of the backward's linear solves: ``raise``, ``warn`` or ``mask``
(``on_nonconvergence``; docs/guide.md, failures)."""

from __future__ import annotations

import warnings

import torch

from convex_eq.errors import ConvergenceError, ConvergenceWarning, OptionError

from ..solvers import SolverStats
from .problem import AdjointConfig


def judge(y: torch.Tensor, stats: SolverStats, cfg: AdjointConfig, what: str
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, kept)`` after a linear solve of the backward whose statistics are ``stats``:
    unconverged samples raise (``raise``), are named in a warning (``warn``), or are left out
    of the gradient (``mask``: their rows of ``y`` are zero, ``kept`` the mask of the rows kept,
    None when all are)."""
    if stats.all_converged or bool(stats.converged.all()):  # the solver's word: no sync
        return y, None
    idx = stats.failed_indices
    if cfg.rows is not None:  # rows of a subset → the batch samples they are
        idx = [int(cfg.rows[i]) for i in idx]
    shown = ", ".join(map(str, idx[:10])) + (", …" if len(idx) > 10 else "")
    msg = (f"{what} did not reach relative residual {cfg.tol:g} in {cfg.max_iter} iterations "
           f"of {cfg.solver} for {len(idx)}/{stats.converged.numel()} samples (indices "
           f"{shown}; worst {stats.max_residual:.3e})")
    if cfg.on_fail == "raise":
        raise ConvergenceError(msg, term="backward",
                               hint="raise backward_max_iter / backward_tol, or pass "
                               "on_nonconvergence='warn' to train through it")
    if cfg.on_fail == "warn":
        warnings.warn(f"backward: {msg}", ConvergenceWarning, stacklevel=5)
        return y, None
    if not cfg.batch_independent:
        # (refused at construction; the config is mutable): leaving rows of a coupled system
        # out would change the others' adjoint
        raise OptionError(f"{msg}; on_nonconvergence='mask' cannot leave samples of this layer "
                          "out of the gradient: its objective couples the batch", term="backward",
                          hint="set module.config.on_nonconvergence to 'raise' or 'warn'")
    warnings.warn(f"backward: {msg}; they are left out of the gradient "
                  "(on_nonconvergence='mask')", ConvergenceWarning, stacklevel=5)
    # as the forward's failed samples, those whose adjoint did not converge leave the backward:
    # their rows are zero, so an unconverged (or NaN) row never enters the weights' gradient
    keep = stats.converged.reshape(-1, *([1] * (y.ndim - 1)))
    return torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device)), keep
