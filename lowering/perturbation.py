"""Worst-case input perturbations derived from the objective (docs/theory.md §7, MOptEq Proposition
2), and the perturbation-enhanced (PE) layer of MOptEq's Algorithm 2.

When ``G(z; x)`` is affine in the injected input, ``argmax_{||δ||∞ ≤ ε} G(z; x - δ) =
-ε·sign(∇_x G(z; x))``; for the linear kernel ``-<Ux + b, z>`` this is ``δ = ε·sign(Uᵀz)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from convex_eq._lazy import torch
from convex_eq.errors import LoweringError, ScaleError
from convex_eq.objective import Objective
from convex_eq.symbols import Env
from convex_eq.terms.base import Term
from convex_eq.terms.quadratic import Linear

from .derived import DerivedLayer, register_edit
from .nodes import Node, Substitute, Z_t
from .trace import Claim, ClaimKind, Contraction, Step


@dataclass
class Perturbation:
    """``δ(z, x) = -ε·sign(∇_x G(z; x))`` with its derivation; ``exact`` iff G is affine in x."""

    #: the objective the perturbation is derived from
    objective: Objective
    #: the size ``ε`` of the perturbation (``||δ||∞ ≤ ε``)
    eps: float
    #: the terms of ``G`` that read an input (their input gradients give ``δ``)
    terms: list[Term]
    #: True if ``G`` is affine in ``x``: then ``δ`` is the exact worst case, otherwise first-order
    exact: bool
    #: ``δ`` as text (``ε·sign(…)``, one ``δ_name = …`` per input when there are several)
    formula: str

    def delta(self, values: dict[str, torch.Tensor], env: Env | None = None
              ) -> dict[str, torch.Tensor]:
        """Per-input perturbation for flat batched ``values`` (states and inputs)."""
        out: dict[str, torch.Tensor] = {}
        for t in self.terms:
            for k, g in t.grad(values, env, wrt="input").items():
                out[k] = out[k] + g if k in out else g
        return {k: -self.eps * torch.sign(g) for k, g in out.items()}

    def __str__(self) -> str:
        kind = "exact (G affine in x)" if self.exact else "first-order (G not affine in x)"
        lhs = "" if self.formula.startswith("δ_") else "δ = "
        return f"{lhs}{self.formula}, ||δ||∞ ≤ {self.eps:g} — {kind}"


def _formula(terms: list[Term], eps: float) -> str:
    """``ε·sign(…)`` per input (one ``δ_name = …`` each when the objective has several)."""
    parts: dict[str, list[str]] = {}
    for t in terms:
        if isinstance(t, Linear):
            w, u = t.args
            for e in w.entries:
                if e.symbol.kind != "input":
                    continue
                sign = -t.scale * e.coef  # δ = -ε sign(∇_x G); ∇_x <c·A x, u> = c Aᵀu
                op = f"{e.op}ᵀ" if e.op is not None else ""
                pre = "" if sign > 0 else "-"
                parts.setdefault(e.symbol.name, []).append(f"{pre}{op}({u})")
        else:
            for a in t.args:
                for sym in a.symbols("input"):
                    parts.setdefault(sym.name, []).append(f"-∇_{sym.name}[{t}]")
    texts = {k: f"{eps:g}·sign({' + '.join(v)})" for k, v in parts.items()}
    if len(texts) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"δ_{k} = {v}" for k, v in texts.items())


def perturbation(objective: Any, eps: float) -> Perturbation:
    """Derive the worst-case ℓ∞ input perturbation of size ``eps`` from ``objective``."""
    if eps < 0:
        raise ScaleError(f"ε = {eps} must be ≥ 0", term="perturbation")
    if not isinstance(objective, Objective):
        raise LoweringError("perturbation needs an Objective", term="perturbation")
    terms = [t for t in objective.terms
             if any(s.kind == "input" for a in t.args for s in a.symbols())]
    if not terms:
        raise LoweringError("the objective does not depend on an input", term="perturbation")
    exact = all(isinstance(t, Linear) and not t.args[1].symbols("input") for t in terms)
    return Perturbation(objective, float(eps), terms, exact, _formula(terms, eps))


class Memo(Node):
    """``node`` evaluated once per state dict: Algorithm 2 reads branch ``i−1``'s new output in
    branch ``i``, so the branches' updates share it (the dict of one ``T`` evaluation is the key;
    it is held, so its identity cannot be reused while the entry lives)."""

    def __init__(self, node: Node):
        self.node = node
        self._last: tuple[Any, Any, torch.Tensor] | None = None

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        last = self._last
        if last is not None and last[0] is Z and last[1] is env:
            return last[2]
        out = self.node.eval(Z, env)
        self._last = (Z, env, out)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"node": self.node, "_last": None}

    def lip(self, env: Env | None) -> float:
        return self.node.lip(env)

    def text(self) -> str:
        return self.node.text()

    def latex(self) -> str:
        return self.node.latex()


class PerturbedInput(Node):
    """``x − δ``, ``δ = ε·sign(U_{i−1}ᵀ y_{i−1})`` from branch ``i−1``'s output ``y_{i−1}`` of the
    same evaluation (MOptEq Algorithm 2); ``sign`` is piecewise constant (zero gradient a.e.)."""

    def __init__(self, name: str, source: str, pert: Perturbation, block: str, new: Node):
        self.name, self.source, self.pert, self.block, self.new = name, source, pert, block, new

    def eval(self, Z: Z_t, env: Env | None) -> torch.Tensor:
        vals = dict(Z)
        vals[self.block] = self.new.eval(Z, env)
        vals[self.source] = Z[self.source]
        return Z[self.name] - self.pert.delta(vals, env)[self.source]

    def lip(self, env: Env | None) -> float:
        return float("inf")

    def text(self) -> str:
        return f"{self.name} − {self.pert.formula.replace(f'({self.block})', f'({self.block}⁺)')}"

    def latex(self) -> str:
        return f"{self.name} - \\delta({self.block}^+)"


@dataclass(frozen=True)
class PEPayload:
    """What :func:`perturbation_enhanced` built: the layer it wraps, ``ε``, the branch inputs in
    order and, per branch after the first, the perturbation of the previous branch's input."""

    base: DerivedLayer
    eps: float
    branches: tuple[str, ...]
    blocks: tuple[str, ...]
    perturbations: tuple[Perturbation, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base, "eps": self.eps, "branches": self.branches}

    def frozen_inputs(self, states: Mapping[str, torch.Tensor],
                      inputs: Mapping[str, torch.Tensor], env: Env | None = None
                      ) -> dict[str, torch.Tensor]:
        """The inputs at which the claim holds: ``x_1``, and ``x_i − δ_{i−1}(y*_{i−1})`` with
        the perturbations frozen at the (flat, batched) ``states``."""
        out = dict(inputs)
        for i in range(1, len(self.branches)):
            prev, name = self.branches[i - 1], self.branches[i]
            vals = {**inputs, **states}
            out[name] = inputs[name] - self.perturbations[i - 1].delta(vals, env)[prev]
        return out

    def sign_inputs(self, states: Mapping[str, torch.Tensor],
                    inputs: Mapping[str, torch.Tensor], env: Env | None = None) -> torch.Tensor:
        """The entries the signs read, ``∇_{x_i}G_i`` of every branch but the last, flat
        ``(B, ·)`` (an entry 0: every ``δ`` entry there maximizes the lower level; a small one:
        the fixed point is near a jump of ``T``)."""
        parts = []
        for i in range(len(self.branches) - 1):
            vals = {**inputs, **states}
            g = None
            for t in self.perturbations[i].terms:
                gi = t.grad(vals, env, wrt="input").get(self.branches[i])
                if gi is not None:
                    g = gi if g is None else g + gi
            parts.append(g)
        return torch.cat(parts, dim=-1)


def _branch_perturbations(obj: Objective, blocks: list[str], eps: float
                          ) -> tuple[list[str], list[Perturbation]]:
    """One input per branch, in block order, each read by its own branch's terms only."""
    names = [s.name for s in obj.inputs]
    if len(names) != len(blocks):
        raise LoweringError(
            f"PE needs one input per branch: the layer has blocks {blocks} and inputs {names}",
            term="perturbation_enhanced",
            hint="build the model with one input per branch (e.g. conv_mopteq(branch_inputs="
                 "True)); the classifier feeds the same g(x) to each")
    shapes = {tuple(s.shape) for s in obj.inputs}
    if len(shapes) != 1:
        raise LoweringError(f"the branch inputs have different shapes {sorted(shapes)}: PE "
                            "perturbs one shared feature g(x)", term="perturbation_enhanced")
    order, perts = [], []
    for b in blocks:
        mine = [t for t in obj.terms if any(s.name == b for s in t.states())
                and any(s.kind == "input" for a in t.args for s in a.symbols())]
        ins = sorted({s.name for t in mine for a in t.args for s in a.symbols("input")})
        if len(ins) != 1 or any(len(t.states()) != 1 for t in mine):
            raise LoweringError(f"branch {b} must read exactly one input through terms of its "
                                f"own state only (it reads {ins})", term="perturbation_enhanced")
        order.append(ins[0])
        pert = perturbation(Objective(mine, name=f"G_{b}"), eps)
        if not pert.exact:
            raise LoweringError(f"branch {b}'s injection is not affine in its input: the "
                                "worst case ε·sign(·) is not exact there",
                                term="perturbation_enhanced",
                                hint="use a linear injection −<U x + b, y>")
        perts.append(pert)
    if len(set(order)) != len(order):
        raise LoweringError(f"two branches read the same input ({order}): PE perturbs each "
                            "branch's own copy of g(x)", term="perturbation_enhanced",
                            hint="build the model with one input per branch")
    return order, perts


@register_edit("perturbation_enhanced")
def perturbation_enhanced(derived: DerivedLayer, eps: float) -> DerivedLayer:
    """MOptEq's PE layer (Algorithm 2, docs/theory.md §7): branch ``i`` reads ``x_i − δ_{i−1}``,
    ``δ_{i−1} = ε·sign(U_{i−1}ᵀ y_{i−1})`` recomputed in every evaluation of ``T`` from branch
    ``i−1``'s new output (``δ_0 = 0``).  ``derived``: a multi-branch layer with one input per
    branch (the same ``g(x)`` is fed to each).  Its fixed points are stationary points of ``G``
    at the inputs ``x_i − δ*_{i−1}`` with ``δ*`` frozen at the fixed point, wherever no entry of
    ``U_{i−1}ᵀ y*_{i−1}`` is 0 (``δ`` is locally constant there); ``T`` jumps where one is, and
    no fixed point is guaranteed."""
    if not (eps >= 0 and eps < float("inf")):
        raise ScaleError(f"ε = {eps} must be a finite number ≥ 0", term="perturbation_enhanced")
    if derived.outputs is not None or not isinstance(derived.source, Objective):
        raise LoweringError("PE applies to a layer derived from an Objective whose state is its "
                            "output", term="perturbation_enhanced")
    blocks = [b.name for b in derived.blocks]
    branches, perts = _branch_perturbations(derived.source, blocks, float(eps))
    nodes: dict[str, Node] = {}
    for i, b in enumerate(blocks):
        node = derived.nodes[b]
        if i:
            prev = blocks[i - 1]
            node = Substitute(node, _input_symbol(derived, branches[i]),
                              PerturbedInput(branches[i], branches[i - 1], perts[i - 1], prev,
                                             nodes[prev]))
        nodes[b] = Memo(node)
    formula = "; ".join(f"δ_{blocks[i]} = {perts[i].formula}" for i in range(len(blocks) - 1))
    step = Step(
        "perturbation-enhanced branches (MOptEq Algorithm 2)",
        f"branch i reads x_i − δ_(i−1), δ_(i−1) = argmax_(||δ||∞ ≤ {eps:g}) G_(i−1)(y; x − δ) "
        "at branch i−1's new output y_(i−1) (exact: G is affine in x), δ_0 = 0",
        ("T(y; x_1, …, x_L)",), ("T(y; x_1, x_2 − δ_1(y), …, x_L − δ_(L−1)(y))",),
        note=f"{formula} (y⁺: the branch's output in the same evaluation); sign(·) is "
             "piecewise constant: T jumps where an entry of "
             "U_(i−1)ᵀy_(i−1) crosses 0, and no fixed point is guaranteed",
    )
    claim = Claim(
        ClaimKind.STATIONARY,
        f"stationary point of G = {derived.source} at the inputs x_i − δ*_(i−1), δ* = δ(y*) "
        "frozen at the fixed point: the upper level of the paper's bilevel problem at a "
        "solution of its lower level (δ* maximizes it; where an entry that a sign reads is 0, "
        "every value of that δ entry does)",
        "\\text{stationary point of } G(\\cdot; x - \\delta^*)",
        objective_text=str(derived.source))
    contraction = Contraction("∞ (δ = ε·sign(·) is discontinuous)", "\\infty",
                              lambda env: float("inf"))
    payload = PEPayload(derived, float(eps), tuple(branches), tuple(blocks), tuple(perts[:-1]))
    return replace(derived, nodes=nodes, derivation=derived.derivation.then(step), claim=claim,
                   contraction=contraction, payload=payload, certificate=None,
                   claim_inputs=payload.frozen_inputs,
                   edits=(*derived.edits, ("perturbation_enhanced", {"eps": float(eps)})))


def _input_symbol(derived: DerivedLayer, name: str) -> Any:
    return next(s for s in derived.inputs if s.name == name)
