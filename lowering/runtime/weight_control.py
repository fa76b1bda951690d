"""Weight control: ``||A||₂ ≤ bound − margin`` for every weight named in a norm condition.

The rescaling uses a *guaranteed upper bound* ``σ̄(A) ≥ ||A||₂`` (never an estimate that
usually holds), so the certified quantity cannot exceed its bound at any step:

* ``W ↦ W · min(1, (bound − margin) / σ̄(W))`` gives ``||A(W_eff)||₂ ≤ bound − margin`` exactly
  (up to one rounding of the scale, far below ``margin``);
* ``σ̄`` is computed by a unit found in :data:`NORM_BOUNDS` (by operator type): the exact norm
  ``σ = uᵀ A v`` from a dense SVD (top singular pair ``u, v`` cached per weight value, the
  value and its gradient ``u vᵀ`` evaluated through the operator, so autograd gives the true
  gradient of what is computed), or, for a 2-D convolution, the largest singular value over
  the DFT frequencies of a circulant embedding (``max_ω σ_max(K̂(ω))``, an upper bound of the
  zero-padded convolution's norm, differentiable through ``torch.fft``).

Modes: ``spectral_norm`` rescales functionally (differentiable); ``project`` rescales the stored
parameter in place before each training forward.  See ``docs/theory.md`` §8.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import NonFiniteError, OptionError

MODES = ("spectral_norm", "project")
#: largest operator (rows × columns) the generic exact bound materialises
MAX_DENSE_ENTRIES = 4096 * 4096

NormBound = Callable[[Any, str, dict, "WeightControl"], torch.Tensor]
NORM_BOUNDS: dict[str, NormBound] = {}


def register_norm_bound(op_type: str) -> Callable[[NormBound], NormBound]:
    """Register ``fn(op, weight_name, env, control) → σ̄`` (a differentiable 0-d tensor with
    ``σ̄ ≥ ||op||₂`` at ``env``) for operators whose class is named ``op_type``."""

    def deco(fn: NormBound) -> NormBound:
        NORM_BOUNDS[op_type] = fn
        return fn

    return deco


def norm_conditions(derived: Any) -> list[tuple[Any, float]]:
    """``(operator, bound)`` pairs from ``||op||₂ ≤ bound`` conditions of the derivation."""
    conds = []
    for c in certificate_conditions(derived):
        op = getattr(c, "op", None)
        if op is not None and c.sense == "<=":
            conds.append((op, c.bound))
    return conds


def _dense_matrix(op: Any, env: dict) -> torch.Tensor:
    """The operator as a dense float64 matrix (no autograd)."""
    if op.in_size * op.out_size > MAX_DENSE_ENTRIES:
        raise OptionError(
            f"weight control needs ||{op}||₂ and no norm bound is registered for "
            f"{type(op).__name__}; its dense matrix ({op.out_size}×{op.in_size}) is too large "
            "to factorise", term="weight_control",
            hint="register a bound with lowering.runtime.weight_control.register_norm_bound")
    with torch.no_grad():
        e64 = {k: (v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v)
               for k, v in env.items()}
        eye = torch.eye(op.in_size, dtype=torch.float64,
                        device=next(iter(env.values())).device)
        return op.apply(eye, e64).T


#: half-precision dtypes, whose norms are measured in float32
_HALF = (torch.float16, torch.bfloat16)


@register_norm_bound("LinOp")
def exact_norm(op: Any, name: str, env: dict, control: WeightControl) -> torch.Tensor:
    """``||A||₂ = uᵀ A v`` with the top singular pair of the dense matrix (cached per value of
    the weight); value and gradient flow through ``op.apply``."""
    w = env[name]
    key = (name, w._version, w.data_ptr(), str(w.dtype))
    cached = control.cache.get(name)
    # the version counter misses writes through ``w.data`` (``W.data.copy_(pretrained)``): a
    # stale pair would give ``uᵀAv < ||A||₂`` (no bound at all), so the values are compared too
    if cached is None or cached[0] != key or not torch.equal(cached[3], w.detach()):
        # normal tensors also when made under inference_mode: the pair is multiplied into the
        # autograd graph of a later training call (an inference tensor cannot be saved there)
        with torch.inference_mode(False):
            M = _dense_matrix(op, env)
            if not bool(torch.isfinite(M).all()):  # (a write through .data passed env's check)
                raise NonFiniteError(f"parameter '{name}' contains NaN or Inf", term=name,
                                     hint="check the optimizer step / the loaded state_dict")
            U, _, Vh = torch.linalg.svd(M, full_matrices=False)
            cached = (key, U[:, 0].contiguous(), Vh[0].contiguous(), w.detach().clone())
        control.cache[name] = cached
    _, u, v, _ = cached
    if w.dtype in _HALF:
        # uᵀAv in float32 (the half values are exact there; a float16/bfloat16 product would
        # round σ by up to 2⁻⁸ relative, and a σ that reads low is no bound: a bfloat16 weight
        # of norm 1.00045 read 1.0); the cast keeps the gradient to the weight
        env = {k: (t.float() if torch.is_tensor(t) and t.dtype in _HALF else t)
               for k, t in env.items()}
        av = op.apply(v.float()[None], env)[0]
    else:
        av = op.apply(v.to(w.dtype)[None], env)[0]
    sig = (u.to(av.dtype) * av).sum().to(torch.float64)
    target = next((t for _, n, t in control.targets if n == name), None)
    return sig if target is None else _FirstOrderNorm.apply(sig, target, name)


@register_norm_bound("_ConvNd")
@register_norm_bound("Conv2d")
def conv_bound(op: Any, name: str, env: dict, control: WeightControl) -> torch.Tensor:
    """``max_ω σ_max(K̂_g(ω))`` over the DFT grid of size ``n + k + p`` per spatial axis and over
    the groups ``g``: the zero-padded (and strided: a row subset) convolution is a compression of
    that circulant operator, whose singular values are those of the per-frequency
    ``C_out/g × C_in/g`` matrices (1-D and 2-D convolutions alike)."""
    if getattr(op, "dilation", 1) not in (1, (1,), (1, 1)):
        return exact_norm(op, name, env, control)
    K = env[name].to(torch.float64)
    nd = K.ndim - 2
    spatial = op.in_shape[1:]
    ks = K.shape[2:]
    pads = tuple(op.padding) if isinstance(op.padding, (tuple, list)) else (op.padding,) * nd
    sizes = [n + k + p for n, k, p in zip(spatial, ks, pads)]
    Kh = torch.fft.fftn(K, s=sizes, dim=tuple(range(2, 2 + nd)))  # (C_out, C_in/g, *sizes)
    groups = int(getattr(op, "groups", 1))
    per_group = K.shape[0] // groups
    freqs = 1
    for n in sizes:
        freqs *= n
    best = []
    for g in range(groups):
        blk = Kh[g * per_group:(g + 1) * per_group]
        mats = blk.permute(*range(2, 2 + nd), 0, 1).reshape(freqs, blk.shape[0], blk.shape[1])
        try:
            best.append(torch.linalg.matrix_norm(mats, ord=2).max())
        except torch.linalg.LinAlgError:  # checked only then: no host sync on every call
            if bool(torch.isfinite(K).all()):
                raise
            raise NonFiniteError(f"parameter '{name}' contains NaN or Inf", term=name,
                                 hint="check the optimizer step / the loaded state_dict"
                                 ) from None
    return torch.stack(best).max()


def norm_bound(op: Any, name: str, env: dict, control: WeightControl) -> torch.Tensor:
    """The registered bound for ``op`` (by class, most specific first)."""
    for cls in type(op).__mro__:
        fn = NORM_BOUNDS.get(cls.__name__)
        if fn is not None:
            return fn(op, name, env, control)
    return exact_norm(op, name, env, control)


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
    """Applies the chosen control to every weight with a spectral-norm condition."""

    def __init__(self, derived: Any, mode: str, margin: float,
                 bounds: dict[str, float] | None = None,
                 trainable: Collection[str] | None = None):
        if mode not in MODES:
            raise OptionError(f"unknown weight_control {mode!r}", term="torch_module",
                              hint=f"use one of {MODES}")
        if not 0 <= margin < 1:
            raise OptionError("margin must lie in [0, 1)", term="torch_module")
        self.mode, self.margin = mode, margin
        self.cache: dict[str, Any] = {}
        #: ``project``: per weight, the (version, data pointer) and values it was left at
        self.projected: dict[str, Any] = {}
        self.targets: list[tuple[Any, str, float]] = []
        for op, name, bound in controlled_conditions(derived, trainable):
            self.targets.append((op, name, bound - margin))
        for name, bound in (bounds or {}).items():
            op = _operator_for(derived, name)
            self.targets = [t for t in self.targets if t[1] != name]
            self.targets.append((op, name, bound - margin))
        if not self.targets:
            raise OptionError("weight control requested but the certificate has no "
                              "||W||₂ ≤ bound condition", term="torch_module",
                              hint="name the weights to control: weight_bounds={'W': 1.0}")

    def calibrate(self, env: dict) -> None:
        """``weight_control='auto'``: never change weights that satisfy the certificate.  A
        weight whose bound ``σ̄₀`` lies in ``(bound − margin, bound]`` keeps ``σ̄₀`` as its
        target (the declared layer is unchanged, bit for bit); one above ``bound`` is rescaled
        to ``bound − margin`` with a :class:`WeightControlWarning` naming it."""
        out = []
        for op, name, target in self.targets:
            bound = target + self.margin
            with torch.no_grad():
                sig = float(norm_bound(op, name, env, self))
            # 1e-9: the round-off of a norm computed in float64 from weights declared exactly at
            # the bound (e.g. singular values 1 by construction) — not a violation
            if target < sig <= bound * (1 + 1e-9):
                target = sig
            elif sig > bound:
                warnings.warn(f"weight control rescales '{name}': the norm bound of {op} is "
                              f"{sig:.4g} > {bound:g} (the certificate's condition); the layer "
                              f"uses {name}·{target / sig:.4g} so that its norm is ≤ "
                              f"{target:g}", WeightControlWarning, stacklevel=6)
            out.append((op, name, target))
        self.targets = out

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "cache": {}, "projected": {}}
        state.pop("rounded", None)
        return state

    def _rounded_norm(self, op: Any, name: str, env: dict, value: torch.Tensor) -> float:
        """``σ̄`` of the operator at a rounded half-precision ``value`` of weight ``name`` (its
        singular pair cached apart from the weight's own, so that neither evicts the other)."""
        meas = self.__dict__.setdefault("rounded", _Measure())
        with torch.no_grad():
            return float(norm_bound(op, name, {**env, name: value.detach()}, meas))

    def _scaled_below(self, op: Any, name: str, env: dict, w: torch.Tensor,
                      scale: torch.Tensor, target: float) -> torch.Tensor:
        """``w·s`` rounded to ``w``'s (half) dtype with ``σ̄ ≤ target`` measured at the rounded
        value: a bfloat16 rounding of ``w·s`` reads up to ~2⁻⁸ above ``s·σ̄(w) = target``, so
        ``s`` shrinks by the measured excess (differentiable in ``s`` as before)."""
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

    def norms(self, env: dict) -> dict[str, tuple[float, float]]:
        """``name → (σ̄ of the controlled operator at env, target)`` (for logging and tests)."""
        with torch.no_grad():
            return {name: (float(norm_bound(op, name, env, self)), target)
                    for op, name, target in self.targets}

    def __call__(self, module: Any, env: dict) -> dict:
        """The controlled weights (``project`` rescales the parameter in place in training
        mode only; in eval mode both modes rescale functionally, leaving parameters alone)."""
        env = dict(env)
        for op, name, target in self.targets:
            if self.mode == "project" and module.training:
                p = module.weights[name]
                # measured once per change of the weight: a projected weight's norm is the
                # target up to a rounding, and projecting it again for that rounding would
                # write into a parameter an earlier forward's graph still holds (a loss over
                # two calls then failed in backward: "modified by an inplace operation")
                done = getattr(self, "projected", {}).get(name)  # (older pickles: none)
                if done is None or done[0] != (p._version, p.data_ptr()) \
                        or not torch.equal(done[1], p.detach()):
                    with torch.no_grad():
                        sig = float(norm_bound(op, name, env, self))
                        if sig > target:
                            p.mul_(target / sig)
                            for k in range(8 if p.dtype in _HALF else 0):
                                # the in-place product is rounded to the half dtype: measured
                                # (and shrunk by a growing extra step, see _scaled_below)
                                sig_h = self._rounded_norm(op, name, env, p)
                                if sig_h <= target:
                                    break
                                p.mul_(target / sig_h
                                       * (1 - torch.finfo(p.dtype).eps * 2.0 ** (k - 4)))
                    self.__dict__.setdefault("projected", {})[name] = (
                        (p._version, p.data_ptr()), p.detach().clone())
                env[name] = p
            else:
                sig = norm_bound(op, name, env, self)
                w = env[name]
                if w.dtype in _HALF and bool(sig > target):  # (else: w itself, nothing rounded)
                    env[name] = self._scaled_below(op, name, env, w, target / sig, target)
                else:
                    scale = torch.clamp(target / sig, max=1.0).to(w.dtype)
                    env[name] = w * scale
        return env


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


class _Measure:
    """The cache :func:`exact_norm` needs, for norms measured outside the control's targets."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}
        self.targets: tuple = ()


class _FirstOrderNorm(torch.autograd.Function):
    """Identity on :func:`exact_norm`'s ``σ``, whose derivative is exact to first order only: the
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


def _operator_for(derived: Any, name: str) -> Any:
    """The linear operator applying weight ``name`` (a Dense wrapper for plain matrices)."""
    from convex_eq.operators import Compose, Dense

    def walk(op: Any) -> Any:
        if isinstance(op, Compose):
            return walk(op.A) or walk(op.B)
        syms = op.symbols() if hasattr(op, "symbols") else []
        if len(syms) == 1 and syms[0].name == name and type(op).__name__ in ("Dense", "Conv1d",
                                                                              "Conv2d"):
            return op
        return None

    src = derived.source
    layers = getattr(src, "layers", None) or [src]
    for obj in layers:
        for t in getattr(obj, "terms", []):
            for a in t.args:
                for e in a.entries:
                    if e.op is not None and (found := walk(e.op)) is not None:
                        return found
    for s in derived.parameters:
        if s.name == name and len(s.shape) == 2:
            return Dense(s)
    raise OptionError(f"no weight named '{name}' to control", term="torch_module")
