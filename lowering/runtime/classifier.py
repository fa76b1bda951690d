"""A derived equilibrium layer as an image/signal classifier, with the settings that train.

``EquilibriumClassifier(derived)``: ``x ↦ g(x) ↦ z*(g(x)) ↦ pool each block ↦ concatenate ↦
linear`` (``g`` an optional stem)
(``logits = A·[P(z*_1); …; P(z*_k)] + c``, ``P`` adaptive max/average pooling to at most
``pooled`` positions per spatial axis).  The pooling never shrinks an axis below 1, so a
``(C, 1, W)`` or ``(C, L)`` state (1-D signals) is handled like a ``(C, H, W)`` one; a multi-block
layer (MOptEq branches) has each branch pooled separately and the features concatenated (branch
fusion by concatenation, ``fusion="concat"``).  ``fusion="average"`` fuses branches of equal
channels as the GEQ and MDEQ papers do: each branch is brought to a common size by average
pooling (a larger branch) or nearest up-sampling (a smaller one), the branches are averaged, and
the average is pooled and read out (``logits = A·P(mean_i R_i z*_i) + c``).

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
import torch.nn.functional as F
from torch import nn

from convex_eq.errors import OptionError

from .backward import get_backward
from .solvers import SolverStats
from .weight_control import controlled_conditions

POOLS = ("max", "avg", "none")
#: how the state blocks of a multi-block layer are fused before the linear readout
FUSIONS = ("concat", "average")


@dataclass
class TrainingSettings:
    """Module options for training: stop the forward solve at relative residual ``tol`` or after
    ``max_iter`` iterations (the adjoint after ``backward_factor·max_iter``, with
    ``backward_solver``, by default the forward's), report a solve
    that stops at its cap as a warning (``on_nonconvergence``), keep certified norms (and
    ``weight_bounds``) below their bounds minus ``margin`` by spectral-norm control."""

    #: the forward solver
    solver: str = "anderson"
    #: keyword options of the forward solver (e.g. Anderson's memory: ``{"m": 3}``)
    solver_options: dict[str, Any] | None = None
    #: the adjoint's solver (None: ``solver``); ``"auto"`` takes a direct solve when small,
    #: conjugate gradients on a symmetric adjoint system (the canonical OptEq's), else plain
    #: iteration continued by Anderson (docs/theory.md §8)
    backward_solver: str | None = None
    #: relative-residual tolerance of the forward and adjoint solves
    tol: float = 1e-4
    #: forward iteration cap
    max_iter: int = 40
    #: the adjoint's iteration cap is ``backward_factor·max_iter``
    backward_factor: int = 2
    #: what a solve that stops at its cap does (``"warn"``: training goes on with the best
    #: iterate; the training loop counts these steps)
    on_nonconvergence: str = "warn"
    #: controlled norms stay at most ``bound − margin``
    margin: float = 0.02
    #: extra spectral-norm bounds per weight name
    weight_bounds: dict[str, float] | None = None
    #: dtype of the layer and the head
    dtype: torch.dtype = torch.float32
    #: the backward strategy (``"implicit"``, ``"phantom"``, ``"unroll"``)
    backward: str = "implicit"
    #: weights reparametrised as ``g·V/||V||`` (weight normalisation, never also under
    #: spectral-norm control: :mod:`lowering.runtime.weight_control`)
    weight_normalization: tuple[str, ...] = ()
    #: keep ``Lip(x ↦ z*) ≤ lipschitz_target`` during training by weight control (None: off):
    #: the injection weights and the certificate's controlled weights get the norm bounds of
    #: :func:`~lowering.runtime.robustness.lipschitz_weight_bounds` (``Lip(T) ≤
    #: contraction_target``), merged with ``weight_bounds`` (the smaller bound wins)
    lipschitz_target: float | None = None
    #: the bound on ``Lip(T)`` the controlled weights' bounds give under ``lipschitz_target``
    #: (refused without one)
    contraction_target: float = 0.5

    def module_options(self, derived: Any) -> dict[str, Any]:
        """Keyword options of ``derived.torch_module`` (spectral-norm weight control when the
        certificate has ``||A||₂ ≤ bound`` conditions, ``weight_bounds`` names weights or a
        ``lipschitz_target`` is set)."""
        bounds = dict(self.weight_bounds or {})
        kept: set[str] = set()  # (weights the Lipschitz target bounds)
        if self.lipschitz_target is None and self.contraction_target != 0.5:
            raise OptionError("contraction_target applies only together with a "
                              "lipschitz_target", term="TrainingSettings",
                              hint="set lipschitz_target, or leave contraction_target at 0.5")
        if self.lipschitz_target is not None:
            from .robustness import lipschitz_weight_bounds

            for n, b in lipschitz_weight_bounds(derived, self.lipschitz_target,
                                                self.contraction_target).items():
                bounds[n] = min(b, bounds.get(n, b))
                kept.add(n)
        # (conditions on trainable weights: one on a fixed constant holds as declared)
        controlled = controlled_conditions(derived)
        both = sorted(set(self.weight_normalization) & ({n for _, n, _ in controlled} | kept))
        if both:
            raise OptionError(f"weight_normalization of {both} conflicts with the spectral-norm "
                              "control the certificate's norm conditions (or the Lipschitz "
                              "target) ask for", term="TrainingSettings", hint="normalise other "
                              "weights, or build the module with derived.torch_module("
                              "weight_control=None, weight_normalization=...)")
        wc = "spectral_norm" if controlled or bounds else None
        adjoint = ({"backward_solver": self.backward_solver,
                    "backward_max_iter": self.backward_factor * self.max_iter}
                   if getattr(get_backward(self.backward), "solves_adjoint", True) else {})
        if not adjoint and self.backward_solver is not None:
            raise OptionError(f"backward_solver={self.backward_solver!r} configures the adjoint "
                              f"solve; backward={self.backward!r} solves none",
                              term="TrainingSettings", hint="drop backward_solver, or use "
                              "backward='implicit'")
        return {"solver": self.solver, "solver_options": dict(self.solver_options or {}),
                "tol": self.tol, "max_iter": self.max_iter, "backward": self.backward, **adjoint,
                "on_nonconvergence": self.on_nonconvergence, "weight_control": wc,
                "weight_bounds": bounds or None, "margin": self.margin,
                "dtype": self.dtype, "weight_normalization": self.weight_normalization}


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


class AverageFusion(nn.Module):
    """``mean_i R_i z_i``: every block resampled to ``size`` (average pooling by the integer
    factor where a block is larger, nearest up-sampling where it is smaller), then averaged."""

    def __init__(self, shapes: list[tuple[int, ...]], size: tuple[int, ...] | None = None):
        super().__init__()
        if len(shapes) < 2:
            raise OptionError("fusion='average' averages several branches; this layer has one "
                              "state block", term="EquilibriumClassifier",
                              hint="use fusion='concat' (the default)")
        if len({s[0] for s in shapes}) > 1 or len({len(s) for s in shapes}) > 1 \
                or len(shapes[0]) not in (2, 3):
            raise OptionError(f"fusion='average' needs branches of equal channels on grids of "
                              f"the same dimension ((C, L) or (C, H, W)); the blocks are "
                              f"{shapes}", term="EquilibriumClassifier",
                              hint="use fusion='concat', or branches of equal channels "
                              "(e.g. models.conv_geq)")
        self.size = tuple(size) if size is not None else tuple(shapes[0][1:])
        if len(self.size) != len(shapes[0]) - 1:
            raise OptionError(f"fused_size {self.size} has {len(self.size)} axes, the blocks "
                              f"{len(shapes[0]) - 1}", term="EquilibriumClassifier")
        for s in shapes:
            if any(n % t and t % n for n, t in zip(s[1:], self.size)):
                raise OptionError(f"a block of size {s[1:]} is not an integer factor of the "
                                  f"fused size {self.size} (or a multiple of it) on every axis",
                                  term="EquilibriumClassifier",
                                  hint="choose fused_size so that average pooling or nearest "
                                  "up-sampling by an integer factor reaches it from every block")
        self.shapes = [tuple(s) for s in shapes]

    @property
    def shape(self) -> tuple[int, ...]:
        """The fused map's shape ``(C, *size)``."""
        return (self.shapes[0][0], *self.size)

    def resample(self, z: torch.Tensor) -> torch.Tensor:
        """One block ``(B, C, *n)`` to ``(B, C, *size)``."""
        n = tuple(z.shape[2:])
        down = tuple(max(1, a // t) for a, t in zip(n, self.size))
        if any(k > 1 for k in down):
            pool = F.avg_pool1d if z.ndim == 3 else F.avg_pool2d
            z = pool(z, down, down)
        if tuple(z.shape[2:]) != self.size:
            z = F.interpolate(z, size=self.size, mode="nearest")
        return z

    def forward(self, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``mean_i R_i z_i`` of the blocks ``(B, *shape_i)``."""
        return torch.stack([self.resample(b) for b in blocks]).mean(dim=0)


class EquilibriumClassifier(nn.Module):
    """``logits = Linear(concat_i pool(z*_i(g(x))))`` on a derived equilibrium layer.

    ``derived``: a :class:`~lowering.derived.DerivedLayer` (``lowering.lower(objective)``, or a
    layer edited after it, e.g. :func:`lowering.perturbation_enhanced`); ``settings``: the
    module options (:class:`TrainingSettings`); ``stem``: a module computing the feature
    ``g(x)`` the layer reads (trained with it; None: ``g(x) = x``); ``pool``: ``"max"``,
    ``"avg"`` or ``"none"`` (flatten); ``pooled``: positions kept per spatial axis (never more
    than the axis has: 1-row states work); ``classes``: output size.  A layer with one input
    per branch reads the same ``g(x)`` in every branch.  ``input_shape``: reshape each sample
    to it first (e.g. a ``(C, L)`` signal read by a layer declared on ``(C, 1, L)`` images).
    ``fusion``: ``"concat"`` (pool each output block, concatenate) or ``"average"``
    (:class:`AverageFusion` to ``fused_size``, by default the first block's size, then pool);
    ``"average"`` is refused with a typed error where it does not apply (one block, unequal
    channels, sizes without integer factors)."""

    def __init__(self, derived: Any, settings: TrainingSettings | None = None, *,
                 pool: str = "max", pooled: int = 4, classes: int = 10,
                 stem: nn.Module | None = None, input_shape: tuple[int, ...] | None = None,
                 fusion: str = "concat", fused_size: tuple[int, ...] | None = None):
        super().__init__()
        if fusion not in FUSIONS:
            raise OptionError(f"unknown fusion {fusion!r}", term="EquilibriumClassifier",
                              hint=f"use one of {FUSIONS}")
        if fused_size is not None and fusion != "average":
            raise OptionError("fused_size applies to fusion='average' only",
                              term="EquilibriumClassifier", hint="pass fusion='average' too")
        self.fusion = (AverageFusion([tuple(b.shape) for b in derived.output_blocks], fused_size)
                       if fusion == "average" else None)
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.settings = settings or TrainingSettings()
        self.stem = stem.to(self.settings.dtype) if stem is not None else None
        self.eq = derived.torch_module(**self.settings.module_options(derived))
        self.input_names = [s.name for s in derived.inputs]
        shapes = [self.fusion.shape] if self.fusion is not None else \
            [tuple(b.shape) for b in derived.output_blocks]
        pools, width = [], 0
        for shape in shapes:
            p, k = _pool(pool, shape, pooled)
            pools.append(p)
            width += k
        self.pools = nn.ModuleList(pools)
        self.fc = nn.Linear(width, classes, dtype=self.settings.dtype)
        self.features_dim = width

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input ``g(x)``: ``x`` in the module's dtype, reshaped to
        ``input_shape``, through the stem."""
        x = x.to(self.settings.dtype)
        x = x if self.input_shape is None else x.reshape(x.shape[0], *self.input_shape)
        return x if self.stem is None else self.stem(x)

    def features(self, x: torch.Tensor) -> Any:
        """The equilibrium ``z*(g(x))`` (a tensor, or a tuple of blocks)."""
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
        """What the equilibrium layer reads for ``x``: ``g(x)``, or a dict giving it to every
        branch input."""
        return self._shared(self.prepare(x))

    def _equilibrium(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> Any:
        if sample_ids is not None:
            return self.eq(self._shared(x), sample_ids=sample_ids)
        return self.eq(self._shared(x))

    def pooled_features(self, z: Any) -> torch.Tensor:
        """``[P(z_1); …; P(z_k)]`` of an equilibrium (one row per sample); ``P(mean_i R_i z_i)``
        with ``fusion="average"``."""
        blocks = z if isinstance(z, tuple) else (z,)
        if self.fusion is not None:
            blocks = (self.fusion(blocks),)
        return torch.cat([p(b) for p, b in zip(self.pools, blocks)], dim=1)

    def forward(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None,
                jacobian_penalty: bool = False) -> Any:
        """The logits; ``sample_ids``: the samples' dataset indices, whose last equilibria start
        their solves (after :meth:`enable_warm_start`); ``jacobian_penalty``: return ``(logits,
        penalty)`` with the layer's Jacobian penalty at this equilibrium
        (:meth:`~lowering.runtime.module.EquilibriumModule.jacobian_penalty`)."""
        g = self.prepare(x)
        z = self._equilibrium(g, sample_ids)
        logits = self.fc(self.pooled_features(z))
        if not jacobian_penalty:
            return logits
        return logits, self.eq.jacobian_penalty(self._shared(g), z)

    def enable_warm_start(self, size: int) -> Any:
        """Warm starts of the equilibrium layer for ``size`` samples
        (:meth:`~lowering.runtime.module.EquilibriumModule.enable_warm_start`)."""
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
