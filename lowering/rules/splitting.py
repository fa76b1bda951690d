"""Splitting rules for monotone inclusions ``0 ∈ F(z) + ∂g(z)`` and saddle objectives
(docs/monotone.md §2–§4).  ``F(z) = Mz − q`` is ``m``-strongly monotone and ``L``-Lipschitz:

* symmetric ``F = ∇h``: the inclusion is stationarity of ``g + h`` — lowered by the objective
  rules (the canonical layer and claim);
* forward–backward: ``z ← prox_{αg}(z − αF(z))``, ``α = m/L²`` (contraction factor
  ``√(1 − 2αm + α²L²) = √(1 − m²/L²)``);
* Peaceman–Rachford / Douglas–Rachford on ``u``: ``z = prox_{αg}(u)``,
  ``w = (I + αM)⁻¹(2z − u + αq)``, ``u ← u + 2(w − z)`` (PR) or ``u + (w − z)`` (DR),
  ``α = 1/L``; output ``z = prox_{αg}(u)``; the reflected resolvent of ``αF`` has factor
  ``√(1 − 4αm/(1 + 2αm + α²L²))``;
* Chambolle–Pock for ``min_z max_w G(z) + ⟨Kz + c, w⟩ − H(w)``:
  ``z⁺ = prox_{τG}(z − τKᵀw)``, ``w⁺ = prox_{σH}(w + σ(K(2z⁺ − z) + c))``, ``τσ||K||² < 1``.

Step sizes are re-derived from the current weights (cached per weight version) because a
parametrisation that is monotone for every weight trains without weight control: ``L`` moves,
the certificate does not.  The equilibrium does not depend on the step (an unrolled backward
does not differentiate through it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from convex_eq._lazy import torch
from convex_eq.errors import LoweringError
from convex_eq.inclusion import Inclusion, MonotonicityCertificate, Saddle, saddle_step_sizes
from convex_eq.symbols import Env
from convex_eq.tensor_keys import content_key

from ..derived import DerivedLayer
from ..nodes import Node, Var, Z_t, solve_cache
from ..trace import Claim, ClaimKind, Contraction, Derivation, Step
from .base import LowerContext, Match, Payload
from .common import no_prox


# ----------------------------------------------------------------------------- step sizes
def _value(t: torch.Tensor) -> torch.Tensor:
    """The plain values of ``t`` under ``torch.func`` grad wrappers, detached (call it with
    functorch disabled)."""
    while torch._C._functorch.is_gradtrackingtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t.detach()


def _env_key(syms: list[Any], env: Env | None) -> tuple | None:
    """A key of the weights' current contents (``convex_eq.tensor_keys.content_key``: a write
    through ``.data`` changes it too), or None: do not cache (autograd is recording, or a
    value has no readable storage).  Inside one forward solve (``partial_evaluation``, whose
    weights do not change) it is computed once and kept in the solve's own cache."""
    if torch.is_grad_enabled():
        return None
    names, tensors, rest = [], [], []
    for s in syms:
        t = None if env is None else env.get(s.name)
        if t is None:
            t = s.value
        if isinstance(t, torch.Tensor):
            names.append(s.name)
            tensors.append(t)
        else:
            rest.append((s.name, t))
    solve = solve_cache()
    memo = ("splitting weights key", *map(id, tensors))
    if solve is not None and memo in solve:
        contents = solve[memo]
    else:
        contents = content_key(*tensors)
        if solve is not None:
            solve[memo] = contents
    if contents is None:
        return None
    return (tuple(zip(names, contents)), tuple(rest))


class _PerWeights:
    """A pair of floats computed from the float64 weights at ``env``, cached per weight
    version (``compute(env64)``)."""

    def __init__(self, syms: list[Any], compute: Any):
        self._syms = [s for s in syms if s.kind in ("weight", "constant", "scalar")]
        self._compute = compute
        self._key: Any = None
        self._val: tuple[float, float] = (math.nan, math.nan)

    def __call__(self, env: Env | None) -> tuple[float, float]:
        key = _env_key(self._syms, env)
        if key is not None and key == self._key:
            return self._val
        # ``(m, L)`` and the steps are numbers of the current weights, never differentiated
        # (the equilibrium does not depend on them): computed on the plain values with
        # ``torch.func`` off, as inside a transform every tensor made (the float64 copies, the
        # probes of ``M``) is a wrapper without storage, which ``.numpy()`` cannot read — the
        # implicit backward's second-order path evaluates ``T`` inside ``torch.func.vjp``
        with torch._C._DisableFuncTorch():
            e64 = None if env is None else {k: _value(v).to(torch.float64).cpu()
                                             for k, v in env.items()}
            self._val = self._compute(e64)
        self._key = key
        return self._val


class _Constants(_PerWeights):
    """``(m, L)`` of an inclusion at ``env``; ``estimate``: ``L`` may be an estimate of
    ``||M||₂`` (a step that only has to be positive), else an upper bound (forward–backward)."""

    def __init__(self, inc: Inclusion, estimate: bool = False):
        self.inc, self.estimate = inc, estimate
        super().__init__(inc.symbols, self._margin_lipschitz)

    def _margin_lipschitz(self, env: Env | None) -> tuple[float, float]:
        mo = self.inc.margin(env)
        if not mo.value > 0:
            raise LoweringError(f"the inclusion is not strongly monotone at these weights "
                                f"({mo.why})", term=str(self.inc),
                                hint="use a parametrisation that is monotone for every weight "
                                "(MonotoneMatrix)")
        lip = self.inc.lipschitz_estimate(env) if self.estimate else self.inc.lipschitz(env)
        return mo.value, lip


def _steps(sad: Saddle) -> _PerWeights:
    """Chambolle–Pock steps ``τ = σ = 0.9/||K||₂`` at ``env``."""
    return _PerWeights(sad.K.symbols(), lambda env: saddle_step_sizes(sad.K, env))


def fb_step(m: float, lip: float) -> float:
    """``α = m/L²`` (the middle of ``(0, 2m/L²)``)."""
    return m / lip**2


def fb_factor(m: float, lip: float) -> float:
    """``√(1 − 2αm + α²L²)`` at ``α = m/L²``: ``√(1 − m²/L²)``."""
    return math.sqrt(max(0.0, 1.0 - (m / lip) ** 2))


def pr_step(m: float, lip: float) -> float:
    """``α = 1/L``."""
    return 1.0 / lip


def pr_factor(m: float, lip: float, alpha: float) -> float:
    """``||2(I + αM)⁻¹ − I||`` bound ``√(1 − 4αm/(1 + 2αm + α²L²))`` (2prox − I is
    nonexpansive)."""
    return math.sqrt(max(0.0, 1.0 - 4 * alpha * m / (1 + 2 * alpha * m + (alpha * lip) ** 2)))


# ----------------------------------------------------------------------------- nodes
class _IncNode(Node):
    """Shared by the splitting nodes: ``F``, ``g``'s prox, the step."""

    def __init__(self, inc: Inclusion, consts: _Constants):
        self.inc, self.consts = inc, consts
        self.g = inc.g

    def _F(self, Z: Z_t, z: torch.Tensor, env: Env | None) -> torch.Tensor:
        vals = dict(Z)
        vals[self.inc.z.name] = z
        return self.inc.F(vals, env)


class ForwardBackwardNode(_IncNode):
    """``prox_{αg}(z − αF(z))``, ``α = m/L²``."""

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        m, lip = self.consts(env)
        a = fb_step(m, lip)
        z = Z[self.inc.z.name]
        return self.g.prox(z - a * self._F(Z, z, env), a, Z, env)

    def lip(self, env: Env | None) -> float:
        return fb_factor(*self.consts(env))

    def text(self) -> str:
        z = self.inc.z.name
        return f"prox_{{α{self.g}}}({z} − α({self.inc.F_text()}))"

    def latex(self) -> str:
        z = self.inc.z.latex()
        return (f"\\mathrm{{prox}}_{{\\alpha {self.g.latex()}}}\\big({z} - \\alpha\\,"
                f"({self.inc.F_text(True)})\\big)")


class ResolventNode(_IncNode):
    """Peaceman–Rachford (``relax = 2``) / Douglas–Rachford (``relax = 1``) on ``u``:
    ``u + relax·((I + αM)⁻¹(2z − u + αq) − z)``, ``z = prox_{αg}(u)``; with ``output`` the
    node is ``z = prox_{αg}(u)`` itself.  ``I + αM`` is LU-factorised once per weight version
    (``torch.linalg.lu_factor``; autograd-recording calls factorise afresh)."""

    def __init__(self, inc: Inclusion, consts: _Constants, u: Any, relax: float,
                 output: bool = False):
        super().__init__(inc, consts)
        self.u, self.relax, self.output = u, relax, output
        self._key: Any = None
        self._lu: Any = None

    def _factor(self, like: torch.Tensor, Z: Z_t, env: Env | None, a: float) -> Any:
        key = _env_key(self.consts._syms, env)
        if key is not None:
            key = (*key, like.dtype, str(like.device), a)
            if key == self._key:
                return self._lu
        n = self.inc.z.size
        vals = {s.name: torch.zeros(1, s.size, dtype=like.dtype, device=like.device)
                for s in self.inc.inputs}
        eye = torch.eye(n, dtype=like.dtype, device=like.device)
        f0 = self._F(vals, torch.zeros(1, n, dtype=like.dtype, device=like.device), env)
        vals = {k: v.expand(n, -1) for k, v in vals.items()}
        m = (self._F(vals, eye, env) - f0).T  # column j = M e_j
        lu = torch.linalg.lu_factor(eye + a * m)
        if key is not None:
            self._key, self._lu = key, lu
        return lu

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        m, lip = self.consts(env)
        a = pr_step(m, lip)
        u = Z[self.u.name]
        z = self.g.prox(u, a, Z, env)
        if self.output:
            return z
        q = -self.inc.affine_part({**Z, self.inc.z.name: u}, env)  # F(z) = Mz − q
        lu, piv = self._factor(u, Z, env, a)
        rhs = (2 * z - u + a * q).T
        w = torch.linalg.lu_solve(lu, piv, rhs).T
        return u + self.relax * (w - z)

    def lip(self, env: Env | None) -> float:
        m, lip = self.consts(env)
        c = pr_factor(m, lip, pr_step(m, lip))
        if self.output:
            return 1.0
        return c if self.relax == 2.0 else 0.5 * (1 + c)

    def text(self) -> str:
        u, g = self.u.name, self.g
        if self.output:
            return f"prox_{{α{g}}}({u})"
        k = "2" if self.relax == 2.0 else ""
        z = f"prox_{{α{g}}}({u})"
        return f"{u} + {k}((I + αM)⁻¹(2{z} − {u} + αq) − {z})"

    def latex(self) -> str:
        u, g = self.u.latex(), self.g.latex()
        z = f"\\mathrm{{prox}}_{{\\alpha {g}}}({u})"
        if self.output:
            return z
        k = "2" if self.relax == 2.0 else ""
        return f"{u} + {k}\\big((I + \\alpha M)^{{-1}}(2{z} - {u} + \\alpha q) - {z}\\big)"


class ChambollePockNode(Node):
    """One block of Chambolle–Pock: ``z⁺ = prox_{τG}(z − τKᵀw)`` or
    ``w⁺ = prox_{σH}(w + σ(K(2z⁺ − z) + c))``."""

    def __init__(self, sad: Saddle, steps: _PerWeights, dual: bool):
        self.sad, self.steps, self.dual = sad, steps, dual
        self.G, self.H = sad.G, sad.H

    def _primal(self, Z: Z_t, env: Env | None, tau: float) -> torch.Tensor:
        z, w = Z[self.sad.z.name], Z[self.sad.w.name]
        return self.G.prox(z - tau * self.sad.K.adjoint(w, env), tau, Z, env)

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        tau, sig = self.steps(env)
        zp = self._primal(Z, env, tau)
        if not self.dual:
            return zp
        z, w = Z[self.sad.z.name], Z[self.sad.w.name]
        v = self.sad.K.apply(2 * zp - z, env)
        c = self.sad.offset(Z, env)
        if c is not None:
            v = v + c
        return self.H.prox(w + sig * v, sig, Z, env)

    def lip(self, env: Env | None) -> float:
        return 1.0

    def text(self) -> str:
        z, w, k = self.sad.z.name, self.sad.w.name, self.sad.K
        zp = f"prox_{{τG}}({z} − τ{k}ᵀ{w})"
        if not self.dual:
            return zp
        c = f" + {self.sad.c}" if self.sad.c is not None else ""
        return f"prox_{{σH}}({w} + σ({k}(2{z}⁺ − {z}){c})), {z}⁺ = {zp}"

    def latex(self) -> str:
        z, w, k = self.sad.z.latex(), self.sad.w.latex(), self.sad.K.latex()
        zp = f"\\mathrm{{prox}}_{{\\tau G}}({z} - \\tau {k}^\\top {w})"
        if not self.dual:
            return zp
        c = f" + {self.sad.c.latex()}" if self.sad.c is not None else ""
        return (f"\\mathrm{{prox}}_{{\\sigma H}}\\big({w} + \\sigma({k}(2{z}^+ - {z}){c})\\big),"
                f"\\ {z}^+ = {zp}")


# ----------------------------------------------------------------------------- payloads
@dataclass(frozen=True)
class SplittingPayload(Payload):
    """The inclusion, its method and certificate at declaration."""

    inclusion: Any
    method: str
    certificate: MonotonicityCertificate


@dataclass(frozen=True)
class SaddlePayload(Payload):
    saddle: Any
    moduli: tuple[float, float]


# ----------------------------------------------------------------------------- shared
def _check_g(inc: Inclusion) -> None:
    why = no_prox(inc.g, 1.0)
    if why:
        raise LoweringError(f"g has no closed-form prox: {why}", term=str(inc.g),
                            hint="keep one prox-able term in g (plus ½||z||² and linear terms)")


def _prepare(m: Match, estimate: bool = False
             ) -> tuple[Inclusion, MonotonicityCertificate, _Constants]:
    """The inclusion of a match, checked (prox-able ``g``, strongly monotone ``F``), with its
    certificate and its step-size constants."""
    inc: Inclusion = m.objective
    _check_g(inc)
    return inc, inc.require_strongly_monotone(), _Constants(inc, estimate)


def _claim(inc: Inclusion, cert: MonotonicityCertificate) -> Claim:
    where = (f" for every {', '.join(cert.weights)}" if cert.for_every_weight and cert.weights
             else "" if cert.for_every_weight else " at the declared weights")
    return Claim(ClaimKind.INCLUSION,
                 f"the unique solution of {inc} (F strongly monotone{where}, m = "
                 f"{cert.margin:.4g})",
                 f"\\text{{the unique solution of }} {inc.latex()}", objective_text=str(inc),
                 conditions=() if cert.for_every_weight else (f"λ_min(½(M + Mᵀ)) > 0 "
                                                              f"(now {cert.margin:.4g})",))


def _declare_step(inc: Inclusion, cert: MonotonicityCertificate) -> Step:
    return Step("monotone inclusion",
                f"F affine, strongly monotone: {cert.why} ⇒ exactly one solution; "
                f"Lip(F) = ||M||₂ = {cert.lipschitz:.4g} at the declared weights",
                ("0 ∈ F(z) + ∂g(z), F(z) = ", inc.F_text()),
                ("0 ∈ Mz − q + ∂g(z), ½(M + Mᵀ) ⪰ mI, m = ", f"{cert.margin:.4g}"))


# ----------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class InclusionMatch(Match):
    method: str


class SymmetricInclusion:
    """``F = ∇h`` (no operator part): the inclusion is stationarity of ``g + h``; lowered by
    the objective rules (the canonical layer and claim)."""

    name = "inclusion-symmetric"

    def match(self, objective: Any) -> InclusionMatch | None:
        if isinstance(objective, Inclusion) and objective.symmetric:
            return InclusionMatch(objective, "objective")
        return None

    def lower(self, m: InclusionMatch, ctx: LowerContext) -> DerivedLayer:
        inc: Inclusion = m.objective
        obj = inc.as_objective()
        inner = ctx.lower(obj)
        step = Step("symmetric F is a gradient",
                    "F = ∇h with no skew or operator part: 0 ∈ ∇h(z) + ∂g(z) is stationarity "
                    "of the objective g + h",
                    ("0 ∈ ∇h(z) + ∂g(z), ", inc), ("G = ", obj))
        return dataclasses.replace(inner, derivation=Derivation((step, *inner.derivation.steps)))


class ForwardBackwardSplitting:
    """``z ← prox_{αg}(z − αF(z))`` with ``α = m/L²`` (``splitting="forward-backward"``)."""

    name = "inclusion-forward-backward"

    def match(self, objective: Any) -> InclusionMatch | None:
        if isinstance(objective, Inclusion) and objective.splitting == "forward-backward":
            return InclusionMatch(objective, "forward-backward")
        return None

    def lower(self, m: InclusionMatch, ctx: LowerContext) -> DerivedLayer:
        inc, cert, consts = _prepare(m)
        node = ForwardBackwardNode(inc, consts)
        mm, lip = cert.margin, cert.lipschitz
        a = fb_step(mm, lip)
        steps = (_declare_step(inc, cert), Step(
            "forward–backward splitting",
            f"z − αF(z) is a contraction for α ∈ (0, 2m/L²): ||I − αM||² ≤ 1 − 2αm + α²L²; "
            f"α = m/L² (= {a:.4g} now, re-derived from the weights at every forward) gives "
            f"factor √(1 − m²/L²) = {fb_factor(mm, lip):.4g}; prox_{{αg}} is nonexpansive",
            ("0 ∈ F(z) + ∂g(z) ⇔ z − αF(z) ∈ z + α∂g(z) ⇔ ", Var(inc.z), " = ",
             "prox_{αg}(z − αF(z))"),
            (Var(inc.z), " ← ", node),
            note="fixed points are exactly the solutions of the inclusion"))
        contraction = Contraction("√(1 − m²/L²) with α = m/L²", "\\sqrt{1 - m^2/L^2}",
                                  lambda env, c=consts: fb_factor(*c(env)))
        return DerivedLayer(source=inc, blocks=[inc.z], nodes={inc.z.name: node},
                            derivation=Derivation(steps), claim=_claim(inc, cert),
                            contraction=contraction, certificate=cert,
                            payload=SplittingPayload(inc, "forward-backward", cert))


class ResolventSplitting:
    """Peaceman–Rachford (``splitting="auto"``/``"peaceman-rachford"``) or Douglas–Rachford
    (``"douglas-rachford"``) on ``u``; the layer's output is ``z = prox_{αg}(u)``."""

    name = "inclusion-peaceman-rachford"

    def match(self, objective: Any) -> InclusionMatch | None:
        if isinstance(objective, Inclusion) and objective.splitting in (
                "auto", "peaceman-rachford", "douglas-rachford"):
            method = ("douglas-rachford" if objective.splitting == "douglas-rachford"
                      else "peaceman-rachford")
            return InclusionMatch(objective, method)
        return None

    def lower(self, m: InclusionMatch, ctx: LowerContext) -> DerivedLayer:
        from convex_eq.symbols import State

        inc, cert, consts = _prepare(m, estimate=True)
        u = State(f"u_{inc.z.name}", inc.z.shape)
        relax = 2.0 if m.method == "peaceman-rachford" else 1.0
        node = ResolventNode(inc, consts, u, relax)
        out = ResolventNode(inc, consts, u, relax, output=True)
        mm, lip = consts(None)
        a = pr_step(mm, lip)
        c = pr_factor(mm, lip, a)
        title = "Peaceman–Rachford" if relax == 2.0 else "Douglas–Rachford"
        factor = (f"factor √(1 − 4αm/(1 + 2αm + α²L²)) = {c:.4g}" if relax == 2.0 else
                  f"averaged: factor (1 + {c:.4g})/2 = {0.5 * (1 + c):.4g}")
        steps = (_declare_step(inc, cert), Step(
            f"{title} splitting",
            "R_F = (I + αM)⁻¹ (LU-factorised once per weight version), prox_{αg} = R_{∂g}; "
            "2R_F − I has ||(I − αM)(I + αM)⁻¹||² ≤ 1 − 4αm/(1 + 2αm + α²L²) for every α > 0 "
            f"and 2prox − I is nonexpansive; α = 1/L (= {a:.4g} now, re-derived from the "
            f"weights at every forward): {factor}",
            ("0 ∈ F(z) + ∂g(z) ⇔ ", Var(u), " = z + αξ, ξ ∈ ∂g(z), z = (I + αM)⁻¹(2z − ",
             Var(u), " + αq)"),
            (Var(u), " ← ", node, ";  output z = ", out),
            note="at a fixed point u*, z = prox_{αg}(u*) solves the inclusion"))
        factor_fn = ((lambda env, cs=consts: pr_factor(*cs(env), pr_step(*cs(env))))
                     if relax == 2.0 else
                     (lambda env, cs=consts: 0.5 * (1 + pr_factor(*cs(env), pr_step(*cs(env))))))
        contraction = Contraction(
            "√(1 − 4αm/(1 + 2αm + α²L²)) with α = 1/L" if relax == 2.0 else
            "(1 + √(1 − 4αm/(1 + 2αm + α²L²)))/2 with α = 1/L",
            "\\sqrt{1 - \\frac{4\\alpha m}{1 + 2\\alpha m + \\alpha^2 L^2}}", factor_fn)
        return DerivedLayer(source=inc, blocks=[u], nodes={u.name: node},
                            derivation=Derivation(steps), claim=_claim(inc, cert),
                            contraction=contraction, certificate=cert,
                            payload=SplittingPayload(inc, m.method, cert),
                            outputs=[(inc.z, out)])


class ChambollePock:
    """``min_z max_w G(z) + ⟨Kz + c, w⟩ − H(w)`` ⇒ primal–dual (Chambolle–Pock) on ``(z, w)``."""

    name = "saddle-primal-dual"

    def match(self, objective: Any) -> Match | None:
        return Match(objective) if isinstance(objective, Saddle) else None

    def lower(self, m: Match, ctx: LowerContext) -> DerivedLayer:
        sad: Saddle = m.objective
        for part, obj in (("G", sad.G), ("H", sad.H)):
            why = no_prox(obj, 1.0)
            if why:
                raise LoweringError(f"{part} has no closed-form prox: {why}", term=str(obj),
                                    hint=f"keep one prox-able term in {part} (plus ½||·||² and "
                                    "linear terms)")
        steps_fn = _steps(sad)
        nz = ChambollePockNode(sad, steps_fn, dual=False)
        nw = ChambollePockNode(sad, steps_fn, dual=True)
        mu_g, mu_h = sad.moduli()
        knorm = sad.K.norm(None)
        cert = MonotonicityCertificate(
            min(mu_g, mu_h), knorm + max(mu_g, mu_h), True,
            f"G is {mu_g:g}-strongly convex, H is {mu_h:g}-strongly convex; the coupling "
            "[Kᵀw; −Kz] is skew", tuple(s.name for s in sad.K.symbols() if s.kind == "weight"))
        z, w = Var(sad.z), Var(sad.w)
        steps = (
            Step("saddle optimality system",
                 "L convex in z, concave in w: (z, w) is a saddle point ⇔ the monotone inclusion "
                 "0 ∈ [Kᵀw; −Kz − c] + [∂G(z); ∂H(w)] (skew linear part)",
                 ("", sad),
                 ("0 ∈ ∂G(", z, ") + Kᵀ", w, ",  0 ∈ ∂H(", w, ") − K", z, " − c")),
            Step("primal–dual (Chambolle–Pock)",
                 f"τ = σ = 0.9/||K||₂ (= {0.9 / knorm if knorm > 0 else 1.0:.4g} now, "
                 "re-derived from the weights at every forward) so τσ||K||₂² = 0.81 < 1: the "
                 "iteration is averaged in the metric [[I/τ, −Kᵀ], [−K, I/σ]]" +
                 ("; G and H strongly convex: the saddle point is unique" if cert.holds else ""),
                 ("0 ∈ ∂G(z) + Kᵀw, 0 ∈ ∂H(w) − Kz − c"),
                 (z, " ← ", nz, ";  ", w, " ← ", nw),
                 note="fixed points are exactly the saddle points"),
        )
        what = ("the unique saddle point" if cert.holds else
                "a saddle point (uniqueness not certified: G or H not strongly convex)")
        claim = Claim(ClaimKind.INCLUSION, f"{what} of {sad}",
                      f"\\text{{{what.split(' (')[0]} of }} {sad.latex()}", objective_text=str(sad))
        contraction = Contraction("1 (averaged in the Chambolle–Pock metric)", "1",
                                  lambda env: 1.0)
        return DerivedLayer(source=sad, blocks=[sad.z, sad.w], nodes={sad.z.name: nz,
                                                                      sad.w.name: nw},
                            derivation=Derivation(steps), claim=claim, contraction=contraction,
                            certificate=cert, payload=SaddlePayload(sad, (mu_g, mu_h)))


SYMMETRIC = SymmetricInclusion()
FORWARD_BACKWARD = ForwardBackwardSplitting()
PEACEMAN_RACHFORD = ResolventSplitting()
PRIMAL_DUAL = ChambollePock()
RULES = (SYMMETRIC, PEACEMAN_RACHFORD, FORWARD_BACKWARD, PRIMAL_DUAL)
