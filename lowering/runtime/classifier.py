"""A derived equilibrium layer as an image/signal classifier, with the settings that train.

``EquilibriumClassifier(derived)``: ``x ↦ z*(x) ↦ pool each state block ↦ concatenate ↦ linear``
(``logits = A·[P(z*_1); …; P(z*_k)] + c``, ``P`` adaptive max/average pooling to at most
``pooled`` positions per spatial axis).  The pooling never shrinks an axis below 1, so a
``(C, 1, W)`` or ``(C, L)`` state (1-D signals) is handled like a ``(C, H, W)`` one; a multi-block
layer (MOptEq branches) has each branch pooled separately and the features concatenated (branch
fusion by concatenation).

:class:`TrainingSettings` holds the module options under which equilibrium layers train well
(looser tolerance than the module default, a capped iteration count, non-convergence reported as a
warning so that one slow batch does not abort an epoch, weight control of the certified norms);
:meth:`EquilibriumClassifier.solver_stats` returns the forward and backward solver statistics of
the last step as a :class:`StepStats`, and :class:`StatsMeter` averages them over an epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from convex_eq.errors import OptionError
from lowering.perturbation import Cascade

from .solvers import SolverStats
from .weight_control import controlled_conditions

POOLS = ("max", "avg", "none")


@dataclass
class TrainingSettings:
    """Module options for training: stop the forward solve at relative residual ``tol`` or after
    ``max_iter`` iterations (the adjoint after ``backward_factor·max_iter``, with
    ``backward_solver``, by default the forward's), report a solve
    that stops at its cap as a warning (``on_nonconvergence``), keep certified norms (and
    ``weight_bounds``) below their bounds minus ``margin`` by spectral-norm control."""

    solver: str = "anderson"
    #: the adjoint's solver (None: ``solver``); ``"auto"`` takes a direct solve when small,
    #: conjugate gradients on a symmetric adjoint system (the canonical OptEq's), else plain
    #: iteration continued by Anderson (docs/theory.md §8)
    backward_solver: str | None = None
    tol: float = 1e-4
    max_iter: int = 40
    backward_factor: int = 2
    on_nonconvergence: str = "warn"
    margin: float = 0.02
    weight_bounds: dict[str, float] | None = None
    dtype: torch.dtype = torch.float32
    backward: str = "implicit"
    #: keep ``Lip(x ↦ z*) ≤ lipschitz_target`` during training by weight control (None: off):
    #: the injection weights and the certificate's controlled weights get the norm bounds of
    #: :func:`~lowering.runtime.robustness.lipschitz_weight_bounds` (``Lip(T) ≤
    #: contraction_target``), merged with ``weight_bounds`` (the smaller bound wins)
    lipschitz_target: float | None = None
    contraction_target: float = 0.5

    def module_options(self, derived: Any) -> dict[str, Any]:
        """Keyword options of ``derived.torch_module`` (spectral-norm weight control when the
        certificate has ``||A||₂ ≤ bound`` conditions, ``weight_bounds`` names weights or a
        ``lipschitz_target`` is set)."""
        bounds = dict(self.weight_bounds or {})
        if self.lipschitz_target is None and self.contraction_target != 0.5:
            raise OptionError("contraction_target applies only together with a "
                              "lipschitz_target", term="TrainingSettings",
                              hint="set lipschitz_target, or leave contraction_target at 0.5")
        if self.lipschitz_target is not None:
            from .robustness import lipschitz_weight_bounds

            for n, b in lipschitz_weight_bounds(derived, self.lipschitz_target,
                                                self.contraction_target).items():
                bounds[n] = min(b, bounds.get(n, b))
        # (conditions on trainable weights: one on a fixed constant holds as declared)
        wc = "spectral_norm" if controlled_conditions(derived) or bounds else None
        return {"solver": self.solver, "tol": self.tol, "max_iter": self.max_iter,
                "backward": self.backward, "backward_solver": self.backward_solver,
                "backward_max_iter": self.backward_factor * self.max_iter,
                "on_nonconvergence": self.on_nonconvergence, "weight_control": wc,
                "weight_bounds": bounds or None, "margin": self.margin,
                "dtype": self.dtype}


@dataclass
class SolveSummary:
    """One solve over a batch: mean iterations, samples that missed ``tol``, worst residual."""

    iterations: float
    unconverged: int
    batch: int
    max_residual: float

    @classmethod
    def of(cls, st: SolverStats) -> SolveSummary:
        return cls(float(st.iterations.double().mean()), int((~st.converged).sum()),
                   int(st.converged.numel()), float(st.max_residual))


@dataclass
class StepStats:
    """Solver statistics of one training step: ``forward`` (the equilibrium solve) and
    ``backward`` (the adjoint solve of implicit differentiation; None when there was none, e.g.
    in evaluation or with ``backward='phantom'``/``'unroll'``)."""

    forward: SolveSummary | None
    backward: SolveSummary | None


@dataclass
class StatsMeter:
    """Averages :class:`StepStats` over the steps of an epoch.

    ``summary()``: ``fwd_iters``/``bwd_iters`` (mean iterations per step), ``fwd_capped`` /
    ``bwd_capped`` (steps in which some sample stopped at the iteration cap before ``tol``),
    ``fwd_max_residual``/``bwd_max_residual`` (worst over the epoch)."""

    steps: list[StepStats] = field(default_factory=list)

    def update(self, st: StepStats) -> None:
        self.steps.append(st)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for side in ("forward", "backward"):
            xs = [getattr(s, side) for s in self.steps if getattr(s, side) is not None]
            key = "fwd" if side == "forward" else "bwd"
            if not xs:
                out.update({f"{key}_iters": math.nan, f"{key}_capped": 0,
                            f"{key}_max_residual": math.nan})
                continue
            out[f"{key}_iters"] = sum(x.iterations for x in xs) / len(xs)
            out[f"{key}_capped"] = sum(x.unconverged > 0 for x in xs)
            out[f"{key}_max_residual"] = max(x.max_residual for x in xs)
        return out


def _pool(kind: str, block_shape: tuple[int, ...], pooled: int) -> tuple[nn.Module, int]:
    """Pooling of one state block and the number of features it leaves."""
    if kind not in POOLS:
        raise OptionError(f"unknown pool {kind!r}", term="EquilibriumClassifier",
                          hint=f"use one of {POOLS}")
    c, *spatial = block_shape
    if kind == "none" or not spatial:
        return nn.Flatten(), math.prod(block_shape)
    out = tuple(min(pooled, s) for s in spatial)
    if len(spatial) == 1:
        layer: nn.Module = nn.AdaptiveMaxPool1d(out) if kind == "max" else \
            nn.AdaptiveAvgPool1d(out)
    elif len(spatial) == 2:
        layer = nn.AdaptiveMaxPool2d(out) if kind == "max" else nn.AdaptiveAvgPool2d(out)
    else:
        raise OptionError(f"state block of shape {block_shape}: pooling needs (C, L) or "
                          "(C, H, W)", term="EquilibriumClassifier", hint="use pool='none'")
    return nn.Sequential(layer, nn.Flatten()), c * math.prod(out)


class EquilibriumClassifier(nn.Module):
    """``logits = Linear(concat_i pool(z*_i(x)))`` on a derived equilibrium layer.

    ``derived``: a :class:`~lowering.derived.DerivedLayer` (``lowering.lower(objective)``);
    ``settings``: the module options (:class:`TrainingSettings`); ``pool``: ``"max"``,
    ``"avg"`` or ``"none"`` (flatten); ``pooled``: positions kept per spatial axis (never more
    than the axis has: 1-row states work); ``classes``: output size.  A layer with one input
    per branch reads the same ``x`` in every branch, or, in training mode with ``cascade``
    (:func:`lowering.perturbation.cascade`), the perturbation-enhanced inputs
    ``x - δ_{i-1}``.  ``input_shape``: reshape each sample to it first (e.g. a ``(C, L)``
    signal read by a layer declared on ``(C, 1, L)`` images)."""

    def __init__(self, derived: Any, settings: TrainingSettings | None = None, *,
                 pool: str = "max", pooled: int = 4, classes: int = 10,
                 cascade: Cascade | None = None, input_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.settings = settings or TrainingSettings()
        self.eq = derived.torch_module(**self.settings.module_options(derived))
        self.input_names = [s.name for s in derived.inputs]
        if cascade is not None and cascade.branches != self.input_names:
            raise OptionError(f"the cascade's branches {cascade.branches} are not the layer's "
                              f"inputs {self.input_names}", term="EquilibriumClassifier",
                              hint="build the cascade from the same objective")
        self.cascade = cascade
        pools, width = [], 0
        for b in derived.blocks:
            p, k = _pool(pool, tuple(b.shape), pooled)
            pools.append(p)
            width += k
        self.pools = nn.ModuleList(pools)
        self.fc = nn.Linear(width, classes, dtype=self.settings.dtype)
        self.features_dim = width

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input: ``x`` in the module's dtype, reshaped to ``input_shape``."""
        x = x.to(self.settings.dtype)
        return x if self.input_shape is None else x.reshape(x.shape[0], *self.input_shape)

    def features(self, x: torch.Tensor) -> Any:
        """The equilibrium ``z*(x)`` (a tensor, or a tuple of blocks) of the shared input."""
        return self.eq(self._shared(self.prepare(x)))

    def measure(self, x: torch.Tensor) -> SolverStats:
        """Forward solver statistics on ``x`` (evaluation mode, no gradient)."""
        self.eval()
        with torch.no_grad():
            _, st = self.eq(self._shared(self.prepare(x)), return_stats=True)
        return st

    def _shared(self, x: torch.Tensor) -> Any:
        return x if len(self.input_names) == 1 else {n: x for n in self.input_names}

    def layer_inputs(self, x: torch.Tensor) -> Any:
        """What the equilibrium layer reads for ``x`` (clean): the prepared tensor, or a dict
        giving it to every branch input."""
        return self._shared(self.prepare(x))

    def _equilibrium(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> Any:
        if sample_ids is not None:
            if self.cascade is not None and self.training:
                raise OptionError("warm starts (sample_ids) do not apply to a perturbation "
                                  "cascade: its second solve reads inputs that change with the "
                                  "weights", term="EquilibriumClassifier",
                                  hint="train the cascade without warm starts")
            return self.eq(self._shared(x), sample_ids=sample_ids)
        if self.cascade is None or not self.training:
            return self.eq(self._shared(x))
        with torch.no_grad():
            z = self.eq(self._shared(x))
            blocks = z if isinstance(z, tuple) else (z,)
            states = {b.name: t.reshape(t.shape[0], -1)
                      for b, t in zip(self.eq.blocks, blocks)}
            inputs = self.cascade.inputs(x, states, self.eq.env())
        return self.eq(inputs)

    def pooled_features(self, z: Any) -> torch.Tensor:
        """``[P(z_1); …; P(z_k)]`` of an equilibrium (one row per sample)."""
        blocks = z if isinstance(z, tuple) else (z,)
        return torch.cat([p(b) for p, b in zip(self.pools, blocks)], dim=1)

    def forward(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; ``sample_ids``: the samples' dataset indices, whose last equilibria start
        their solves (after :meth:`enable_warm_start`)."""
        return self.fc(self.pooled_features(self._equilibrium(self.prepare(x), sample_ids)))

    def enable_warm_start(self, size: int) -> Any:
        """Warm starts of the equilibrium layer for ``size`` samples
        (:meth:`~lowering.runtime.module.EquilibriumModule.enable_warm_start`)."""
        if self.cascade is not None:
            raise OptionError("warm starts do not apply to a perturbation cascade",
                              term="EquilibriumClassifier", hint="train it without them")
        return self.eq.enable_warm_start(size)

    def solver_stats(self) -> StepStats:
        """Forward and backward solver statistics of the last forward / backward pass."""
        f, b = self.eq.last_stats, self.eq.last_backward_stats
        return StepStats(SolveSummary.of(f) if f is not None else None,
                         SolveSummary.of(b) if b is not None else None)

    def certified_radius(self, x: torch.Tensor) -> Any:
        """Per sample of ``x``: prediction, margin, error bound and certified ℓ2 radius of the
        exact equilibrium classifier (:func:`lowering.runtime.robustness.certified_radius`;
        docs/theory.md §9.6)."""
        from .robustness import certified_radius

        return certified_radius(self, x)

    def reset_stats(self) -> None:
        """Forget the statistics of earlier passes (so a pass without an adjoint solve reports
        ``backward=None`` instead of an older one)."""
        self.eq.last_stats = None
        self.eq.last_backward_stats = None
