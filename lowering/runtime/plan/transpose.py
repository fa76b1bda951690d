"""Transpose Jacobians ``v ↦ Jᵀv`` of a plan at a point of linearisation, one small type per
shape of ``Jᵀ`` (docs/theory.md §8, evaluation plans)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Transpose:
    """``v ↦ Jᵀv`` at a point of linearisation (a small type per shape of ``Jᵀ``); ``plus``
    applies the affine map ``v ↦ Jᵀv + b`` of an adjoint iteration, fused where torch can
    (``addmm``)."""

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.__call__")

    def plus(self, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``Jᵀv + b``."""
        return self(v) + b

    def plus_fn(self, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``v ↦ Jᵀv + b`` as one closure (what an adjoint solve iterates; types that can fuse
        it into one torch call override this)."""
        return lambda v: self.plus(v, b)

    def scaled_plus_fn(self, d: torch.Tensor, b: torch.Tensor
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``v ↦ Jᵀ(d ⊙ v) + b`` as one closure."""
        step = self.plus_fn(b)
        return lambda v: step(d * v)

    def blocks(self, like: torch.Tensor) -> torch.Tensor | None:
        """The per-sample matrices ``L_b`` with ``(Jᵀv)_b = L_b v_b`` (column vectors), shaped
        ``(B, N, N)`` or ``(1, N, N)`` when shared, for a direct adjoint solve; None when this
        ``Jᵀ`` is only known as a map."""
        return None

    #: whether this map is its own adjoint (``⟨Lu, v⟩ = ⟨u, Lv⟩`` per sample), known by
    #: construction (a Gram matrix, the identity): what :meth:`symmetric_split` asks of the map
    #: after a diagonal
    self_adjoint = False

    def symmetric_split(self) -> tuple[torch.Tensor, Transpose] | None:
        """``(d, L)`` with ``Jᵀv = L(d ⊙ v)``, ``L`` self-adjoint, when this ``Jᵀ`` has that form
        (the adjoint system ``g = v + L(d ⊙ g)`` is then symmetric after the change of
        variables ``h = √d ⊙ g``, for ``d ≥ 0``: conjugate gradients apply,
        lowering/backward.py, docs/theory.md §8); None otherwise."""
        return None


#: ``v ↦ Jᵀv``; ``None`` stands for the zero map
Lin = Transpose | None
#: ``(tensor held by a plan, its cotangent)`` pairs, or None (no closed form)
Pairs = list[tuple[torch.Tensor, torch.Tensor]] | None


def join(a: Pairs, b: Pairs) -> Pairs:
    return None if a is None or b is None else a + b


class IdentityT(Transpose):
    """``Jᵀ = I``."""

    self_adjoint = True

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def blocks(self, like: torch.Tensor) -> torch.Tensor | None:
        return torch.eye(like.shape[-1], dtype=like.dtype, device=like.device)[None]


class MatrixT(Transpose):
    """``Jᵀv = v Mᵀ`` (batched rows); ``symmetric``: ``Mᵀ = M`` by construction (a Gram
    matrix), so the map is self-adjoint."""

    def __init__(self, mt: torch.Tensor, symmetric: bool = False):
        self.mt = mt
        self.self_adjoint = symmetric

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return v @ self.mt

    def plus(self, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if v.ndim == 2 and b.ndim == 2:
            return torch.addmm(b, v, self.mt)
        return v @ self.mt + b

    def plus_fn(self, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        if b.ndim != 2:  # the iterates have b's shape
            return super().plus_fn(b)
        mt = self.mt
        return lambda v: torch.addmm(b, v, mt)

    def scaled_plus_fn(self, d: torch.Tensor, b: torch.Tensor
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
        if b.ndim != 2:
            return super().scaled_plus_fn(d, b)
        mt = self.mt
        return lambda v: torch.addmm(b, d * v, mt)

    def blocks(self, like: torch.Tensor) -> torch.Tensor | None:
        return self.mt.T[None]  # rows v ↦ v·mt are columns v ↦ mtᵀ·v


class FunctionT(Transpose):
    """``Jᵀ`` given as a function (``self_adjoint``: known to be its own adjoint, e.g. the
    ``c·Aᵀ(A·)`` of a Gram term applied without forming ``AᵀA``)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], self_adjoint: bool = False):
        self.fn = fn
        self.self_adjoint = self_adjoint

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return self.fn(v)


class DiagonalThenT(Transpose):
    """``Jᵀv = J_innerᵀ(d ⊙ v)`` (an elementwise map after ``inner``)."""

    def __init__(self, d: torch.Tensor, inner: Transpose):
        self.d, self.inner = d, inner

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return self.inner(self.d * v)

    def plus(self, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.inner.plus(self.d * v, b)

    def plus_fn(self, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.inner.scaled_plus_fn(self.d, b)

    def blocks(self, like: torch.Tensor) -> torch.Tensor | None:
        inner = self.inner.blocks(like)
        return None if inner is None else inner * self.d[:, None, :]  # L_inner · diag(d_b)

    def symmetric_split(self) -> tuple[torch.Tensor, Transpose] | None:
        return (self.d, self.inner) if self.inner.self_adjoint else None


class ComposeT(Transpose):
    """``(J_out J_in)ᵀ v = J_inᵀ(J_outᵀ v)``."""

    def __init__(self, inner: Transpose, outer: Transpose):
        self.inner, self.outer = inner, outer

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return self.inner(self.outer(v))

    def plus(self, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.inner.plus(self.outer(v), b)

    def blocks(self, like: torch.Tensor) -> torch.Tensor | None:
        inner, outer = self.inner.blocks(like), self.outer.blocks(like)
        return None if inner is None or outer is None else inner @ outer


class SumT(Transpose):
    """``Σ_k c_k J_kᵀ v``."""

    def __init__(self, parts: list[tuple[Any, Transpose]]):
        self.parts = parts
        # real scalar coefficients of self-adjoint maps sum to a self-adjoint map
        self.self_adjoint = all(jt.self_adjoint and (isinstance(c, (int, float)) or (
            isinstance(c, torch.Tensor) and c.ndim == 0 and not c.is_complex()))
            for c, jt in parts)

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return weighted_sum(self.parts, v)

    def blocks(self, like: torch.Tensor) -> torch.Tensor | None:
        acc = None
        for c, jt in self.parts:
            m = jt.blocks(like)
            if m is None:
                return None
            acc = add(acc, m if _is_one(c) else c * m)
        return acc


def weighted_sum(parts: list[tuple[Any, Callable[[torch.Tensor], torch.Tensor]]],
                 v: torch.Tensor) -> torch.Tensor:
    """``Σ_k c_k f_k(v)`` (a coefficient 1.0 costs no multiplication)."""
    acc = None
    for c, f in parts:
        w = f(v)
        acc = add(acc, w if _is_one(c) else c * w)
    assert acc is not None
    return acc


def add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """``a + b`` where ``None`` is zero."""
    if a is None:
        return b
    return a if b is None else a + b


def _is_one(c: Any) -> bool:
    return isinstance(c, float) and c == 1.0
