"""Sizes and budgets of the commands that train: ``demo`` (:class:`DemoConfig`), ``train-table``
(:class:`TableConfig`) and ``reproduce`` (:class:`Budget`, which reads the table's config).

Plain dataclasses importing only the standard library, so that ``convex-eq ... --help`` shows
their defaults without loading torch; what needs torch is imported inside the methods.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

#: weights kept at spectral norm ≤ bound while the demo trains (convexity / contraction
#: certificates of the Gaussian-kernel model)
#: the demo's GEQ: the multi-branch model of the GEQ paper (docs/theory.md §3.2)
DEMO_GEQ = "GEQ (multi-branch, paper's γ)"
#: its branches' input scales (strides of U_i), patch length and channel split
DEMO_GEQ_SCALES = (1, 2, 4, 4)


@dataclass
class DemoConfig:
    """Sizes and budgets of ``convex-eq demo`` (``quick`` shrinks them for the smoke run)."""

    channels: int = 12
    kernel: int = 5
    epochs: int = 8
    batch: int = 64
    lr: float = 1e-2
    tol: float = 1e-4
    max_iter: int = 40
    l1: float = 0.01
    alpha: float = 0.5
    verify_inputs: int = 1
    pool: str = "max"
    pooled: int = 8
    quick: bool = False
    seed: int = 0
    #: processes training the models in parallel (each single-threaded); 1 = in this process
    workers: int = 2
    #: ``cpu``, ``cuda`` or ``auto`` (CUDA when present)
    device: str = "cpu"
    #: training samples used (0 = all 4000; the quick run uses a subset)
    train_subset: int = 0

    @classmethod
    def quick_config(cls) -> DemoConfig:
        """The smoke run: 4 channels, kernel 3, one epoch on 512 training signals."""
        return cls(channels=4, kernel=3, epochs=1, verify_inputs=1, quick=True,
                   train_subset=512)

    def settings(self, name: str) -> Any:
        """The module options model ``name`` trains under
        (:class:`~lowering.runtime.classifier.TrainingSettings`): Anderson forward, the adjoint
        by the module's ``auto`` choice (conjugate gradients where the adjoint system is
        symmetric, as the conv OptEq's; docs/theory.md §8)."""
        from lowering.runtime.classifier import TrainingSettings

        if name == DEMO_GEQ:  # the paper trains GEQ with weight normalisation, phantom gradients
            wn = tuple(f"W{i + 1}" for i in range(len(DEMO_GEQ_SCALES)))
            return TrainingSettings(tol=self.tol, max_iter=self.max_iter, backward="phantom",
                                    weight_normalization=wn)
        return TrainingSettings(tol=self.tol, max_iter=self.max_iter, backward_solver="auto")

    @property
    def geq_channels(self) -> int:
        """Channels of each GEQ branch: 8 (the paper's channel split c_s), fewer in the smoke
        run's small models."""
        return min(8, self.channels)

    def train_config(self) -> Any:
        """The loop's :class:`~convex_eq_app.training.TrainConfig`."""
        from .training import TrainConfig

        return TrainConfig(epochs=self.epochs, batch=self.batch, lr=self.lr, seed=self.seed,
                           device=self.device)


@dataclass
class TableConfig:
    """Architecture and budget of ``convex-eq train-table`` (``quick``: the smoke run)."""

    channels: int = 32
    kernel: int = 5
    pooled: int = 8
    epochs: int = 30
    batch: int = 64
    lr: float = 5e-3
    weight_decay: float = 0.0
    shift: int = 2
    tol: float = 1e-4
    max_iter: int = 30
    alpha: float = 0.5
    #: MOptEq: PE's ε (the paper's 0.1), λ of D (≈ 1/(3C): the paper's 0.01 at C = 32), the
    #: Huber width of the smoothed D, and ζ, the bound on every ||W_i||₂ of MOptEq and POptEq
    pe_eps: float = 0.1
    lam: float = 0.02
    width: float = 1.0
    zeta: float = 0.9
    #: channels of the stem Conv1d(1, C, 3) + ReLU that computes g(x) for the multi-branch models
    stem: int = 16
    #: the fixed bandwidth of the GEQ row without the paper's rule (KerDEQ's best on CIFAR)
    gamma: float = 0.5
    #: held-out signals: the 12 000 drawn apart by the generator ("mnist1d-large-test") or the
    #: package's 1000 ("mnist1d")
    dataset: str = "mnist1d-large-test"
    seeds: tuple[int, ...] = (0, 1, 2)
    #: held-out accuracy measured every ``eval_every`` epochs and after the last (on the
    #: 12 000 test signals an evaluation costs about as much as a training epoch)
    eval_every: int = 5
    models: tuple[str, ...] = ()
    val: bool = False
    device: str = "cpu"
    workers: int = 2
    quick: bool = False
    verify_inputs: int = 1
    train_subset: int = 0  # 0 = all (the quick mode trains on a subset)
    #: the equilibrium rows' iteration levers (TrainConfig's; the CNN and MLP have no solve):
    #: warm starts, Jacobian regularisation's γ, the (start, end) tolerance schedule
    warm_start: bool = False
    jacobian_reg: float = 0.0
    tol_schedule: tuple[float, float] | None = None
    #: the backward of the rows that train with the implicit gradient by default (the convex
    #: rows; GEQ trains with phantom gradients, as its paper) and their adjoint solver (None:
    #: the forward's, Anderson)
    backward: str = "implicit"
    backward_solver: str | None = None
    #: the forward Anderson solve's memory (None: the solver's default, 5)
    anderson_m: int | None = None

    @classmethod
    def quick_config(cls) -> TableConfig:
        """The smoke run: 4 channels, kernel 3, one epoch on 256 signals."""
        return cls(channels=4, kernel=3, pooled=4, epochs=1, seeds=(0,), quick=True,
                   train_subset=256, max_iter=20, stem=2, dataset="mnist1d")


#: TableConfig fields that do not change what a run trains (``eval_every``: how often the
#: held-out accuracy is logged during training, a field of later table configs)
NOT_TRAINING = frozenset({"seeds", "models", "workers", "device", "quick", "verify_inputs",
                          "eval_every"})


#: training fields added to TableConfig after tables were recorded, each with the value that
#: is the training of a record without it (the levers off, the solver's own Anderson memory)
LATER_FIELDS: dict[str, Any] = {"warm_start": False, "jacobian_reg": 0.0, "tol_schedule": None,
                                "backward": "implicit", "backward_solver": None,
                                "anderson_m": None}


def training_identity(cfg: TableConfig | dict[str, Any]) -> dict[str, Any]:
    """The fields of a table config that decide what is trained, JSON-normalised (tuples as
    lists), so that a config and one read back from ``results.json`` compare equal; a record
    without a field of :data:`LATER_FIELDS` reads as that field's earlier training."""
    d = asdict(cfg) if isinstance(cfg, TableConfig) else {**LATER_FIELDS, **dict(cfg)}
    return json.loads(json.dumps({k: v for k, v in sorted(d.items()) if k not in NOT_TRAINING}))


#: epochs of every model in the full reproduction (docs/reproduce.md, "Budget")
REPRODUCE_EPOCHS = 10


@dataclass(frozen=True)
class Budget:
    """One ``convex-eq reproduce`` run: ``seeds`` (every claim compares models over them),
    ``epochs`` (every model's), the ``device`` and the training ``workers``; everything else
    about a model and its training is the MNIST-1D table's :class:`TableConfig`
    (:meth:`table_config`), so that a model name means the same model in ``train-table`` and
    ``reproduce``.  ``quick``: the smoke run (the table's quick config)."""

    quick: bool
    seeds: tuple[int, ...]
    epochs: int
    device: str = "cpu"
    workers: int = 1

    @classmethod
    def full(cls, device: str = "cpu", workers: int = 1) -> Budget:
        """The full run: seeds 0, 1, 2 and ``REPRODUCE_EPOCHS`` epochs of the table's models on
        the 4000 training signals, tested on the 12 000 held-out ones."""
        return cls(quick=False, seeds=(0, 1, 2), epochs=REPRODUCE_EPOCHS, device=device,
                   workers=workers)

    @classmethod
    def quick_budget(cls, device: str = "cpu", workers: int = 1) -> Budget:
        """The smoke run: one seed, one epoch, the table's quick config (tiny models, 256
        signals).  Its verdicts exercise the code, they are not evidence."""
        return cls(quick=True, seeds=(0,), epochs=1, device=device, workers=workers)

    def table_config(self) -> TableConfig:
        """The :class:`TableConfig` every run starts from: the table's (or its quick config)
        with this budget's epochs, seeds, device and workers."""
        base = TableConfig.quick_config() if self.quick else TableConfig()
        return replace(base, epochs=self.epochs, seeds=tuple(self.seeds), device=self.device,
                       workers=self.workers)
