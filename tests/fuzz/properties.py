"""Properties checked on every drawn case.  Each ``check_*`` returns an outcome label (counted
by :mod:`fuzz.stats`) and raises ``AssertionError`` on a violation; any exception that is not a
documented project error (``convex_eq.ConvexEqError``) propagates and fails the test."""

from __future__ import annotations

import importlib
import math
import re
from typing import Any

import numpy as np
import torch

import convex_eq as ce
import lowering
from convex_eq import DeepComposition, Objective
from convex_eq.terms import AntiderivativeConjugate, LinfBallIndicator, Potential

from .strategies import Case

T64 = torch.float64


# ----------------------------------------------------------------------------- error naming
def mentionables(obj: Any) -> list[str]:
    """Strings a message may use to name an offending part of ``obj``: symbol names, term texts
    and term labels (for deep compositions: those of every layer, and its name)."""
    out: list[str] = []
    if isinstance(obj, DeepComposition):
        out.append(obj.name)
        for layer in obj.layers:
            out += mentionables(layer)
        return out
    if isinstance(obj, Objective):
        out += [s.name for s in obj.symbols]
        for t in obj.terms:
            out += [str(t), t.label]
            inner = getattr(t, "inner", None)
            if isinstance(inner, Objective):
                out += mentionables(inner)
        pc = getattr(obj, "precomposition", None)
        if pc is not None:
            out += mentionables(pc.inner)
    return [s for s in out if s]


def assert_documented(err: BaseException, obj: Any, where: str) -> str:
    """``err`` is a project error whose message names a term/symbol of ``obj``."""
    assert isinstance(err, ce.ConvexEqError), (
        f"{where}: undocumented {type(err).__name__}: {err}")
    msg = str(err)
    assert err.term, f"{where}: {type(err).__name__} names no term: {msg}"
    names = mentionables(obj)
    assert any(n in msg for n in names), (
        f"{where}: {type(err).__name__} message names no term or symbol of the objective: {msg}")
    return f"{where}-error:{type(err).__name__}"


# ----------------------------------------------------------------------------- lowering
_RULES = (("Theorem 1", "theorem1"), ("stationarity", "canonical"), ("forward", "fb"),
          ("deep composition", "deep"), ("multi-block", "deep-multiblock"),
          ("precomposition", "precompose"), ("Moreau", "moreau-skip"),
          ("regularizer edit", "regularizer-edit"))


def rule_of(d: lowering.DerivedLayer) -> str:
    last = d.derivation.rules()[-1] if d.derivation.rules() else "?"
    for key, label in _RULES:
        if key in last:
            return label
    return last


def lower_case(case: Case) -> tuple[lowering.DerivedLayer | None, str]:
    """``lower`` derives a layer or raises a documented error naming the term."""
    try:
        d = lowering.lower(case.obj, **case.options)
    except ce.ConvexEqError as err:
        return None, assert_documented(err, case.obj, "lower")
    assert isinstance(d, lowering.DerivedLayer)
    assert d.blocks and all(b.name in d.nodes for b in d.blocks)
    return d, f"derived:{rule_of(d)}"


def state_values(d: lowering.DerivedLayer, case: Case, scale: float, seed: int = 0
                 ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    Z = dict(case.input_tensors())
    for b in d.blocks:
        Z[b.name] = scale * torch.randn(case.batch, b.size, generator=g, dtype=T64)
    return Z


def check_T_finite(d: lowering.DerivedLayer, case: Case) -> str:
    """``T`` maps finite inputs to finite outputs of the right shapes (several magnitudes)."""
    for i, scale in enumerate((0.0, 1.0, 1e-3, 30.0)):
        Z = state_values(d, case, scale, seed=i)
        with torch.no_grad():
            out = d.apply(Z)
        for b in d.blocks:
            v = out[b.name]
            assert tuple(v.shape) == (case.batch, b.size), (
                f"T[{b.name}] has shape {tuple(v.shape)}, expected {(case.batch, b.size)}")
            assert torch.isfinite(v).all(), (
                f"T[{b.name}] is not finite at state scale {scale:g}: {v}")
    return "T-finite"


def check_contraction(d: lowering.DerivedLayer, case: Case, steps: int = 40) -> str:
    """The contraction estimate ``c`` is a valid Lipschitz bound of ``T`` along plain iteration:
    ``||z_{k+2} − z_{k+1}|| ≤ c ||z_{k+1} − z_k||`` at every step; when ``c < 1`` (the
    certificate says "contraction") the iteration converges geometrically at rate ``c``."""
    c = d.contraction.value()
    assert not math.isnan(c), f"contraction estimate is NaN ({d.contraction.formula})"
    assert c >= 0, f"negative Lipschitz bound {c}"
    if not math.isfinite(c):
        return "contraction:no-bound"
    _check_lipschitz_pairs(d, case, c)
    if not c < 1:
        steps = 8
    Z = state_values(d, case, 1.0, seed=11)
    names = [b.name for b in d.blocks]

    def stack(values: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([values[k] for k in names], dim=-1)

    with torch.no_grad():
        prev = stack(Z)
        Z = {**Z, **d.apply(Z)}
        cur = stack(Z)
        d0 = dk = (cur - prev).norm(dim=-1)
        for k in range(steps):
            Z = {**Z, **d.apply(Z)}
            nxt = stack(Z)
            dn = (nxt - cur).norm(dim=-1)
            atol = 1e-11 * (1.0 + nxt.norm(dim=-1))
            bad = dn > c * dk * (1 + 1e-7) + atol
            assert not bool(bad.any()), (
                f"step {k + 1}: ||Δz|| went {dk.tolist()} → {dn.tolist()} but Lip(T) ≤ {c:.6g} "
                f"({d.contraction.formula})")
            cur, dk = nxt, dn
            if bool((dk <= atol).all()) or not bool((cur.norm(dim=-1) < 1e100).all()):
                break
    if not c < 1:
        return "contraction:bound-holds(c>=1)"
    bound = d0 * c ** (k + 1) + 1e-9 * (1.0 + cur.norm(dim=-1))
    assert bool((dk <= bound).all()), "plain iteration does not converge at the certified rate"
    return "contraction:converges"


def _check_lipschitz_pairs(d: lowering.DerivedLayer, case: Case, c: float) -> None:
    """``||T(z) − T(z')|| ≤ c ||z − z'||`` at random pairs, near and far, small and large."""
    if any(getattr(t, "batch_coupled", False) for t in _terms(case.obj)):
        return  # T couples the samples: the bound is not per sample
    names = [b.name for b in d.blocks]
    g = torch.Generator().manual_seed(3)
    for i, (scale, rel) in enumerate(((1.0, 1.0), (1.0, 1e-3), (5.0, 0.3), (0.1, 1.0))):
        Z = state_values(d, case, scale, seed=20 + i)
        Z2 = dict(Z)
        for k in names:
            Z2[k] = Z[k] + rel * scale * torch.randn(Z[k].shape, generator=g, dtype=T64)
        with torch.no_grad():
            a, b = d.apply(Z), d.apply(Z2)
        num = torch.cat([a[k] - b[k] for k in names], -1).norm(dim=-1)
        den = torch.cat([Z[k] - Z2[k] for k in names], -1).norm(dim=-1)
        big = torch.cat([a[k] for k in names], -1).norm(dim=-1)
        bad = num > c * den * (1 + 1e-7) + 1e-11 * (1 + big)
        assert not bool(bad.any()), (
            f"Lip(T) ≤ {c:.6g} ({d.contraction.formula}) violated: ratio "
            f"{(num / den).tolist()} at state scale {scale:g}, |Δz| ~ {rel * scale:g}")


def _terms(obj: Any) -> list[Any]:
    if isinstance(obj, DeepComposition):
        return [t for layer in obj.layers for t in _terms(layer)]
    out = []
    for t in getattr(obj, "terms", []):
        out.append(t)
        if isinstance(getattr(t, "inner", None), Objective):
            out += _terms(t.inner)
    pc = getattr(obj, "precomposition", None)
    return out + (_terms(pc.inner) if pc is not None else [])


# ----------------------------------------------------------------------------- printing
def check_printing(case: Case, d: lowering.DerivedLayer | None) -> str:
    obj = case.obj
    texts = [str(obj), repr(obj), obj.latex()]
    if isinstance(obj, Objective):
        texts.append(obj.describe())
        try:
            cert = obj.certificate()
            texts += [cert.text, cert.long_text()]
        except ce.ConvexEqError as err:
            assert_documented(err, obj, "certificate")
    if d is not None:
        texts += [d.describe(), d.latex(), d.formula(), d.formula(latex=True), str(d.claim),
                  d.contraction.describe()]
    for t in texts:
        assert isinstance(t, str) and t.strip(), f"empty printout in {texts}"
    return "printed"


# ----------------------------------------------------------------------------- values
def _clean(obj: Objective, z: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Project CVXPY's (feasible up to solver tolerance) states onto the terms' closed domains:
    activation ranges of potentials on a state and ℓ∞ balls (a 1e-10 violation would otherwise
    make an indicator +∞)."""
    out = {k: np.array(v, dtype=np.float64) for k, v in z.items()}
    for t in obj.terms:
        s = t.prox_state
        if s is None or s.name not in out or t.coef(None) <= 0:
            continue
        if isinstance(t, (Potential, AntiderivativeConjugate)):
            lo, hi = t.act.domain
            out[s.name] = np.clip(out[s.name], lo, hi)
        elif isinstance(t, LinfBallIndicator):
            r = t.radius_value(None)
            out[s.name] = np.clip(out[s.name], -r, r)
    return out


def check_value(case: Case, d: lowering.DerivedLayer | None) -> str:
    """``objective.value`` at ``T``'s outputs is a finite number or +∞ (an indicator), or a
    documented error; never NaN."""
    obj = case.objective
    if obj is None or d is None or set(b.name for b in d.blocks) != {s.name for s in obj.states}:
        return "value:skipped"
    Z = state_values(d, case, 1.0, seed=5)
    with torch.no_grad():
        out = d.apply(Z)
    kwargs = {k: v.numpy() for k, v in out.items()}
    kwargs.update({k: v for k, v in case.inputs.items()})
    try:
        v = np.asarray(obj.value(**kwargs), dtype=np.float64)
    except ce.ConvexEqError as err:
        return assert_documented(err, obj, "value")
    assert not np.isnan(v).any(), f"objective value is NaN at T's output: {v}"
    assert not (v == -np.inf).any(), f"objective value is -inf at T's output: {v}"
    return "value:finite" if np.isfinite(v).all() else "value:+inf"


def _assert_empty_domain(obj: Objective, x1: dict[str, np.ndarray]) -> None:
    """An infeasible export is only right if the objective is +∞ everywhere: probe it at random
    points projected onto the terms' domains."""
    rng = np.random.default_rng(0)
    for scale in (0.0, 0.1, 1.0, 3.0):
        z = {s.name: scale * rng.standard_normal(s.size) for s in obj.states}
        try:
            v = float(np.asarray(obj.value(**_clean(obj, z), **x1)))
        except ce.ConvexEqError:
            continue
        assert not math.isfinite(v), (
            f"CVXPY export is infeasible but objective.value = {v} at a point {z}")


def check_cvxpy(case: Case) -> str:
    """CVXPY export matches ``objective.value`` at feasible points, or raises NotDCPError."""
    obj = case.objective
    if isinstance(case.obj, DeepComposition):
        try:  # L = 2, α < 1: the Corollary 1 objective (Moreau envelopes of ψ* − ½||·||²)
            obj = case.obj.corollary1_objective()
        except ce.ConvexEqError as err:
            assert_documented(err, case.obj, "corollary1")
            return "cvxpy:deep-no-objective"
    if obj is None:
        return "cvxpy:not-an-objective"
    x1 = {k: v[0] for k, v in case.inputs.items()}
    try:
        exp = obj.to_cvxpy(**x1)
    except ce.NotDCPError as err:
        assert_documented(err, obj, "export")
        return "cvxpy:not-DCP"
    except ce.ConvexEqError as err:
        return assert_documented(err, obj, "export")
    import cvxpy as cp

    try:
        exp.solve()
    except ce.SolverError as err:  # the solver itself failed: typed, names the export
        assert err.term and str(err).strip()
        return "cvxpy:solver-failed(SolverError)"
    status = exp.problem.status
    if status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        _assert_empty_domain(obj, x1)
    if status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
        return f"cvxpy:{status}"
    z = _clean(obj, exp.state_values())
    aux = set(exp.blocks) - {s.name for s in obj.states}
    try:
        val = float(np.asarray(obj.value(**z, **x1)))
    except ce.ConvexEqError as err:  # e.g. an envelope of a φ without closed-form prox
        return "cvxpy:exported," + assert_documented(err, obj, "value")
    if aux:  # auxiliary variables (conjugates, envelopes): compare the optimal values
        ref, tol = exp.value, 1e-5 * (1 + abs(exp.value))
        if not math.isfinite(val):
            return "cvxpy:solution-on-domain-boundary(aux)"
    else:  # only states own blocks of the free vector: compare at the very same point
        f = np.concatenate([z[s.name].reshape(-1) for s in obj.states])
        viol = exp.max_violation(f)
        assert viol <= 1e-7, f"CVXPY solution infeasible by {viol}"
        ref, tol = exp.objective_at(f), 1e-7 * (1 + abs(exp.objective_at(f)))
        probes = _probe_points(exp, obj, x1)
        if not math.isfinite(val):
            # e.g. φ∘A with the solution on the boundary of dom f_σ(Mz + c): 1e-13 outside
            return f"cvxpy:solution-on-domain-boundary,probes-match({probes})"
    assert abs(val - ref) <= tol, (
        f"CVXPY export value {ref!r} ≠ objective.value {val!r} (|Δ| = {abs(val - ref):.3e}) "
        f"at {'the CVXPY solution' if aux else 'the same feasible point'}")
    return f"cvxpy:matches({'aux' if aux else f'exact,probes={probes}'})"


def _probe_points(exp: Any, obj: Objective, x1: dict[str, np.ndarray]) -> int:
    """Wherever ``objective.value`` is finite, the exported problem (no auxiliary variables)
    is feasible there and has the same value; returns the number of finite probes."""
    rng = np.random.default_rng(1)
    n = 0
    for scale in (0.0, 0.1, 1.0, 3.0):
        z = _clean(obj, {s.name: scale * rng.standard_normal(s.size) for s in obj.states})
        try:
            v = float(np.asarray(obj.value(**z, **x1)))
        except ce.ConvexEqError:
            continue
        if not math.isfinite(v):
            continue
        f = np.concatenate([z[s.name].reshape(-1) for s in obj.states])
        viol = exp.max_violation(f)
        assert viol <= 1e-9 * (1 + float(np.abs(f).max(initial=0.0))), (
            f"objective.value = {v} is finite at {f} but the export is infeasible there ({viol})")
        ref = exp.objective_at(f)
        assert abs(v - ref) <= 1e-7 * (1 + abs(v)), (
            f"at a feasible probe point: export value {ref!r} ≠ objective.value {v!r}")
        n += 1
    return n


def check_prox(phi: Objective, t: float, v: float) -> str:
    """``Objective.prox`` (1-D) returns a minimizer of ``t·φ(u) + (u − v)²/2``: finite there and
    no worse than the best point of a fine grid (plus its local refinement)."""
    z = phi.states[0].name
    try:
        p = phi.prox(torch.tensor([[v]], dtype=T64), t, {})
    except ce.ConvexEqError as err:
        return assert_documented(err, phi, "prox")

    def F(u: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return t * phi.value_tensor({z: u.reshape(-1, 1)}) + 0.5 * (u.reshape(-1) - v) ** 2

    fp = float(F(p))
    assert math.isfinite(fp), f"prox_{{{t:g}φ}}({v}) = {float(p)} is outside dom φ"
    grid = torch.linspace(-12.0, 12.0, 48001, dtype=T64)
    fg = F(grid)
    i = int(torch.argmin(torch.where(torch.isnan(fg), torch.full_like(fg, math.inf), fg)))
    fine = torch.linspace(float(grid[max(i - 1, 0)]), float(grid[min(i + 1, grid.numel() - 1)]),
                          2001, dtype=T64)
    best = float(torch.nan_to_num(F(fine), nan=math.inf).min())
    assert fp <= best + 1e-9 * (1 + abs(best)), (
        f"prox_{{{t:g}φ}}({v}) = {float(p)} has value {fp}, the grid reaches {best}")
    return "prox:minimizer"


# ----------------------------------------------------------------------------- verify
def verify_check() -> Any:
    """``verify.check`` if it exists (it is being written concurrently), else None."""
    try:
        mod = importlib.import_module("verify.check")
    except ImportError:
        return None
    return getattr(mod, "check", None)


def check_verify(d: lowering.DerivedLayer, case: Case) -> str:
    check = verify_check()
    if check is None:
        return "verify:unavailable"
    x = case.input_tensors()
    arg: Any = x if len(x) != 1 else next(iter(x.values()))
    if not x:
        arg = {}
    try:
        rep = check(d, arg, starts=2)
    except ce.ConvexEqError as err:
        reason = re.sub(r"[-+]?\d[\d.e+-]*", "#", err.reason)[:60]
        return f"verify-error:{type(err).__name__}({reason})"
    assert isinstance(rep.passed, bool)
    if rep.passed:
        return f"verify:passed({rep.label})"
    assert rep.failures and all(isinstance(f, str) and f.strip() for f in rep.failures), (
        "verify.check failed without a labelled reason")
    head = re.sub(r"[-+]?\d[\d.e+-]*", "#", rep.failures[0].split(":")[0])[:48]
    from .adjudicate import classify  # every FAIL re-checked by an independent method
    from .stats import keep_case

    cls = classify(d, rep, x)
    if cls in ("unconfirmed", "confirmed"):  # a suspected false alarm, or a real layer defect
        keep_case(cls, f"{case!r}\n{rep}")
    return f"verify:failed[{cls}]({head})"
