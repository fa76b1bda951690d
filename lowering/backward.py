"""Backward strategies of the emitted module, one unit each, found through a registry.

A strategy turns the equilibrium ``z*`` found without autograd into a tensor whose gradient is
the strategy's gradient (``docs/theory.md`` §8):

* ``implicit`` — exact implicit differentiation: ``dL/dθ = (∂T/∂θ)ᵀ g`` with the adjoint fixed
  point ``g = Jᵀ g + ∂L/∂z*`` (``J = ∂T/∂z`` at ``z*``), as a ``torch.autograd.Function``
  whose backward is itself differentiable: second-order gradients (``create_graph=True``)
  differentiate the adjoint system implicitly (``h = J h + u``) — ``gradgradcheck`` passes;
  a third derivative raises :class:`~convex_eq.errors.OptionError` when it is taken;
* ``phantom`` — the gradient of the last ``k`` (damped) applications of ``T`` from ``z*``;
  first order only: ``create_graph=True`` raises :class:`~convex_eq.errors.OptionError`;
* ``unroll`` — ordinary autograd through ``K`` iterations from ``z0`` (any order).

Every strategy receives a :class:`FixedPointProblem`: ``T`` as a function of the flat state and
of the tensors it reads (inputs and weights), so that gradients reach exactly those tensors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from convex_eq.errors import ConvergenceError, ConvergenceWarning, OptionError

from .nodes import partial_evaluation
from .solvers import (
    _COMPILED,
    SOLVERS,
    CompiledSteps,
    SolverStats,
    accumulation_dtype,
    compiled_steps,
    exact_rel_residual,
    get_solver,
    grad_off,
)


@dataclass
class AdjointConfig:
    """How adjoint (and second-order) linear fixed points are solved.

    ``method``: ``"iterative"`` (the ``solver`` on ``g = Jᵀg + v``), ``"direct"`` (the
    per-sample Jacobian ``J`` formed once by one batched vector–Jacobian product, then an LU
    solve of ``(I − Jᵀ) g = v``; needs samples that do not interact), or ``"auto"``: direct when
    the samples are independent and the problem is small (``N ≤ DIRECT_MAX_STATE`` and
    ``B·N ≤ DIRECT_MAX_ROWS``: there the per-iteration overhead of an iterative adjoint
    dominates, while the N-row VJP of the Jacobian costs about one iteration), iterative
    otherwise (docs/theory.md §8)."""

    solver: str = "anderson"
    tol: float = 1e-6
    max_iter: int = 100
    on_fail: str = "raise"  # "raise" | "warn" | "mask"
    method: str = "auto"
    batch_independent: bool = False
    #: compiled chunks of plain adjoint iterations (:class:`~lowering.solvers.CompiledSteps`;
    #: None: eager), used when ``Jᵀ`` comes from a plan (the module sets them inside
    #: ``torch.compile``)
    compiled_steps: CompiledSteps | None = None
    #: the batch index of each row of the adjoint problem when it holds a subset of the batch
    #: (samples masked out of the backward), so that messages name batch samples; None: all
    rows: torch.Tensor | None = None


#: ``"auto"`` forms the Jacobian only when it is small: N batched VJP rows per sample
DIRECT_MAX_STATE = 256
DIRECT_MAX_ROWS = 2048
ADJOINT_METHODS = ("auto", "direct", "iterative")
#: with a plan an adjoint iteration is two tensor operations, so ``"auto"`` solves directly
#: only while one batched LU costs less than its ~20–30 iterations (OptEq QP, N = 64, float32,
#: fwd+bwd: direct 0.88 vs 1.01 ms at B = 1, 1.20 vs 1.39 at B = 4, 2.36 vs 2.47 at B = 8,
#: 2.37 vs 2.07 at B = 16, 3.22 vs 1.74 at B = 32)
DIRECT_MAX_STATE_PLAN = 128
DIRECT_MAX_ROWS_PLAN = 512


@dataclass
class FixedPointProblem:
    """``T(z, tensors)`` with the tensors it depends on (inputs and weights, in order).

    ``sink`` receives the adjoint solver statistics (``sink(stats)``), so that the module can
    expose them as ``last_backward_stats``."""

    fn: Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
    tensors: list[torch.Tensor]
    adjoint: AdjointConfig
    sink: Callable[[SolverStats], None]
    #: ``T`` planned at these tensors (lowering/plan.py), built with autograd from ``leaves``
    #: (detached copies of ``tensors``): the first-order implicit backward linearises it
    plan: Any = None
    leaves: list[torch.Tensor] | None = None
    #: True when ``tensors`` are the plan's own held tensors (``plan.held``, built with
    #: autograd from the inputs and weights) and ``fn`` is ``plan.eval_with``: the implicit
    #: backward then differentiates the plan in closed form (:class:`_PlannedFixedPoint`)
    held: bool = False
    #: ``T`` at the equilibrium as the forward solver computed it (or None): the planned
    #: backward reads ``f'`` there (``plan.linearize_at``)
    image: torch.Tensor | None = None

    def with_grad(self, z: torch.Tensor, tensors: Sequence[torch.Tensor],
                  needs: Sequence[bool]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Leaf copies of ``z`` and of the tensors that need gradients, and ``T`` at them."""
        zz = z.detach().requires_grad_()
        ts = [t.detach().requires_grad_() if n else t.detach() for t, n in zip(tensors, needs)]
        return zz, ts, self.fn(zz, ts)


class BackwardStrategy(Protocol):
    """Turns the detached equilibrium into the differentiable output of the layer."""

    name: str

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor: ...


BACKWARD_STRATEGIES: dict[str, BackwardStrategy] = {}


def register_backward(strategy: BackwardStrategy) -> BackwardStrategy:
    """Add a backward strategy to the registry (by its ``name``)."""
    BACKWARD_STRATEGIES[strategy.name] = strategy
    return strategy


def get_backward(name: str) -> BackwardStrategy:
    """The registered strategy ``name`` (OptionError listing the available ones otherwise)."""
    if name not in BACKWARD_STRATEGIES:
        raise OptionError(f"unknown backward mode {name!r}", term="torch_module",
                          hint=f"use one of {tuple(BACKWARD_STRATEGIES)}")
    return BACKWARD_STRATEGIES[name]


# ----------------------------------------------------------------------------- adjoint solves
def _report(stats: SolverStats, cfg: AdjointConfig, what: str) -> None:
    if stats.all_converged or bool(stats.converged.all()):  # the solver's word: no sync
        return
    idx = stats.failed_indices
    if cfg.rows is not None:  # rows of a subset → the batch samples they are
        idx = [int(cfg.rows[i]) for i in idx]
    shown = ", ".join(map(str, idx[:10])) + (", …" if len(idx) > 10 else "")
    msg = (f"{what} did not reach relative residual {cfg.tol:g} in {cfg.max_iter} iterations "
           f"of {cfg.solver} for {len(idx)}/{stats.converged.numel()} samples (indices "
           f"{shown}; worst {stats.max_residual:.3e})")
    if cfg.on_fail == "mask" and not cfg.batch_independent:
        # (refused at construction; the config is mutable): leaving rows of a coupled system
        # out would change the others' adjoint
        raise OptionError(f"{msg}; on_nonconvergence='mask' cannot leave samples of this layer "
                          "out of the gradient: its objective couples the batch", term="backward",
                          hint="set module.config.on_nonconvergence to 'raise' or 'warn'")
    if cfg.on_fail == "mask":
        msg += "; they are left out of the gradient (on_nonconvergence='mask')"
    if cfg.on_fail == "raise":
        raise ConvergenceError(msg, term="backward",
                               hint="raise backward_max_iter / backward_tol, or pass "
                               "on_nonconvergence='warn' to train through it")
    warnings.warn(f"backward: {msg}", ConvergenceWarning, stacklevel=4)


def _linear_fixed_point(apply: Callable[[torch.Tensor], torch.Tensor], rhs: torch.Tensor,
                        cfg: AdjointConfig, what: str, sink: Callable | None = None,
                        kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Solve ``y = apply(y) + rhs`` (``apply`` linear) with the adjoint solver (``kept``, when
    given, receives the mask of the rows kept when mask mode zeroed failed ones)."""
    solver = SOLVERS.get(cfg.solver) or get_solver(cfg.solver)  # (the latter: a typed error)
    plus_fn = getattr(apply, "plus_fn", None)  # a plan's Jᵀ fuses the affine step (addmm)
    step = plus_fn(rhs) if plus_fn is not None else (lambda y: apply(y) + rhs)
    steps = cfg.compiled_steps if plus_fn is not None else None
    on = torch.is_grad_enabled()  # (grad_off's work inline: off already in a first-order
    if on:  # backward, where this runs once per call)
        _set_grad_enabled(False)
    try:
        if steps is None and _COMPILED.get() is None:  # eager already: no context to enter
            y, st = solver(step, rhs, tol=cfg.tol, max_iter=cfg.max_iter)
        else:
            with compiled_steps(steps):
                y, st = solver(step, rhs, tol=cfg.tol, max_iter=cfg.max_iter)
    finally:
        if on:
            _set_grad_enabled(True)
    st.__dict__.pop("image", None)  # (not kept by the statistics)
    if sink is not None:
        sink(st)
    if not st.all_converged:  # (_report's own first test, without the call)
        _report(st, cfg, what)
    if cfg.on_fail == "mask" and not (st.all_converged or bool(st.converged.all())):
        # as the forward's failed samples, those whose adjoint did not converge leave the
        # backward: their rows are zero (mask mode needs samples that do not interact), so an
        # unconverged (or NaN) row never enters the weights' gradient
        keep = st.converged.reshape(-1, *([1] * (y.ndim - 1)))
        y = torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))
        if kept is not None:
            kept.append(keep)
    return y


def _use_direct(cfg: AdjointConfig, z: torch.Tensor, max_state: int = DIRECT_MAX_STATE,
                max_rows: int = DIRECT_MAX_ROWS) -> bool:
    if cfg.method == "iterative" or not cfg.batch_independent or z.ndim != 2:
        return False
    if cfg.method == "direct":
        return True
    b, n = z.shape
    return n <= max_state and b * n <= max_rows


def _direct_adjoint(fz: torch.Tensor, zz: torch.Tensor, v: torch.Tensor, cfg: AdjointConfig
                    ) -> tuple[torch.Tensor, SolverStats] | None:
    """``g = (I − J_bᵀ)⁻¹ v_b`` per sample from the Jacobians ``J_b`` (one batched VJP of the
    identity rows), its residual ``||g − Jᵀg − v|| / ||g||`` measured; ``None`` when a step
    fails (non-finite, singular, an op without a batching rule) so the caller iterates."""
    b, n = zz.shape
    eye = torch.eye(n, dtype=zz.dtype, device=zz.device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "performance drop" of ops without batching rules
            rows = torch.autograd.grad(fz, zz, eye[:, None, :].expand(n, b, n),
                                       retain_graph=True, is_grads_batched=True)[0]
        jac = rows.transpose(0, 1)  # (B, N, N): jac[b, i, :] = row i of J_b

        def true_jt(y: torch.Tensor) -> torch.Tensor:
            return torch.autograd.grad(fz, zz, y, retain_graph=True)[0]

        return _direct_solve(jac.transpose(1, 2), v, true_jt, cfg)
    except (RuntimeError, NotImplementedError):
        return None


def _direct_solve(jt_blocks: torch.Tensor, v: torch.Tensor,
                  true_jt: Callable[[torch.Tensor], torch.Tensor], cfg: AdjointConfig
                  ) -> tuple[torch.Tensor, SolverStats] | None:
    """``g_b = (I − J_bᵀ)⁻¹ v_b`` from the formed blocks ``J_bᵀ`` (B, N, N); the residual is
    measured with the *true* map (one application), so a coupling between samples that the
    block-diagonal form misses fails it (None: the caller iterates)."""
    b, n = v.shape
    eye = torch.eye(n, dtype=v.dtype, device=v.device)
    with torch.no_grad():
        acc = accumulation_dtype(v.dtype)
        g = torch.linalg.solve((eye - jt_blocks).to(acc), v.detach().to(acc)[..., None])[..., 0]
        g = g.to(v.dtype)
    res = (g - true_jt(g) - v).detach()
    # exact: float64 norms of a float32/16 state, the scaled form of a float64 one
    exact = exact_rel_residual(res, g)
    conv = exact <= cfg.tol  # False for a NaN residual: one test for non-finite and unconverged
    if not bool(conv.all()):
        return None
    r = exact.to(g.dtype)
    stats = SolverStats("direct", r[:, None], torch.ones(b, dtype=torch.long, device=v.device),
                        conv, cfg.tol, returned_residual=r, all_converged=True)
    return g, stats


def _adjoint(fz: torch.Tensor, zz: torch.Tensor, v: torch.Tensor, problem: FixedPointProblem
             ) -> torch.Tensor:
    """The first-order adjoint ``g = Jᵀg + v`` at the retained graph ``fz = T(zz)``."""
    cfg = problem.adjoint
    if _use_direct(cfg, zz):
        out = _direct_adjoint(fz, zz, v, cfg)
        if out is not None:
            problem.sink(out[1])
            return out[0]

    def jt(y: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(fz, zz, y, retain_graph=True)[0]

    return _linear_fixed_point(jt, v, cfg, "adjoint fixed point", problem.sink)


def _planned_backward(problem: FixedPointProblem, z: torch.Tensor, v: torch.Tensor,
                      needs: list[bool]) -> list[torch.Tensor | None]:
    """First-order implicit gradients from the forward's plan: ``Jᵀ`` at ``z*`` as a closure
    (no autograd per adjoint iteration), then ``(∂T/∂θ)ᵀ g`` (:func:`param_grads`)."""
    plan, leaves = problem.plan, problem.leaves
    assert leaves is not None
    # at an alias of the saved output without its grad_fn: the plan caches the point it was
    # linearised at, and the output object there would be a reference cycle (output → its
    # grad_fn → this problem → the plan → the output), freed only by the cyclic collector
    z = z.detach()
    _, jt = plan.linearize(z, value=False)  # a first-order backward runs without gradients
    g = v if jt is None else _adjoint_from_map(jt, z, v, problem)
    return param_grads(plan, z, g, leaves, needs)


def param_grads(plan: Any, z: torch.Tensor, g: torch.Tensor, leaves: list[torch.Tensor],
                needs: list[bool]) -> list[torch.Tensor | None]:
    """``(∂T/∂θ)ᵀ g`` for each leaf the plan was built from (None where not needed or not
    reached): in closed form for the plan's state-free tensors (``param_vjp``), autograd only
    from those to the weights and inputs they were built from; one backward of ``T(z)`` when
    some part of the plan has no closed form."""
    with grad_off():
        pairs = plan.param_vjp(z, g)
    grads: list[torch.Tensor | None] = [None] * len(needs)
    if pairs is None:
        with torch.enable_grad():
            fz = plan(z)
        rest_t, rest_c = [fz], [g]
    else:
        index = {id(t): i for i, t in enumerate(leaves)}
        rest_t, rest_c = [], []
        for t, ct in pairs:
            if not t.requires_grad:
                continue
            i = index.get(id(t))
            if i is not None:  # the plan holds the leaf itself (an input injection q)
                grads[i] = ct if grads[i] is None else grads[i] + ct
            else:
                rest_t.append(t)
                rest_c.append(ct)
    want = [i for i, n in enumerate(needs) if n]
    if rest_t and want and any(t.requires_grad for t in rest_t):
        # retain_graph: the plan's state-free parts (Ux + b, AᵀA) keep their graph for a
        # second backward through the same output (retain_graph=True upstream)
        more = torch.autograd.grad(rest_t, [leaves[i] for i in want], rest_c, allow_unused=True,
                                   retain_graph=True)
        for i, gr in zip(want, more):
            if gr is not None:
                grads[i] = gr if grads[i] is None else grads[i] + gr
    return [gr if n else None for gr, n in zip(grads, needs)]


def _adjoint_from_map(jt: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
                      v: torch.Tensor, problem: FixedPointProblem) -> torch.Tensor:
    """``g = Jᵀg + v`` with ``Jᵀ`` given as a map: direct when :func:`_use_direct` says so
    (the per-sample matrices from the plan's transpose types — one broadcast product for the
    canonical ``diag(σ') M`` — or, asked for explicitly, by ``vmap`` of the map over the identity
    rows; then LU), else the adjoint solver."""
    cfg = problem.adjoint
    if _use_direct(cfg, z, DIRECT_MAX_STATE_PLAN, DIRECT_MAX_ROWS_PLAN):
        form = getattr(jt, "blocks", None)  # a plan's transpose types can form them
        blocks = form(v) if form is not None else None
        if blocks is None and cfg.method == "direct":
            b, n = z.shape
            eye = torch.eye(n, dtype=z.dtype, device=z.device)
            try:  # rows[i, b] = Jᵀ_b e_i
                rows = torch.func.vmap(jt)(eye[:, None, :].expand(n, b, n))
                blocks = rows.transpose(0, 1).transpose(1, 2)
            except (RuntimeError, NotImplementedError):
                blocks = None
        if blocks is not None:
            out = _direct_solve(blocks, v, jt, cfg)
            if out is not None:
                problem.sink(out[1])
                return out[0]
    if cfg.method == "auto" and cfg.solver == "auto" and cfg.batch_independent and z.ndim == 2:
        # (inside torch.compile too: the recurrence runs eagerly, as the adjoint's stop tests)
        ask = getattr(jt, "symmetric_split", None)  # a plan's transpose types can tell
        split = ask() if ask is not None else None
        if split is not None:
            out = _cg_adjoint(split[0], split[1], jt, v, cfg)
            if out is not None:
                problem.sink(out[1])
                return out[0]
    return _linear_fixed_point(jt, v, cfg, "adjoint fixed point", problem.sink)


#: the conjugate-gradient adjoint stops its recurrence at this fraction of ``tol`` first (the
#: returned gradient is then checked against ``tol`` exactly with the true map; the target is
#: tightened ten-fold while that check fails, within the iteration cap).  ½: the true residual
#: is ``||L(s ⊙ r)||/||T(g)||`` for the recurrence's ``r`` (docs/theory.md §8), at most
#: ``2ρ/(1 − 3ρ)`` for ``ρ = ||r||/||s ⊙ v||`` where ``||L|| < 1`` and ``0 ≤ d ≤ 1``, so the
#: check passes at the first stop there up to a relative 1.5·tol (measured on the canonical
#: layer, m = 64–4096: 1–2 iterations fewer than at 0.1, the checked residual 0.1–0.17·tol)
CG_TARGET = 0.5


def _cg_adjoint(d: torch.Tensor, inner: Any, jt: Callable[[torch.Tensor], torch.Tensor],
                v: torch.Tensor, cfg: AdjointConfig) -> tuple[torch.Tensor, SolverStats] | None:
    """``g = v + L(d ⊙ g)`` for a self-adjoint ``L`` and ``d ≥ 0`` by conjugate gradients, per
    sample: with ``s = √d`` and ``h = s ⊙ g`` the system is ``(I − S L S) h = s ⊙ v``, symmetric,
    and positive definite where ``Jᵀ`` contracts; then ``g = v + L(s ⊙ h)``.  About a third of
    the plain iterations of a well-contracting layer (each about twice the work;
    docs/theory.md §8).  The returned ``g`` is checked with the true map ``jt`` (relative
    residual ``||T(g) − g|| / ||T(g)||`` ≤ ``tol`` with ``T(g) = Jᵀg + v``, as the fixed-point
    solvers measure it, norms accumulated in float64 for float32/16); None when that check
    fails within ``max_iter`` iterations or stops improving, or on a non-finite value (an
    indefinite system, a NaN cotangent, a negative ``d``): the caller then iterates with the
    configured solver.  ``residuals`` hold the recurrence's ``||r_k|| / ||s ⊙ v||`` per
    iteration, and ``iterations`` each sample's first ``k`` where it met ``tol``."""
    on = torch.is_grad_enabled()
    if on:
        _set_grad_enabled(False)
    try:
        return _cg_run(d, inner, jt, v.detach(), cfg)
    finally:
        if on:
            _set_grad_enabled(True)


def _cg_run(d: torch.Tensor, inner: Any, jt: Callable[[torch.Tensor], torch.Tensor],
            v: torch.Tensor, cfg: AdjointConfig) -> tuple[torch.Tensor, SolverStats] | None:
    if v.ndim != 2 or d.shape != v.shape or not v.shape[0]:  # (an empty batch: iterate)
        return None
    norm, addcmul = torch.linalg.vector_norm, torch.addcmul
    s = d.sqrt()  # NaN for a negative d: the recurrence reads non-finite and gives up
    # the right-hand side s ⊙ v scaled to unit norm per sample (its norm nb is put back on the
    # returned h): ||r|| is then the relative residual itself, with no division per iteration.
    # Clamped away from 0: a sample with b = 0 (h = 0 is exact), or one whose recurrence
    # residual reaches exactly 0 before the others (finite termination: a ReLU sample with few
    # active units, common in float32), would read 0/0 in α or β
    tiny = torch.finfo(v.dtype).tiny
    r = s * v
    nb = norm(r, 2, 1, True).clamp_min_(tiny)  # (B, 1)
    r.div_(nb)
    p = r.clone()
    h = torch.zeros_like(r)
    rr = norm(r, 2, 1, True).square_().clamp_min_(tiny)  # (B, 1) squared norms
    target = CG_TARGET * cfg.tol
    checked = math.inf  # the worst checked residual of the last failed check
    hist: list[torch.Tensor] = []  # ||r_k|| / ||s ⊙ v|| per iteration, (B, 1) each
    k = 0
    while k < cfg.max_iter:
        k += 1
        ap = addcmul(p, s, inner(s * p), value=-1.0)  # (I − S L S) p
        alpha = rr / (p * ap).sum(1, keepdim=True).clamp_min_(tiny)
        h.addcmul_(alpha, p)
        r.addcmul_(alpha, ap, value=-1.0)
        nr = norm(r, 2, 1, True)
        hist.append(nr)
        top = float(nr.max())
        if not math.isfinite(top):
            return None
        if top <= target:
            g = inner.plus((h * nb).mul_(s), v)
            tg = jt.plus(g, v)  # T(g) = Jᵀg + v
            exact = exact_rel_residual(tg - g, tg)  # the fixed-point residual, exactly
            conv = exact <= cfg.tol  # False for NaN: non-finite and unconverged in one test
            if bool(conv.all()):
                # (the history's columns, joined when first read; iterations: each sample's
                # first k with ||r_k||/||b|| ≤ tol there)
                return g, SolverStats("cg", tuple(hist), None, conv, cfg.tol,
                                      returned_residual=exact.to(g.dtype), all_converged=True)
            # the recurrence's residual ran ahead of the true one: go on with a target ten
            # times lower while that moves the checked residual (it stalls where round-off in
            # the state's dtype, not the recurrence, limits it: the configured solver then)
            worst = float(exact.max())
            if not worst < 0.5 * checked:
                return None
            checked = worst
            target *= 0.1
        rr_new = nr.square().clamp_min_(tiny)
        p = addcmul(r, rr_new / rr, p)
        rr = rr_new
    return None


class _Solved:
    """The equilibrium handed to :class:`_ImplicitFixedPoint` as a non-tensor argument."""

    __slots__ = ("z",)

    def __init__(self, z: torch.Tensor):
        self.z = z


def _refuse_batched_backward() -> None:
    """A typed error for a vectorised (vmapped) backward of the implicit gradient: its adjoint
    solve reads residuals on the host per iteration, which a batched ``v`` cannot give."""
    raise OptionError(
        "batched gradients through backward='implicit' are not supported "
        "(torch.autograd.grad(is_grads_batched=True), "
        "torch.autograd.functional.jacobian(vectorize=True), "
        "gradcheck(check_batched_grad=True), vmap over a vjp): the adjoint solve reads "
        "residuals on the host every iteration", term="backward",
        hint="compute the rows one at a time (jacobian(..., vectorize=False), a loop over "
        "grad_outputs), or use backward='phantom' or 'unroll'")


def _output(ctx: Any, z: torch.Tensor, problem: FixedPointProblem,
            tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The solver's iterate as an implicit function's output, saved with ``tensors`` for its
    backward (a view is copied: an output that is a view of another tensor would refuse later
    in-place operations)."""
    out = z if z._base is None else z.clone()
    ctx.problem = problem
    ctx.save_for_backward(out, *tensors)
    return out


def _refuse_batched(v: torch.Tensor) -> None:
    """:func:`_refuse_batched_backward` when the cotangent is batched or a functorch transform
    is active."""
    if _is_batched(v) or _transforms_active():
        _refuse_batched_backward()


_is_batched = torch._C._functorch.is_legacy_batchedtensor
_transforms_active = torch._C._are_functorch_transforms_active
_set_grad_enabled = torch._C._set_grad_enabled


class _ImplicitFixedPoint(torch.autograd.Function):
    """Output ``z*``; backward ``(∂T/∂θ)ᵀ (I − Jᵀ)⁻¹ v``, differentiable (second order)."""

    @staticmethod
    def forward(ctx: Any, z_star: _Solved, problem: FixedPointProblem,
                *tensors: torch.Tensor) -> torch.Tensor:
        # the solver's iterate is not an input of this function (it comes boxed), so it can be
        # the output itself, without a copy; a view (a reshaped state) is copied, as an output
        # that is a view of another tensor would refuse later in-place operations
        # the output is saved (not z_star): in a second-order backward its dependence on θ is
        # again this implicit function
        return _output(ctx, z_star.z, problem, tensors)

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        z, *tensors = ctx.saved_tensors
        problem: FixedPointProblem = ctx.problem
        needs = list(ctx.needs_input_grad[2:])
        if not any(needs):
            return (None, None, *([None] * len(tensors)))
        _refuse_batched(v)
        if not torch.is_grad_enabled() and problem.plan is not None:
            return (None, None, *_planned_backward(problem, z, v, needs))
        if not torch.is_grad_enabled():  # first order: leaf copies, one retained graph
            with torch.enable_grad():
                with partial_evaluation():  # one graph, differentiated many times
                    zz, ts, fz = problem.with_grad(z, tensors, needs)
                g = _adjoint(fz, zz, v, problem)
                want = [t for t, n in zip(ts, needs) if n]
                grads = iter(torch.autograd.grad(fz, want, g, allow_unused=True))
            return (None, None, *[next(grads) if n else None for n in needs])
        return (None, None, *_differentiable_grads(problem, z, v, tensors, needs))


def _differentiable_grads(problem: FixedPointProblem, z: torch.Tensor, v: torch.Tensor,
                          tensors: Sequence[torch.Tensor], needs: Sequence[bool]
                          ) -> list[torch.Tensor | None]:
    """``(∂T/∂θ)ᵀ (I − Jᵀ)⁻¹ v`` for each of ``tensors`` (θ) as a differentiable function of
    ``(v, z, θ)`` (a backward under ``create_graph=True``).  ``z`` is the saved *output*, so its
    dependence on θ is again the implicit function; the partial derivative at fixed ``z`` is a
    functorch vjp over θ alone: ``z`` enters as a captured tensor, differentiated only by the
    outer (higher-order) autograd."""
    g = _AdjointSolve.apply(v, z, problem, *tensors)
    _, vjp_fn = torch.func.vjp(lambda *ts: problem.fn(z, list(ts)), *tensors)
    grads = vjp_fn(g)
    return [gr if n else None for gr, n in zip(grads, needs)]


class _Express:
    """What :class:`_PlannedFixedPoint` carries from the forward to the backward (not a tensor
    argument, so that the solver's iterate can be the output without a copy)."""

    __slots__ = ("problem", "z")

    def __init__(self, z: torch.Tensor, problem: FixedPointProblem):
        self.z, self.problem = z, problem


class _PlannedFixedPoint(torch.autograd.Function):
    """``z*`` of a problem whose tensors are its plan's held tensors (``problem.held``): the
    same gradient as :class:`_ImplicitFixedPoint`, with the plan's state-free tensors ``(c, M)``
    as the autograd inputs (built with autograd from the layer's inputs and weights, so autograd
    carries their cotangents on: no leaf copies, no second autograd pass) and ``f'`` at ``z*``
    read from the solver's last image where the activation allows (docs/theory.md §8).  Second
    order differentiates the plan's evaluation ``T(z, c, M)`` implicitly, as
    :class:`_ImplicitFixedPoint` differentiates ``T``."""

    @staticmethod
    def forward(ctx: Any, box: _Express, *held: torch.Tensor) -> torch.Tensor:
        z = box.z
        box.z = None  # (the output is saved; the box must not hold it: a cycle)
        return _output(ctx, z, box.problem, held)

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        z, *held = ctx.saved_tensors
        problem: FixedPointProblem = ctx.problem
        needs = ctx.needs_input_grad[1:]
        if not any(needs):
            return (None, *([None] * len(held)))
        if _is_batched(v) or _transforms_active():  # (_refuse_batched's test, inline)
            _refuse_batched_backward()
        if torch.is_grad_enabled():  # create_graph=True: T as the plan's evaluation
            return (None, *_differentiable_grads(problem, z, v, held, needs))
        z = z.detach()  # (an alias without the output's grad_fn: no cycle through the plan)
        plan = problem.plan
        image = problem.image
        jt, d = plan.linearize_at(z, image if image is not None and image.shape == z.shape
                                  else None)
        g = _adjoint_from_map(jt, z, v, problem)
        return (None, *plan.held_vjp(z, g, d, needs))


class _AdjointSolve(torch.autograd.Function):
    """``g = (I − J(z, θ)ᵀ)⁻¹ v`` with its implicit derivative: for an upstream ``u``,
    ``h = (I − J)⁻¹ u`` gives ``∂/∂v = h`` and ``∂/∂(z, θ) = ∇_{z,θ} ⟨J(z, θ) h, g⟩``."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, z: torch.Tensor, problem: FixedPointProblem,
                *tensors: torch.Tensor) -> torch.Tensor:
        needs = [True] * len(tensors)
        with torch.enable_grad():
            zz, _, fz = problem.with_grad(z, tensors, [False] * len(tensors))

            def jt(y: torch.Tensor) -> torch.Tensor:
                return torch.autograd.grad(fz, zz, y, retain_graph=True)[0]

            kept: list[torch.Tensor] = []
            g = _linear_fixed_point(jt, v.detach(), problem.adjoint, "adjoint fixed point",
                                    problem.sink, kept)
        del needs
        ctx.problem = problem
        # mask mode: rows zeroed for a failed adjoint are constant, so their derivative is 0
        ctx.kept = kept[0] if kept else None
        ctx.save_for_backward(z, g, *tensors)
        return g

    @staticmethod
    def backward(ctx: Any, u: torch.Tensor) -> Any:
        z, g, *tensors = ctx.saved_tensors
        deps = [t for t in (u, z, g, *tensors) if t.requires_grad]
        if torch.is_grad_enabled() and deps:  # a third-order graph is being recorded
            with torch.no_grad():
                out = _AdjointSolve._second_order(ctx, u, z, g, tensors)
            # once_differentiable would connect its outputs to ``u`` only: their dependence on
            # (z, g, θ) would be dropped, and a third derivative would come out silently wrong
            return tuple(o if o is None else _ThirdOrderRefused.apply(o, *deps) for o in out)
        return _AdjointSolve._second_order(ctx, u, z, g, tensors)

    @staticmethod
    def _second_order(ctx: Any, u: torch.Tensor, z: torch.Tensor, g: torch.Tensor,
                      tensors: list[torch.Tensor]) -> tuple:
        """``(h, ∂/∂z, None, ∂/∂θ…)`` of :meth:`backward`, without a graph."""
        problem: FixedPointProblem = ctx.problem
        needs = list(ctx.needs_input_grad[3:])
        u = u.detach()
        if ctx.kept is not None:  # g's zeroed rows do not depend on v (nor, below, on z, θ)
            u = torch.where(ctx.kept, u, torch.zeros((), dtype=u.dtype, device=u.device))
        with torch.enable_grad():
            zz, ts, fz = problem.with_grad(z, tensors, needs)
            y = torch.zeros_like(fz, requires_grad=True)
            jty = torch.autograd.grad(fz, zz, y, create_graph=True)[0]

            def jv(h: torch.Tensor) -> torch.Tensor:  # J h as the derivative of ⟨Jᵀy, h⟩ in y
                return torch.autograd.grad(jty, y, h, retain_graph=True)[0]

            h = _linear_fixed_point(jv, u, problem.adjoint, "second-order (tangent) fixed point")
            jtg = torch.autograd.grad(fz, zz, g, create_graph=True)[0]
            s = (jtg * h).sum()
            want = [zz] + [t for t, n in zip(ts, needs) if n]
            grads = torch.autograd.grad(s, want, allow_unused=True)
        gz, rest = grads[0], iter(grads[1:])
        return (h, gz, None, *[next(rest) if n else None for n in needs])


class _ThirdOrderRefused(torch.autograd.Function):
    """Identity on ``out`` whose backward (a third derivative through the implicit backward)
    refuses with a typed error; ``deps`` connect it to what ``out`` depends on."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise OptionError(
            "third- and higher-order gradients through backward='implicit' are not supported: "
            "its second-order (tangent) solve is differentiable once", term="backward",
            hint="use backward='unroll' for third-order gradients (autograd through its "
            "iterations, any order)")


class ImplicitBackward:
    """Exact implicit differentiation (first and second order)."""

    name = "implicit"

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor:
        """``z*`` with the exact implicit gradient attached (through the plan's held tensors
        when the problem is posed on them: ``problem.held``)."""
        z = z_star.detach() if z_star.requires_grad else z_star  # (the solvers' is not)
        if problem.held:
            return _PlannedFixedPoint.apply(_Express(z, problem), *problem.tensors)
        return _ImplicitFixedPoint.apply(_Solved(z), problem, *problem.tensors)


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses ``create_graph=True`` with a typed error."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, mode: str) -> torch.Tensor:
        ctx.mode = mode
        return z.view_as(z)

    @staticmethod
    def backward(ctx: Any, v: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise OptionError(
                f"backward='{ctx.mode}' gives first-order gradients only; "
                "create_graph=True (second-order autograd) is not supported by it",
                term="backward", hint="use backward='implicit' (exact, any first/second order) "
                "or backward='unroll' for higher-order gradients")
        return v, None


class PhantomBackward:
    """Phantom gradient: autograd through ``k`` damped applications of ``T`` from ``z*``."""

    name = "phantom"

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor:
        """``k`` damped applications of ``T`` from the detached ``z*``, first order only."""
        z = z_star.detach()
        lam = options.phantom_damping
        for _ in range(options.phantom_steps):
            fz = problem.fn(z, problem.tensors)
            z = fz if lam == 1.0 else lam * fz + (1 - lam) * z
        return _FirstOrderOnly.apply(z, self.name) if z.requires_grad else z


class UnrollBackward:
    """Autograd through ``K`` plain iterations from ``z0`` (the forward is the unrolled loop)."""

    name = "unroll"

    def attach(self, problem: FixedPointProblem, z_star: torch.Tensor, z0: torch.Tensor,
               options: Any) -> torch.Tensor:
        """The unrolled iterate as is (the module runs the unrolled loop with autograd)."""
        return z_star


for _s in (ImplicitBackward(), PhantomBackward(), UnrollBackward()):
    register_backward(_s)
