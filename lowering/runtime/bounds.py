"""Certified bounds of an emitted layer at its current (controlled) weights (docs/theory.md §9.6).

* **A posteriori error bound**: ``||o − o*|| ≤ c_e·||T(u) − u||`` for the returned state ``u``
  and output ``o`` (``o*`` the output at the fixed point ``u*``).  For a ``T`` whose certified
  Lipschitz constant is ``L < 1``: ``c_e = Lip(output map)/(1 − L)``; for the Chambolle–Pock
  saddle layer (averaged, factor 1): ``c_e = 1 + ||P||₂/μ`` from the strong monotonicity of the
  saddle operator (``P`` the iteration's metric).  Where no certificate holds a
  :class:`~convex_eq.errors.CertificateError` says why — never a number.
* **Lipschitz bound of the solution map** ``x ↦ o*(x)``: ``Lip(output)·Lip_x(T)/(1 − L)``, with
  ``Lip_x(T)`` derived per rule from the input terms of the declared objective; for monotone
  inclusions ``Lip_x(q)/m`` from the strong monotonicity margin ``m``.

Constants are evaluated with *certified* operator norms (:func:`certified_norm`: a float64 SVD
or a registered guaranteed upper bound, never the power-iteration estimate, which is a lower
bound) and cached per version of the weights (their content keys, :mod:`.versions`).  The rules
are found by the type of the derived layer's payload in :data:`ERROR_RULES`,
:data:`CONTRACTION_RULES`, :data:`T_INPUT_RULES` and :data:`SOLUTION_INPUT_RULES`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from convex_eq.errors import CertificateError
from convex_eq.operators.base import norm_policy
from convex_eq.symbols import Env

from . import parameters as params
from .norms import upper_bound
from .versions import Checksums

#: largest operator (rows × columns) whose certified norm is a dense float64 SVD (32 MiB)
CERT_DENSE_ENTRIES = 2048 * 2048
_U64 = 2.0 ** -53


@dataclass(frozen=True)
class Factor:
    """A certified constant and the formula it was evaluated from."""

    value: float
    formula: str

    def __str__(self) -> str:
        return f"{self.formula} = {self.value:.6g}"


@dataclass(frozen=True)
class Certified:
    """The bounds' constants at one weight version: ``error`` (``||o − o*|| ≤ error·||T(u) −
    u||``) and ``lipschitz`` (``Lip(x ↦ o*)`` w.r.t. the stacked inputs), each None with the
    error that refuses it; ``contraction``: the certified ``Lip(T)`` (NaN where the rule uses
    none)."""

    error: Factor | None
    error_refusal: CertificateError | None
    lipschitz: Factor | None
    lipschitz_refusal: CertificateError | None
    contraction: float

    def require(self, which: str) -> Factor:
        """``error`` or ``lipschitz``, or the :class:`CertificateError` that refuses it (a fresh
        one each time, with the refusal's reason, term and hint)."""
        f, why = (self.error, self.error_refusal) if which == "error" else (
            self.lipschitz, self.lipschitz_refusal)
        if f is None:
            assert why is not None
            raise CertificateError(why.reason, term=why.term, hint=why.hint)
        return f


# ----------------------------------------------------------------------------- certified norms
def certified_norm(op: Any, env: Env | None) -> float:
    """A guaranteed upper bound of ``||op||₂`` at ``env``: the largest singular value of the
    dense float64 matrix, raised by ``8·max(m, n)·u`` (``u = 2⁻⁵³``, above the SVD's backward
    error), for operators up to :data:`CERT_DENSE_ENTRIES` entries; else the registered upper
    bound of its type (:func:`lowering.runtime.norms.upper_bound`, e.g. a convolution's Fourier
    bound); else a :class:`CertificateError`."""
    n, m = op.in_size, op.out_size
    if n * m <= CERT_DENSE_ENTRIES:
        with torch.no_grad():
            mat = torch.from_numpy(op.matrix(env))
            top = float(torch.linalg.svdvals(mat)[0])
        return top * (1.0 + 8.0 * max(n, m) * _U64)
    syms = [s for s in op.symbols() if env is not None and s.name in env]
    ub = upper_bound(op, syms[0].name, env) if len(syms) == 1 else None
    if ub is None or not math.isfinite(ub):
        raise CertificateError(f"no certified norm of {op} ({m}×{n}): too large for a dense SVD "
                               "and no guaranteed upper bound is registered for it",
                               term=str(op), hint="register one with lowering.runtime.norms."
                               "register_upper_bound")
    return float(ub)


def certified_norms() -> Any:
    """A context in which every estimated operator norm (:meth:`LinOp.norm`) is
    :func:`certified_norm`, memoised per operator: use it for one ``env``."""
    return norm_policy(_policy())


def _policy() -> Callable[[Any, Any], float]:
    """:func:`certified_norm`, memoised per operator (one evaluation at one ``env``)."""
    seen: dict[int, tuple[Any, float]] = {}

    def policy(op: Any, env: Any) -> float:
        hit = seen.get(id(op))
        if hit is None or hit[0] is not op:
            hit = seen[id(op)] = (op, certified_norm(op, env))
        return hit[1]

    return policy


# ----------------------------------------------------------------------------- helpers
def _payload(derived: Any) -> str:
    return type(derived.payload).__name__


def _norm_of(a: Any, kind: str, env: Env | None) -> float:
    """``||∂a/∂(stacked symbols of kind)||₂ ≤ √(Σ_s ||A_s||²)`` of an affine argument."""
    return math.sqrt(sum(a.operator_norm(s, env) ** 2 for s in a.symbols(kind)))


def reads_input(t: Any) -> bool:
    return any(s.kind == "input" for s in t.symbols())


def grad_input_lipschitz(t: Any, env: Env | None) -> float:
    """``Lip_x(∇_z t)``: how far the term's gradient in the stacked state moves with the stacked
    input (0 for a term that reads no input).  ``t = c·f(a_1, …, a_k)``, ``a_i = A_i z + B_i x +
    b_i``: a bilinear ``f`` whose ``∇_{a_i} f = a_{s(i)}`` gives ``|c|·Σ_i ||A_i||·||B_{s(i)}||``;
    one argument gives ``|c|·||A||·Lip(∇f)·||B||`` (docs/theory.md §9.6)."""
    if not reads_input(t):
        return 0.0
    if not t.smooth:
        raise CertificateError(f"'{t}' reads the input and is not smooth: no Lipschitz bound of "
                               "its gradient in the input is derived", term=str(t))
    c = abs(t.coef(env))
    src = getattr(t, "grad_sources", None)
    if getattr(t, "grad_structure", None) == "bilinear" and src is not None:
        return c * sum(_norm_of(t.args[i], "state", env) * _norm_of(t.args[j], "input", env)
                       for i, j in enumerate(src))
    if len(t.args) == 1:
        lip = float(t.raw_grad_lipschitz(env)[0])
        a = t.args[0]
        return c * _norm_of(a, "state", env) * lip * _norm_of(a, "input", env)
    raise CertificateError(f"'{t}' ({t.label}) reads the input through {len(t.args)} arguments "
                           "without a declared bilinear gradient: no input Lipschitz bound is "
                           "derived for it", term=str(t))


def _output_lipschitz(derived: Any, env: Env | None) -> float:
    """``Lip`` of the output map in the state (1: the state itself)."""
    if derived.outputs is None:
        return 1.0
    return math.sqrt(sum(n.lip(env) ** 2 for _, n in derived.outputs))


# ----------------------------------------------------------------------------- contraction
def declared_contraction(derived: Any, env: Env | None) -> Factor:
    """The derivation's own ``Lip(T)`` formula, evaluated with certified norms."""
    c = derived.contraction
    return Factor(c.value(env), c.formula)


def splitting_contraction(derived: Any, env: Env | None) -> Factor:
    """Forward–backward / Peaceman–Rachford / Douglas–Rachford with the step ``α`` the node
    uses (from its own, possibly estimated, ``L``) and an *upper* bound ``L̄ ≥ ||M||₂``
    (:func:`_matrix_norm`): ``√(1 − 2αm + α²L̄²)`` (FB), ``c = √(1 − 4αm/(1 + 2αm +
    α²L̄²))`` (PR) or ``(1 + c)/2`` (DR) — valid for every ``α > 0`` (docs/theory.md §9.6)."""
    p = derived.payload
    node = derived.nodes[derived.blocks[0].name]
    m, lip_step = node.consts(env)
    lip = max(_matrix_norm(p.inclusion, env), lip_step)
    if p.method == "forward-backward":
        a = m / lip_step ** 2
        return Factor(math.sqrt(max(0.0, 1 - 2 * a * m + (a * lip) ** 2)),
                      "√(1 − 2αm + α²L̄²), α = m/L², L̄ ≥ ||M||₂")
    a = 1.0 / lip_step
    c = math.sqrt(max(0.0, 1 - 4 * a * m / (1 + 2 * a * m + (a * lip) ** 2)))
    if p.method == "peaceman-rachford":
        return Factor(c, "√(1 − 4αm/(1 + 2αm + α²L̄²)), α = 1/L, L̄ ≥ ||M||₂")
    return Factor(0.5 * (1 + c), "(1 + √(1 − 4αm/(1 + 2αm + α²L̄²)))/2, α = 1/L, L̄ ≥ ||M||₂")


def _matrix_norm(inc: Any, env: Env | None) -> float:
    """``L̄ ≥ ||M||₂`` of an inclusion's ``F(z) = Mz − q``: the dense float64 SVD raised as in
    :func:`certified_norm` up to :data:`CERT_DENSE_ENTRIES` entries, else
    :meth:`Inclusion.lipschitz` (``√(||M||₁||M||_∞)``)."""
    n = inc.z.size
    if n * n > CERT_DENSE_ENTRIES:
        return float(inc.lipschitz(env))
    top = float(torch.linalg.svdvals(torch.from_numpy(inc.matrix(env)))[0])
    return top * (1.0 + 8.0 * n * _U64)


#: payload type → ``Lip(T)`` with certified norms (default: :func:`declared_contraction`)
CONTRACTION_RULES: dict[str, Callable[[Any, Env | None], Factor]] = {
    "SplittingPayload": splitting_contraction,
}


def contraction(derived: Any, env: Env | None) -> Factor:
    """The certified ``Lip(T)`` of ``derived`` at ``env`` (call inside the norm policy)."""
    return CONTRACTION_RULES.get(_payload(derived), declared_contraction)(derived, env)


def _below_one(derived: Any, env: Env | None) -> Factor:
    lc = contraction(derived, env)
    if not (math.isfinite(lc.value) and lc.value < 1.0):
        claim = derived.claim.kind
        raise CertificateError(
            f"Lip(T) ≤ {lc.formula} = {lc.value:.4g} is not below 1 at these weights ({claim} "
            "claim): T is not a certified contraction, so a residual bounds no distance to a "
            "fixed point", term="Lip(T)",
            hint="keep the certificate's norm conditions strictly (weight control with a margin)")
    return lc


# ----------------------------------------------------------------------------- error factors
def contraction_error(derived: Any, env: Env | None) -> Factor:
    """``||o − o*|| ≤ Lip(output)·||T(u) − u||/(1 − L)``."""
    lc = _below_one(derived, env)
    out = _output_lipschitz(derived, env)
    text = f"1/(1 − L), L = {lc.formula}"
    return Factor(out / (1.0 - lc.value), text if out == 1.0 else f"Lip(output)·{text}")


def saddle_error(derived: Any, env: Env | None) -> Factor:
    """Chambolle–Pock: ``||u − u*|| ≤ (1 + ||P||₂/μ)·||T(u) − u||``, ``||P||₂ ≤ max(1/τ, 1/σ) +
    ||K||₂``, ``μ = min(μ_G, μ_H)`` (docs/theory.md §9.6)."""
    sad = derived.payload.saddle
    mu = min(derived.payload.moduli)
    if not mu > 0:
        raise CertificateError(
            f"G and H are not both strongly convex (moduli {derived.payload.moduli}): the "
            "Chambolle–Pock iteration is averaged, not a contraction, and no distance bound "
            "follows from its residual", term="error_bound",
            hint="add μ·½||z||² to G and μ·½||w||² to H (μ > 0)")
    tau, sig = derived.nodes[sad.z.name].steps(env)
    p = max(1.0 / tau, 1.0 / sig) + sad.K.norm(env)
    return Factor(1.0 + p / mu, "1 + (max(1/τ, 1/σ) + ||K||₂)/min(μ_G, μ_H)")


#: payload type → the error factor ``c_e`` (default: :func:`contraction_error`)
ERROR_RULES: dict[str, Callable[[Any, Env | None], Factor]] = {
    "SaddlePayload": saddle_error,
}


# ----------------------------------------------------------------------------- input Lipschitz
def canonical_input(derived: Any, env: Env | None) -> Factor:
    """``T_b = σ_b(∇_b S)``: ``Lip_x(T) ≤ max_b L_σ_b·Σ_{t ∈ S} Lip_x(∇_z t)``."""
    p = derived.payload
    for t in derived.source.terms:
        if reads_input(t) and all(t is not s for s in p.S_terms):
            raise CertificateError(f"'{t}' reads the input outside S: no input Lipschitz bound "
                                   "is derived for it", term=str(t))
    ls = max(pot.act.lipschitz for pot in p.potentials.values())
    return Factor(ls * sum(grad_input_lipschitz(t, env) for t in p.S_terms),
                  "L_σ·Σ_t Lip_x(∇_z t)")


def theorem1_input(derived: Any, env: Env | None) -> Factor:
    """``T = ∇ψ``, ``ψ = s·Σσ̃(Mz + Ux + b)``: ``Lip_x(T) ≤ s·||M||·L_σ·||U||``."""
    return Factor(grad_input_lipschitz(derived.payload.psi, env), "s·||M||₂·L_σ·||U||₂")


def deep_input(derived: Any, env: Env | None) -> Factor:
    """``f_l = α∇ψ_l + (1 − α)id``: composition ``Σ_l Lip_x(f_l)·Π_{k>l} Lip_z(f_k)``,
    multi-block ``√(Σ_l Lip_x(f_l)²)``."""
    p = derived.payload
    a = float(derived.source.alpha_value(env))
    lx = [a * theorem1_input(inner, env).value for inner in p.layers]
    if p.form != "composition":
        return Factor(math.sqrt(sum(v * v for v in lx)), "√(Σ_l (α·Lip_x(∇ψ_l))²)")
    lz = [a * contraction(inner, env).value + 1 - a for inner in p.layers]
    tot = sum(v * math.prod(lz[i + 1:]) for i, v in enumerate(lx))
    return Factor(tot, "Σ_l α·Lip_x(∇ψ_l)·Π_{k>l}(α·L_k + 1 − α)")


def skip_input(derived: Any, env: Env | None) -> Factor:
    """``T = α·T_inner + (1 − α)·id``: ``α·Lip_x(T_inner)``."""
    inner = derived.payload.inner
    f = t_input(inner, env)
    a = float(derived.payload.alpha)
    return Factor(a * f.value, f"α·({f.formula})")


#: payload type → ``Lip_x(T)`` at a fixed state (then ``Lip(x ↦ o*) ≤ Lip(output)·Lip_x(T)/(1 −
#: L)``)
T_INPUT_RULES: dict[str, Callable[[Any, Env | None], Factor]] = {
    "CanonicalPayload": canonical_input,
    "TheoremOnePayload": theorem1_input,
    "DeepPayload": deep_input,
    "SkipPayload": skip_input,
}


def t_input(derived: Any, env: Env | None) -> Factor:
    rule = T_INPUT_RULES.get(_payload(derived))
    if rule is None:
        raise CertificateError(f"no input Lipschitz rule for a layer derived by "
                               f"{' → '.join(derived.derivation.rules()) or _payload(derived)}",
                               term="lipschitz_bound", hint="rules with one: canonical "
                               "(OptEq), Theorem 1, deep compositions, Moreau skip, monotone "
                               "inclusions and saddles")
    return rule(derived, env)


def inclusion_input(derived: Any, env: Env | None) -> Factor:
    """``0 ∈ Mz − q(x) + ∂g(z)``, ``½(M + Mᵀ) ⪰ mI``: ``||z*(x) − z*(x')|| ≤ ||q(x) −
    q(x')||/m``, ``Lip_x(q) ≤ Σ_h Lip_x(∇_z h)`` (docs/theory.md §9.6)."""
    inc = derived.payload.inclusion
    for t in inc.g_terms:
        if reads_input(t):
            raise CertificateError(f"g's term '{t}' reads the input: no input Lipschitz bound "
                                   "is derived for it", term=str(t))
    if any(s.kind == "input" for op in inc.linear for s in op.symbols()):
        raise CertificateError("a linear part of F reads the input", term=str(inc))
    m = float(inc.margin(env).value)
    if not m > 0:
        raise CertificateError(f"F is not strongly monotone at these weights (m = {m:.4g})",
                               term="lipschitz_bound")
    q = sum(grad_input_lipschitz(t, env) for t in inc.h_terms)
    return Factor(q / m, "Lip_x(q)/m")


def saddle_input(derived: Any, env: Env | None) -> Factor:
    """``0 ∈ A(u) − r(x)`` with ``A`` ``μ``-strongly monotone: ``Lip ≤ Lip_x(r)/μ``, ``r`` the
    input parts of ``∇G``, ``∇H`` and the offset ``c``."""
    p = derived.payload
    sad = p.saddle
    mu = min(p.moduli)
    if not mu > 0:
        raise CertificateError(f"G and H are not both strongly convex (moduli {p.moduli}): the "
                               "saddle point need not move Lipschitz-continuously with the "
                               "input", term="lipschitz_bound")
    parts = sum(grad_input_lipschitz(t, env) for t in sad.terms)
    c = 0.0 if sad.c is None else _norm_of(sad.c, "input", env)
    return Factor((parts + c) / mu, "(Σ_t Lip_x(∇t) + Lip_x(c))/μ")


#: payload type → ``Lip(x ↦ o*)`` derived from the problem's monotonicity directly
SOLUTION_INPUT_RULES: dict[str, Callable[[Any, Env | None], Factor]] = {
    "SplittingPayload": inclusion_input,
    "SaddlePayload": saddle_input,
}


# ----------------------------------------------------------------------------- constants
def certify(derived: Any, env: Env | None) -> Certified:
    """Every constant of the bounds at ``env``, with certified norms; refusals as reasons."""
    with certified_norms(), torch.no_grad():
        try:
            lc = contraction(derived, env).value
        except CertificateError:
            lc = math.nan
        error, why = _attempt(lambda: ERROR_RULES.get(_payload(derived), contraction_error)(
            derived, env))
        lip, lwhy = _attempt(lambda: _solution_input(derived, env))
    return Certified(error, why, lip, lwhy, lc)


def _solution_input(derived: Any, env: Env | None) -> Factor:
    rule = SOLUTION_INPUT_RULES.get(_payload(derived))
    if rule is not None:
        return rule(derived, env)
    lx = t_input(derived, env)
    lc = _below_one(derived, env)
    out = _output_lipschitz(derived, env)
    return Factor(out * lx.value / (1.0 - lc.value),
                  f"Lip_x(T)/(1 − L), Lip_x(T) ≤ {lx.formula}, L = {lc.formula}")


def _attempt(fn: Callable[[], Factor]) -> tuple[Factor | None, CertificateError | None]:
    try:
        f = fn()
    except CertificateError as err:
        return None, err
    if not (math.isfinite(f.value) and f.value >= 0):
        return None, CertificateError(f"the bound {f.formula} evaluates to {f.value!r} at these "
                                      "weights", term="certified bounds")
    return f, None


_CHECKSUMS = Checksums()
#: module → (content keys of its controlled weights, their Certified)
_CACHE: weakref.WeakKeyDictionary[Any, tuple[Any, Certified]] = weakref.WeakKeyDictionary()


def _keyed(env: Mapping[str, torch.Tensor]) -> tuple:
    return tuple(sorted((n, k) for n, k in _CHECKSUMS.keys(dict(env)).items()))


def module_constants(module: Any) -> Certified:
    """:func:`certify` at the module's current controlled weights, once per weight version."""
    with torch.no_grad():
        env = {k: v.detach() for k, v in module.env().items()}
    key = _keyed(env)
    hit = _CACHE.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    out = certify(module.derived, env)
    _CACHE[module] = (key, out)
    return out


# ----------------------------------------------------------------------------- the bounds
def error_factor(module: Any) -> Factor:
    """``c_e`` of the module at its current weights (a :class:`CertificateError` if refused)."""
    return module_constants(module).require("error")


def lipschitz_bound(module: Any) -> Factor:
    """``Lip(x ↦ o*(x))`` w.r.t. the stacked inputs at the module's current weights."""
    return module_constants(module).require("lipschitz")


def error_bound(module: Any, x: Any = None, z: torch.Tensor | None = None) -> torch.Tensor:
    """Per sample ``(B,)`` float64: ``||o − o*(x)||₂ ≤ c_e·||T(u) − u||₂`` (docs/theory.md §9.6).

    Nothing given: the module's last forward (its returned states' residuals, the weights it
    ran with — refused once they changed).  ``x``: a forward at ``x`` (no gradient) first.
    ``x`` and ``z``: the flat state ``(B, N)`` ``z`` (the output itself for a layer without an
    output map) with ``T`` evaluated once at it in float64.  Non-finite samples read ``inf``."""
    factor = error_factor(module).value
    if module.dtype in (torch.float16, torch.bfloat16):
        raise CertificateError(f"a {module.dtype} module rounds its output to that dtype after "
                               "the solve, which the residual does not see", term="error_bound",
                               hint="bound a float32 or float64 copy of the module "
                               "(module.float())")
    if z is not None:
        if x is None:
            raise CertificateError("a state z is given without its input x", term="error_bound",
                                   hint="pass error_bound(x=..., z=...)")
        return factor * _residual_at(module, x, z)
    if x is not None:
        with torch.no_grad():
            module(x, return_stats=True)
    st = module.last_stats
    if st is None:
        raise CertificateError("no forward has run", term="error_bound",
                               hint="call the module first, or pass x")
    if st.image_norm is None or st.weights_keys is None:
        raise CertificateError("the last forward's statistics carry no absolute residual or "
                               "weight version", term="error_bound", hint="pass x to solve again")
    now = _CHECKSUMS.keys(params.raw_env(module))
    if now != st.weights_keys:
        raise CertificateError("the weights changed since the last forward: its residuals "
                               "bound nothing at the current weights", term="error_bound",
                               hint="pass x to solve again at the current weights")
    r = st.abs_residual
    assert r is not None
    r = with_rounding(r, st.image_norm, module.state_size, module.dtype)
    return torch.where(torch.isfinite(r), factor * r, torch.full_like(r, math.inf)).cpu()


def with_rounding(r: torch.Tensor, image_norm: torch.Tensor, n: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """The residual ``r = ||T(u) − u||`` measured in ``dtype`` plus the floating-point allowance
    ``γ·(r + ||T(u)||)``, ``γ = (N + 3)·u`` (``u`` the unit roundoff of ``dtype``, ``N`` the
    state size): the worst-case relative error of a length-``N`` inner product (Higham, Thm
    3.1), for the rounding of ``T``'s evaluation and of the residual's norms; without it a
    state with ``T(u) = u`` in floating point would read a bound of 0 while the exact fixed
    point lies a rounding away (docs/theory.md §9.6)."""
    g = (n + 3) * torch.finfo(dtype).eps / 2
    return r + g * (r + image_norm.to(r.device, torch.float64))


def _residual_at(module: Any, x: Any, z: torch.Tensor) -> torch.Tensor:
    """``||T(z) − z||₂`` per sample with inputs, weights and ``z`` in float64."""
    from .guards import inputs_of

    with torch.no_grad():
        inputs = {k: v.detach().double() for k, v in inputs_of(module, x, torch.float64).items()}
        env = {k: v.detach().double() for k, v in module.env().items()}
        z64 = z.detach().reshape(z.shape[0], -1).double()
        if z64.shape[1] != module.state_size:
            raise CertificateError(f"z has {z64.shape[1]} entries per sample, the state "
                                   f"{module.state_size}", term="error_bound",
                                   hint="pass the flat stacked state (B, N)")
        tz = module.T(z64, inputs, env)
        r = with_rounding(torch.linalg.vector_norm(tz - z64, dim=1),
                          torch.linalg.vector_norm(tz, dim=1), z64.shape[1], torch.float64)
    return torch.where(torch.isfinite(r), r, torch.full_like(r, math.inf)).cpu()


__all__ = ["CERT_DENSE_ENTRIES", "CONTRACTION_RULES", "ERROR_RULES", "SOLUTION_INPUT_RULES",
           "T_INPUT_RULES", "Certified", "Factor", "certified_norm", "certified_norms", "certify",
           "error_bound",
           "error_factor", "grad_input_lipschitz", "lipschitz_bound", "module_constants"]
