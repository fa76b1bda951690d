"""The models the claims train: the MNIST-1D table's models (:mod:`convex_eq_app.table`, built by
its own builders from a :class:`~convex_eq_app.configs.TableConfig`, so a model name means the
same model in ``convex-eq train-table`` and ``convex-eq reproduce``) and the variants only the
claims need, built from the same pieces at the same size:

* ``MOptEq (H only)``: the multi-branch model with the fusion term H and no D (MOptEq Tab. 3's
  "−D" row): :func:`convex_eq_app.table.multibranch` with ``fusion="H"``;
* ``conv OptEq + R*_z``: the table's conv OptEq with ``λ||z||₁`` or ``λ||z||²`` added to its
  hidden objective (TPAMI §5.1, Tab. 3(b));
* ``deep OptEq (L=2), unrolled``: the table's two-layer deep OptEq at ``α`` trained through ``K``
  unrolled iterations (TPAMI Tab. 3(a), Tab. 8); ``deep OptEq (L=2)`` itself (implicit
  differentiation) is the table's model with ``alpha``/``tol`` set in the config;
* the table's ``GEQ (multi-branch, fixed γ)`` with ``gamma`` set in the config (KerDEQ §4.5).

A run names a model and its parameters: fields of ``TableConfig`` (``alpha``, ``tol``,
``gamma``, ...) change the config the table's builder reads; the others (``reg``,
``reg_lambda``, ``K``) are options of the variant's builder (:data:`VARIANTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import nn

from convex_eq.errors import OptionError
from lowering.runtime.classifier import TrainingSettings

from ..configs import TableConfig

#: builder ``(cfg, shape, seed, **options) → model`` of each variant only the claims train
Builder = Callable[..., nn.Module]
VARIANTS: dict[str, Builder] = {}
#: the options each variant's builder takes (anything else must be a TableConfig field)
VARIANT_OPTIONS: dict[str, tuple[str, ...]] = {}


def variant(name: str, options: tuple[str, ...] = ()) -> Callable[[Builder], Builder]:
    """``@variant(name, options)``: register a builder of the claims' own models."""
    def deco(fn: Builder) -> Builder:
        VARIANTS[name] = fn
        VARIANT_OPTIONS[name] = options
        return fn
    return deco


@variant("MOptEq (H only)")
def h_only(cfg: TableConfig, shape: tuple[int, ...], seed: int) -> nn.Module:
    """MOptEq with the fusion term H and no decorrelation D (Tab. 3's "−D"), same branches,
    stem and bounds as the table's MOptEq rows."""
    from ..table import multibranch

    return multibranch(cfg, shape, seed, fusion="H")


def _equilibrium_classifier(obj: Any, cfg: TableConfig, settings: Any) -> nn.Module:
    """The table's wrapping of a single equilibrium layer: max pooling to ``cfg.pooled``
    positions, linear head."""
    import lowering
    from lowering.runtime.classifier import EquilibriumClassifier

    return EquilibriumClassifier(lowering.lower(obj), settings, pool="max", pooled=cfg.pooled)


@variant("conv OptEq + R*_z", ("reg", "reg_lambda"))
def regularized_opteq(cfg: TableConfig, shape: tuple[int, ...], seed: int, *, reg: str,
                      reg_lambda: float) -> nn.Module:
    """The table's conv OptEq (``Σf_σ(z) + ½||z||² − <q, z> − ½||Wz||²``) with ``R*_z`` added
    to its hidden objective (TPAMI §5.1): ``reg="l1"`` adds ``λ||z||₁`` (the layer
    ``z = relu(WᵀWz + q − λ)``); ``reg="l2"`` adds ``λ||z||²``, declared in the equivalent
    scaled form ``Σf_σ(z) + ½||z||² − s<q, z> − s·½||Wz||²``, ``s = 1/(1 + 2λ)`` (the same
    minimizers: ``f_σ`` of ReLU is an indicator, unchanged by scaling), whose layer
    ``z = relu(s(WᵀWz + q))`` is a contraction for every ``λ ≥ 0`` (docs/reproduce.md)."""
    from convex_eq import models
    from convex_eq.objective import Objective
    from convex_eq.terms import L1

    obj = models.opteq(conv=(cfg.channels, cfg.kernel), image=shape, seed=seed)
    lam = float(reg_lambda)
    if not lam >= 0:
        raise OptionError(f"reg_lambda = {reg_lambda} must be ≥ 0", term="conv OptEq + R*_z")
    if reg == "l1":
        obj = obj + lam * L1(obj.states[0])
    elif reg == "l2":
        potential, sq, lin, quad = obj.terms
        s = 1.0 / (1.0 + 2.0 * lam)
        obj = Objective([potential, sq, lin * s, quad * s], name=f"opteq-conv+{lam:g}||z||²")
    else:
        raise OptionError(f"unknown regulariser {reg!r}", term="conv OptEq + R*_z",
                          hint="reg='l1' (λ||z||₁) or reg='l2' (λ||z||²)")
    return _equilibrium_classifier(obj, cfg, TrainingSettings(tol=cfg.tol,
                                                              max_iter=cfg.max_iter))


@variant("deep OptEq (L=2), unrolled", ("K",))
def unrolled_deep_opteq(cfg: TableConfig, shape: tuple[int, ...], seed: int, *, K: int
                        ) -> nn.Module:
    """The table's deep OptEq (two conv layers of ``cfg.channels // 2`` channels,
    ``α = cfg.alpha``) whose forward is ``K`` plain iterations of ``T = f_2∘f_1`` from 0 and
    whose gradient is back-propagated through them (TPAMI §6, Tab. 8)."""
    from convex_eq import models

    k = int(K)
    if k < 1:
        raise OptionError(f"K = {K} unrolled iterations must be ≥ 1",
                          term="deep OptEq (L=2), unrolled")
    obj = models.deep_opteq(L=2, conv=(cfg.channels // 2, cfg.kernel), image=shape,
                            alpha=cfg.alpha, seed=seed)
    return _equilibrium_classifier(obj, cfg, UnrolledSettings(tol=cfg.tol, max_iter=cfg.max_iter,
                                                              backward="unroll", unroll_steps=k))


@dataclass
class UnrolledSettings(TrainingSettings):
    """:class:`~lowering.runtime.classifier.TrainingSettings` that also passes
    ``unroll_steps`` (``K`` of ``backward="unroll"``) to the module."""

    unroll_steps: int = 20

    def module_options(self, derived: Any) -> dict[str, Any]:
        return {**super().module_options(derived), "unroll_steps": int(self.unroll_steps)}


def deep_channels(cfg: TableConfig, shape: tuple[int, ...]) -> int:
    """``cfg.channels`` at which the table's deep OptEq (two layers of ``channels // 2``) has
    the parameter count closest to the conv OptEq's (even counts from 2 to ``2·cfg.channels``,
    where two layers of ``channels`` each already exceed one layer of ``cfg.channels``;
    bisection: the parameter count grows with the channels)."""
    from ..table import conv_opteq, deep_opteq
    from ..training import n_params

    target = n_params(conv_opteq(cfg, shape, 0))

    def count(c: int) -> int:
        return n_params(deep_opteq(replace(cfg, channels=c), shape, 0))

    lo, hi = 1, cfg.channels  # halves of the even counts: bisect on c = 2h
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(2 * mid) < target else (lo, mid)
    return min((2 * max(1, lo - 1), 2 * lo), key=lambda c: abs(count(c) - target))


#: TableConfig's field names (a run's parameter is one of these or a variant option)
CONFIG_FIELDS = frozenset(f.name for f in fields(TableConfig))


def split_params(model: str, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config overrides, builder options)`` of a run's parameters; a typed error names a
    parameter that is neither."""
    opts = VARIANT_OPTIONS.get(model, ())
    cfg_part = {k: v for k, v in params.items() if k in CONFIG_FIELDS}
    opt_part = {k: v for k, v in params.items() if k in opts}
    rest = sorted(set(params) - set(cfg_part) - set(opt_part))
    if rest:
        raise OptionError(f"model {model!r} takes no parameter {rest}", term="reproduce",
                          hint=f"TableConfig fields or the variant's options {list(opts)}")
    return cfg_part, opt_part


def build(model: str, cfg: TableConfig, shape: tuple[int, ...], seed: int,
          **params: Any) -> tuple[nn.Module, TableConfig]:
    """``(model, the config it was built from)``: a table model
    (:func:`convex_eq_app.table.build` on ``cfg`` with the config parameters applied) or a
    variant of :data:`VARIANTS`."""
    import torch

    from .. import table

    cfg_part, opts = split_params(model, params)
    run_cfg = replace(cfg, **cfg_part) if cfg_part else cfg
    if model in VARIANTS:
        torch.manual_seed(seed)
        return VARIANTS[model](run_cfg, shape, seed, **opts), run_cfg
    if opts:
        raise OptionError(f"the table model {model!r} takes no builder options",
                          term="reproduce", hint="set TableConfig fields instead")
    known = [*table.EQ_MODELS, table.MLP, table.CNN, *VARIANTS]
    if model not in known:
        raise OptionError(f"unknown model {model!r}", term="reproduce", hint=f"one of {known}")
    return table.build(model, run_cfg, shape, seed), run_cfg


__all__ = ["VARIANTS", "UnrolledSettings", "build", "deep_channels", "split_params", "variant"]
