"""Options of the emitted module, grouped into small validated dataclasses.

``derived.torch_module(**options)`` accepts the flat keywords listed in :data:`FLAT_OPTIONS`
(the documented API) or ``config=ModuleConfig(...)``; both build the same
:class:`ModuleConfig`.  See ``docs/guide.md`` (the emitted module) and ``docs/theory.md`` §8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from convex_eq.errors import OptionError

from .backward import ADJOINT_METHODS, get_backward
from .sam import SAMConfig
from .solvers import get_solver
from .solvers.registry import check_options

ON_FAIL = ("raise", "warn", "mask")
CONTROL_MODES = ("auto", "spectral_norm", "project", None)


@dataclass
class SolveConfig:
    """Forward fixed-point solve: ``solver`` from the registry, stop at relative residual ``tol``
    or after ``max_iter`` iterations; ``options`` go to the solver (e.g. Anderson's ``m``).
    The default ``"auto"`` runs plain iteration on small states while it converges fast and
    Anderson otherwise (:func:`lowering.runtime.solvers.auto.auto`; docs/theory.md §8)."""

    #: forward fixed-point solver: ``"auto"`` (plain iteration on states under 256 entries
    #: while it converges fast, Anderson otherwise, decided from the residuals), ``"anderson"``,
    #: ``"plain"``, ``"broyden"``, or one added with ``lowering.register_solver``
    #: (docs/theory.md §8)
    solver: str = "auto"
    #: stop a sample when its relative residual ``||T(z) − z|| / ||T(z)||`` is at most ``tol``
    tol: float = 1e-6
    #: iteration cap; a sample still above ``tol`` then returns its best iterate and is
    #: reported by ``on_nonconvergence``
    max_iter: int = 100
    #: keyword options passed to the solver (e.g. Anderson's memory ``m``)
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.solve_fn()
        if not (self.tol > 0 and math.isfinite(self.tol)) or int(self.max_iter) < 1:
            raise OptionError(f"tol = {self.tol} must be > 0 and max_iter = {self.max_iter} ≥ 1",
                              term="torch_module")
        self.tol, self.max_iter = float(self.tol), int(self.max_iter)

    def solve_fn(self) -> Any:
        """The registered solver; options it does not take are refused (checked on every call
        too: the config is mutable)."""
        check_options(self.solver, self.options)
        return get_solver(self.solver)


@dataclass
class BackwardConfig:
    """Backward strategy (``implicit`` | ``phantom`` | ``unroll``) and its numerics.  The adjoint
    fixed point of ``implicit`` uses ``solver``/``tol``/``max_iter`` (None: the forward's)."""

    #: ``"implicit"``: exact implicit differentiation (second order too; a third raises
    #: ``OptionError``); ``"phantom"``: the gradient of the last ``phantom_steps`` damped
    #: applications of ``T`` (first order only); ``"unroll"``: autograd through
    #: ``unroll_steps`` iterations; or a strategy added with ``lowering.register_backward``
    mode: str = "implicit"
    #: solver of the implicit adjoint fixed point (None: the forward's)
    solver: str | None = None
    #: tolerance of the adjoint fixed point (None: the forward's)
    tol: float | None = None
    #: iteration cap of the adjoint fixed point (None: the forward's)
    max_iter: int | None = None
    #: the phantom gradient's number of steps ``k``
    phantom_steps: int = 1
    #: the phantom gradient's damping, in ``(0, 1]``
    phantom_damping: float = 1.0
    #: iterations unrolled by ``mode="unroll"`` (its forward is those iterations)
    unroll_steps: int = 20
    #: how the adjoint system is solved: ``"direct"`` forms each sample's Jacobian and
    #: LU-solves (residual measured with the true Jacobian; iterative fallback),
    #: ``"iterative"`` runs the adjoint solver, ``"auto"`` is direct for small problems and,
    #: with the adjoint solver ``"auto"``, conjugate gradients where the adjoint system is
    #: symmetric (docs/theory.md §8)
    adjoint: str = "auto"

    def __post_init__(self) -> None:
        self.strategy()
        if self.adjoint not in ADJOINT_METHODS:
            raise OptionError(f"backward_adjoint = {self.adjoint!r} is not one of "
                              f"{ADJOINT_METHODS}", term="torch_module",
                              hint="'auto' forms the Jacobian when it is small, 'direct' always, "
                              "'iterative' never")
        if self.solver is not None:
            get_solver(self.solver)
        if self.tol is not None and not self.tol > 0:
            raise OptionError(f"backward_tol = {self.tol} must be > 0", term="torch_module")
        if self.max_iter is not None and int(self.max_iter) < 1:
            raise OptionError(f"backward_max_iter = {self.max_iter} must be ≥ 1",
                              term="torch_module")
        if int(self.phantom_steps) < 1 or int(self.unroll_steps) < 1:
            raise OptionError("phantom_steps ≥ 1 and unroll_steps ≥ 1 required",
                              term="torch_module")
        if not 0 < self.phantom_damping <= 1:
            raise OptionError(f"phantom_damping = {self.phantom_damping} must lie in (0, 1]",
                              term="torch_module")

    def strategy(self) -> Any:
        """The registered strategy of ``mode``; adjoint options set for a strategy that solves
        no adjoint are refused (checked on every call too: the config is mutable)."""
        strategy = get_backward(self.mode)
        if not getattr(strategy, "solves_adjoint", True):
            given = [f"backward_{k}" for k, v in (("solver", self.solver), ("tol", self.tol),
                                                  ("max_iter", self.max_iter)) if v is not None]
            given += ["backward_adjoint"] if self.adjoint != "auto" else []
            if given:
                verb = "configures" if len(given) == 1 else "configure"
                raise OptionError(f"{', '.join(given)} {verb} the adjoint solve of the "
                                  f"implicit backward; backward={self.mode!r} solves none",
                                  term="torch_module", hint="drop them, or use "
                                  "backward='implicit'")
        return strategy


@dataclass
class WeightControlConfig:
    """Keep ``||A||₂ ≤ bound − margin`` for every weight with a norm condition in the
    certificate.  ``mode``: ``"auto"`` (``spectral_norm`` when the certificate has such a
    condition, nothing otherwise), ``"spectral_norm"`` (differentiable rescaling by an upper
    bound of the norm), ``"project"`` (in-place rescaling of the stored parameter), None (off)."""

    #: keeps every norm condition ``||A||₂ ≤ bound`` of the certificate during training:
    #: ``"auto"`` is ``"spectral_norm"`` when the certificate has such a condition on a
    #: trainable tensor and off otherwise; ``"spectral_norm"`` rescales the weight
    #: differentiably by a guaranteed upper bound of its norm; ``"project"`` rescales the stored
    #: parameter in place before a training forward; None turns it off
    mode: str | None = "auto"
    #: the controlled norm stays at most ``bound − margin``
    margin: float = 0.01
    #: extra bounds per weight name (``{"W": 1.0}``), kept like the certificate's
    bounds: dict[str, float] | None = None
    #: weights reparametrised as ``W = g·V/||V||`` per output row or filter (weight
    #: normalisation, :mod:`lowering.runtime.weight_control`); never also under norm control
    normalized: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.normalized, str):
            self.normalized = (self.normalized,)
        self.normalized = tuple(self.normalized or ())
        if not all(isinstance(n, str) for n in self.normalized):
            raise OptionError(f"weight_normalization = {self.normalized!r} must name weights",
                              term="torch_module", hint="e.g. weight_normalization=('W',)")
        both = sorted(set(self.normalized) & set(self.bounds or {}))
        if both:
            raise OptionError(f"weight(s) {both} would be under two controls: weight_bounds "
                              "(spectral-norm control) and weight_normalization",
                              term="torch_module", hint="name each weight in one of them only")
        if self.mode not in CONTROL_MODES:
            raise OptionError(f"unknown weight_control {self.mode!r}", term="torch_module",
                              hint=f"use one of {CONTROL_MODES}")
        if not 0 <= self.margin < 1:
            raise OptionError(f"margin = {self.margin} must lie in [0, 1)", term="torch_module")
        if self.bounds and self.mode is None:
            raise OptionError("weight_bounds needs weight control (weight_control='auto', "
                              "'spectral_norm' or 'project'); it is None here",
                              term="torch_module")


@dataclass
class ModuleConfig:
    """Everything that configures an :class:`~lowering.EquilibriumModule`: the forward solve,
    the backward, weight control and the module-wide options (docs/guide.md, section 3)."""

    #: the forward solve
    forward: SolveConfig = field(default_factory=SolveConfig)
    #: the backward strategy and its adjoint solve
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    #: norm control of the weights during training
    weight_control: WeightControlConfig = field(default_factory=WeightControlConfig)
    #: a sample that does not converge is never silent: ``"raise"`` a ``ConvergenceError`` or
    #: ``"warn"``, naming the samples, the residual reached and the contraction estimate;
    #: ``"mask"`` returns NaN for every failed sample and leaves it out of the backward.
    #: NaN/Inf inputs or iterates raise ``NonFiniteError`` except under ``"mask"``
    on_nonconvergence: str = "raise"
    #: select ``argmin_{Fix T} R`` among many equilibria with the SAM iteration
    #: (docs/theory.md §6); it stops by ``SAMConfig``'s own ``tol`` and ``max_iter``, so the
    #: forward's options are refused beside it
    sam: SAMConfig | None = None
    #: dtype of the parameters and the solve (half precision is solved in float32)
    dtype: torch.dtype = torch.float32
    #: make ``Constant`` symbols trainable too
    learnable_constants: bool = False
    #: inside ``torch.compile``: plain iterations (forward and adjoint, planned layers) run this
    #: many per compiled call (:class:`lowering.runtime.solvers.CompiledSteps`); 0 keeps the
    #: eager loop
    compile_steps: int = 16
    #: warm starts: the number of samples (dataset indices) whose last equilibrium is kept and
    #: used as the start of their next solve (``forward(x, sample_ids=...)``); 0: off.  Only
    #: for layers whose equilibrium the certificate makes unique (docs/guide.md, training speed)
    warm_start: int = 0

    def __post_init__(self) -> None:
        if self.on_nonconvergence not in ON_FAIL:
            raise OptionError(f"on_nonconvergence={self.on_nonconvergence!r}",
                              term="torch_module",
                              hint=f"use one of {ON_FAIL}: non-convergence is never silent")
        if self.sam is not None and self.forward != SolveConfig():
            # SAM stops by its own schedule: a forward tol/max_iter/solver would be ignored,
            # and the flags would read "converged" at SAMConfig.tol, not at the tol passed
            raise OptionError("with sam= the equilibrium is found by the SAM iteration, which "
                              "stops by SAMConfig(tol=..., max_iter=...); the forward solve's "
                              f"options ({self.forward}) would not be used", term="torch_module",
                              hint="set tol / max_iter in SAMConfig, and the adjoint's with "
                              "backward_tol / backward_max_iter / backward_solver")
        if self.sam is not None and self.backward.mode == "unroll":
            raise OptionError("SAM with backward='unroll' is not supported (the unrolled "
                              "iteration is plain T, not SAM's)", term="torch_module",
                              hint="use backward='implicit' or 'phantom' with sam=")
        if isinstance(self.compile_steps, bool) or not isinstance(self.compile_steps, int) \
                or self.compile_steps < 0:
            raise OptionError(f"compile_steps = {self.compile_steps!r} must be an int ≥ 0",
                              term="torch_module",
                              hint="iterations per compiled call under torch.compile; 0 turns "
                              "compiled chunks off")
        if isinstance(self.warm_start, bool) or not isinstance(self.warm_start, int) \
                or self.warm_start < 0:
            raise OptionError(f"warm_start = {self.warm_start!r} must be an int ≥ 0 (the number "
                              "of samples whose equilibria are kept)", term="torch_module")
        if self.warm_start and (self.sam is not None or self.backward.mode == "unroll"):
            raise OptionError("warm_start needs a layer whose output does not depend on where "
                              "its solve starts; "
                              + ("SAM selects among several equilibria" if self.sam is not None
                                 else "backward='unroll' returns the K-th iterate from the start"),
                              term="torch_module", hint="leave warm_start at 0 here")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise OptionError(f"dtype={self.dtype!r} is not a floating dtype",
                              term="torch_module")

    def adjoint_settings(self) -> tuple[str, float, int]:
        """``(solver, tol, max_iter)`` of the adjoint fixed point: the backward's where set, else
        the forward's (one call: the module reads them on every call)."""
        b, f = self.backward, self.forward
        return (b.solver or f.solver, float(b.tol if b.tol is not None else f.tol),
                int(b.max_iter or f.max_iter))

    @property
    def adjoint_solver(self) -> str:
        """Solver of the adjoint fixed point (the backward's, else the forward's)."""
        return self.adjoint_settings()[0]

    @property
    def adjoint_tol(self) -> float:
        """Tolerance of the adjoint fixed point (the backward's, else the forward's)."""
        return self.adjoint_settings()[1]

    @property
    def adjoint_max_iter(self) -> int:
        """Iteration cap of the adjoint fixed point (the backward's, else the forward's)."""
        return self.adjoint_settings()[2]


#: flat keyword → (group, field) of :class:`ModuleConfig`
FLAT_OPTIONS: dict[str, tuple[str | None, str]] = {
    "solver": ("forward", "solver"), "tol": ("forward", "tol"),
    "max_iter": ("forward", "max_iter"), "solver_options": ("forward", "options"),
    "backward": ("backward", "mode"), "backward_solver": ("backward", "solver"),
    "backward_adjoint": ("backward", "adjoint"),
    "backward_tol": ("backward", "tol"), "backward_max_iter": ("backward", "max_iter"),
    "phantom_steps": ("backward", "phantom_steps"),
    "phantom_damping": ("backward", "phantom_damping"),
    "unroll_steps": ("backward", "unroll_steps"),
    "weight_control": ("weight_control", "mode"), "margin": ("weight_control", "margin"),
    "weight_bounds": ("weight_control", "bounds"),
    "weight_normalization": ("weight_control", "normalized"),
    "on_nonconvergence": (None, "on_nonconvergence"), "sam": (None, "sam"),
    "dtype": (None, "dtype"), "learnable_constants": (None, "learnable_constants"),
    "compile_steps": (None, "compile_steps"), "warm_start": (None, "warm_start"),
}


def build_config(config: ModuleConfig | None = None, **options: Any) -> ModuleConfig:
    """A :class:`ModuleConfig` from flat keywords (or ``config`` and no keywords)."""
    if config is not None:
        if options:
            raise OptionError(f"pass either config= or keywords, not both ({sorted(options)})",
                              term="torch_module")
        if not isinstance(config, ModuleConfig):
            raise OptionError(f"config must be a ModuleConfig, got {type(config).__name__}",
                              term="torch_module")
        return config
    unknown = set(options) - set(FLAT_OPTIONS)
    if unknown:
        raise OptionError(f"unknown option(s) {sorted(unknown)}", term="torch_module",
                          hint=f"valid options: {sorted(FLAT_OPTIONS)}")
    groups: dict[str | None, dict[str, Any]] = {}
    for key, value in options.items():
        group, name = FLAT_OPTIONS[key]
        if key == "solver_options":
            value = dict(value or {})
        groups.setdefault(group, {})[name] = value
    kw = dict(groups.get(None, {}))
    kinds = {"forward": SolveConfig, "backward": BackwardConfig,
             "weight_control": WeightControlConfig}
    for group, cls in kinds.items():
        kw[group] = cls(**groups.get(group, {}))
    return ModuleConfig(**kw)


__all__ = ["FLAT_OPTIONS", "BackwardConfig", "ModuleConfig", "SolveConfig",
           "WeightControlConfig", "build_config"]
