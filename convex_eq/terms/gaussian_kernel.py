"""Gaussian-kernel similarity terms of GEQ / KerDEQ (docs/theory.md §3).

``GaussianKernel(r, γ)``:  ``S(r) = (1/(2γ)) exp(-γ||r||²)`` with ``r`` an affine argument (users
pass ``q - W @ z``).

* ``∇_r S = (1/(2γ)) e^{-γ||r||²} (-2γ r) = -e^{-γ||r||²} r``; through ``r = q - Wz`` the base's
  chain rule gives ``∇_z S = e^{-γ||q-Wz||²} Wᵀ(q - Wz)`` (the GEQ layer's pre-activation).
* Lipschitz constant of ``∇_r S`` is 1.  Proof: the Jacobian of ``∇_r S`` is
  ``J(r) = -e^{-γ||r||²}(I - 2γ r rᵀ)``, symmetric, with eigenvalues ``-e^{-t}`` (on ``r^⊥``) and
  ``-e^{-t}(1 - 2t)`` (along ``r``), ``t = γ||r||² ≥ 0``.  ``e^{-t} ≤ 1``; and
  ``h(t) = e^{-t}|1 - 2t|`` is ≤ 1 on ``[0, ½]`` (both factors ≤ 1) and on ``t > ½`` its maximum
  is at ``h'(t) = e^{-t}(3 - 2t) = 0``, ``t = 3/2``, ``h = 2e^{-3/2} ≈ 0.446``.  So
  ``||J(r)||₂ ≤ 1`` everywhere (equality at ``r = 0``), and by the mean-value theorem ``∇S`` is
  1-Lipschitz.  The base multiplies by ``||∂r/∂z||₂²`` (e.g. ``||W||₂²``).
* Neither convex nor concave (``J(0) = -I`` while the curvature along ``r`` is positive for
  ``γ||r||² > ½``); the equilibria are stationary points.  No prox, export refused.

``PatchGaussianKernel(q, wz, γ, patch, W_h, image_shape)`` (patch splitting):

    ``S = (1/(2γ)) Σ_i exp(-γ ||(x̃_i - z̃_i) W_h||²)``,

``x̃_i, z̃_i`` the i-th non-overlapping ``c_s × p_h × p_w`` patch of ``q`` and of ``Wz``, laid out
as ``image_shape = (C, H, W)``: ``c_s`` consecutive channels (the channel split; all ``C`` by
default) and a ``p_h × p_w`` window (``patch`` an int for square patches).  A patch is flattened
in ``(c_s, p_h, p_w)`` row-major order into a row vector of length ``c_s·p_h·p_w``; patches are
enumerated row-major over the ``(C/c_s) × (H/p_h) × (W/p_w)`` grid; ``W_h`` is a
``(c_s·p_h·p_w) × h`` Weight/Constant (shared by all patches).

Design: the term has ONE affine argument ``r = q - wz`` (``q`` and ``wz`` are kept as the
attributes ``.q`` and ``.wz``).  With ``y_i = r̃_i W_h``,
``∇_{r̃_i} S = -e^{-γ||y_i||²} r̃_i W_h W_hᵀ``, scattered back to the image layout; the base's
chain rule through ``r = q - Wz`` then gives ``∇_z S = Wᵀ m`` with ``m`` the scattered patches of
``e^{-γ||·||²}(x̃_i - z̃_i) W_h W_hᵀ`` — exactly docs/theory.md §3.  Gradient Lipschitz bound w.r.t.
``r``:
the Hessian is block diagonal over the disjoint patches, with blocks
``-W_h e^{-γ||y||²}(I - 2γ y yᵀ) W_hᵀ``; by the bound above each has norm ``≤ ||W_h||₂²``, hence
``Lip(∇_r S) ≤ ||W_h||₂²`` (and the base multiplies by ``||∂r/∂z||₂²``).  One argument (rather
than ``[q, wz]``) keeps this bound valid even if ``q`` also depends on a state: with two
arguments the joint Hessian ``[[Hs, -Hs], [-Hs, Hs]]`` has twice the norm.

Bandwidth rules (``gamma=InputBandwidth(c, statistic)`` or ``ResidualBandwidth(c, statistic)``,
docs/theory.md §3.1–3.2), per sample (a batch-wide statistic would make one sample's output
depend on the others in its batch) and differentiated through (no stop-gradient):

    ``γ(x) = c / max(stat_i ||q̃_i W_h||², floor)`` (the input part only) or
    ``γ(x, z) = c / max(stat_i ||r̃_i W_h||², floor)`` (the residual at the current state;
    ``W_h = I``, one patch, for the whole kernel).

``γ(x)`` is GEQ's rule evaluated at ``z = 0`` (the solvers' start): it depends on the sample
only, so ``G(·; x)`` is one fixed objective per sample, the lowering holds sample by sample, and
neither the contraction bound (``Lip(∇_r S) ≤ ||W_h||₂²`` for every ``γ > 0``) nor the claim
depend on its value.  The term then has a second argument ``q`` (no state): ``∂S/∂q`` at fixed
``r`` is ``(∂S/∂γ)(∂γ/∂q)``, ``∂S/∂γ = −(1/(2γ)) Σ_i e^{−γ n_i}(1/γ + n_i)``,
``n_i = ||r̃_i W_h||²``, and ``∂γ/∂q = −(c/m²)·∂m/∂q`` (0 where the floor is active),
``∂||q̃_i W_h||²/∂q̃_i = 2q̃_i W_h W_hᵀ``.

``γ(x, z)`` is GEQ's rule as the paper runs it: the term keeps one argument ``r`` and its
gradient rule evaluates ``∇_r S`` at ``γ`` frozen at ``γ(r)`` — GEQ's iteration, not the gradient
of the term's value ``(1/(2γ(r)))Σ_i e^{−γ(r)n_i}`` (which has the extra ``(∂S/∂γ)∇_r γ``).  The
term says so (``state_parameters``), lowering claims a fixed point of the iteration, and no
Lipschitz bound is given (``∂γ/∂r`` grows without bound as ``min_i n_i → 0``).  At a fixed point
``z*`` the layer is a stationary point of the same term with ``γ`` fixed at ``γ(r*)``
(:meth:`at_bandwidth`), which is how verify judges it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .._lazy import torch
from ..affine import Affine, as_affine
from ..errors import LoweringError, NotDCPError, OptionError, ScaleError, ShapeError
from ..export import ExportContext
from ..symbols import Constant, Env, Scalar, Symbol, Weight, scalar_coef
from .base import Curvature, Term, require_states

STATISTICS = ("min", "median", "mean")


@dataclass(frozen=True)
class _PatchStatistic:
    """``γ = c / max(stat_i n_i, floor)`` (shared validation and evaluation)."""

    c: float = 0.2
    statistic: str = "min"
    floor: float = 1e-12

    #: the arguments of ``γ`` (printed as ``γ(x)`` or ``γ(x, z)``)
    arguments: ClassVar[str] = "x"

    def _validate(self, term: str) -> None:
        if self.statistic not in STATISTICS:
            raise OptionError(f"statistic {self.statistic!r} is not one of {STATISTICS}",
                              term=term, hint="statistic='min' (GEQ's rule) or 'median'")
        if not (math.isfinite(self.c) and self.c > 0 and math.isfinite(self.floor)
                and self.floor > 0):
            raise ScaleError(f"c = {self.c:g} and floor = {self.floor:g} must be positive and "
                             "finite", term=term)

    def gamma(self, m: torch.Tensor) -> torch.Tensor:
        """``γ = c / max(m, floor)`` from the per-sample statistic ``m`` ``(B,)``."""
        return self.c / m.clamp_min(self.floor)

    def statistic_of(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, ∂m/∂n)`` for per-patch squared norms ``n`` ``(B, P)``: the statistic and its
        (a.e.) derivative weights over the patches."""
        if self.statistic == "mean":
            return n.mean(dim=-1), torch.full_like(n, 1.0 / n.shape[-1])
        m, idx = (n.min(dim=-1) if self.statistic == "min" else n.median(dim=-1))
        return m, torch.zeros_like(n).scatter_(-1, idx[:, None], 1.0)

    def of_norms(self, n: torch.Tensor) -> torch.Tensor:
        """``γ`` ``(B,)`` from the per-patch squared norms ``n`` ``(B, P)``."""
        return self.gamma(self.statistic_of(n)[0])

    def text(self, v: Any, wh: str | None) -> str:
        """``γ(·) = c/max(stat_i ||[v]_i W_h||², floor)`` as text."""
        pw = "" if wh is None else f" {wh}"
        arg = f"||[{v}]_i{pw}||²" if wh is not None else f"||{v}||²"
        stat = f"{self.statistic}_i " if wh is not None else ""
        return f"γ({self.arguments}) = {self.c:g}/max({stat}{arg}, {self.floor:g})"

    def latex(self, v: Any, wh: str | None) -> str:
        """LaTeX of :meth:`text`."""
        pw = "" if wh is None else f"\\, {wh}"
        arg = f"\\|[{v}]_i{pw}\\|^2" if wh is not None else f"\\|{v}\\|^2"
        stat = f"\\operatorname{{{self.statistic}}}_i " if wh is not None else ""
        return (f"\\gamma({self.arguments}) = \\frac{{{self.c:g}}}{{\\max({stat}{arg},\\ "
                f"{self.floor:g})}}")

    @property
    def symbol_text(self) -> str:
        """``γ(x)`` or ``γ(x, z)``."""
        return f"γ({self.arguments})"

    @property
    def symbol_latex(self) -> str:
        """LaTeX of :attr:`symbol_text`."""
        return f"\\gamma({self.arguments})"


@dataclass(frozen=True)
class InputBandwidth(_PatchStatistic):
    """``γ(x) = c / max(stat_i ||q̃_i W_h||², floor)``: a bandwidth from the input part ``q``
    of the kernel's argument, per sample (module docstring; docs/theory.md §3.1).

    ``statistic="min"`` is GEQ's rule evaluated at ``z = 0`` (where the solvers start);
    ``"median"`` the median heuristic over the patches.  ``of="residual"`` is refused: GEQ's rule
    on ``q − Wz`` is :class:`ResidualBandwidth`, whose claim differs."""

    of: str = "input"

    def __post_init__(self) -> None:
        if self.of == "residual":
            raise OptionError(
                "a bandwidth γ(z) computed from the residual q − Wz depends on the state: "
                "σ(e^{−γ||r||²}Wᵀr) is then not ∇ of (1/(2γ(z)))e^{−γ(z)||r||²} (the ∇γ(z) terms "
                "are missing), so the equilibrium is a stationary point of no stated objective",
                term="InputBandwidth", hint="use ResidualBandwidth for GEQ's iteration (its "
                "claim: a fixed point of that iteration), or of='input' (GEQ's rule at z = 0: "
                "one fixed objective per sample)")
        if self.of != "input":
            raise OptionError(f"of={self.of!r} is not a bandwidth source", term="InputBandwidth",
                              hint="of='input', or ResidualBandwidth for the residual")
        self._validate("InputBandwidth")


@dataclass(frozen=True)
class ResidualBandwidth(_PatchStatistic):
    """GEQ's rule ``γ(x, z) = c / max(stat_i ||(x̃_i − z̃_i)W_h||², floor)`` on the residual
    ``r = q − Wz`` at the current state, recomputed at every application of ``T`` (module
    docstring; docs/theory.md §3.2).  The claim of a layer with it is "fixed point of the
    iteration", never "stationary point"."""

    arguments: ClassVar[str] = "x, z"

    def __post_init__(self) -> None:
        self._validate("ResidualBandwidth")


#: what a kernel's ``gamma`` may be besides a number or a Scalar
BANDWIDTH_RULES = (InputBandwidth, ResidualBandwidth)

_REASON = "Gaussian kernel term is neither convex nor concave"


def _as_symbol(x: Any, prefix: str) -> Symbol:
    """An array as a Constant with a generated unique name (``W_h0``, ``W_h1``, ...)."""
    from ..operators.base import as_symbol

    return as_symbol(x, prefix=prefix)


def _limit_note(layer: str, feedback: str, through: str, limit: str, where: str = "") -> str:
    """The kernel factor → 1 limit of a Gaussian-kernel layer, which is not OptEq's."""
    return (f"at kernel factor 1 (γ → 0) the layer reads σ({layer}){where}: inhibitory feedback "
            f"−{feedback}z, the input only through {through}; that is not OptEq's σ(WᵀWz + q) "
            f"(the limit objective Σf_σ(z) + ½||z||² + ½{limit} is convex; docs/theory.md "
            "§3.2)")


class _GammaMixin:
    """Shared handling of the bandwidth ``γ > 0``: a float, a Scalar, an ``InputBandwidth``
    (``γ(x)``) or a ``ResidualBandwidth`` (``γ(x, z)``, GEQ's iteration)."""

    gamma: float | Scalar | InputBandwidth | ResidualBandwidth
    args: list[Affine]
    scale: float
    scalars: tuple[Scalar, ...]

    @property
    def input_gamma(self) -> InputBandwidth | None:
        """The ``InputBandwidth`` rule when ``γ = γ(x)``, else None."""
        return self.gamma if isinstance(self.gamma, InputBandwidth) else None

    @property
    def state_gamma(self) -> ResidualBandwidth | None:
        """The ``ResidualBandwidth`` rule when ``γ = γ(x, z)``, else None."""
        return self.gamma if isinstance(self.gamma, ResidualBandwidth) else None

    def _input_part(self, q: Affine | None) -> Affine:
        """``q`` of ``r = q − Wz`` for an input bandwidth (a ``ShapeError`` if absent or if it
        reads a state)."""
        if q is None or q.states():
            raise ShapeError(
                "an input bandwidth γ(x) needs the input part q of r = q − Wz free of states "
                f"(got {'no offset' if q is None else str(q)})", term=self._name(),
                hint="write r as (U x + b) − W z, or give a fixed γ")
        return q

    def _patch_norms(self, v: torch.Tensor, env: Env | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, y)``: per-patch ``n_i = ||ṽ_i W_h||²`` ``(B, P)`` and ``y_i = ṽ_i W_h``."""
        return (v * v).sum(dim=-1, keepdim=True), v[:, None, :]

    def _unpatch_grad(self, g: torch.Tensor, env: Env | None) -> torch.Tensor:
        """Per-patch ``2 y_i`` back-mapped to the flat layout (``∂n_i/∂v`` contracted)."""
        return g[:, 0, :]

    def _gamma_at(self, us: list[torch.Tensor], env: Env | None) -> Any:
        """``γ``: a float, or ``(B, 1)`` from the evaluated input part ``us[1]`` (``γ(x)``) or
        the residual ``us[0]`` (``γ(x, z)``)."""
        rule = self.input_gamma or self.state_gamma
        if rule is None:  # checked, then read as a tensor when γ is a learnable Scalar
            return scalar_coef(self.gamma, env) if self.gamma_value(env) else 0.0
        n, _ = self._patch_norms(us[1] if rule is self.input_gamma else us[0], env)
        return rule.of_norms(n)[:, None]

    def bandwidth(self, values: Any, env: Env | None = None) -> torch.Tensor:
        """``γ`` per sample ``(B,)`` at flat batched ``values`` (states and inputs); a fixed
        ``γ`` repeated."""
        us = [a.evaluate(values, env) for a in self.args]
        g = self._gamma_at(us, env)
        if isinstance(g, torch.Tensor) and g.ndim == 2:
            return g[:, 0]
        return torch.full((us[0].shape[0],), float(g), dtype=us[0].dtype, device=us[0].device)

    def frozen_at(self, values: Any, env: Env | None = None) -> list[Term]:
        """Per sample, the term at ``γ`` fixed at its value at ``values`` (``γ(x, z)`` only)."""
        if self.state_gamma is None:
            return Term.frozen_at(self, values, env)  # type: ignore[arg-type]
        with torch.no_grad():
            return [self.at_bandwidth(float(g)) for g in self.bandwidth(values, env)]

    def at_bandwidth(self, gamma: float) -> Term:
        """The same term (arguments, coefficient) with ``γ`` fixed at ``gamma``: at a fixed point
        of GEQ's iteration, the objective whose stationary point it is (module docstring)."""
        t = self._rebuilt(float(gamma))
        t.scale, t.scalars = self.scale, self.scalars
        return t

    def _rebuilt(self, gamma: float) -> Any:
        raise NotImplementedError

    def _q_grad(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``∂S/∂q`` at fixed ``r`` (module docstring): ``(∂S/∂γ)(∂γ/∂q)``."""
        ib = self.input_gamma
        assert ib is not None
        nq, yq = self._patch_norms(us[1], env)
        m, w = ib.statistic_of(nq)
        gam = ib.gamma(m)[:, None]  # (B, 1)
        nr, _ = self._patch_norms(us[0], env)
        ds_dg = -(torch.exp(-gam * nr) * (1.0 / gam + nr)).sum(dim=-1, keepdim=True) / (2 * gam)
        active = (m > ib.floor).to(m.dtype)[:, None]
        dg_dm = -active * gam * gam / ib.c  # −c/m² = −γ²/c where m > floor
        dm_dq = self._unpatch_grad(2.0 * w[..., None] * yq, env)
        return ds_dg * dg_dm * dm_dq

    def grad(self, values: Any, env: Env | None = None, wrt: str = "state"
             ) -> dict[str, torch.Tensor]:
        """The gradient rule (module docstring); with ``γ(x, z)`` only ``wrt="state"``: GEQ's
        iteration has no objective to differentiate in the input (a ``LoweringError``)."""
        if wrt != "state" and self.state_gamma is not None:
            raise LoweringError(
                "with γ(x, z) recomputed from the state (GEQ's iteration) the layer is not the "
                "stationarity map of this term, so ∇_x of it is no input gradient of the layer's "
                "objective", term=str(self),
                hint="use InputBandwidth (γ(x): one fixed objective per sample) or a fixed γ")
        return Term.grad(self, values, env, wrt)  # type: ignore[arg-type]

    def _lipschitz(self, lip: float) -> list[float]:
        """``[Lip(∇_r S)]`` (``inf`` for ``γ(x, z)``), and ``0`` for the state-free ``q``."""
        if self.state_gamma is not None:
            return [math.inf]
        return [lip] if self.input_gamma is None else [lip, 0.0]

    def gamma_value(self, env: Env | None = None) -> float:
        """Current ``γ`` (ScaleError naming the term unless positive and finite); a bandwidth
        rule has no single value (a ``ScaleError`` that says so)."""
        g = self.gamma
        if isinstance(g, InputBandwidth | ResidualBandwidth):
            raise ScaleError(f"γ = {g.symbol_text} depends on the sample: it has no single "
                             "value", term=str(self), hint="read it per sample with "
                             ".bandwidth(values)")
        v = g.check(float(g.numpy(env)), term=str(self)) if isinstance(g, Scalar) else float(g)
        if not (math.isfinite(v) and v > 0):
            raise ScaleError(f"γ = {v:g} must be positive", term=str(self),
                             hint="the Gaussian kernel bandwidth γ must be > 0")
        return v

    def _gamma_str(self, latex: bool) -> str:
        g = self.gamma
        if isinstance(g, InputBandwidth | ResidualBandwidth):
            return g.symbol_latex if latex else g.symbol_text
        if isinstance(g, Scalar):
            return g.latex() if latex else g.name
        return f"{float(g):g}"

    def _rule_definition(self, wh: str | None, wh_latex: str | None
                         ) -> tuple[tuple[str, str], ...]:
        """``((text, LaTeX),)`` of the bandwidth rule on the vector it reads (q or r)."""
        rule = self.input_gamma or self.state_gamma
        if rule is None:
            return ()
        v = self.args[1] if rule is self.input_gamma else self.args[0]
        return ((rule.text(v, wh), rule.latex(v.latex(), wh_latex)),)

    def _labelled(self, kind: str) -> str:
        """``kind``, with the definitions of the per-sample parameters (a certificate built
        from the labels then names every symbol the terms print)."""
        defs = "; ".join(text for text, _ in self.input_parameters())
        if defs:
            return f"{kind} [{defs}, per sample, from the input only]"
        defs = "; ".join(text for text, _ in self.state_parameters())
        return kind if not defs else (f"{kind} [{defs}, per sample, recomputed from the state "
                                      "in every iteration]")

    def _reason(self) -> str:
        """Why the term is not convex."""
        return _REASON

    def _gamma_symbols(self, out: list[Symbol]) -> list[Symbol]:
        if isinstance(self.gamma, Scalar) and all(self.gamma is not o for o in out):
            out.append(self.gamma)
        return out

    def _refuse_export(self) -> None:
        raise NotDCPError(
            f"{_REASON}, so it has no CVXPY (DCP) form", term=str(self),
            hint="verify Gaussian-kernel objectives with the local reference (stationary points)",
        )


class GaussianKernel(_GammaMixin, Term):
    """``S(r) = (1/(2γ)) exp(-γ||r||²)``; ``∇_r S = -e^{-γ||r||²} r``, ``Lip(∇_r S) = 1``."""

    @property
    def label(self) -> str:  # type: ignore[override]
        """"Gaussian kernel", with the definition of ``γ(x)`` / ``γ(x, z)`` when it is a rule."""
        return self._labelled("Gaussian kernel")
    base_curvature = "unknown"
    smooth = True

    def __init__(self, r: Any,
                 gamma: float | Scalar | InputBandwidth | ResidualBandwidth = 1.0):
        self.gamma = gamma
        r = as_affine(r)
        self._r_text = str(r)
        if isinstance(gamma, InputBandwidth):  # second argument q: γ(x) is read from it
            super().__init__(r, self._input_part(r.offset_part))
        else:
            super().__init__(r)
            if not isinstance(gamma, ResidualBandwidth):
                self.gamma_value(None)

    def _rebuilt(self, gamma: float) -> GaussianKernel:
        return GaussianKernel(self.args[0], gamma)

    def _name(self) -> str:
        return f"GaussianKernel({self._r_text})"

    def check_shapes(self) -> None:
        """The argument ``r`` must involve a state."""
        require_states(self.args[:1], self._name())

    def symbols(self) -> list[Symbol]:
        """The argument's symbols and ``γ`` when it is a ``Scalar``."""
        return self._gamma_symbols(super().symbols())

    def input_parameters(self) -> tuple[tuple[str, str], ...]:
        """``γ(x)`` with its definition (text, LaTeX) when the bandwidth is input-dependent."""
        return self._rule_definition(None, None) if self.input_gamma is not None else ()

    def state_parameters(self) -> tuple[tuple[str, str], ...]:
        """``γ(x, z)`` with its definition (text, LaTeX) for GEQ's iteration."""
        return self._rule_definition(None, None) if self.state_gamma is not None else ()

    def derivation_notes(self) -> tuple[str, ...]:
        """The kernel factor → 1 limit (docs/theory.md §3.2)."""
        return (_limit_note("Wᵀ(q − Wz)", "WᵀW", "Wᵀ", "||q − Wz||²"),)

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``S(r) = (1/(2γ)) exp(−γ||r||²)`` per sample (``γ = γ(r)`` for the residual rule)."""
        g = self._gamma_at(us, env)
        r = us[0]
        if isinstance(g, torch.Tensor) and g.ndim == 2:  # per sample (γ(x))
            g = g[:, 0]
        return torch.exp(-g * (r * r).sum(dim=-1)) / (2.0 * g)

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """``∇_r S = −e^{−γ||r||²} r`` (and ``∂S/∂q`` through ``γ(x)``; at ``γ`` frozen at
        ``γ(r)`` for the residual rule: module docstring)."""
        g = self._gamma_at(us, env)
        r = us[0]
        gr = -torch.exp(-g * (r * r).sum(dim=-1, keepdim=True)) * r
        return [gr] if self.input_gamma is None else [gr, self._q_grad(us, env)]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``Lip(∇_r S) = 1`` for every fixed ``γ > 0`` (the Hessian's eigenvalues lie in
        ``[−1, 2e^{−3/2}]``); ``q`` holds no state; none for ``γ(x, z)``."""
        return self._lipschitz(1.0)

    def grad_text(self, latex: bool = False) -> list[str | None]:
        """Printable gradient ``−exp(−γ||r||²)·r`` (for derivations)."""
        r = self.args[0]
        g = self._gamma_str(latex)
        extra: list[str | None] = [] if self.input_gamma is None else [None]
        if latex:
            return [f"-e^{{-{g}\\|{r.latex()}\\|^2}}({r.latex()})", *extra]
        return [f"-exp(-{g}·||{r}||²)·({r})", *extra]

    def raw_curvature(self) -> Curvature:
        """Unknown: the Gaussian kernel is neither convex nor concave (docs/theory.md §3 row 2)."""
        return Curvature("unknown", reason=self._reason())

    def export(self, ctx: ExportContext) -> None:
        """Refused with a ``NotDCPError``: the Gaussian kernel is not convex (local reference)."""
        self._refuse_export()

    def raw_latex(self) -> str:
        """LaTeX of ``(1/(2γ))exp(−γ||r||²)`` (without the coefficient)."""
        g = self._gamma_str(True)
        two_g = f"2 \\cdot {g}" if isinstance(self.gamma, float | int) else f"2{g}"
        return f"\\frac{{1}}{{{two_g}}} e^{{-{g}\\|{self.args[0].latex()}\\|^2}}"

    def raw_str(self) -> str:
        """Plain-text formula ``(1/(2γ))exp(−γ||r||²)`` (without the coefficient)."""
        g = self._gamma_str(False)
        return f"exp(-{g}·||{self.args[0]}||²)/(2·{g})"


class PatchGaussianKernel(_GammaMixin, Term):
    """``(1/(2γ)) Σ_i exp(-γ||(x̃_i - z̃_i) W_h||²)`` over non-overlapping patches (module doc).

    ``q`` and ``wz`` are affine expressions of the image size ``C·H·W`` (typically ``q = U x + b``
    and ``wz = W @ z``); the term's single argument is ``r = q - wz``.  ``W_h`` is a Weight or
    Constant (an array is wrapped into a Constant named ``W_h<k>``) of shape
    ``(c_s·p_h·p_w, h)``; ``patch`` is ``p`` or ``(p_h, p_w)``, ``channel_split`` is ``c_s``
    (``None``: all channels).
    ``image_shape`` is ``(C, H, W)`` (or ``(H, W)`` for one channel); ``None`` takes the shape of
    the first 3-d state/input symbol of ``q``/``wz``."""

    @property
    def label(self) -> str:  # type: ignore[override]
        """"patch Gaussian kernel", with the definition of ``γ(x)`` / ``γ(x, z)`` when a rule."""
        return self._labelled("patch Gaussian kernel")
    base_curvature = "unknown"
    smooth = True

    def __init__(self, q: Any, wz: Any,
                 gamma: float | Scalar | InputBandwidth | ResidualBandwidth,
                 patch: int | tuple[int, int],
                 W_h: Any, image_shape: tuple[int, ...] | None = None, *,
                 channel_split: int | None = None):
        self.q: Affine = as_affine(q)
        self.wz: Affine = as_affine(wz)
        self.gamma = gamma
        ph, pw = (patch, patch) if isinstance(patch, (int, np.integer)) else tuple(patch)
        self.patch_hw = (int(ph), int(pw))
        self.W_h = W_h if isinstance(W_h, (Weight, Constant)) else _as_symbol(W_h, "W_h")
        self.image_shape = self._image_shape(image_shape)
        self.channel_split = self.image_shape[0] if channel_split is None else int(channel_split)
        if self.q.size != self.wz.size:
            raise ShapeError(
                f"q has size {self.q.size} but Wz has size {self.wz.size}",
                term=self._name(), hint="q and W z must both be images of shape (C, H, W)",
            )
        if isinstance(gamma, InputBandwidth):  # second argument q: γ(x) is read from it
            super().__init__(self.q - self.wz, self._input_part(self.q))
        else:
            super().__init__(self.q - self.wz)
            if not isinstance(gamma, ResidualBandwidth):
                self.gamma_value(None)

    def _rebuilt(self, gamma: float) -> PatchGaussianKernel:
        return PatchGaussianKernel(self.q, self.wz, gamma, self.patch_hw, self.W_h,
                                   self.image_shape, channel_split=self.channel_split)

    def _name(self) -> str:
        return f"PatchGaussianKernel({self.q}, {self.wz})"

    def _image_shape(self, shape: tuple[int, ...] | None) -> tuple[int, int, int]:
        if shape is None:
            for a in (self.wz, self.q):
                for s in a.symbols():
                    if s.kind in ("state", "input") and len(s.shape) == 3:
                        shape = s.shape
                        break
                if shape is not None:
                    break
            if shape is None:
                raise ShapeError("cannot infer the image layout", term=self._name(),
                                 hint="pass image_shape=(C, H, W)")
        shape = tuple(int(s) for s in shape)
        if len(shape) == 2:
            shape = (1, *shape)
        if len(shape) != 3 or any(s <= 0 for s in shape):
            raise ShapeError(f"image_shape {shape} must be (C, H, W) with positive sizes",
                             term=self._name())
        return shape  # type: ignore[return-value]

    @property
    def patch(self) -> int | tuple[int, int]:
        """``p`` for square patches, else ``(p_h, p_w)``."""
        ph, pw = self.patch_hw
        return ph if ph == pw else (ph, pw)

    @property
    def patch_dim(self) -> int:
        """``c_s·p_h·p_w``: the length of a flattened patch (rows of ``W_h``)."""
        return self.channel_split * self.patch_hw[0] * self.patch_hw[1]

    def check_shapes(self) -> None:
        """The image shape matches the argument and the patches tile it (a ``ShapeError``
        otherwise)."""
        require_states(self.args[:1], self._name())
        c, h, w = self.image_shape
        (ph, pw), cs = self.patch_hw, self.channel_split
        n = self.args[0].size
        if c * h * w != n:
            raise ShapeError(
                f"image_shape {self.image_shape} has {c * h * w} entries, q - Wz has {n}",
                term=str(self),
            )
        if ph <= 0 or pw <= 0 or h % ph or w % pw:
            raise ShapeError(
                f"patch size {ph}×{pw} does not divide the image height {h} and width {w}",
                term=str(self), hint="choose patch sizes (p_h, p_w) that divide H and W",
            )
        if cs <= 0 or c % cs:
            raise ShapeError(f"channel split {cs} does not divide the {c} channels",
                             term=str(self), hint="choose channel_split c_s that divides C")
        if len(self.W_h.shape) != 2 or self.W_h.shape[0] != self.patch_dim:
            raise ShapeError(
                f"W_h has shape {self.W_h.shape}, expected ({self.patch_dim}, h) = "
                f"(c_s·p_h·p_w, h) for c_s = {cs}, patch = {ph}×{pw}", term=str(self),
            )

    def symbols(self) -> list[Symbol]:
        """The argument's symbols, ``W_h`` and ``γ`` when it is a ``Scalar``."""
        out = super().symbols()
        if all(self.W_h is not o for o in out):
            out.append(self.W_h)
        return self._gamma_symbols(out)

    @property
    def n_patches(self) -> int:
        """Number of patches ``(C/c_s)·(H/p_h)·(W/p_w)``."""
        c, h, w = self.image_shape
        ph, pw = self.patch_hw
        return (c // self.channel_split) * (h // ph) * (w // pw)

    def _wh(self, env: Env | None, like: torch.Tensor) -> torch.Tensor:
        return self.W_h.resolve(env).to(dtype=like.dtype, device=like.device)

    def patches(self, r: torch.Tensor) -> torch.Tensor:
        """``(B, C·H·W) → (B, n_patches, c_s·p_h·p_w)`` (layout in the module docstring)."""
        c, h, w = self.image_shape
        (ph, pw), cs = self.patch_hw, self.channel_split
        b = r.shape[0]
        t = r.reshape(b, c // cs, cs, h // ph, ph, w // pw, pw).permute(0, 1, 3, 5, 2, 4, 6)
        return t.reshape(b, self.n_patches, self.patch_dim)

    def unpatch(self, g: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`patches` (scatter patches back to the flat image layout)."""
        c, h, w = self.image_shape
        (ph, pw), cs = self.patch_hw, self.channel_split
        b = g.shape[0]
        t = g.reshape(b, c // cs, h // ph, w // pw, cs, ph, pw).permute(0, 1, 4, 2, 5, 3, 6)
        return t.reshape(b, c * h * w)

    def input_parameters(self) -> tuple[tuple[str, str], ...]:
        """``γ(x)`` with its definition (text, LaTeX) when the bandwidth is input-dependent."""
        if self.input_gamma is None:
            return ()
        return self._rule_definition(self.W_h.name, self.W_h.latex())

    def state_parameters(self) -> tuple[tuple[str, str], ...]:
        """``γ(x, z)`` with its definition (text, LaTeX) for GEQ's iteration."""
        if self.state_gamma is None:
            return ()
        return self._rule_definition(self.W_h.name, self.W_h.latex())

    def derivation_notes(self) -> tuple[str, ...]:
        """The kernel factor → 1 limit (docs/theory.md §3.2)."""
        wh = self.W_h.name
        return (_limit_note("Wᵀ P_h (q − Wz)", "WᵀP_hW", "WᵀP_h", f"Σ_i||(x̃_i − z̃_i){wh}||²",
                            f", P_h = blockdiag_i({wh}{wh}ᵀ) over the patches"),)

    def _patch_norms(self, v: torch.Tensor, env: Env | None) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.patches(v) @ self._wh(env, v)  # (B, P, h)
        return (y * y).sum(dim=-1), y

    def _unpatch_grad(self, g: torch.Tensor, env: Env | None) -> torch.Tensor:
        return self.unpatch(g @ self._wh(env, g).transpose(0, 1))

    def raw_value(self, us: list[torch.Tensor], env: Env | None) -> torch.Tensor:
        """``(1/(2γ)) Σ_i exp(−γ||r̃_i W_h||²)`` over the patches ``r̃_i`` of ``r``."""
        g = self._gamma_at(us, env)
        n, _ = self._patch_norms(us[0], env)
        out = torch.exp(-g * n).sum(dim=-1)
        return out / (2.0 * (g[:, 0] if isinstance(g, torch.Tensor) and g.ndim == 2 else g))

    def raw_grad(self, us: list[torch.Tensor], env: Env | None) -> list[torch.Tensor | None]:
        """Patches ``−e^{−γ||r̃_i W_h||²} r̃_i W_h W_hᵀ`` scattered back (docs/theory.md §3 row 3);
        with ``γ(x)`` also ``∂S/∂q`` (module docstring)."""
        g = self._gamma_at(us, env)
        if isinstance(g, torch.Tensor) and g.ndim == 2:  # per sample (γ(x))
            g = g[:, :, None]  # (B, 1, 1) against the (B, P, 1) patch norms
        wh = self._wh(env, us[0])
        y = self.patches(us[0]) @ wh  # (B, P, h)
        e = torch.exp(-g * (y * y).sum(dim=-1, keepdim=True))
        gr = self.unpatch(-e * (y @ wh.transpose(0, 1)))
        return [gr] if self.input_gamma is None else [gr, self._q_grad(us, env)]

    def raw_grad_lipschitz(self, env: Env | None) -> list[float]:
        """``||W_h||₂²`` (block-diagonal Hessian over disjoint patches) for every ``γ > 0``;
        ``q`` holds no state."""
        wh = self.W_h.resolve(env).detach().cpu().numpy().astype(np.float64)
        lip = float(np.linalg.norm(wh, 2)) ** 2
        return self._lipschitz(lip)

    def raw_curvature(self) -> Curvature:
        """Unknown: the patch Gaussian kernel is neither convex nor concave."""
        return Curvature("unknown", reason=self._reason())

    def export(self, ctx: ExportContext) -> None:
        """Refused with a ``NotDCPError``: the kernel is not convex (local reference)."""
        self._refuse_export()

    def raw_latex(self) -> str:
        """LaTeX of ``(1/(2γ))Σ_i exp(−γ||r̃_i W_h||²)`` (without the coefficient)."""
        g = self._gamma_str(True)
        two_g = f"2 \\cdot {g}" if isinstance(self.gamma, float | int) else f"2{g}"
        r = self.args[0].latex()
        return (f"\\frac{{1}}{{{two_g}}} \\sum_i e^{{-{g}\\|[{r}]_i\\, {self.W_h.latex()}\\|^2}}")

    def raw_str(self) -> str:
        """Plain-text formula ``(1/(2γ))Σ_i exp(−γ||r̃_i W_h||²)`` (without the coefficient)."""
        g = self._gamma_str(False)
        return (f"Σ_i exp(-{g}·||[{self.args[0]}]_i {self.W_h.name}||²)/(2·{g})"
                f" [{self._patch_text()} patches of {self.image_shape}]")

    def _patch_text(self) -> str:
        (ph, pw), cs = self.patch_hw, self.channel_split
        chans = "" if cs == self.image_shape[0] else f"{cs}-channel "
        return f"{chans}{ph}×{pw}"


__all__ = ["BANDWIDTH_RULES", "STATISTICS", "GaussianKernel", "InputBandwidth",
           "PatchGaussianKernel", "ResidualBandwidth"]
