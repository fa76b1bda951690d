"""Quadratic and linear terms: ``½||u||²`` (incl. ``½||Wz||²``), ``½ zᵀQz`` and ``<w, u>``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._lazy import torch
from ..affine import Affine, as_affine
from ..errors import ShapeError
from ..export import ExportContext
from ..symbols import Constant, Env, Weight
from .base import Condition, Curvature, QuadPart, Term, batch_dot, single_arg


class SqNorm(Term):
    """``½||u||²``: convex, ``∇ = Aᵀu``, prox ``v/(1+t)`` on a state, self-conjugate."""

    label = "squared norm"
    grad_structure = "identity"
    prox_elementwise = True
    base_curvature = "convex"
    smooth = True

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``½||u||²`` per sample."""
        return 0.5 * (us[0] * us[0]).sum(dim=-1)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇(½||u||²) = u``."""
        return [us[0]]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``1``: the gradient is the identity."""
        return [1.0]

    def raw_prox(self, v: torch.Tensor, t: float, env: Env | None) -> torch.Tensor:
        """``prox_{t·½||·||²}(v) = v/(1 + t)``."""
        return v / (1.0 + t)

    def grad_text(self, latex: bool = False) -> list[str | None]:
        """Printable gradient ``u`` (for derivations)."""
        u = single_arg(self)
        return [u.latex() if latex else str(u)]

    def quad_parts(self, env: Env | None = None) -> list[QuadPart]:
        """One quadratic summand ``coef·½||u||²``."""
        return [QuadPart(self.coef(env), single_arg(self), None, str(self))]

    def conjugate(self) -> Term:
        """``(c·½||u||²)* = (1/c)·½||y||²`` for ``c > 0``."""
        if self.prox_state is None or self.scalars or self.scale <= 0:
            return super().conjugate()
        return SqNorm(single_arg(self)) * (1.0 / self.scale)

    def export(self, ctx: ExportContext) -> None:
        """Nothing here: the quadratic part is exported through the collected PSD form."""

    def raw_latex(self) -> str:
        """LaTeX of ``½||u||²`` (without the coefficient)."""
        return f"\\tfrac12\\big\\|{single_arg(self).latex()}\\big\\|^2"

    def raw_str(self) -> str:
        """Plain-text formula ``½||u||²`` (without the coefficient)."""
        return f"½||{single_arg(self)}||²"


class Linear(Term):
    """``<w, u>`` with ``w`` state-free (e.g. ``q = Ux + b``): affine, ``∇_u = w``."""

    label = "linear"
    grad_structure = "bilinear"
    grad_sources = (1, 0)  # ∇_w = u, ∇_u = w (raw_grad)
    base_curvature = "affine"
    smooth = True

    def __init__(self, w: Any, u: Any):
        w = as_affine(w)
        if w.states():
            raise ShapeError("the coefficient of a linear term must not depend on the state",
                             term=f"<{w}, {u}>", hint="use a quadratic or coupling term instead")
        super().__init__(w, u)

    def check_shapes(self) -> None:
        """``w`` and ``u`` have the same size (a ``ShapeError`` otherwise)."""
        w, u = self.args
        if w.size != u.size:
            raise ShapeError(f"sizes differ: {w} has {w.size}, {u} has {u.size}",
                             term=f"<{w}, {u}>")

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``<w, u>`` per sample."""
        return batch_dot(us[0], us[1])

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇_u <w, u> = w`` and ``∇_w <w, u> = u``."""
        return [us[1], us[0]]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``0`` in the state: the gradient ``w`` does not depend on it."""
        return [0.0, 0.0]

    def grad_text(self, latex: bool = False) -> list[str | None]:
        """Printable gradient ``w`` with respect to ``u`` (for derivations)."""
        w = self.args[0]
        return [None, w.latex() if latex else str(w)]

    def export(self, ctx: ExportContext) -> None:
        """``coef·<w, u>`` as a linear term of the export."""
        ctx.add_linear(self.coef(ctx.env), self.args[0], self.args[1], source=str(self))

    def raw_latex(self) -> str:
        """LaTeX of ``<w, u>`` (without the coefficient)."""
        return f"\\langle {self.args[0].latex()}, {self.args[1].latex()}\\rangle"

    def raw_str(self) -> str:
        """Plain-text formula ``<w, u>`` (without the coefficient)."""
        return f"<{self.args[0]}, {self.args[1]}>"


class QuadraticForm(Term):
    """``½ zᵀQz`` with symmetric ``Q`` (weight or constant): convex iff ``Q ⪰ 0``."""

    label = "quadratic form"
    base_curvature = "convex"
    smooth = True

    def __init__(self, Q: Any, z: Any):
        if not isinstance(Q, (Weight, Constant)):
            Q = Constant(f"Q_{id(Q) % 10000}", Q)
        self.Q = Q
        super().__init__(z)

    def check_shapes(self) -> None:
        """``Q`` is square of the argument's size and symmetric (a ``ShapeError`` otherwise)."""
        u = single_arg(self)
        if self.Q.shape != (u.size, u.size):
            raise ShapeError(f"Q has shape {self.Q.shape}, argument {u} has size {u.size}",
                             term=str(self))
        q = self.Q.resolve(None)
        if not torch.allclose(q, q.T, atol=1e-10, rtol=1e-10):
            raise ShapeError("Q is not symmetric", term=str(self), hint="pass (Q + Qᵀ)/2")

    def _mat(self, env: Env | None) -> torch.Tensor:
        return self.Q.resolve(env)

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``½ uᵀQu`` per sample."""
        u = us[0]
        return 0.5 * batch_dot(u, u @ self._mat(env).to(u))

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇(½ uᵀQu) = Qu`` (``Q`` symmetric)."""
        return [us[0] @ self._mat(env).to(us[0])]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``||Q||₂ = max_i |λ_i(Q)|``."""
        return [float(np.abs(np.linalg.eigvalsh(self._mat(env).detach().cpu().numpy())).max())]

    def raw_curvature(self) -> Curvature:
        """Convex iff ``λ_min(Q) ≥ 0`` (a condition checked at the current weights)."""
        def eigmin(env: Env | None) -> float:
            return float(np.linalg.eigvalsh(self._mat(env).detach().cpu().numpy()).min())

        cond = Condition(f"λ_min({self.Q.name}) ≥ 0",
                         f"\\lambda_{{\\min}}({self.Q.latex()}) \\ge 0", eigmin, 0.0, ">=",
                         reads=(self.Q.name,))
        return Curvature("convex", [cond])

    def quad_parts(self, env: Env | None = None) -> list[QuadPart]:
        """One quadratic summand ``coef·½<u, Qu>``."""
        from ..operators import Dense

        u = single_arg(self)
        return [QuadPart(0.5 * self.coef(env), u, as_affine(u).map(Dense(self.Q)), str(self))]

    def export(self, ctx: ExportContext) -> None:
        """Nothing here: exported through the collected PSD form."""

    def raw_latex(self) -> str:
        """LaTeX of ``½ uᵀQu`` (without the coefficient)."""
        u = single_arg(self).latex()
        return f"\\tfrac12 ({u})^\\top {self.Q.latex()} ({u})"

    def raw_str(self) -> str:
        """Plain-text formula ``½ uᵀQu`` (without the coefficient)."""
        u = single_arg(self)
        return f"½({u})ᵀ{self.Q.name}({u})"


def gram(op: Any, z: Any) -> Affine:
    """``op z`` as an affine expression (helper for ``½||Wz||²``)."""
    return as_affine(z).map(op)
