"""A derived equilibrium layer: ``T`` as an expression, its derivation, claim and contraction."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from convex_eq._lazy import torch
from convex_eq.affine import values_from
from convex_eq.errors import OptionError, ShapeError
from convex_eq.symbols import Env, Symbol, as_tensor

from .nodes import Node, broadcast_batch
from .trace import Claim, Contraction, Derivation

#: ``torch_module(backend=…)``: backend name → ``emit(derived, **options) -> nn.Module``, filled
#: by the runtime (:mod:`lowering.runtime`), which sits above the deriving side
EMITTERS: dict[str, Callable[..., torch.nn.Module]] = {}


def register_emitter(backend: str) -> Callable[[Callable[..., torch.nn.Module]],
                                               Callable[..., torch.nn.Module]]:
    """Decorator entering ``emit(derived, **options)`` as the emitter of ``backend``."""

    def deco(emit: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        EMITTERS[backend] = emit
        return emit

    return deco


#: callables that import the modules registering emitters; ``torch_module`` runs them when the
#: backend asked for is not registered yet (``import lowering`` enters one that imports the
#: runtime, so deriving a layer loads no torch and emitting one loads the runtime)
EMITTER_LOADERS: list[Callable[[], object]] = []


_LOADING = threading.Lock()


def _emitter(backend: str) -> Callable[..., torch.nn.Module] | None:
    if backend not in EMITTERS and EMITTER_LOADERS:
        with _LOADING:  # (threads emitting their first modules at once load the runtime once)
            for load in list(EMITTER_LOADERS):
                if backend in EMITTERS:
                    break
                load()  # a failing import raises here and stays entered, to raise again
                EMITTER_LOADERS.remove(load)
    return EMITTERS.get(backend)


#: edits of a derived layer, ``name → edit(derived, **options) -> DerivedLayer`` (e.g. MOptEq's
#: perturbation-enhanced branches); a layer records the edits applied to it in ``edits``, so it
#: can be derived again from its objective (``lowering.lower.derive_again``, on unpickle)
EDITS: dict[str, Callable[..., DerivedLayer]] = {}


def register_edit(name: str) -> Callable[[Callable[..., DerivedLayer]],
                                         Callable[..., DerivedLayer]]:
    """Decorator entering ``edit(derived, **options)`` as the edit ``name``."""

    def deco(edit: Callable[..., DerivedLayer]) -> Callable[..., DerivedLayer]:
        EDITS[name] = edit
        return edit

    return deco


@dataclass
class DerivedLayer:
    """``z = T(z, x)`` derived from a hidden objective.

    ``nodes[b]`` is the update of block ``b`` (all blocks are updated from the same old state).
    ``is_prox`` says whether ``T`` is exactly ``prox_φ`` of the lowered objective (needed by
    edits such as the Moreau skip rule to keep their exact claims); ``payload`` holds the
    rule's typed facts (``info`` is the same as a dict)."""

    #: the lowered objective (an ``Objective`` or a ``DeepComposition``; after an edit, the
    #: edited one)
    source: Any
    #: the state blocks ``z`` the layer solves for, in the order of the stacked state
    blocks: list[Symbol]
    #: the update of each block, by block name (the expression tree of ``T``)
    nodes: dict[str, Node]
    #: the rules applied, step by step (prints with ``describe()`` or ``latex()``)
    derivation: Derivation
    #: what the equilibrium is: a minimizer, a minimizer of a modified objective, or a
    #: stationary point (docs/theory.md §9)
    claim: Claim
    #: the estimate of ``Lip(T)`` and its formula
    contraction: Contraction
    #: True if ``T`` is exactly ``prox_φ`` of the lowered objective
    is_prox: bool = False
    #: the convexity certificate of the objective the claim is about (None for deep
    #: compositions, whose per-layer conditions are in ``info["conditions"]``)
    certificate: Any = None
    #: the regularizer terms an edit ``φ + γR`` added (empty without an edit)
    regularizers: list[Any] = field(default_factory=list)
    #: the rule's typed facts (``info`` gives them as a dict)
    payload: Any = None
    #: the keyword options ``lower`` was called with (re-deriving the layer, e.g. on unpickle)
    lower_options: dict[str, Any] = field(default_factory=dict)
    #: the layer's outputs as nodes of the solved state (None: the state blocks themselves),
    #: e.g. ``z = prox_{αg}(u)`` of a Peaceman–Rachford layer whose state is ``u``
    outputs: list[tuple[Symbol, Node]] | None = None
    #: the edits applied after ``lower``, in order: ``(name, options)`` of :data:`EDITS`
    edits: tuple[tuple[str, dict[str, Any]], ...] = ()
    #: ``(states, inputs, env) ↦ inputs`` at which the claim holds, when they differ from the
    #: layer's own (flat batched tensors; None: the claim is about the layer's inputs)
    claim_inputs: Callable[..., dict[str, torch.Tensor]] | None = None

    @property
    def output_blocks(self) -> list[Symbol]:
        """The blocks the layer returns (the state blocks unless ``outputs`` maps them)."""
        return self.blocks if self.outputs is None else [b for b, _ in self.outputs]

    def output(self, z: torch.Tensor, inputs: Mapping[str, torch.Tensor], env: Env | None
               ) -> torch.Tensor:
        """The stacked outputs ``(B, ·)`` at the flat stacked solved state ``z`` (``z`` itself
        without an output map)."""
        if self.outputs is None:
            return z
        Z = dict(inputs)
        Z.update(self.split(z))
        return torch.cat([broadcast_batch(n.eval(Z, env), z.shape[0]) for _, n in self.outputs],
                         dim=-1)

    @property
    def info(self) -> dict[str, Any]:
        """The rule's payload as a dict (``{}`` without one)."""
        return {} if self.payload is None else self.payload.as_dict()

    # ------------------------------------------------------------------ symbols
    @property
    def symbols(self) -> list[Symbol]:
        """Every symbol of the lowered objective."""
        src = self.source
        syms = src.symbols if hasattr(src, "symbols") else []
        return list(syms)

    @property
    def inputs(self) -> list[Symbol]:
        """The layer's inputs ``x``."""
        return [s for s in self.symbols if s.kind == "input"]

    @property
    def parameters(self) -> list[Symbol]:
        """Weights, constants and scalars the layer depends on."""
        return [s for s in self.symbols if s.kind in ("weight", "constant", "scalar")]

    @property
    def state_size(self) -> int:
        """``N``: the number of entries of the stacked state (all blocks)."""
        return sum(b.size for b in self.blocks)

    # ------------------------------------------------------------------ evaluation
    def apply(self, Z: Mapping[str, torch.Tensor], env: Env | None = None
              ) -> dict[str, torch.Tensor]:
        """One application of ``T`` to flat batched block values (inputs also in ``Z``); a
        block update that does not depend on the batch (e.g. ``z ← −c``) is broadcast to it."""
        batch = max((v.shape[0] for v in Z.values() if v.ndim == 2), default=1)
        return {b.name: broadcast_batch(self.nodes[b.name].eval(Z, env), batch)
                for b in self.blocks}

    def split(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat stacked state ``(B, N)`` → per-block dict."""
        out, o = {}, 0
        for b in self.blocks:
            out[b.name] = z[:, o:o + b.size]
            o += b.size
        return out

    def stack(self, Z: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Per-block flat values ``(B, n_b)`` → the stacked state ``(B, N)`` (inverse of
        ``split``)."""
        return torch.cat([Z[b.name] for b in self.blocks], dim=-1)

    def T(self, **kwargs: Any) -> Any:
        """User-facing ``T(z, x)``: pass blocks and inputs by name (numpy or torch)."""
        known = {s.name: s for s in [*self.blocks, *self.symbols]}
        for k in kwargs:
            if k not in known:
                raise ShapeError(f"unknown name '{k}'", term="T",
                                 hint=f"known: {', '.join(sorted(known))}")
        vals = values_from([*self.blocks, *self.inputs], kwargs)
        sizes = {k: v.shape[0] for k, v in vals.items()}
        if len(set(sizes.values())) > 1:
            if len(set(sizes.values()) - {1}) == 1:
                b = max(sizes.values())  # broadcast single samples (as Objective.value does)
                vals = {k: v.expand(b, -1) if v.shape[0] == 1 else v for k, v in vals.items()}
            else:
                raise ShapeError(f"batch sizes differ: {sizes}", term="T",
                                 hint="give every block and input the same batch size")
        env = {k: as_tensor(v) for k, v in kwargs.items()
               if known[k].kind in ("weight", "constant", "scalar")}
        out = self.apply(vals, env)
        torch_in = any(isinstance(kwargs[b.name], torch.Tensor) for b in self.blocks)
        res = {k: (v if torch_in else v.detach().cpu().numpy()) for k, v in out.items()}
        return res[self.blocks[0].name] if len(self.blocks) == 1 else res

    # ------------------------------------------------------------------ printing
    def formula(self, latex: bool = False) -> str:
        """The layer ``z ← T(z, x)``, one block per line (or LaTeX)."""
        parts = []
        for b in self.blocks:
            n = self.nodes[b.name]
            parts.append(f"{b.latex()} = {n.latex()}" if latex else f"{b.name} ← {n.text()}")
        for b, n in self.outputs or []:
            parts.append(f"\\text{{output }} {b.latex()} = {n.latex()}" if latex
                         else f"output {b.name} = {n.text()}")
        return (",\\\\ ".join(parts)) if latex else "\n".join(parts)

    def describe(self, env: Env | None = None) -> str:
        """Derivation, layer, claim, certificate and contraction as plain text."""
        lines = [f"objective: {self.source}", "derivation:", self.derivation.text(),
                 "layer:", *("  " + ln for ln in self.formula().splitlines()),
                 f"claim: {self.claim}"]
        if self.certificate is not None:
            lines.append(f"certificate: {self.certificate.long_text()}")
        lines.append(f"contraction: {self.contraction.describe(env)}")
        return "\n".join(lines)

    def latex(self) -> str:
        """The derivation and the layer in LaTeX."""
        return (f"{self.derivation.latex()}\n\\[\n{self.formula(latex=True)}\n\\]\n"
                f"\\text{{claim: {self.claim.kind}}}\\; {self.claim.latex}")

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ emission
    def torch_module(self, **options: Any) -> torch.nn.Module:
        """Emit a trainable ``nn.Module``: ``backend="fixed_point"`` (default, an
        :class:`~lowering.runtime.module.EquilibriumModule`; options: the fields of
        :class:`~lowering.runtime.config.ModuleConfig`) or ``"cvxpylayers"`` (an exact conic
        solve); docs/guide.md, the emitted module."""
        backend = options.pop("backend", "fixed_point")
        emit = _emitter(backend)
        if emit is None:
            raise OptionError(f"unknown backend {backend!r}", term="torch_module",
                              hint=f"use one of {sorted(EMITTERS)}")
        return emit(self, **options)
