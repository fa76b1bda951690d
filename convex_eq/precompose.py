"""Affine precomposition ``φ → φ∘A``, ``A(z) = Mz + c`` with ``M`` square invertible
(docs/theory.md §4)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .affine import Affine, Entry
from .errors import LoweringError, ShapeError
from .objective import Objective
from .symbols import Constant, State, Symbol, as_tensor
from .terms.base import Term


class Precomposed(Objective):
    """``(φ∘A)(z) = φ(Mz + c)``: an objective whose terms read ``Mz + c`` in place of the old
    state, remembering ``φ``, the old and new states and ``A`` for the lowering rule
    ``A⁻¹∘T∘A``."""

    def __init__(self, terms: list[Term], inner: Objective, old: Symbol, new: Symbol,
                 M: Constant, c: Constant | None, name: str = "") -> None:
        super().__init__(terms, name=name)
        self.inner, self.old, self.new, self.M, self.c = inner, old, new, M, c

    @property
    def precomposition(self) -> Precomposed:
        """The record of ``φ∘A`` (this objective itself)."""
        return self

    def orthogonality_defect(self) -> float:
        """``||MᵀM - I||₂`` (0 iff the linear part is orthogonal: the layer is then a prox)."""
        m = self.M.resolve(None).detach().cpu().numpy()
        return float(np.linalg.norm(m.T @ m - np.eye(m.shape[0]), 2))


#: former name of the record (now the objective itself)
Precomposition = Precomposed


def _subst(a: Affine, old: Symbol, new: Symbol, op: Any, c: Constant | None) -> Affine:
    from .operators import Compose

    out: list[Entry] = []
    for e in a.entries:
        if e.symbol is old:
            out.append(Entry(e.coef, op if e.op is None else Compose(e.op, op), new))
            if c is not None:
                out.append(Entry(e.coef, e.op, c))
        else:
            out.append(e)
    return Affine(out)


def precompose(obj: Objective, M: Any, c: Any = None, name: str | None = None) -> Objective:
    """``(φ∘A)(z) = φ(Mz + c)`` for a single-state objective; ``M`` must be invertible."""
    from .operators import Dense

    if len(obj.states) != 1:
        raise ShapeError("precomposition needs a single-state objective", term=str(obj))
    old = obj.states[0]
    m = as_tensor(M)
    if tuple(m.shape) != (old.size, old.size):
        raise ShapeError(f"M has shape {tuple(m.shape)}, expected {(old.size, old.size)}",
                         term="precompose")
    cond = float(np.linalg.cond(m.detach().cpu().numpy()))
    if not np.isfinite(cond) or cond > 1e12:
        raise ShapeError(f"M is not invertible (condition number {cond:.3g})", term="precompose",
                         hint="the rule φ → φ∘A needs an invertible affine map")
    new = State(name or f"{old.name}_A", old.shape)
    mc = Constant(f"M_{new.name}", m)
    cc = None if c is None else Constant(f"c_{new.name}", as_tensor(c).reshape(-1))
    op = Dense(mc)
    terms = []
    for t in obj.terms:
        if hasattr(t, "declare") and type(t).with_args is Term.with_args:
            raise LoweringError(
                f"precomposition of a {t.label} term is not supported", term=str(t),
                hint="precompose an objective written with affine-argument terms "
                "(e.g. the canonical OptEq form)",
            )
        terms.append(t.with_args([_subst(a, old, new, op, cc) for a in t.args]))
    return Precomposed(terms, obj, old, new, mc, cc, name=f"{obj.name}∘A")
