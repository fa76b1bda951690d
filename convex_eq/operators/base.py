"""Base class of linear operators ``A: R^n -> R^m`` acting on flat batched tensors.

Convention: ``apply(v)`` maps ``v`` of shape ``(..., in_size)`` (normally ``(B, in_size)``) to
``(..., out_size)``; ``adjoint(w)`` maps back.  Weights are unbatched symbols resolved at call
time (``symbol.resolve(env)``) and cast to the dtype/device of the input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from .._algebra import build
from .._lazy import torch
from ..errors import NonFiniteError, ShapeError
from ..symbols import Constant, Env, Symbol, as_tensor

_const_ids = itertools.count()

#: Number of basis vectors pushed through ``apply`` at once when building a dense matrix.
_MATRIX_CHUNK = 1024

#: ``policy(op, env) -> float`` active inside :func:`norm_policy`: what :meth:`LinOp.norm`
#: returns instead of its power-iteration estimate (a lower bound), e.g. a guaranteed upper
#: bound for a certified constant (docs/theory.md §9.6); None outside
_NORM_POLICY: ContextVar[Callable[[Any, Any], float] | None] = ContextVar(
    "convex_eq_norm_policy", default=None)


@contextmanager
def norm_policy(policy: Callable[[Any, Any], float]) -> Iterator[None]:
    """Within the block, every operator norm that would be estimated by power iteration
    (:meth:`LinOp.norm` of operators without a closed form) is ``policy(op, env)`` instead."""
    token = _NORM_POLICY.set(policy)
    try:
        yield
    finally:
        _NORM_POLICY.reset(token)


def as_symbol(x: Any, prefix: str = "A_c") -> Symbol:
    """``x`` itself if it is a Symbol, else a ``Constant`` holding ``x`` (generated name)."""
    if isinstance(x, Symbol):
        if x.kind not in ("weight", "constant"):
            raise ShapeError(
                f"a {x.kind} cannot be used as an operator's weight",
                term=x.name,
                hint="use a Weight or Constant (or a plain array)",
            )
        return x
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().to(torch.float64)
    return Constant(f"{prefix}{next(_const_ids)}", x)


def as_shape(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    """Normalise an int or tuple into a shape tuple of positive ints."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not shape or any(int(s) != s or s <= 0 for s in shape):
        raise ShapeError(f"invalid shape {shape}: need positive integer dimensions", term="shape")
    return tuple(int(s) for s in shape)


class LinOp:
    """A linear map ``A: R^{in_size} -> R^{out_size}`` with ``apply = A v`` and ``adjoint = Aᵀ w``.

    ``in_shape``/``out_shape`` are layout shapes (``(n,)`` for vectors, ``(C, H, W)`` for feature
    maps; block operators use a tuple of per-block shapes).  ``name`` is the plain-text display.
    """

    in_size: int
    out_size: int
    in_shape: tuple
    out_shape: tuple
    name: str
    #: False for operators whose display needs parentheses under a transpose (compositions).
    atomic: bool = True

    def __init__(self, default_name: str, name: str | None = None) -> None:
        """Set the display name: the user-given ``name`` if any, else ``default_name``."""
        self._user_name = name
        self.name = default_name if name is None else name

    # ------------------------------------------------------------------ numerics
    def apply(self, v: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``A v`` for ``v`` of shape ``(..., in_size)``."""
        raise NotImplementedError

    def adjoint(self, w: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``Aᵀ w`` for ``w`` of shape ``(..., out_size)``."""
        raise NotImplementedError

    def symbols(self) -> list[Symbol]:
        """Weights/constants referenced by the operator (distinct, in order)."""
        return []

    @property
    def apply_cost(self) -> int:
        """Multiply–adds of one application to one sample (a dense matrix's ``m·n`` by default;
        structured operators say less), for cost decisions such as forming ``AᵀA``."""
        return self.in_size * self.out_size

    def bound(self, env: Env | None, like: torch.Tensor
              ) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                         Callable[[torch.Tensor], torch.Tensor]]:
        """``(v ↦ A v, w ↦ Aᵀ w)`` with the weights of ``env`` resolved once (for repeated
        applications at fixed weights, e.g. a solve's iterations); an operator with a matrix
        returns bare matrix products."""
        return (lambda v: self.apply(v, env)), (lambda w: self.adjoint(w, env))

    def gram(self, like: torch.Tensor, env: Env | None = None) -> torch.Tensor:
        """``AᵀA`` as an ``(in_size, in_size)`` tensor of ``like``'s dtype and device (default:
        ``Aᵀ(A I)``, two applications to the identity; a matrix operator forms it directly)."""
        eye = torch.eye(self.in_size, dtype=like.dtype, device=like.device)
        return self.adjoint(self.apply(eye, env), env)

    def check_input(
        self, v: Any, term: str | None = None, *, adjoint: bool = False
    ) -> torch.Tensor:
        """Return ``v`` as a floating tensor; ShapeError unless ``v.shape[-1]`` matches.

        The expected size is ``in_size`` (``apply``) or ``out_size`` (``adjoint=True``).
        ``term`` names the offending term in the error (default: the operator itself).
        """
        if not isinstance(v, torch.Tensor):
            v = as_tensor(v)
        if not v.is_floating_point():
            v = v.to(torch.float64)
        expected = self.out_size if adjoint else self.in_size
        if v.ndim == 0 or v.shape[-1] != expected:
            what = "adjoint" if adjoint else "apply"
            layout = self.out_shape if adjoint else self.in_shape
            raise ShapeError(
                f"{type(self).__name__} operator '{self}' ({what}) expects a tensor of shape "
                f"(B, {expected}) (layout {layout}), got shape {tuple(v.shape)}",
                term=term or str(self),
                hint=f"flatten the operand to (B, {expected})",
            )
        return v

    def _device(self, env: Env | None) -> torch.device:
        for s in self.symbols():
            return s.resolve(env).device
        return torch.device("cpu")

    def matrix(self, env: Env | None = None) -> np.ndarray:
        """Dense float64 ``(out_size, in_size)`` matrix ``[A e_1, ..., A e_n]``."""
        dev = self._device(env)
        cols = []
        with torch.no_grad():
            for start in range(0, self.in_size, _MATRIX_CHUNK):
                k = min(_MATRIX_CHUNK, self.in_size - start)
                e = torch.zeros(k, self.in_size, dtype=torch.float64, device=dev)
                e[torch.arange(k), start + torch.arange(k)] = 1.0
                cols.append(self.apply(e, env))
        m = torch.cat(cols, dim=0).T.detach().cpu().to(torch.float64).numpy().copy()
        return finite_matrix(m, str(self))

    def norm(
        self, env: Env | None = None, iters: int = 200, tol: float = 1e-10, seed: int = 0
    ) -> float:
        """Estimate of ``||A||₂ = sqrt(λ_max(AᵀA))`` by power iteration on ``AᵀA``.

        Deterministic (Gaussian start from ``seed``); returns ``sqrt(||AᵀA v||)`` for the last
        unit iterate ``v``, a lower bound of ``||A||₂`` that converges to it.  Stops when the
        relative change falls below ``tol``.  Inside :func:`norm_policy` the policy's value
        instead.
        """
        policy = _NORM_POLICY.get()
        if policy is not None:
            return float(policy(self, env))
        dev = self._device(env)
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(1, self.in_size, generator=g, dtype=torch.float64).to(dev)
        v = v / v.norm()
        est = 0.0
        with torch.no_grad():
            for _ in range(max(int(iters), 1)):
                u = self.adjoint(self.apply(v, env), env).to(torch.float64)
                un = float(u.norm())
                if not math.isfinite(un):
                    raise NonFiniteError("power iteration produced NaN/Inf", term=str(self))
                if un == 0.0:
                    return est
                new = math.sqrt(un)
                v = u / un
                done = abs(new - est) <= tol * new
                est = new
                if done:
                    break
        return est

    # ------------------------------------------------------------------ algebra
    @property
    def T(self) -> LinOp:
        """The adjoint operator ``Aᵀ``."""
        return build("transpose", self)

    def __matmul__(self, other: Any) -> Any:
        """``A @ B`` (operator composition) or ``A @ u`` (applied to an affine expression)."""
        if isinstance(other, LinOp):
            return build("compose", self, other)
        return build("affine", other).map(self)

    # ------------------------------------------------------------------ display
    def latex(self) -> str:
        """LaTeX of the operator (the user-given name if any)."""
        return self._user_name if self._user_name is not None else self._latex()

    def _latex(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name

    def transpose_text(self, latex: bool = False) -> str:
        """Display of ``Aᵀ`` (derivations print gradients ``Aᵀ(…)``)."""
        base = str(self) if self.atomic else f"({self})"
        return f"{self.latex()}^\\top" if latex else f"{base}ᵀ"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}: {self.in_size} -> {self.out_size})"


def resolve_weight(sym: Symbol, env: Env | None, like: torch.Tensor, op: LinOp) -> torch.Tensor:
    """``sym``'s value from ``env`` (checked against its declared shape), cast ``.to(like)``."""
    t = sym.resolve(env)
    if tuple(t.shape) != sym.shape:
        raise ShapeError(
            f"weight '{sym.name}' has shape {tuple(t.shape)}, operator expects {sym.shape}",
            term=str(op),
        )
    return t if t.dtype == like.dtype and t.device == like.device else t.to(like)


def unique_symbols(groups: list[list[Symbol]]) -> list[Symbol]:
    """Concatenate symbol lists, dropping repeats (by identity)."""
    out: list[Symbol] = []
    for group in groups:
        for s in group:
            if all(s is not t for t in out):
                out.append(s)
    return out


def op_symbols(op: Any) -> list[Symbol]:
    """``op.symbols()`` for LinOps and duck-typed operators (empty if not provided)."""
    f = getattr(op, "symbols", None)
    return list(f()) if callable(f) else []


def op_latex(op: Any) -> str:
    """``op.latex()`` for LinOps and duck-typed operators (``str(op)`` fallback)."""
    f = getattr(op, "latex", None)
    return f() if callable(f) else str(op)


def finite_matrix(m: np.ndarray, term: str) -> np.ndarray:
    if not np.isfinite(m).all():
        raise NonFiniteError("operator matrix contains NaN or Inf", term=term)
    return m
