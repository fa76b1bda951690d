"""MOptEq branch-fusion terms (docs/theory.md §3): ``H(z_i, z_j) = z_iᵀ P z_j`` and the off-diagonal
channel
cross-correlation ``D(z_i, z_j) = Σ_{k1} Σ_{k2≠k1} |⟨z_i^{(k1)}, (P z_j)^{(k2)}⟩|``.

``P`` is a linear operator from ``z_j``'s space to ``z_i``'s (average-downsample, its transpose,
or the identity — e.g. ``operators.downsample_or_identity(z_j.shape, z_i.shape)``); a Weight or
Constant matrix is wrapped in ``Dense``; ``None`` means the identity (equal sizes only).  Both
terms take the two affine arguments ``[z_i, z_j]`` and keep ``P`` inside the term, so the base's
chain rule gives ``∇_{z_i}`` and ``∇_{z_j}`` (summed when ``z_i`` and ``z_j`` are the same state).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._lazy import torch
from ..affine import Affine, as_affine
from ..errors import LoweringError, NotDCPError, ShapeError
from ..export import ExportContext
from ..symbols import Constant, Env, Symbol, Weight
from .base import Curvature, QuadPart, Term, Values, batch_dot, require_states


def _operator(P: Any, ui: Affine, uj: Affine, name: str) -> Any:
    if P is None:
        if ui.size != uj.size:
            raise ShapeError(
                f"sizes differ ({ui} has {ui.size}, {uj} has {uj.size}) and no P was given",
                term=name, hint="pass P = downsample_or_identity(z_j.shape, z_i.shape)",
            )
        from ..operators import Identity

        return Identity(ui.size)
    if all(hasattr(P, a) for a in ("apply", "adjoint", "in_size", "out_size", "norm")):
        return P
    if isinstance(P, (Weight, Constant, np.ndarray, torch.Tensor)):
        from ..operators import as_operator

        return as_operator(P)
    raise ShapeError(f"P must be a linear operator or a matrix, got {type(P).__name__}",
                     term=name)


def _wrap(u: Affine, latex: bool) -> str:
    s = u.latex() if latex else str(u)
    simple = len(u.entries) == 1 and u.entries[0].op is None and u.entries[0].coef == 1.0
    return s if simple else f"({s})"


class _PairTerm(Term):
    """Two arguments ``[z_i, z_j]`` and an operator ``P: space(z_j) → space(z_i)``."""

    def __init__(self, z_i: Any, z_j: Any, P: Any = None):
        ui, uj = as_affine(z_i), as_affine(z_j)
        self.P = _operator(P, ui, uj, f"{type(self).__name__}({ui}, {uj})")
        super().__init__(ui, uj)

    def check_shapes(self) -> None:
        require_states(self.args, str(self))
        ui, uj = self.args
        if self.P.in_size != uj.size or self.P.out_size != ui.size:
            raise ShapeError(
                f"P maps size {self.P.in_size} → {self.P.out_size}, but it must map z_j = {uj} "
                f"(size {uj.size}) to the space of z_i = {ui} (size {ui.size})", term=str(self),
                hint="use P = downsample_or_identity(z_j.shape, z_i.shape)",
            )

    def symbols(self) -> list[Symbol]:
        out = super().symbols()
        syms = self.P.symbols() if hasattr(self.P, "symbols") else []
        for s in syms:
            if all(s is not o for o in out):
                out.append(s)
        return out

    def _p_str(self, latex: bool) -> str:
        if latex:
            return self.P.latex() if hasattr(self.P, "latex") else "P"
        return str(self.P)


class Coupling(_PairTerm):
    """``H(z_i, z_j) = z_iᵀ P z_j``: bilinear, indefinite (curvature 'unknown').

    ``∇_{z_i} H = P z_j``, ``∇_{z_j} H = Pᵀ z_i``.  Gradient Lipschitz bound ``||P||₂`` per
    argument: the Hessian of ``(u_i, u_j) ↦ u_iᵀ P u_j`` is ``[[0, P], [Pᵀ, 0]]``, whose norm is
    exactly ``||P||₂``.

    As a quadratic, its summand ``coef·⟨z_i, P z_j⟩`` is returned by :meth:`quad_parts` and
    collected objective-wide (certificate ``λ_min(Q) ≥ 0``, CVXPY export through the collected
    PSD form), so :meth:`export` itself adds nothing."""

    label = "bilinear coupling"
    base_curvature = "unknown"
    smooth = True

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``H(u, v) = uᵀ P v`` per sample."""
        return batch_dot(us[0], self.P.apply(us[1], env))

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇_u H = P v``, ``∇_v H = Pᵀ u``."""
        return [self.P.apply(us[1], env), self.P.adjoint(us[0], env)]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``||P||₂`` for each argument (``∇H`` is linear with norm ``||P||₂``)."""
        n = float(self.P.norm(env))
        return [n, n]

    def raw_curvature(self) -> Curvature:
        """Unknown: the bilinear ``uᵀ P v`` is indefinite (docs/theory.md §3 row 4)."""
        return Curvature("unknown", reason="the bilinear coupling z_iᵀ P z_j is indefinite")

    def grad_text(self, latex: bool = False) -> list[str | None]:
        """Printable gradients ``P z_j`` and ``Pᵀ z_i`` (for derivations)."""
        ui, uj = self.args
        p = self._p_str(latex)
        tt = getattr(self.P, "transpose_text", None)
        pt = tt(latex) if tt is not None else (f"{p}^\\top" if latex else f"{p}ᵀ")
        if latex:
            return [f"{p}\\,{_wrap(uj, True)}", f"{pt} {_wrap(ui, True)}"]
        return [f"{p} {_wrap(uj, False)}", f"{pt} {_wrap(ui, False)}"]

    def quad_parts(self, env: Env | None = None) -> list[QuadPart]:
        """One quadratic summand ``coef·<u, P v>`` (for the objective's quadratic form)."""
        ui, uj = self.args
        return [QuadPart(self.coef(env), ui, uj.map(self.P), str(self))]

    def export(self, ctx: ExportContext) -> None:
        """Nothing here: the bilinear form is exported by the caller through :meth:`quad_parts`
        (``Objective.to_cvxpy`` adds every term's quadratic parts to one collected form, which
        must be PSD as a whole)."""

    def raw_latex(self) -> str:
        """LaTeX of ``z_iᵀ P z_j`` (without the coefficient)."""
        ui, uj = self.args
        return f"{_wrap(ui, True)}^\\top {self._p_str(True)}\\, {_wrap(uj, True)}"

    def raw_str(self) -> str:
        """Plain-text formula ``z_iᵀ P z_j`` (without the coefficient)."""
        ui, uj = self.args
        return f"{_wrap(ui, False)}ᵀ {self._p_str(False)} {_wrap(uj, False)}"


class ChannelDecorrelation(_PairTerm):
    """``D(z_i, z_j) = Σ_{k1} Σ_{k2≠k1} |⟨z_i^{(k1)}, (P z_j)^{(k2)}⟩|`` over channel slices.

    ``z_i`` has ``channels`` channels (``None``: ``shape[0]`` of the 3-d state in ``z_i``); channel
    ``k`` is the contiguous slice ``[k·L, (k+1)·L)`` of the flat vector, ``L = size/channels``
    (``H·W`` for a ``(C, H, W)`` map).  With ``M_{k1k2} = ⟨u^{(k1)}, v^{(k2)}⟩`` (``u = z_i``,
    ``v = P z_j``) and ``G = sign(M)`` with zero diagonal (``sign(0) = 0``):
    ``∂D/∂u^{(k1)} = Σ_{k2} G_{k1k2} v^{(k2)}``, ``∂D/∂v^{(k2)} = Σ_{k1} G_{k1k2} u^{(k1)}``, then
    ``∇_{z_j} = Pᵀ(∂D/∂v)``.

    Nonsmooth (absolute values): ``smooth = False``, but ``almost_everywhere_grad = True`` — the
    formula above is the gradient wherever no off-diagonal ``M_{k1k2}`` vanishes (almost
    everywhere), and :meth:`grad` / :meth:`subgradient` return it everywhere (with
    ``sign(0) = 0``) for the MOptEq lowering ``-(λ/2)∇_{z_i} D``.  No gradient Lipschitz bound
    (``grad_lipschitz`` is ``inf``).  Curvature 'unknown'; export refused."""

    label = "channel decorrelation"
    base_curvature = "unknown"
    smooth = False
    #: ``grad`` returns the almost-everywhere gradient although the term is not smooth
    almost_everywhere_grad = True

    def __init__(self, z_i: Any, z_j: Any, P: Any = None, channels: int | None = None):
        ui = as_affine(z_i)
        if channels is None:
            shapes = [s.shape for s in ui.states() if len(s.shape) == 3]
            if not shapes:
                raise ShapeError("cannot infer the number of channels of z_i",
                                 term=f"ChannelDecorrelation({ui}, {z_j})",
                                 hint="pass channels=C")
            channels = shapes[0][0]
        self.channels = int(channels)
        super().__init__(z_i, z_j, P)

    def check_shapes(self) -> None:
        """``P`` maps ``z_j`` to ``z_i``'s space; ``channels ≥ 2`` split ``z_i`` evenly."""
        super().check_shapes()
        n = self.args[0].size
        c = self.channels
        if c < 2 or n % c:
            raise ShapeError(
                f"{c} channels do not split z_i = {self.args[0]} of size {n} into ≥ 2 equal "
                "channel slices", term=str(self), hint="pass channels=C for a (C, H, W) map",
            )

    def _corr(self, us: list[torch.Tensor], env: Env | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, c = us[0].shape[0], self.channels
        u = us[0].reshape(b, c, -1)
        v = self.P.apply(us[1], env).reshape(b, c, -1)
        return u, v, u @ v.transpose(1, 2)

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_{k1} Σ_{k2≠k1} |⟨u^{(k1)}, (P v)^{(k2)}⟩|`` per sample."""
        _, _, m = self._corr(us, env)
        a = m.abs()
        return a.sum(dim=(1, 2)) - torch.diagonal(a, dim1=1, dim2=2).sum(dim=-1)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """A.e. gradient: ``sign`` of the off-diagonal correlations times the other argument's
        channels."""
        u, v, m = self._corr(us, env)
        g = self._weights(m)
        b = u.shape[0]
        gu = (g @ v).reshape(b, -1)
        gv = (g.transpose(1, 2) @ u).reshape(b, -1)
        return [gu, self.P.adjoint(gv, env)]

    def _weights(self, m: torch.Tensor) -> torch.Tensor:
        """``∂φ/∂M`` with a zero diagonal: ``sign(M)`` (``sign(0) = 0``) for ``φ = |·|``."""
        g = torch.sign(m)
        return g - torch.diag_embed(torch.diagonal(g, dim1=1, dim2=2))

    def grad(self, values: Values, env: Env | None = None) -> dict[str, torch.Tensor]:
        """The almost-everywhere gradient (``sign(0) = 0``) w.r.t. each state block."""
        if not self.almost_everywhere_grad:
            raise LoweringError("term is not differentiable", term=str(self))
        us = [a.evaluate(values, env) for a in self.args]
        gs = self.raw_grad(us, env)
        c = self.coef_t(env)
        out: dict[str, torch.Tensor] = {}
        for a, g in zip(self.args, gs):
            for s in a.states():
                contrib = c * a.adjoint(g, s, env)
                out[s.name] = out[s.name] + contrib if s.name in out else contrib
        return out

    subgradient = grad

    def raw_curvature(self) -> Curvature:
        """Unknown: sums of absolute cross-correlations are neither convex nor concave."""
        return Curvature("unknown",
                         reason="the channel decorrelation Σ|⟨z_i^(k1), (P z_j)^(k2)⟩| is "
                         "neither convex nor concave")

    def export(self, ctx: ExportContext) -> None:
        """Refused with a ``NotDCPError``: the term is not convex (local reference)."""
        raise NotDCPError(
            "the channel decorrelation term (sum of absolute values of bilinear forms) is not "
            "convex, so it has no CVXPY (DCP) form", term=str(self),
            hint="verify MOptEq objectives with the local reference (stationary points)",
        )

    def raw_latex(self) -> str:
        """LaTeX of ``D(z_i, z_j)`` (without the coefficient)."""
        ui, uj = self.args
        return (f"\\sum_{{k_1}}\\sum_{{k_2 \\ne k_1}} \\big|\\langle {_wrap(ui, True)}^{{(k_1)}}, "
                f"({self._p_str(True)} {_wrap(uj, True)})^{{(k_2)}}\\rangle\\big|")

    def raw_str(self) -> str:
        """Plain-text formula ``D(z_i, z_j)`` (without the coefficient)."""
        ui, uj = self.args
        return (f"Σ_k1 Σ_k2≠k1 |<{_wrap(ui, False)}^(k1), "
                f"({self._p_str(False)} {_wrap(uj, False)})^(k2)>|")


class SmoothChannelDecorrelation(ChannelDecorrelation):
    """``D_ε(z_i, z_j) = Σ_{k1} Σ_{k2≠k1} φ_ε(⟨z_i^{(k1)}, (P z_j)^{(k2)}⟩)``, ``φ_ε`` the Huber
    function of width ``ε`` (``m²/(2ε)`` for ``|m| ≤ ε``, ``|m| − ε/2`` beyond): the channel
    decorrelation with ``|·|`` smoothed, ``φ_ε ≤ |·| ≤ φ_ε + ε/2`` (docs/theory.md §3 row 4).

    Its gradient is that of :class:`ChannelDecorrelation` with ``sign(M)`` replaced by the
    continuous ``clip(M/ε, −1, 1)``, so the MOptEq layer built on it is continuous (the sign
    version jumps where a correlation changes sign and need not have a fixed point).  ``∇D_ε``
    is Lipschitz on bounded sets only (the correlations are bilinear): no global bound
    (``grad_lipschitz`` is ``inf``); the multi-branch lowering derives the bound on the ball
    the layer maps into itself."""

    label = "channel decorrelation (Huber-smoothed)"
    smooth = True
    almost_everywhere_grad = False

    def __init__(self, z_i: Any, z_j: Any, P: Any = None, channels: int | None = None, *,
                 width: float = 1.0):
        w = float(width)
        if not (w > 0 and w < float("inf")):
            raise ShapeError(f"width ε = {width} must be a finite number > 0",
                             term=f"SmoothChannelDecorrelation({z_i}, {z_j})",
                             hint="ε is the Huber width of the smoothed |·| (e.g. 1.0)")
        self.width = w
        super().__init__(z_i, z_j, P, channels)

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``Σ_{k1≠k2} φ_ε(M_{k1k2})`` per sample."""
        _, _, m = self._corr(us, env)
        a, e = m.abs(), self.width
        h = torch.where(a <= e, 0.5 * m * m / e, a - 0.5 * e)
        return h.sum(dim=(1, 2)) - torch.diagonal(h, dim1=1, dim2=2).sum(dim=-1)

    def _weights(self, m: torch.Tensor) -> torch.Tensor:
        g = torch.clamp(m / self.width, -1.0, 1.0)
        return g - torch.diag_embed(torch.diagonal(g, dim1=1, dim2=2))

    def grad(self, values: Values, env: Env | None = None, wrt: str = "state"
             ) -> dict[str, torch.Tensor]:
        """``∇D_ε`` w.r.t. each state block (``wrt="input"``: each input), by the chain rule."""
        return Term.grad(self, values, env, wrt)

    subgradient = grad

    def raw_curvature(self) -> Curvature:
        """Unknown: a sum of Huber functions of bilinear forms is neither convex nor concave."""
        return Curvature("unknown",
                         reason="the smoothed channel decorrelation Σφ_ε(⟨z_i^(k1), "
                         "(P z_j)^(k2)⟩) is neither convex nor concave")

    def raw_latex(self) -> str:
        """LaTeX of ``D_ε(z_i, z_j)`` (without the coefficient)."""
        ui, uj = self.args
        return (f"\\sum_{{k_1}}\\sum_{{k_2 \\ne k_1}} \\phi_{{{self.width:g}}}\\big(\\langle "
                f"{_wrap(ui, True)}^{{(k_1)}}, ({self._p_str(True)} {_wrap(uj, True)})^{{(k_2)}}"
                "\\rangle\\big)")

    def raw_str(self) -> str:
        """Plain-text formula ``D_ε(z_i, z_j)`` (without the coefficient)."""
        ui, uj = self.args
        return (f"Σ_k1 Σ_k2≠k1 huber_{self.width:g}(<{_wrap(ui, False)}^(k1), "
                f"({self._p_str(False)} {_wrap(uj, False)})^(k2)>)")
