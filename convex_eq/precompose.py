"""Affine precomposition ``φ → φ∘A``, ``A(z) = Mz + c`` with ``M`` square invertible
(docs/theory.md §4)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from .affine import Affine, Entry
from .errors import LoweringError, ShapeError
from .objective import Objective
from .symbols import Constant, State, Symbol, as_tensor


@dataclass
class Precomposition:
    """Record of ``φ∘A`` kept on the new objective for the lowering rule ``A⁻¹∘T∘A``."""

    inner: Objective
    old: Symbol
    new: Symbol
    M: Constant
    c: Constant | None

    def orthogonality_defect(self) -> float:
        """``||MᵀM - I||₂`` (0 iff the linear part is orthogonal: the layer is then a prox)."""
        m = self.M.resolve(None).detach().cpu().numpy()
        return float(np.linalg.norm(m.T @ m - np.eye(m.shape[0]), 2))


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
        if hasattr(t, "declare"):
            raise LoweringError(
                f"precomposition of a {t.label} term is not supported", term=str(t),
                hint="precompose an objective written with affine-argument terms "
                "(e.g. the canonical OptEq form)",
            )
        t2 = copy.copy(t)
        t2.args = [_subst(a, old, new, op, cc) for a in t.args]
        terms.append(t2)
    out = Objective(terms, name=f"{obj.name}∘A")
    out.precomposition = Precomposition(obj, old, new, mc, cc)
    return out
