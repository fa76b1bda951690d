"""User-supplied activations from sympy expressions (docs/theory.md §1).

``from_sympy(expr, var)`` checks that ``σ`` is nondecreasing (``σ' ≥ 0``) and 1-Lipschitz
(``σ' ≤ 1``) -- symbolically with ``sympy.calculus.util.minimum/maximum`` of ``σ'`` over ℝ when
sympy can decide, otherwise on a dense grid -- and refuses it with ``ActivationError`` naming the
violated condition.  It then derives, symbolically where sympy can and numerically otherwise:

* ``σ⁻¹`` by ``sympy.solve`` (the branch that inverts ``σ`` on its range, checked numerically),
  else vectorized safeguarded Newton/bisection;
* ``σ̃(a) = ∫_0^a σ`` by ``sympy.integrate``, else ``scipy.integrate.quad``;
* ``σ̃*(u) = ∫_{σ(0)}^u σ⁻¹`` by ``sympy.integrate`` (or ``u σ⁻¹(u) - σ̃(σ⁻¹(u))``), else
  numerically from ``σ⁻¹`` and ``σ̃``; ``f_σ = σ̃* - u²/2``.

Every symbolic result is lambdified to torch and verified numerically on sample points of the
range before it is used; a result that fails the check falls back to the numeric path.  The
steps are recorded in ``derivation`` (a list of strings).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import sympy as sp
from sympy.calculus.util import maximum, minimum
from sympy.printing.pytorch import TorchPrinter

from .._lazy import torch
from ..errors import ActivationError
from . import _numeric as nm
from .base import INF, Activation, TensorLike, fmt_interval
from .checks import CONDITION_HINT, GRID, GRID_TOL


# ------------------------------------------------------------------ lambdify to torch / numpy
def _to_tensor_arg(x: Any) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x
    return torch.tensor(float(x), dtype=torch.float64)


def _maximum(*args: Any) -> torch.Tensor:
    return functools.reduce(torch.maximum, [torch.as_tensor(_to_tensor_arg(a)) for a in args])


def _minimum(*args: Any) -> torch.Tensor:
    return functools.reduce(torch.minimum, [torch.as_tensor(_to_tensor_arg(a)) for a in args])


def _heaviside(x: torch.Tensor, value: Any = 0.5) -> torch.Tensor:
    return torch.heaviside(x, torch.as_tensor(value, dtype=x.dtype, device=x.device))


class _TorchShim:
    """Stands in for ``torch`` in lambdified code: python scalars become 0-d float64 tensors."""

    _special: ClassVar[dict[str, Callable[..., torch.Tensor]]] = {
        "max": _maximum,
        "min": _minimum,
        "heaviside": _heaviside,
    }

    def __getattr__(self, name: str) -> Any:
        if name in self._special:
            return self._special[name]
        fn = getattr(torch, name)
        if not callable(fn):
            return fn

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return fn(*[_to_tensor_arg(a) for a in args], **kwargs)

        return wrapped


_TORCH_NAMESPACE: dict[str, Any] = {
    "torch": _TorchShim(),
    "erfinv": torch.special.erfinv,
    "erfc": torch.special.erfc,
    "expm1": torch.special.expm1,
    "log1p": torch.log1p,
}


def lambdify_torch(expr: sp.Expr, sym: sp.Symbol) -> Callable[[torch.Tensor], torch.Tensor]:
    """Lambdify ``expr(sym)`` to an elementwise torch function (constants broadcast)."""
    fn = sp.lambdify(
        sym, expr, modules=[dict(_TORCH_NAMESPACE)], printer=TorchPrinter({"strict": False})
    )

    def call(x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        if not isinstance(y, torch.Tensor):
            return torch.full_like(x, float(y))
        if y.dtype != x.dtype and y.is_floating_point():
            y = y.to(x.dtype)
        if y.shape != x.shape:
            y = y.expand_as(x) if y.dim() <= x.dim() else y
        return y

    return call


def lambdify_numpy_scalar(expr: sp.Expr, sym: sp.Symbol) -> Callable[[float], float]:
    """Lambdify ``expr(sym)`` to a float -> float function (numpy, warnings silenced)."""
    fn = sp.lambdify(sym, expr, modules="numpy")

    def call(x: float) -> float:
        with np.errstate(all="ignore"):
            return float(np.real(fn(np.float64(x))))

    return call


def _as_float(value: sp.Expr) -> float | None:
    """Float of a real sympy number (``±oo`` → ``±inf``); None if not a real number."""
    try:
        if value is sp.oo:
            return INF
        if value is sp.S.NegativeInfinity:
            return -INF
        if value.is_number and value.is_extended_real:
            return float(value)
    except (TypeError, ValueError, AttributeError):
        return None
    return None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    ok = torch.isfinite(a) & torch.isfinite(b)
    if not bool(ok.all()):
        return False
    return bool(((a - b).abs() <= tol * (1 + b.abs())).all())


# -------------------------------------------------------------------------- the activation
class SympyActivation(Activation):
    """An activation derived from a sympy expression ``σ(t)`` (see module docstring).

    Attributes (beyond ``Activation``): ``expr``, ``var``, ``derivation: list[str]``,
    ``check_method`` (``"symbolic"`` or ``"grid"``), ``symbolic`` (which of ``inverse``,
    ``antiderivative``, ``antiderivative_conjugate`` have verified closed forms), and the sympy
    expressions ``sigma_expr``, ``sigma_prime_expr``, ``inverse_expr``, ``antiderivative_expr``,
    ``antiderivative_conjugate_expr``, ``potential_expr`` (None where numeric).
    """

    _split_coefficient = None

    def __init__(self, expr: Any, var: Any, name: str | None = None, *, check: str = "auto"):
        if check not in ("auto", "symbolic", "grid"):
            raise ActivationError(f"check must be 'auto', 'symbolic' or 'grid' (got {check!r})")
        expr = sp.sympify(expr)
        var = sp.Symbol(var) if isinstance(var, str) else var
        if not isinstance(var, sp.Symbol):
            raise ActivationError(f"var must be a sympy Symbol (got {var!r})")
        extra = expr.free_symbols - {var}
        label = name or str(expr)
        if extra:
            raise ActivationError(
                f"σ(t) = {expr} depends on symbols {sorted(map(str, extra))} besides {var}",
                term=label,
                hint="substitute numeric values for parameters before calling from_sympy",
            )
        t = sp.Symbol(var.name, real=True)
        self.var = t
        self.expr = self.sigma_expr = expr.subs(var, t)
        self.name = label
        self.text_sigma = str(self.expr)
        self.latex_sigma = sp.latex(self.expr)
        self.derivation: list[str] = [f"σ({t}) = {self.expr}"]
        self.symbolic: dict[str, bool] = {}
        self._u = sp.Symbol("u", real=True)
        self._a = sp.Symbol("a", real=True)

        d = sp.diff(self.expr, t)
        self.sigma_prime_expr = d
        self.derivation.append(f"σ'({t}) = {d}")
        self._check_conditions(d, check)

        self._sigma = lambdify_torch(self.expr, t)
        self._dsigma = lambdify_torch(d, t)
        self._sigma_np = lambdify_numpy_scalar(self.expr, t)
        self._verify_torch()
        self._derive_domain()
        self._derive_strictness(d)
        self._samples()
        self._derive_inverse()
        self._derive_antiderivative()
        self._derive_antiderivative_conjugate()
        self._conj_domain: tuple[float, float] | None = None

    # ------------------------------------------------------------------------------ checks
    def _refuse(self, condition: str, detail: str) -> None:
        raise ActivationError(
            f"σ({self.var}) = {self.expr} is not {condition}: {detail}",
            term=self.name,
            hint=CONDITION_HINT,
        )

    def _check_conditions(self, d: sp.Expr, check: str) -> None:
        lo_val = hi_val = None
        reason = "grid check requested"
        if check in ("auto", "symbolic"):
            try:
                if not d.free_symbols:
                    lo_val = hi_val = d
                else:
                    lo_val = minimum(d, self.var, sp.S.Reals)
                    hi_val = maximum(d, self.var, sp.S.Reals)
                if _as_float(lo_val) is None or _as_float(hi_val) is None:
                    reason = f"sympy returned non-numeric bounds {lo_val}, {hi_val}"
                    lo_val = hi_val = None
            except Exception as exc:  # sympy raises many types when it cannot decide
                reason = f"sympy could not decide ({type(exc).__name__})"
                lo_val = hi_val = None
            if lo_val is None and check == "symbolic":
                raise ActivationError(
                    f"cannot check σ({self.var}) = {self.expr} symbolically: {reason}",
                    term=self.name,
                    hint="use check='auto' or check='grid'",
                )
        if lo_val is not None and hi_val is not None:
            self.check_method = "symbolic"
            const = not d.free_symbols
            lo_f, hi_f = _as_float(lo_val), _as_float(hi_val)
            assert lo_f is not None and hi_f is not None
            if lo_f < 0:
                detail = (
                    f"σ'({self.var}) = {d} < 0"
                    if const
                    else f"inf σ'({self.var}) = {lo_val} < 0 (σ'({self.var}) = {d}; symbolic)"
                )
                self._refuse("nondecreasing", detail)
            if hi_f > 1:
                detail = (
                    f"σ'({self.var}) = {d} > 1"
                    if const
                    else f"sup σ'({self.var}) = {hi_val} > 1 (σ'({self.var}) = {d}; symbolic)"
                )
                self._refuse("1-Lipschitz", detail)
            self._dmin, self._dmax = lo_f, hi_f
            self.derivation.append(
                f"checks (symbolic, sympy minimum/maximum of σ' over ℝ): inf σ' = {lo_val} ≥ 0, "
                f"sup σ' = {hi_val} ≤ 1"
            )
        else:
            self._grid_check(d, reason)
        if self._dmax <= 0:
            raise ActivationError(
                f"σ({self.var}) = {self.expr} is constant: f_σ would be the indicator of a point",
                term=self.name,
                hint="use a non-constant activation",
            )
        self.lipschitz = float(self._dmax)

    def _grid_check(self, d: sp.Expr, reason: str) -> None:
        self.check_method = "grid"
        fn = sp.lambdify(self.var, d, modules="numpy")
        sfn = sp.lambdify(self.var, self.expr, modules="numpy")
        with np.errstate(all="ignore"):
            vals = np.broadcast_to(np.asarray(fn(GRID), dtype=complex), GRID.shape)
            svals = np.broadcast_to(np.asarray(sfn(GRID), dtype=complex), GRID.shape)
        where = f"on a grid of {GRID.size} points in [-1e6, 1e6] ({reason})"
        bad = ~np.isfinite(vals) | (np.abs(vals.imag) > 1e-12)
        bad |= ~np.isfinite(svals) | (np.abs(svals.imag) > 1e-12)
        if bad.any():
            t0 = GRID[np.argmax(bad)]
            raise ActivationError(
                f"σ({self.var}) = {self.expr} is not real-valued and differentiable everywhere: "
                f"σ or σ' is not a finite real number at t = {t0:.6g} {where}",
                term=self.name,
                hint=CONDITION_HINT,
            )
        vr = vals.real
        i_min, i_max = int(np.argmin(vr)), int(np.argmax(vr))
        if vr[i_min] < -GRID_TOL:
            self._refuse(
                "nondecreasing",
                f"min σ'({self.var}) = {vr[i_min]:.6g} < 0 at t = {GRID[i_min]:.6g} {where}",
            )
        if vr[i_max] > 1 + GRID_TOL:
            self._refuse(
                "1-Lipschitz",
                f"max σ'({self.var}) = {vr[i_max]:.6g} > 1 at t = {GRID[i_max]:.6g} {where}",
            )
        self._dmin, self._dmax = float(vr[i_min]), float(min(vr[i_max], 1.0))
        self._grid_dvals = vr
        self.derivation.append(
            f"checks (grid, {where}): min σ' = {vr[i_min]:.6g} ≥ 0, max σ' = {vr[i_max]:.6g} ≤ 1"
        )

    def _verify_torch(self) -> None:
        x = torch.linspace(-3.0, 3.0, 13, dtype=torch.float64)
        try:
            y = self._sigma(x)
            dy = self._dsigma(x)
        except Exception as exc:
            raise ActivationError(
                f"σ({self.var}) = {self.expr} cannot be evaluated with torch "
                f"({type(exc).__name__}: {exc})",
                term=self.name,
                hint="write σ with functions torch provides (exp, log, tanh, atan, erf, ...)",
            ) from exc
        ref = torch.tensor([self._sigma_np(float(v)) for v in x], dtype=torch.float64)
        if not _close(y, ref, 1e-10) or not bool(torch.isfinite(dy).all()):
            raise ActivationError(
                f"σ({self.var}) = {self.expr}: the torch evaluation disagrees with numpy",
                term=self.name,
            )

    # -------------------------------------------------------------------------- derivation
    def _derive_domain(self) -> None:
        t = self.var
        ends: list[float] = []
        exact: list[sp.Expr | None] = []
        how = "sympy limits at ±oo"
        for direction in (-sp.oo, sp.oo):
            val: float | None
            try:
                lim = sp.limit(self.expr, t, direction)
                val = _as_float(lim)
            except Exception:
                val = None
            exact.append(lim if val is not None else None)
            if val is None:
                how = "numeric: σ(±1e12)"
                x = 1e12 if direction is sp.oo else -1e12
                y = self._sigma_np(x)
                val = (INF if y > 0 else -INF) if abs(y) > 1e9 else y
            ends.append(val)
        self.domain = (ends[0], ends[1])
        self._domain_exact = exact
        self.derivation.append(
            f"range σ: ends {ends[0]}, {ends[1]} ({how}); dom f_σ = {fmt_interval(*self.domain)}"
        )

    def _derive_strictness(self, d: sp.Expr) -> None:
        strict: bool | None = None
        try:
            zeros = sp.solveset(sp.Eq(d, 0), self.var, sp.S.Reals)
            if zeros is sp.S.EmptySet or isinstance(zeros, sp.FiniteSet):
                strict = True
            elif zeros.measure > 0:
                strict = False
        except Exception:
            strict = None
        how = "symbolic: zeros of σ' via solveset"
        if strict is None:
            how = "grid: σ' vanishes on no two consecutive grid points"
            dv = getattr(self, "_grid_dvals", None)
            if dv is None:
                fn = sp.lambdify(self.var, d, modules="numpy")
                with np.errstate(all="ignore"):
                    dv = np.broadcast_to(np.real(np.asarray(fn(GRID), dtype=complex)), GRID.shape)
            zero = dv == 0
            strict = not bool((zero[1:] & zero[:-1]).any())
        self.smooth_potential = strict
        kind = (
            "strictly increasing (f_σ smooth on int dom)"
            if strict
            else ("not strictly increasing (f_σ has an indicator part)")
        )
        self.derivation.append(f"σ is {kind} ({how})")

    def _samples(self) -> None:
        ts = torch.linspace(-6.0, 6.0, 49, dtype=torch.float64)
        keep = (self._dsigma(ts) > 1e-6) & self._interior(self._sigma(ts))
        self._t_samples = ts[keep]
        self._u_samples = self._sigma(self._t_samples)

    def _derive_inverse(self) -> None:
        u, t = self._u, self.var
        self.inverse_expr: sp.Expr | None = None
        self._inverse_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        try:
            candidates = sp.solve(sp.Eq(self.expr, u), t)
        except Exception:
            candidates = []
        for cand in candidates:
            try:
                fn = lambdify_torch(cand, u)
                vals = fn(self._u_samples)
                if vals.is_complex() or not _close(self._sigma(vals), self._u_samples, 1e-9):
                    continue
            except Exception:
                continue
            self.inverse_expr, self._inverse_fn = cand, fn
            break
        self.symbolic["inverse"] = self._inverse_fn is not None
        if self._inverse_fn is not None:
            self.derivation.append(
                f"σ⁻¹(u) = {self.inverse_expr} (sympy solve; branch checked on the range)"
            )
        else:
            self.derivation.append(
                "σ⁻¹(u): no verified closed form; numeric (safeguarded Newton/bisection)"
            )

    def _derive_antiderivative(self) -> None:
        a, t = self._a, self.var
        self.antiderivative_expr: sp.Expr | None = None
        self._antider_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        try:
            expr = sp.integrate(self.expr, (t, 0, a))
            if not expr.has(sp.Integral):
                fn = lambdify_torch(expr, a)
                if self._check_antiderivative(fn):
                    self.antiderivative_expr, self._antider_fn = expr, fn
        except Exception:
            pass
        self.symbolic["antiderivative"] = self._antider_fn is not None
        if self._antider_fn is not None:
            self.derivation.append(f"σ̃(a) = {self.antiderivative_expr} (sympy integrate)")
        else:
            self.derivation.append("σ̃(a) = ∫_0^a σ(t) dt: no closed form; numeric (scipy quad)")

    def _check_antiderivative(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        ts = torch.linspace(-5.0, 5.0, 21, dtype=torch.float64)
        h = 1e-5
        z = fn(torch.zeros(1, dtype=torch.float64))
        vals = fn(ts)
        if z.is_complex() or vals.is_complex() or abs(float(z[0])) > 1e-10:
            return False
        fd = (fn(ts + h) - fn(ts - h)) / (2 * h)
        return _close(fd, self._sigma(ts), 1e-6)

    def _derive_antiderivative_conjugate(self) -> None:
        u = self._u
        self.antiderivative_conjugate_expr: sp.Expr | None = None
        self.potential_expr: sp.Expr | None = None
        self._antider_conj_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        how = ""
        if self.inverse_expr is not None:
            attempts: list[tuple[str, Callable[[], sp.Expr]]] = [
                ("∫_{σ(0)}^u σ⁻¹, sympy integrate", self._conj_by_integral),
            ]
            if self.antiderivative_expr is not None:
                attempts.append(("u σ⁻¹(u) - σ̃(σ⁻¹(u))", self._conj_by_composition))
            for label, make in attempts:
                try:
                    expr = make()
                    if expr is None or expr.has(sp.Integral):
                        continue
                    fn = lambdify_torch(expr, u)
                    if self._check_antiderivative_conjugate(fn):
                        self.antiderivative_conjugate_expr, self._antider_conj_fn = expr, fn
                        how = label
                        break
                except Exception:
                    continue
        self.symbolic["antiderivative_conjugate"] = self._antider_conj_fn is not None
        if self.antiderivative_conjugate_expr is not None:
            self.potential_expr = self.antiderivative_conjugate_expr - u**2 / 2
            self.derivation.append(f"σ̃*(u) = {self.antiderivative_conjugate_expr} ({how})")
            self.derivation.append(f"f_σ(u) = σ̃*(u) - u²/2 = {self.potential_expr}")
        else:
            self.derivation.append(
                "σ̃*(u) = u σ⁻¹(u) - σ̃(σ⁻¹(u)): numeric; f_σ(u) = σ̃*(u) - u²/2 (numeric)"
            )

    def _conj_by_integral(self) -> sp.Expr:
        s = sp.Symbol("s", real=True)
        assert self.inverse_expr is not None
        lower = sp.simplify(self.expr.subs(self.var, 0))
        return sp.integrate(self.inverse_expr.subs(self._u, s), (s, lower, self._u))

    def _conj_by_composition(self) -> sp.Expr:
        assert self.inverse_expr is not None and self.antiderivative_expr is not None
        inv = self.inverse_expr
        return sp.simplify(self._u * inv - self.antiderivative_expr.subs(self._a, inv))

    def _check_antiderivative_conjugate(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        if self._t_samples.numel() == 0:
            return False
        vals = fn(self._u_samples)
        if vals.is_complex():
            return False
        ref = self._u_samples * self._t_samples - self.antiderivative(self._t_samples)
        return _close(vals, ref, 1e-8)

    # ----------------------------------------------------------------- Activation interface
    def sigma(self, t: TensorLike) -> torch.Tensor:
        """``σ(t)`` (lambdified sympy expression)."""
        return self._sigma(nm.as_tensor(t))

    def sigma_prime(self, t: TensorLike) -> torch.Tensor:
        """``σ'(t)`` (lambdified sympy derivative)."""
        return self._dsigma(nm.as_tensor(t))

    def inverse(self, u: TensorLike) -> torch.Tensor:
        """``σ⁻¹(u)``: verified closed form or numeric; ``∓inf`` at finite ends, NaN outside."""
        u = nm.as_tensor(u)
        if self._inverse_fn is None:
            return self._numeric_inverse(u)
        inside = self._interior(u)
        us = torch.where(inside, u, torch.full_like(u, self._domain_point()))
        out = torch.where(inside, self._inverse_fn(us), torch.full_like(u, math.nan))
        lo, hi = self.domain
        out = torch.where(u == lo, torch.full_like(u, self._inverse_at_end(0)), out)
        return torch.where(u == hi, torch.full_like(u, self._inverse_at_end(1)), out)

    def antiderivative(self, a: TensorLike) -> torch.Tensor:
        """``σ̃(a)``: sympy closed form, or scipy quad of ``σ`` (autograd ``σ̃' = σ``)."""
        a = nm.as_tensor(a)
        if self._antider_fn is not None:
            return self._antider_fn(a)
        return nm.numpy_antiderivative(a, self._quad_antiderivative_np, self.sigma)

    def _quad_antiderivative_np(self, a: np.ndarray) -> np.ndarray:
        return nm.quad_antiderivative(self._sigma_np, a)

    def antiderivative_conjugate(self, u: TensorLike) -> torch.Tensor:
        """``σ̃*(u)``: sympy closed form or ``u σ⁻¹(u) - σ̃(σ⁻¹(u))``; ``+inf`` outside."""
        u = nm.as_tensor(u)
        if self._antider_conj_fn is None:
            return self._numeric_antiderivative_conjugate(u)
        lo, hi = self.domain
        inside = self._interior(u)
        us = torch.where(inside, u, torch.full_like(u, self._domain_point()))
        out = torch.where(inside, self._antider_conj_fn(us), torch.full_like(u, INF))
        for end, side in ((lo, 0), (hi, 1)):
            if math.isfinite(end):
                bval = self._antideriv_conj_boundary_value(side)
                out = torch.where(u == end, torch.full_like(u, bval), out)
        return torch.where(torch.isnan(u), u, out)

    def _antideriv_conj_boundary_value(self, side: int) -> float:
        cached = self._antideriv_conj_boundary[side]
        if cached is None and self.antiderivative_conjugate_expr is not None:
            end = self._domain_exact[side]
            end = sp.nsimplify(self.domain[side]) if end is None else end
            try:
                lim = sp.limit(
                    self.antiderivative_conjugate_expr, self._u, end, dir="+" if side == 0 else "-"
                )
                val = _as_float(lim)
            except Exception:
                val = None
            if val is not None:
                bounds = list(self._antideriv_conj_boundary)
                bounds[side] = val
                self._antideriv_conj_boundary = (bounds[0], bounds[1])
        return super()._antideriv_conj_boundary_value(side)

    def _inverse_at_end(self, side: int) -> float:
        end = self.domain[side]
        if not math.isfinite(end):
            return math.nan
        cache = self.__dict__.setdefault("_inverse_end_cache", {})
        if side not in cache:
            cache[side] = self._inverse_at_end_uncached(side, end)
        return cache[side]

    def _inverse_at_end_uncached(self, side: int, end: float) -> float:
        try:
            exact = self._domain_exact[side]
            exact = sp.nsimplify(end) if exact is None else exact
            sol = sp.solveset(sp.Eq(self.expr, exact), self.var, sp.S.Reals)
            if isinstance(sol, sp.Interval):
                pt = _as_float(sol.sup if side == 0 else sol.inf)
                if pt is not None:
                    return pt
        except Exception:
            pass
        return -INF if side == 0 else INF

    @property
    def conjugate_domain(self) -> tuple[float, float]:  # type: ignore[override]
        """Closure of the range of ``s - σ(s)`` (sympy limits at ±oo, numeric fallback)."""
        if self._conj_domain is None:
            g = self.var - self.expr
            ends = []
            for direction in (-sp.oo, sp.oo):
                try:
                    val = _as_float(sp.limit(g, self.var, direction))
                except Exception:
                    val = None
                if val is None:
                    x = 1e12 if direction is sp.oo else -1e12
                    y = x - self._sigma_np(x)
                    val = (INF if y > 0 else -INF) if abs(y) > 1e9 else y
                ends.append(val)
            self._conj_domain = (ends[0], ends[1])
        return self._conj_domain

    def _conjugate_boundary_value(self, side: int) -> float:
        cached = self._conjugate_boundary[side]
        if cached is None and self.antiderivative_expr is not None:
            f_conj = self.antiderivative_expr.subs(self._a, self.var) - self.expr**2 / 2
            try:
                val = _as_float(sp.limit(f_conj, self.var, sp.oo if side == 1 else -sp.oo))
            except Exception:
                val = None
            if val is not None:
                bounds = list(self._conjugate_boundary)
                bounds[side] = val
                self._conjugate_boundary = (bounds[0], bounds[1])
        return super()._conjugate_boundary_value(side)

    def latex_potential(self, arg: str = "u") -> str:
        """LaTeX of ``f_σ(arg)`` (symbolic when derived, else the defining formula)."""
        if self.potential_expr is not None:
            return sp.latex(self.potential_expr.subs(self._u, sp.Symbol(arg, real=True)))
        return super().latex_potential(arg)

    def latex_antiderivative(self, arg: str = "a") -> str:
        """LaTeX of ``σ̃(arg)``."""
        if self.antiderivative_expr is not None:
            return sp.latex(self.antiderivative_expr.subs(self._a, sp.Symbol(arg, real=True)))
        return rf"\int_0^{{{arg}}} {sp.latex(self.expr)}\,d{self.var}"

    def __repr__(self) -> str:
        return f"<SympyActivation {self.name}: σ({self.var}) = {self.expr}>"


def from_sympy(
    expr: Any, var: Any, name: str | None = None, *, check: str = "auto"
) -> SympyActivation:
    """Activation from a sympy ``σ(var)``; refuses non-monotone or non-1-Lipschitz ``σ``."""
    return SympyActivation(expr, var, name, check=check)
