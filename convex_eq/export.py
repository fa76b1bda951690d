"""CVXPY export context: free variables, substitutions, one collected PSD quadratic form.

The exported problem is ``min ½ fᵀQf + cᵀf + Σ DCP terms  s.t. constraints`` in the free vector
``f`` (state blocks and auxiliary variables); each state block is ``z_s = S_s f``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._lazy import cvxpy as cp
from .affine import Affine
from .errors import ExportError, NotDCPError, ShapeError, SolverError
from .symbols import Env, Symbol, as_tensor


@dataclass
class ExportedProblem:
    """A CVXPY problem plus the map back from its variables to the state blocks."""

    #: the CVXPY problem (minimize the exported objective subject to its domains)
    problem: cp.Problem
    #: the free vector ``f`` of the problem: the state blocks and any auxiliary variables
    variable: cp.Variable
    #: per state block, the matrix mapping ``f`` to the block's flattened value
    state_maps: dict[str, np.ndarray]
    #: per state block, its declared shape
    state_shapes: dict[str, tuple[int, ...]]
    #: the constant dropped from the CVXPY objective (added back by ``value``)
    constant: float
    #: inputs exported as CVXPY parameters (by name), to re-solve at other inputs
    parameters: dict[str, cp.Parameter] = field(default_factory=dict)
    #: the smallest eigenvalue of the collected quadratic form ``½fᵀQf`` (≥ 0 up to rounding)
    quadratic_eigmin: float = 0.0
    #: what the export had to do (auxiliary variables, liftings), in words
    notes: list[str] = field(default_factory=list)
    #: where each block (state or auxiliary) lies in ``f``
    blocks: dict[str, slice] = field(default_factory=dict)

    def objective_at(self, f: np.ndarray) -> float:
        """Value of the exported objective (plus dropped constants) at the free vector ``f``."""
        self.variable.value = np.asarray(f, dtype=np.float64)
        return float(self.problem.objective.value) + self.constant

    def max_violation(self, f: np.ndarray) -> float:
        """Largest constraint violation at ``f`` (0 when feasible)."""
        self.variable.value = np.asarray(f, dtype=np.float64)
        return max([float(np.max(c.violation())) for c in self.problem.constraints] or [0.0])

    def solve(self, **kwargs: Any) -> float:
        """Solve (Clarabel by default, tight tolerances) and return the objective value."""
        opts = dict(kwargs)
        if "solver" not in opts:
            opts.update(solver=cp.CLARABEL, tol_gap_abs=1e-11, tol_gap_rel=1e-11, tol_feas=1e-11)
        try:
            self.problem.solve(**opts)
        except cp.error.SolverError as err:  # CVXPY's own exception type: keep it typed here
            raise SolverError(f"the CVXPY solver failed: {err}", term="to_cvxpy",
                              hint="try another solver (solve(solver=...)) or rescale the "
                              "problem") from err
        return self.value

    @property
    def value(self) -> float:
        """Objective value including constants dropped from the CVXPY form."""
        return float(self.problem.value) + self.constant

    def state_values(self) -> dict[str, np.ndarray]:
        """The state blocks at the CVXPY solution, reshaped to their declared shapes."""
        if self.variable.value is None and self.problem.status in (cp.OPTIMAL,
                                                                   cp.OPTIMAL_INACCURATE):
            # the objective is constant and the variable appears in no constraint (e.g.
            # Σ f_identity(z) = 0): CVXPY leaves it unset although every point is optimal
            self.variable.value = np.zeros(self.variable.shape)
        if self.variable.value is None:
            raise ExportError(
                f"problem has no solution (status {self.problem.status})", term="to_cvxpy"
            )
        f = np.asarray(self.variable.value, dtype=np.float64)
        return {
            k: (m @ f).reshape(self.state_shapes[k] or ()) for k, m in self.state_maps.items()
        }


class ExportContext:
    """Collects the pieces of a CVXPY problem from the terms of one objective instance."""

    def __init__(self, states: list[Symbol], inputs: Mapping[str, Any], env: Env | None,
                 parameters: tuple[str, ...] = ()):
        self.env = env
        self.states = list(states)
        self.params: dict[str, cp.Parameter] = {}
        self.inputs: dict[str, Any] = {}
        for name, val in inputs.items():
            v = np.asarray(as_tensor(val).detach().cpu().numpy(), dtype=np.float64).reshape(-1)
            if name in parameters:
                p = cp.Parameter(v.size, name=name)
                p.value = v
                self.params[name] = p
                self.inputs[name] = p
            else:
                self.inputs[name] = v
        self._blocks: list[tuple[str, slice]] = []
        self.n_free = 0
        self.state_maps: dict[str, np.ndarray | None] = {s.name: None for s in states}
        self.pending: dict[str, tuple[str, int]] = {}
        self.quad: list[tuple[np.ndarray, str]] = []
        self.linear: list[tuple[Any, str]] = []
        self.exprs: list[tuple[Any, str]] = []
        self.constraints: list[Any] = []
        self.constant = 0.0
        self.f: cp.Variable | None = None
        self.notes: list[str] = []
        self.alias: dict[str, str] = {}
        self.aux_names: set[str] = set()

    # ------------------------------------------------------------- variables
    def new_block(self, name: str, size: int) -> slice:
        """Reserve a block of the free vector (an auxiliary or state variable)."""
        sl = slice(self.n_free, self.n_free + size)
        self._blocks.append((name, sl))
        self.n_free += size
        return sl

    def add_aux_state(self, sym: Symbol) -> slice:
        """A new auxiliary block used like a state (its own columns of ``f``)."""
        sl = self.new_block(sym.name, sym.size)
        m = np.zeros((sym.size, self.n_free))
        m[:, sl] = np.eye(sym.size)
        self.state_maps[sym.name] = m
        self.aux_names.add(sym.name)
        return sl

    def add_state(self, sym: Symbol) -> None:
        """A new state-like symbol without its own block yet (may be substituted later)."""
        self.state_maps[sym.name] = None
        self.aux_names.add(sym.name)
        self.states.append(sym)

    def resolve_name(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    @contextmanager
    def aliased(self, mapping: dict[str, str]) -> Iterator[None]:
        """Within the block, references to state ``k`` mean state ``mapping[k]``."""
        old = dict(self.alias)
        self.alias.update(mapping)
        try:
            yield
        finally:
            self.alias = old

    def substitute(self, state: Symbol, matrix: np.ndarray, aux: slice, term: str) -> None:
        """Declare ``state = matrix @ f[aux]`` (e.g. ``z = Wᵀy/μ`` for a conjugate term)."""
        name = self.resolve_name(state.name)
        if self.state_maps.get(name) is not None:
            raise ExportError(
                f"state {state.name} is already defined by another auxiliary substitution",
                term=term, hint="use at most one conjugate-of-affine term per state block",
            )
        s = np.zeros((state.size, self.n_free))
        s[:, aux] = matrix
        self.state_maps[name] = s

    def finalize_variables(self) -> None:
        """Give every state not substituted its own block, then create the CVXPY variable (one
        vector over all blocks, named after them)."""
        for s in self.states:
            if self.state_maps[s.name] is None:
                sl = self.new_block(s.name, s.size)
                m = np.zeros((s.size, self.n_free))
                m[:, sl] = np.eye(s.size)
                self.state_maps[s.name] = m
        n = self.n_free
        for k, m in list(self.state_maps.items()):
            if m.shape[1] < n:
                self.state_maps[k] = np.hstack([m, np.zeros((m.shape[0], n - m.shape[1]))])
        # named after the user's symbols: "z", or "[z; w]" for stacked blocks (an auxiliary
        # block carries its state's name, e.g. "z_dual0" for the dual variable of z)
        names = [name for name, _ in self._blocks]
        label = names[0] if len(names) == 1 else "[" + "; ".join(names) + "]"
        self.f = cp.Variable(n, name=label)

    # ------------------------------------------------------------- arguments
    def linear_map(self, u: Affine) -> tuple[np.ndarray, Any]:
        """``u = A f + off``: dense ``A`` over the free vector and the offset (array or expr)."""
        a = np.zeros((u.size, self.n_free))
        off: Any = np.zeros(u.size)
        for e in u.entries:
            m = np.eye(e.symbol.size) if e.op is None else e.op.matrix(self.env)
            m = e.coef * m
            if e.symbol.kind == "state":
                a = a + m @ self.state_maps[self.resolve_name(e.symbol.name)]
            elif e.symbol.kind == "input":
                if e.symbol.name not in self.inputs:
                    raise ShapeError(f"no value for input '{e.symbol.name}'", term=str(u))
                off = off + m @ self.inputs[e.symbol.name]
            else:
                vec = np.asarray(e.symbol.resolve(self.env).detach().cpu().numpy(), np.float64)
                off = off + m @ vec.reshape(-1)
        return a, off

    def expr(self, u: Affine) -> Any:
        """The CVXPY expression of an affine argument."""
        a, off = self.linear_map(u)
        return a @ self.f + off

    # ------------------------------------------------------------- contributions
    def add_quadratic(self, coef: float, u1: Affine, u2: Affine | None, source: str) -> None:
        """Add ``½ coef ||u1||²`` (u2 None) or ``coef <u1, u2>`` to the collected form."""
        a1, o1 = self.linear_map(u1)
        if u2 is None:
            q = coef * a1.T @ a1
            self._linear(coef * (o1 @ a1) if _is_num(o1) else coef * (a1.T @ o1), source)
            if _is_num(o1):
                self.constant += 0.5 * coef * float(o1 @ o1)
        else:
            a2, o2 = self.linear_map(u2)
            q = coef * (a1.T @ a2 + a2.T @ a1)
            self._linear(coef * (a1.T @ o2 + a2.T @ o1), source)
            if _is_num(o1) and _is_num(o2):
                self.constant += coef * float(o1 @ o2)
        self.quad.append((q, source))

    def _linear(self, c: Any, source: str) -> None:
        self.linear.append((c, source))

    def add_linear(self, coef: float, w: Affine, u: Affine, source: str) -> None:
        """Add ``coef <w, u>`` where ``w`` has no state (an input/bias offset)."""
        if w.states():
            raise ExportError("linear coefficient must not depend on the state", term=source)
        _aw, ow = self.linear_map(w)
        au, ou = self.linear_map(u)
        self._linear(coef * (au.T @ ow), source)
        if _is_num(ow) and _is_num(ou):
            self.constant += coef * float(ow @ ou)

    def add(self, expr: Any, constraints: list[Any] | None = None, source: str = "") -> None:
        """Add a DCP expression (convex) and constraints."""
        if expr is not None and not (isinstance(expr, (int, float)) and expr == 0):
            e = cp.Expression.cast_to_const(expr) if not isinstance(expr, cp.Expression) else expr
            if not e.is_convex():
                raise NotDCPError(f"exported expression {e} is not DCP convex", term=source)
            self.exprs.append((e, source))
        self.constraints.extend(constraints or [])

    # ------------------------------------------------------------- assemble
    def build(self) -> ExportedProblem:
        """Assemble the problem; the quadratic form must be PSD (checked numerically)."""
        n = self.n_free
        q = np.zeros((n, n))
        for qi, _ in self.quad:
            q = q + qi
        q = 0.5 * (q + q.T)
        obj: Any = 0
        eigmin = 0.0
        if self.quad:
            w, v = np.linalg.eigh(q)
            scale = max(1.0, float(np.max(np.abs(w))))
            eigmin = float(w.min())
            if eigmin < -1e-9 * scale:
                neg = sorted({s for qi, s in self.quad if np.linalg.eigvalsh(qi).min() < -1e-12})
                raise NotDCPError(
                    f"the collected quadratic form ½fᵀQf is not PSD (λ_min(Q) = {eigmin:.4g}); "
                    f"negative contributions from: {', '.join(neg)}",
                    term="quadratic part",
                    hint="if the objective is convex only through curvature DCP cannot see "
                    "(tanh/sigmoid potentials, ||W||₂ > 1 makes it non-convex), verify it with the "
                    "certified-convex numeric reference (verify.check) instead of CVXPY",
                )
            # one PSD form (rounding-level negative eigenvalues clipped); passed to the solver
            # as a quadratic objective, much faster than an explicit factor for large n
            qpsd = (v * np.clip(w, 0.0, None)) @ v.T
            obj = obj + 0.5 * cp.quad_form(self.f, cp.psd_wrap(0.5 * (qpsd + qpsd.T)))
        for c, _ in self.linear:
            obj = obj + c @ self.f
        for e, _ in self.exprs:
            obj = obj + e
        prob = cp.Problem(cp.Minimize(obj), self.constraints)
        if not prob.is_dcp():
            raise NotDCPError("assembled problem is not DCP", term="to_cvxpy")
        shapes = {s.name: s.shape for s in self.states if s.name not in self.aux_names}
        maps = {k: v for k, v in self.state_maps.items() if k not in self.aux_names}
        return ExportedProblem(
            problem=prob, variable=self.f, state_maps=maps,
            state_shapes=shapes, constant=self.constant, parameters=self.params,
            quadratic_eigmin=eigmin, notes=self.notes, blocks=dict(self._blocks),
        )


def _is_num(x: Any) -> bool:
    return isinstance(x, (np.ndarray, float, int, np.floating))
