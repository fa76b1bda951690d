"""Weight control: ``||A||₂ ≤ bound − margin`` for every weight named in a norm condition of
the certificate (docs/guide.md, weight control).

* ``W ↦ W · min(1, (bound − margin) / ||A(W)||₂)``: a weight within its target is used as it is
  (the declared layer, bit for bit); one above it is rescaled to norm ``bound − margin``;
* ``||A||₂`` is the exact norm of the operator ``T`` applies (zero padding, stride, groups):
  a dense SVD when small, power iteration to a relative change of 1e-7 otherwise
  (:mod:`lowering.runtime.norms`), measured once per version of the weight (its content key,
  :mod:`lowering.runtime.versions`); a guaranteed upper bound (a convolution's Fourier bound)
  skips the measurement when it already proves the target, and in training replaces it for
  operators above :data:`EXACT_EVERY_VERSION_ENTRIES` entries (the weight is then rescaled by
  that bound: certified, slightly conservative, and without an SVD per step);
* the rescaling is differentiable: ``σ = uᵀ A(W) v`` with the measured singular pair, whose
  gradient ``u vᵀ`` is the norm's (first order).

Modes: ``spectral_norm`` rescales functionally (differentiable); ``project`` rescales the stored
parameter in place before each training forward.  The margin (default 0.01) also covers the
power iteration's tolerance.

Weight normalisation (``weight_normalization=(names)``, :func:`normalize_weights`) is the other
control, MDEQ's and the GEQ paper's convergence device (docs/theory.md §3.2): ``W = g·V/||V||``,
one gain per output row (dense) or output filter (convolution), by
``torch.nn.utils.parametrizations.weight_norm`` on the module's weight dictionary.  ``V`` starts
at the declared weight and ``g`` at its row norms, so the layer is unchanged at construction;
training moves ``g`` and ``V`` (``state_dict`` holds them as
``weights.parametrizations.<name>.original0/1``).  It bounds no operator norm, so a certified
condition on a normalised weight is not kept by it, and no weight is put under both controls
(:func:`refuse_double_control`: the spectral rescaling would silently undo the gains).
Parametrized modules pickle only through ``state_dict`` (torch's own refusal says so).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.parametrizations import weight_norm

from convex_eq.errors import OptionError

from .norms import (
    TopPair,
    difference_bound,
    sigma_through,
    top_pair,
    upper_bound,
    upper_bound_tensor,
)
from .versions import Checksums

MODES = ("spectral_norm", "project")


def norm_conditions(derived: Any) -> list[tuple[Any, float]]:
    """``(operator, bound)`` pairs from ``||op||₂ ≤ bound`` conditions of the derivation."""
    conds = []
    for c in certificate_conditions(derived):
        op = getattr(c, "op", None)
        if op is not None and c.sense == "<=":
            conds.append((op, c.bound))
    return conds


#: half-precision dtypes, whose norms are measured in float32
_HALF = (torch.float16, torch.bfloat16)


def controlled_conditions(derived: Any, trainable: Collection[str] | None = None
                          ) -> list[tuple[Any, str, float]]:
    """``(operator, weight name, bound)`` for the norm conditions whose operator reads exactly
    one trainable tensor (``trainable``: their names — the weights, and constants made
    learnable; None: the symbols declared as weights).  A condition on constants alone holds
    as declared and needs no control."""
    out = []
    for op, bound in norm_conditions(derived):
        ws = [s for s in op.symbols()
              if (s.name in trainable if trainable is not None else s.kind == "weight")]
        if len(ws) == 1:
            out.append((op, ws[0].name, bound))
    return out


#: operators up to this many entries (rows × columns) are rescaled by their exact norm in every
#: version (a dense SVD of at most 128 × 128 costs about a millisecond); larger ones with a
#: registered upper bound by that bound, which is loose on small grids (3.5 % above the exact
#: norm for 2 channels on 6 positions) and tight on training sizes (0.6 % for 12 channels on
#: 40 positions)
EXACT_EVERY_VERSION_ENTRIES = 128 * 128


class WeightControlWarning(UserWarning):
    """Weight control changed weights the user declared (they violated the certificate)."""


class UncontrolledConditionWarning(UserWarning):
    """A condition of the certificate reads trained tensors and weight control does not keep it:
    training may leave it false (``EquilibriumModule.certificate_status`` evaluates it)."""


@dataclass(frozen=True)
class ConditionStatus:
    """One condition of the certificate at the module's current (controlled) weights:
    ``value <sense> bound`` with its tolerance, and how training keeps it (:func:`kept_by`)."""

    text: str
    value: float
    bound: float
    sense: str
    holds: bool
    kept: str

    def __str__(self) -> str:
        state = "holds" if self.holds else "VIOLATED"
        return f"{self.text}: now {self.value:.6g} ({state}; {self.kept})"


def certificate_conditions(derived: Any) -> list[Any]:
    """Every condition of the derivation: the certificate's, then the per-layer conditions of a
    composition (``derived.info["conditions"]``) that are not among them."""
    cert = derived.certificate
    out = list(cert.conditions) if cert is not None else []
    out += [c for c in derived.info.get("conditions", []) if all(c is not o for o in out)]
    return out


def kept_by(condition: Any, control: WeightControl | None,
            trainable: Collection[str]) -> str:
    """How a condition is kept during training: ``"weight control"`` (a norm bound whose
    operator is controlled to at most the condition's bound), ``"fixed"`` (it reads no trained
    tensor), or ``"not kept"`` (it reads trained tensors, or its measure's tensors are not
    known and some tensor is trained)."""
    op = getattr(condition, "op", None)
    if op is not None:
        # a target above the bound (weight_bounds={'W': 2.0} for ||W||₂ ≤ 1) keeps nothing;
        # 1e-9: the round-off calibrate() allows a declared weight exactly at its bound
        if control is not None and condition.sense == "<=" and any(
                t[0] is op and t[2] <= condition.bound * (1 + 1e-9) + condition.tol
                for t in control.targets):
            return "weight control"
        reads = [s.name for s in op.symbols()]
    else:
        reads = getattr(condition, "reads", None)
    if reads is None:
        return "not kept" if trainable else "fixed"
    return "not kept" if any(n in trainable for n in reads) else "fixed"


class WeightControl:
    """Keeps ``||A||₂ ≤ target`` for every weight with a spectral-norm condition
    (docs/guide.md, weight control).  The norm is measured once per version of the weight (its
    content key, :mod:`lowering.runtime.versions`): exactly where cheap, by power iteration on
    the actual operator otherwise (:mod:`lowering.runtime.norms`), or rescaled by a registered
    upper bound for large operators (:meth:`_by_bound`); a weight whose norm is within its
    target is used as it is."""

    def __init__(self, derived: Any, mode: str, margin: float,
                 bounds: dict[str, float] | None = None,
                 trainable: Collection[str] | None = None):
        if mode not in MODES:
            raise OptionError(f"unknown weight_control {mode!r}", term="torch_module",
                              hint=f"use one of {MODES}")
        if not 0 <= margin < 1:
            raise OptionError("margin must lie in [0, 1)", term="torch_module")
        self.mode, self.margin = mode, margin
        #: per weight name: ``(content key, TopPair or None, ||A||₂ ≤ target proved by an upper
        #: bound)``, the measurement of the weight version with that key
        self.measured: dict[str, tuple[tuple, TopPair | None, bool]] = {}
        #: per weight name: ``(W₀, its top singular pair)`` of the last exact measurement: later
        #: versions are bounded from it by Weyl's inequality (:func:`norms.difference_bound`),
        #: and their measurements start from its singular vector
        self.anchors: dict[str, tuple[torch.Tensor, TopPair]] = {}
        #: per weight name: ``(content key, its registered upper bound)`` of the last version
        #: rescaled by the bound (:meth:`_by_bound`), reused by calls that build no graph
        self.bounded: dict[str, tuple[tuple, float]] = {}
        self.checksums = Checksums()
        self.targets: list[tuple[Any, str, float]] = []
        #: the certificate's bound of each controlled weight (the warning names it)
        self.bounds: dict[str, float] = {}
        for op, name, bound in controlled_conditions(derived, trainable):
            self.targets.append((op, name, bound - margin))
            self.bounds[name] = bound
        for name, bound in (bounds or {}).items():
            op = _operator_for(derived, name)
            self.targets = [t for t in self.targets if t[1] != name]
            self.targets.append((op, name, bound - margin))
            self.bounds[name] = bound
        if not self.targets:
            raise OptionError("weight control requested but the certificate has no "
                              "||W||₂ ≤ bound condition", term="torch_module",
                              hint="name the weights to control: weight_bounds={'W': 1.0}")

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "measured": {}, "anchors": {}, "bounded": {}}
        state.pop("cache", None)
        state.pop("projected", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("measured", {})
        self.__dict__.setdefault("anchors", {})
        self.__dict__.setdefault("bounded", {})
        self.__dict__.setdefault("checksums", Checksums())
        self.__dict__.setdefault("bounds", {n: t + self.margin for _, n, t in self.targets})

    def measure(self, op: Any, name: str, env: dict, key: tuple | None = None,
                target: float | None = None) -> tuple[TopPair | None, bool]:
        """``(top singular pair, below)`` of ``op`` at ``env`` for the weight version ``key``
        (measured once per version): ``below`` when a guaranteed bound already proves
        ``||op||₂ ≤ target`` — Weyl's inequality from the last exact measurement
        (``||A(W₀)||₂ + ||A(W − W₀)||₂``), or a registered upper bound — and no pair is then
        computed."""
        if key is None:
            key = self.checksums.keys({name: env[name]})[name]
        have = self.measured.get(name)
        if have is not None and have[0] == key and (have[1] is not None or target is not None):
            return have[1], have[2]
        if target is not None and self._proved_below(op, name, env[name], target, have):
            self.measured[name] = (key, None, True)
            return None, True
        anchor = self.anchors.get(name)
        pair = top_pair(op, name, env, anchor[1].v if anchor is not None else None)
        self.measured[name] = (key, pair, False)
        with torch.inference_mode(False):
            self.anchors[name] = (env[name].detach().clone(), pair)
        return pair, False

    def _proved_below(self, op: Any, name: str, w: torch.Tensor, target: float,
                      have: tuple | None) -> bool:
        """Whether a guaranteed bound proves ``||A(w)||₂ ≤ target`` without measuring it."""
        anchor = self.anchors.get(name)
        if anchor is not None and anchor[0].shape == w.shape and anchor[0].device == w.device:
            d = difference_bound(op, w.detach() - anchor[0].to(w.dtype))
            if d is not None and anchor[1].sigma + d <= target:
                return True
        if have is None or have[2]:
            # (an upper bound that did not prove the target for the last version is not
            # tried again: the exact measurement is needed anyway)
            ub = upper_bound(op, name, {name: w})
            return ub is not None and ub <= target
        return False

    def sigma(self, op: Any, name: str, env: dict) -> float:
        """``||op||₂`` at ``env`` (exact to the power iteration's tolerance)."""
        pair, _ = self.measure(op, name, env)
        assert pair is not None
        return pair.sigma

    def calibrate(self, env: dict) -> None:
        """``weight_control='auto'``: never change weights that satisfy the certificate.  A
        weight whose norm ``σ₀`` lies in ``(bound − margin, bound]`` keeps ``σ₀`` as its
        target (the declared layer is unchanged, bit for bit); one above ``bound`` is rescaled
        to ``bound − margin`` with a :class:`WeightControlWarning` naming the condition and the
        measured norm."""
        out = []
        for op, name, target in self.targets:
            bound = target + self.margin
            sig = self.sigma(op, name, env)
            # 1e-9: the round-off of a norm computed in float64 from weights declared exactly at
            # the bound (e.g. singular values 1 by construction) — not a violation
            if target < sig <= bound * (1 + 1e-9):
                target = sig
            elif sig > bound:
                warnings.warn(f"weight control rescales '{name}': the certificate's condition "
                              f"||{op}||₂ ≤ {bound:g} does not hold (||{op}||₂ = {sig:.4g}); "
                              f"the layer uses {name}·{target / sig:.4g}, whose norm is "
                              f"{target:g}", WeightControlWarning, stacklevel=6)
            out.append((op, name, target))
        self.targets = out

    def norms(self, env: dict) -> dict[str, tuple[float, float]]:
        """``name → (||op||₂ of the controlled operator at env, target)``."""
        return {name: (self.sigma(op, name, env), target) for op, name, target in self.targets}

    def __call__(self, module: Any, env: dict, keys: dict[str, tuple] | None = None) -> dict:
        """The controlled weights: a weight within its target as it is; otherwise rescaled,
        functionally (``spectral_norm``, differentiable) or in place before a training forward
        (``project``; in eval mode both rescale functionally, leaving parameters alone).
        ``keys``: the content keys of ``env``'s tensors when the caller has them."""
        env = dict(env)
        for op, name, target in self.targets:
            w = env[name]
            key = keys.get(name) if keys is not None else None
            if self.mode == "project" and module.training:
                env[name] = self._project(module, op, name, env, key, target)
                continue
            if key is None:
                key = self.checksums.keys({name: w})[name]
            if self._by_bound(op, name, key, w):
                graph = torch.is_grad_enabled() and w.requires_grad
                have = self.bounded.get(name)
                if not graph and have is not None and have[0] == key:
                    if have[1] <= target:  # (no graph needed: the bound of this version)
                        continue
                    env[name] = w * (target / have[1])
                    continue
                ub = upper_bound_tensor(op, name, env)
                if ub is not None:
                    self.bounded[name] = (key, float(ub.detach()))
                    if self.bounded[name][1] <= target:
                        continue  # proved within its target: the weight itself
                    sig = _FirstOrderNorm.apply(ub, target, name)
                    env[name] = w * (target / sig).to(w.dtype)
                    continue
            pair, below = self.measure(op, name, env, key, target)
            if below or pair.sigma <= target:  # (type: ignore below: pair set when not below)
                continue  # within its target: the weight itself (the scale is 1 nearby)
            sig = _FirstOrderNorm.apply(sigma_through(op, env, pair, w.dtype), target, name)
            if w.dtype in _HALF:
                env[name] = self._scaled_below(op, name, env, w, target / sig, target)
            else:
                env[name] = w * (target / sig).to(w.dtype)
        return env

    def _by_bound(self, op: Any, name: str, key: tuple, w: torch.Tensor) -> bool:
        """Whether this version of weight ``name`` is rescaled by its operator's registered
        upper bound (differentiable, certified, a fraction of a dense SVD's cost) rather than
        by its exact norm: operators above :data:`EXACT_EVERY_VERSION_ENTRIES` entries, except
        a version measured exactly already (the declared weight that ``auto`` calibrated, kept
        bit for bit) and half precision (whose rounding is measured exactly,
        :meth:`_scaled_below`)."""
        if op.in_size * op.out_size <= EXACT_EVERY_VERSION_ENTRIES or w.dtype in _HALF:
            return False
        have = self.measured.get(name)
        return not (have is not None and have[0] == key and have[1] is not None)

    def _project(self, module: Any, op: Any, name: str, env: dict, key: tuple | None,
                 target: float) -> torch.Tensor:
        """``project``: the stored parameter rescaled in place to norm ``target`` when above it
        (once per version of the weight)."""
        p = module.weights[name]
        pair, below = self.measure(op, name, env, key, target)
        if below or pair.sigma <= target:
            return p
        sigma = target
        with torch.no_grad():
            p.mul_(target / pair.sigma)
            for k in range(8 if p.dtype in _HALF else 0):
                # the in-place product is rounded to the half dtype: measured (and shrunk by a
                # growing extra step, see _scaled_below)
                sigma = self._rounded_norm(op, name, env, p)
                if sigma <= target:
                    break
                p.mul_(target / sigma * (1 - torch.finfo(p.dtype).eps * 2.0 ** (k - 4)))
        # the projected version's norm is the target (σ(s·W) = s·σ(W)): recorded under its own
        # key, so that the next forward does not project it again for a rounding (it would
        # write into a parameter an earlier forward's graph still holds)
        key = self.checksums.keys({name: p})[name]
        self.measured[name] = (key, TopPair(min(sigma, target), pair.u, pair.v, pair.exact),
                               False)
        return p

    def _rounded_norm(self, op: Any, name: str, env: dict, value: torch.Tensor) -> float:
        """``||op||₂`` at a rounded half-precision ``value`` of weight ``name``."""
        return top_pair(op, name, {**env, name: value.detach()}).sigma

    def _scaled_below(self, op: Any, name: str, env: dict, w: torch.Tensor,
                      scale: torch.Tensor, target: float) -> torch.Tensor:
        """``w·s`` rounded to ``w``'s (half) dtype with ``||op||₂ ≤ target`` measured at the
        rounded value: a bfloat16 rounding of ``w·s`` reads up to ~2⁻⁸ above
        ``s·||op(w)||₂ = target``, so ``s`` shrinks by the measured excess (differentiable in
        ``s`` as before)."""
        eps = torch.finfo(w.dtype).eps
        for k in range(8):
            wh = (w.float() * scale.float()).to(w.dtype)
            sig_h = self._rounded_norm(op, name, env, wh)
            if sig_h <= target:
                return wh
            # a growing extra step (eps/16 … 8·eps): a shrink below the dtype's resolution
            # rounds back to the same values
            scale = scale * (target / sig_h * (1 - eps * 2.0 ** (k - 4)))
        raise OptionError(f"weight control could not round '{name}' to {w.dtype} below its "
                          f"target norm {target:g}", term="weight_control",
                          hint="use a larger margin or a float32 module")


def make_weight_control(derived: Any, cfg: Any, trainable: list[str],
                        raw_env: Callable[[], dict]) -> WeightControl | None:
    """The module's weight control for ``cfg`` (a
    :class:`~lowering.runtime.config.WeightControlConfig`): ``auto`` controls the norm
    conditions that read a trainable tensor (conditions on constants alone hold as declared)
    and never changes weights that satisfy the certificate (:meth:`WeightControl.calibrate`,
    at ``raw_env()``); None when nothing is controlled."""
    mode = cfg.mode
    if mode == "auto":
        mode = "spectral_norm" if (controlled_conditions(derived, trainable)
                                   or cfg.bounds) else None
    if mode is None:
        return None
    control = WeightControl(derived, mode, cfg.margin, cfg.bounds, trainable)
    if cfg.mode == "auto":
        control.calibrate(raw_env())
    return control


def warn_uncontrolled(derived: Any, control: WeightControl | None, trainable: list[str],
                      trained: list[str]) -> None:
    """Warn about the certificate's conditions that read trained tensors and that no weight
    control could keep (a norm bound of one weight could be: switched off, that is the user's
    choice, which a failing solve's hint names)."""
    controllable = [op for op, _, _ in controlled_conditions(derived, trainable)]
    loose = [c.text for c in certificate_conditions(derived)
             if kept_by(c, control, trained) == "not kept"
             and all(getattr(c, "op", None) is not op for op in controllable)]
    if not loose:
        return
    many = len(loose) > 1
    it = "them" if many else "it"
    warnings.warn(
        f"the certificate's condition{'s' if many else ''} {'; '.join(loose)} "
        f"read{'' if many else 's'} trained tensors and weight control cannot keep {it} (it "
        f"keeps norm bounds ||op||₂ ≤ b of one weight each): training may leave {it} false, "
        "and the layer's equilibrium then is no longer a certified minimizer. Evaluate "
        f"{it} at the trained weights with module.certificate_status()",
        UncontrolledConditionWarning, stacklevel=5)


def normalize_weights(m: Any, names: Collection[str]) -> None:
    """Reparametrise the weights ``names`` of module ``m`` as ``g·V/||V||`` (per output row or
    filter); a name that is not a trainable weight of ``m`` is a typed error."""
    known = list(m.weights.keys())
    for name in names:
        if name not in known:
            raise OptionError(f"weight_normalization names '{name}', which is not a trained "
                              "weight of this layer", term="torch_module",
                              hint=f"trained weights: {known}")
        weight_norm(m.weights, name, dim=0)


def refuse_double_control(names: Collection[str], control: Any) -> None:
    """A typed error when weight control also rescales a normalised weight."""
    both = sorted(set(names) & {n for _, n, _ in (control.targets if control else [])})
    if both:
        raise OptionError(
            f"weight(s) {both} would be under two controls: weight normalisation and "
            f"spectral-norm weight control ({control.mode}, from the certificate's norm "
            "conditions)", term="torch_module",
            hint="pass weight_control=None (weight normalisation then controls them, and the "
            "certificate's conditions on them are not kept), or drop them from "
            "weight_normalization")


class _FirstOrderNorm(torch.autograd.Function):
    """Identity on ``σ = uᵀAv``, whose derivative is exact to first order only: the
    singular pair ``u, v`` of ``σ = uᵀAv`` is held fixed, so ``d²σ`` misses the pair's own
    change (a Hessian w.r.t. a rescaled weight came out 4 % off).  Its backward refuses
    ``create_graph=True`` with a typed error while the rescaling is active (``σ̄ > target``;
    otherwise the scale is locally 1 and every order is exact)."""

    @staticmethod
    def forward(ctx: Any, sig: torch.Tensor, target: float, name: str) -> torch.Tensor:
        ctx.active, ctx.name = sig.detach() > target, name
        return sig.view_as(sig)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and bool(ctx.active):
            raise OptionError(
                f"second-order gradients through the weight control of '{ctx.name}' are not "
                "supported while it rescales the weight (its norm's derivative is exact to "
                "first order only)", term="weight_control",
                hint="use weight_control='project' (rescales the stored parameter outside "
                "autograd, in training mode) or weight_control=None for create_graph=True "
                "gradients with respect to this weight")
        return g, None, None


def layer_terms(derived: Any) -> list[Any]:
    """The terms ``T`` is built from: ``ψ`` of each Theorem 1 layer (``s·Σσ̃(Wz + Ux + b)``,
    whose conjugate the objective declares), else the objective's (or its layers') terms."""
    p = derived.payload
    kind = type(p).__name__
    if kind == "TheoremOnePayload":
        return [p.psi]
    if kind == "DeepPayload":
        return [t for inner in p.layers for t in layer_terms(inner)]
    src = derived.source
    return [t for obj in getattr(src, "layers", None) or [src] for t in obj.terms]


def _operator_for(derived: Any, name: str) -> Any:
    """The linear operator applying weight ``name`` (a Dense wrapper for plain matrices)."""
    from convex_eq.operators import Adjoint, Compose, Dense

    def walk(op: Any) -> Any:
        if isinstance(op, Compose):
            return walk(op.A) or walk(op.B)
        if isinstance(op, Adjoint):  # ||Aᵀ||₂ = ||A||₂: the weight of A is the one controlled
            return walk(op.A)
        syms = op.symbols() if hasattr(op, "symbols") else []
        if len(syms) == 1 and syms[0].name == name and type(op).__name__ in ("Dense", "Conv1d",
                                                                              "Conv2d"):
            return op
        return None

    src = derived.source
    layers = getattr(src, "layers", None) or [src]
    terms = [t for obj in layers for t in getattr(obj, "terms", [])]
    for t in [*terms, *layer_terms(derived)]:
        for a in t.args:
            for e in a.entries:
                if e.op is not None and (found := walk(e.op)) is not None:
                    return found
    for s in derived.parameters:
        if s.name == name and len(s.shape) == 2:
            return Dense(s)
    raise OptionError(f"no weight named '{name}' to control", term="torch_module")
