"""Per-sample statistics of a fixed-point solve (:class:`SolverStats`).

A ``converged`` flag always describes the returned iterate: it is its exact residual against
``tol`` (docs/theory.md §8, solver bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def meets(r: torch.Tensor, tol: float) -> torch.Tensor:
    """``r <= tol`` elementwise, exactly: a float32/16 residual is compared in float64, where
    ``tol`` is not rounded (torch rounds a Python scalar to the tensor's dtype, and a ``tol`` that
    float32 rounds up would pass residuals up to one float32 step above it)."""
    return (r if r.dtype == torch.float64 else r.double()) <= tol


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

    #: the solver's name as run (e.g. ``"anderson"``, ``"plain[compiled×16]"``)
    solver: str
    #: ``(B, K)`` residual history, or the column blocks it is concatenated from on first read
    #: (:attr:`residuals`; a converged solve whose history nobody reads never concatenates)
    residuals_: torch.Tensor | tuple[torch.Tensor, ...]
    #: (B,) iterations until the sample first met tol (or K); None: computed on first access
    iterations_: torch.Tensor | None
    #: ``(B,)`` bool: the returned iterate of each sample meets ``tol`` (None: made from
    #: ``returned_residual`` on first read)
    converged: torch.Tensor | None
    #: the tolerance the solve stopped at
    tol: float
    #: ``(B,)`` bool: the sample produced NaN/Inf (then it is not converged; None: all False)
    nonfinite: torch.Tensor | None = field(default=None)
    #: residual of the returned iterate per sample (None: the minimum of ``residuals``)
    returned_residual: torch.Tensor | None = field(default=None)
    #: True when the solver knows every sample converged (saves a device synchronisation)
    all_converged: bool | None = field(default=None)
    #: (not a field) ``f`` at the returned iterate, as the solver computed it, when it did
    #: (:meth:`Tracker.stats`; None otherwise): the emitted module linearises ``T`` there
    #: without evaluating it again, and drops it (it is never pickled)
    image = None
    #: (not a field) ``||f(z)||₂`` of each returned iterate ``(B,)``, float64, where the solver
    #: recorded its image (None otherwise): with ``returned_residual`` it gives the absolute
    #: residual ``||f(z) − z||`` the a posteriori error bound reads (docs/theory.md §9.6)
    image_norm = None
    #: (not a field) the content keys of the weights the solve ran with (the emitted module
    #: stamps its forward's statistics; None otherwise): a bound read later from these
    #: statistics is refused once the weights have changed
    weights_keys = None

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
            value = meets(d["returned_residual"], d["tol"])
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
                met = meets(res, self.tol)
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
    def abs_residual(self) -> torch.Tensor | None:
        """``||f(z) − z||₂`` of each returned iterate ``(B,)`` in float64 (the relative
        residual times ``max(||f(z)||, 1e-30)``, its definition's floor); None where the solver
        recorded no image norm."""
        if self.image_norm is None:
            return None
        r = self.final_residual.to(torch.float64)
        return r * self.image_norm.to(device=r.device).clamp_min(1e-30)

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


def empty_stats(name: str, z0: torch.Tensor, tol: float) -> SolverStats:
    """Statistics of a solve over zero samples: nothing iterated, nothing failed."""
    rdt = torch.float32 if z0.dtype in (torch.float16, torch.bfloat16) else z0.dtype
    dev = z0.device
    none = torch.zeros(0, dtype=torch.bool, device=dev)
    return SolverStats(name, torch.zeros(0, 0, dtype=rdt, device=dev),
                       torch.zeros(0, dtype=torch.long, device=dev), none, tol, none.clone(),
                       torch.zeros(0, dtype=rdt, device=dev), True)
