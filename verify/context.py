"""What one ``verify.check`` call knows and records, handed to the reference that runs
(docs/theory.md §9): the layer, its inputs and weights, the tight equilibrium, the tolerances;
the per-sample results, rules, failures, notes and the reference's provenance it fills."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convex_eq.objective import Objective
from lowering import DerivedLayer, EquilibriumModule

from .report import EquilibriumInfo, ReferenceInfo, SampleResult, Tolerances


@dataclass
class CheckContext:
    """One check: what it was given (``derived`` … ``requested``), the tight equilibrium
    (``eq``, ``states``: block name → ``(B, size)`` float64) and what the reference records."""

    derived: DerivedLayer
    module: EquilibriumModule | None
    inputs: dict[str, torch.Tensor]
    env: dict[str, torch.Tensor]
    tols: Tolerances
    opts: dict[str, Any]
    starts: int
    rng: np.random.Generator
    requested: str
    eq: EquilibriumInfo | None = None
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    compare_names: list[str] = field(default_factory=list)
    samples: list[SampleResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rules: dict[str, bool] = field(default_factory=dict)
    ref: ReferenceInfo = field(default_factory=lambda: ReferenceInfo("none", "no reference"))
    label: str = ""
    z_ref: np.ndarray | None = None

    @property
    def bsz(self) -> int:
        """The batch size (1 for an input-free layer)."""
        return next(iter(self.inputs.values())).shape[0] if self.inputs else 1

    def sample_inputs_np(self, b: int) -> dict[str, np.ndarray]:
        """Sample ``b``'s inputs as flat float64 arrays (what an export takes)."""
        return {k: v[b].numpy() for k, v in self.inputs.items()}

    def sample_inputs_t(self, b: int) -> dict[str, torch.Tensor]:
        """Sample ``b``'s inputs as ``(1, size)`` tensors (what a lifted problem takes)."""
        return {k: v[b:b + 1] for k, v in self.inputs.items()}

    def layer_state(self, b: int) -> dict[str, np.ndarray]:
        """Sample ``b``'s equilibrium, block name → flat array."""
        return {k: v[b].numpy() for k, v in self.states.items()}

    def layer_flat(self, b: int) -> np.ndarray:
        """Sample ``b``'s equilibrium over the compared blocks, one flat vector."""
        return flat(self.layer_state(b), self.compare_names)

    def env_for(self, obj: Any) -> dict[str, torch.Tensor]:
        """The weights, constants and scalars that ``obj`` names (what its export takes)."""
        names = {s.name for s in obj.symbols if s.kind in ("weight", "constant", "scalar")}
        return {k: v for k, v in self.env.items() if k in names}

    def rule(self, name: str, ok: bool, message: str) -> None:
        """Record pass/fail rule ``name`` (a rule failed once stays failed) and its failure."""
        self.rules[name] = self.rules.get(name, True) and ok
        if not ok:
            self.failures.append(message)

    def compare(self, b: int, reference: np.ndarray) -> None:
        """Sample ``b``'s relative and absolute state error against ``reference``."""
        s = self.samples[b]
        s.rel_error, s.abs_error = rel_err(self.layer_flat(b), reference, self.tols.scale_floor)


def flat(z: Mapping[str, np.ndarray], names: list[str]) -> np.ndarray:
    """The blocks ``names`` of ``z`` concatenated into one float64 vector."""
    return np.concatenate([np.asarray(z[k], dtype=np.float64).reshape(-1) for k in names])


def rel_err(a: np.ndarray, ref: np.ndarray, floor: float) -> tuple[float, float]:
    """``(||a − ref|| / max(||ref||, floor), ||a − ref||)``."""
    with np.errstate(all="ignore"):
        d = float(np.linalg.norm(a - ref))
        return d / max(float(np.linalg.norm(ref)), floor), d


def batch_coupled(obj: Objective) -> bool:
    """True if a term couples the samples of a batch (e.g. batch decorrelation, HSIC)."""
    pc = getattr(obj, "precomposition", None)
    terms = (pc.inner if pc is not None else obj).terms
    return any(getattr(t, "batch_coupled", False) for t in terms)
