"""Typed symbols of an objective: states, inputs, weights, constants and scalar hyper-parameters.

Numeric convention used everywhere in the toolkit: a vector-valued symbol of shape ``s`` is carried
as a *flat batched* tensor of shape ``(B, prod(s))``; ``shape`` is kept for display and for
operators (convolutions) that need the spatial layout.  Weights and constants are unbatched.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._algebra import build
from ._lazy import is_tensor, torch
from .errors import NonFiniteError, ScaleError, ShapeError

Env = Mapping[str, Any]

KINDS = ("state", "input", "weight", "constant", "scalar")


def as_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Convert numpy / python / torch data to a tensor (keeps torch tensors' dtype/device;
    others become ``dtype``, float64 by default)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(np.asarray(value, dtype=np.float64),
                           dtype=torch.float64 if dtype is None else dtype)


class Symbol:
    """A named leaf of an objective; ``kind`` is one of state/input/weight/constant/scalar."""

    #: the symbol's role: ``"state"``, ``"input"``, ``"weight"``, ``"constant"`` or ``"scalar"``
    kind: str = "symbol"
    #: a value given as numbers or numpy, while no tensor has been made of it (class default:
    #: symbols unpickled from before the attribute existed)
    _array: np.ndarray | None = None
    #: the value is being made (in another thread, or re-entrantly in this one)
    _making = False

    def __init__(self, name: str, shape: tuple[int, ...] | int = (), value: Any = None):
        if not isinstance(name, str) or not name.isidentifier():
            raise ShapeError(f"symbol name {name!r} must be a Python identifier", term="Symbol")
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise ShapeError(f"shape {shape} has a non-positive dimension", term=name)
        self.name = name
        self.shape = shape
        #: how to make the value tensor on first read (``value``), if not made yet
        self._make: Callable[[], torch.Tensor] | None = None
        self._value: torch.Tensor | None = None
        #: a value given as numbers or numpy, while no tensor has been made of it
        self._array: np.ndarray | None = None
        if value is not None:
            self._set_checked(value)

    @property
    def size(self) -> int:
        """Number of scalar entries (``prod(shape)``)."""
        return math.prod(self.shape) if self.shape else 1

    @property
    def value(self) -> torch.Tensor | None:
        """The bound value (a tensor of shape ``shape``), or None.  A value given as numbers or
        a numpy array becomes a float64 tensor on first read: declaring imports no torch."""
        if self._make is not None or self._making:
            with _MAKING:  # (threads reading a value first at once: one makes, the others wait)
                make = self._make
                if make is not None:
                    self._make, self._making = None, True  # re-entrant reads see it in progress
                    try:
                        self._value, self._array = make(), None
                        self._made()
                    except BaseException:
                        self._make = make
                        raise
                    finally:
                        self._making = False
        return self._value

    @value.setter
    def value(self, v: torch.Tensor | None) -> None:
        self._value, self._make, self._array = v, None, None
        self._given()

    def _made(self) -> None:
        """Called once the value has been made on first read (a hook for subclasses)."""

    def _given(self) -> None:
        """Called when a value is bound (a hook for subclasses)."""

    def _check_value(self, value: Any) -> Any:
        """``value`` after checking its shape and finiteness: a tensor as it is, anything else as
        a float64 numpy array (so checking a declared value imports no torch)."""
        tensor = is_tensor(value)
        v = value if tensor else np.asarray(value, dtype=np.float64)
        if tuple(v.shape) != self.shape:
            raise ShapeError(f"value has shape {tuple(v.shape)}, declared shape is {self.shape}",
                             term=self.name)
        if not (bool(torch.isfinite(v).all()) if tensor else bool(np.isfinite(v).all())):
            raise NonFiniteError("value contains NaN or Inf", term=self.name)
        return v

    def _set_checked(self, value: Any) -> None:
        """Bind ``value`` after ``_check_value``; a numpy value becomes a tensor on first read."""
        v = self._check_value(value)
        if is_tensor(v):
            self.value = v
        else:
            self._value, self._make = None, functools.partial(as_tensor, v)
            self._array = v

    def resolve(self, env: Env | None = None) -> torch.Tensor:
        """The symbol's value: ``env[name]`` if given, else its stored value."""
        if env is not None and self.name in env:
            return as_tensor(env[self.name])
        if self.value is None:
            raise ShapeError(
                f"no value bound for {self.kind} '{self.name}'",
                term=self.name,
                hint=f"pass {self.name}=... or give the symbol a value",
            )
        return self.value

    def numpy(self, env: Env | None = None) -> np.ndarray:
        """The symbol's value (``env[name]`` if given) as a float64 numpy array, a copy.  A
        value declared as numbers or numpy is read without making a tensor of it, so measuring
        a certificate's norm at the declared weights imports no torch."""
        if (env is None or self.name not in env) and self._make is not None \
                and self._array is not None:
            return self._array.copy()
        raw = env[self.name] if env is not None and self.name in env else self.resolve(env)
        v = (raw.detach().to("cpu", torch.float64).numpy().copy() if is_tensor(raw)
             else np.array(raw, dtype=np.float64))  # (a value bound as a plain number)
        if self.shape == () and v.size == 1:
            v = v.reshape(self.shape)  # a one-element tensor for a scalar, as float() reads it
        if v.shape != self.shape:
            raise ShapeError(f"value of '{self.name}' has shape {v.shape}, declared shape is "
                             f"{self.shape}", term=self.name)
        return v

    def latex(self) -> str:
        """The symbol's name as LaTeX (Greek names as letters, ``W_h`` with a subscript)."""
        return _latex_name(self.name)

    def text(self) -> str:
        """The symbol as printed in derivations and formulas: its name."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={self.shape})"

    # Arithmetic sugar builds affine expressions (convex_eq.affine, via convex_eq._algebra).
    def __add__(self, other: Any) -> Any:
        return build("affine", self) + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        return build("affine", self) - other

    def __rsub__(self, other: Any) -> Any:
        return (-1.0) * build("affine", self) + other

    def __neg__(self) -> Any:
        return -build("affine", self)

    def __rmul__(self, c: float) -> Any:
        return c * build("affine", self)


class State(Symbol):
    """An equilibrium state block ``z`` (vector or channel x height x width feature map)."""

    kind = "state"


class Input(Symbol):
    """The layer input ``x`` (batched at run time)."""

    kind = "input"


class Weight(Symbol):
    """A learnable parameter (becomes ``nn.Parameter`` in emitted modules).

    Without a value the entries are drawn from ``N(0, 1/fan_in)``: from torch's global generator
    (``torch.manual_seed`` before the declarations reproduces them; each weight gets its own
    draw, in declaration order — weights declared before torch was imported draw, in that order,
    at the first read of any of them), or from a private generator seeded with ``seed``.  Such a
    default value is kept inside the norm conditions of every objective built with the weight
    (``||W||₂ ≤ 0.9·bound``: see :meth:`keep_inside`); a value you give is never changed."""

    kind = "weight"
    #: the value is the library's draw (no value given and none bound since)
    _default = False
    #: waiting for its draw from the global generator (declared before torch was imported)
    _pending = False

    def __init__(self, name: str, shape: tuple[int, ...] | int, value: Any = None, *,
                 seed: int | None = None):
        super().__init__(name, shape, value)
        #: the norm conditions ``(operator, bound)`` the default value is kept inside
        self._caps: list[tuple[Any, float]] = []
        if value is not None:
            return
        self._default = True
        if seed is not None:
            self._value, self._make = None, functools.partial(self._initial, seed)
        elif "torch" in sys.modules:
            _draw_pending()  # earlier declarations draw first: declaration order
            self._value = self._draw(None)
        else:
            self._pending = True
            self._value, self._make = None, self._draw_in_order
            _PENDING.append(weakref.ref(self))

    def _draw(self, generator: Any) -> torch.Tensor:
        """``N(0, 1/fan_in)`` entries (float64) from ``generator`` (None: the global one)."""
        fan_in = self.size // self.shape[0] if self.shape else 1
        return torch.randn(self.shape, generator=generator, dtype=torch.float64) / math.sqrt(
            max(fan_in, 1))

    def _initial(self, seed: int) -> torch.Tensor:
        """The draw from a private generator seeded with ``seed``."""
        return self._draw(torch.Generator().manual_seed(seed))

    def _draw_in_order(self) -> torch.Tensor:
        """This weight's draw, after those of the weights declared before it."""
        _draw_pending()
        if self._pending:  # (not in this process's queue: e.g. unpickled)
            self._pending = False
            self._value = self._draw(None)
        return self._value  # type: ignore[return-value]

    def _made(self) -> None:
        self._apply_caps()

    def _given(self) -> None:
        self._default = self._pending = False
        self._caps = []

    @property
    def is_default(self) -> bool:
        """True while the value is the library's draw (none given, none bound since)."""
        return self._default

    def keep_inside(self, op: Any, bound: float) -> None:
        """Keep a default value inside the norm condition ``||op||₂ ≤ bound`` of a certificate:
        scaled (never up) to ``||op||₂ ≤ 0.9·bound``, now if the value is made, else when it
        is (docs/theory.md §2).  Nothing happens to a value you gave."""
        if not self._default or any(o is op and b == bound for o, b in self._caps):
            return
        self._caps.append((op, float(bound)))
        if self._make is None and self._value is not None:
            self._apply_caps()

    def _apply_caps(self) -> None:
        for op, bound in self._caps:
            target = 0.9 * bound
            for _ in range(8):  # ||op|| is homogeneous of some degree ≥ 1 in this weight
                norm = float(op.norm(None))
                if not norm > target:
                    break
                self._value = self._value * (target / norm)

    def __matmul__(self, other: Any) -> Any:
        return build("dense", self) @ other


#: weights declared before torch was imported, waiting for their draws (declaration order)
_PENDING: list[weakref.ref[Weight]] = []
#: held while a lazily declared value is made (re-entrant: making one value may read others)
_MAKING = threading.RLock()


def _draw_pending() -> None:
    """Draw every waiting weight from the global generator, in declaration order, then keep
    each inside its norm conditions (all values exist before any norm is measured)."""
    drawn = []
    while _PENDING:
        w = _PENDING.pop(0)()
        if w is not None and w._pending:
            w._pending, w._make = False, None
            w._value = w._draw(None)
            drawn.append(w)
    for w in drawn:
        w._apply_caps()


class Constant(Symbol):
    """A fixed array (becomes a buffer in emitted modules)."""

    kind = "constant"

    def __init__(self, name: str, value: Any):
        super().__init__(name, tuple(value.shape) if is_tensor(value) else np.shape(value), value)

    def __matmul__(self, other: Any) -> Any:
        return build("dense", self) @ other


class Scalar(Symbol):
    """A scalar hyper-parameter (γ, α, λ, ε, μ) with an admissible range ``low ≤ v ≤ high``.

    ``learnable=True`` makes the emitted module train it: the module keeps an unconstrained
    parameter θ and uses ``v = low + (high − low)·sigmoid(θ)`` (both bounds),
    ``low + softplus(θ)`` / ``high − softplus(θ)`` (one bound) or ``θ`` (none), so ``v`` stays
    strictly inside the declared range at every step (docs/guide.md, "Learnable
    hyper-parameters")."""

    kind = "scalar"

    def __init__(
        self,
        name: str,
        value: float,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        learnable: bool = False,
    ):
        super().__init__(name, (), float(value))
        self.low, self.high, self.low_open = low, high, low_open
        self.learnable = bool(learnable)
        self.check(float(value))
        v = float(value)
        if self.learnable and (v == low or v == high):
            raise ScaleError(f"learnable {name} = {v:g} starts on a bound of its range "
                             f"[{low}, {high}]; its parametrisation keeps it strictly inside",
                             term=name, hint=f"start {name} inside the range")

    def coef_value(self, env: Env | None = None) -> Any:
        """The value for evaluation: the tensor in ``env`` itself when it carries a gradient
        (a learnable scalar, kept in range by its parametrisation), else the checked float."""
        v = env.get(self.name) if env is not None else None
        if getattr(v, "requires_grad", False):
            return v
        return self.float(env)

    def check(self, v: float, term: str | None = None) -> float:
        """Raise ScaleError unless ``v`` lies in the declared range."""
        if not math.isfinite(v):
            raise NonFiniteError(f"{self.name} = {v} is not finite", term=term or self.name)
        bad_low = self.low is not None and (v <= self.low if self.low_open else v < self.low)
        bad_high = self.high is not None and v > self.high
        if bad_low or bad_high:
            lo = "(" if self.low_open else "["
            rng = f"{lo}{self.low if self.low is not None else '-inf'}, "
            rng += f"{self.high if self.high is not None else 'inf'}]"
            raise ScaleError(
                f"{self.name} = {v} is outside its admissible range {rng}",
                term=term or self.name,
                hint=f"choose {self.name} in {rng}",
            )
        return v

    def float(self, env: Env | None = None) -> float:
        """Current value as a python float (checked against the range)."""
        return self.check(float(self.numpy(env)))

    def __mul__(self, c: Any) -> Any:
        """``c·λ`` for a number ``c``: a coefficient that scales a term (``0.5 * lam * t``)."""
        if isinstance(c, (int, float)) and not isinstance(c, bool):
            return ScaledScalar(self, float(c))
        return NotImplemented

    __rmul__ = __mul__  # type: ignore[assignment]


class ScaledScalar:
    """``factor·λ``: a number times a scalar hyper-parameter, waiting to scale a term."""

    def __init__(self, scalar: Scalar, factor: float):
        self.scalar, self.factor = scalar, factor

    def __mul__(self, c: Any) -> Any:
        if isinstance(c, (int, float)) and not isinstance(c, bool):
            return ScaledScalar(self.scalar, self.factor * float(c))
        return NotImplemented

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"{self.factor:g}·{self.scalar.name}"


_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "lambda", "mu", "sigma", "rho", "kappa",
    "tau", "eta", "theta", "phi", "psi", "omega", "nu", "xi",
}


def _latex_name(name: str) -> str:
    base, _, sub = name.partition("_")
    if base in {"lam", "lmbda"}:
        base = "lambda"
    if base == "eps":
        base = "varepsilon"
    head = f"\\{base}" if base in _GREEK or base == "varepsilon" else base
    return f"{head}_{{{sub}}}" if sub else head


def scalar_value(s: Scalar | float, env: Env | None = None) -> float:
    """A float from a Scalar symbol or a plain number."""
    return s.float(env) if isinstance(s, Scalar) else float(s)


def scalar_coef(s: Scalar | float, env: Env | None = None) -> Any:
    """The value of a Scalar for evaluation (``Scalar.coef_value``: a tensor when learnable and
    carrying a gradient) or the plain number."""
    return s.coef_value(env) if isinstance(s, Scalar) else float(s)
