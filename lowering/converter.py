"""Feed-forward → weight-tied OptEq (docs/theory.md §5, Lemma 1/2).

A network ``x_{k+1} = σ_k(A_k x_k + c_k)`` is rewritten with factors ``A_k = W̄_{k+1} W̄_kᵀ``,
``W̄_k ∈ R^{n_k×m}``, ``m ≥ n_k + n_{k+1}``: ``W̄_{k+1} = A_k (W̄_kᵀ)⁺ + N_k`` with ``N_k W̄_kᵀ = 0``
(``N_k`` a random matrix projected onto the orthogonal complement of ``W̄_k``'s row space, keeping
full row rank).  With ``u_k = W̄_kᵀ x_k`` the hidden layers become the weight-tied OptEq updates
``u_{k+1} = W̄_{k+1}ᵀ σ_k(W̄_{k+1} u_k + c_k) = μ_k · prox_{φ_k}(u_k)`` (``φ_k = ψ_k* − ½||·||²``,
``ψ_k = (1/μ_k)Σσ̃_k(W̄_{k+1}u + c_k)``, ``μ_k = L_σ ||W̄_{k+1}||₂²``, Theorem 1) and the output is
``σ_{L-1}(W̄_L u_{L-1} + c_{L-1})`` — identical to the original network.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from convex_eq.activations import Activation, get_activation
from convex_eq.errors import LoweringError, NonFiniteError, ScaleError
from convex_eq.objective import Objective
from convex_eq.symbols import State, Weight
from convex_eq.terms.potential import Antiderivative
from convex_eq.terms.quadratic import SqNorm

_ACTS = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Identity: "identity",
         nn.Softplus: "softplus", nn.Hardtanh: "hardtanh", nn.LeakyReLU: "leaky_relu"}


def _activation(mod: nn.Module) -> Activation:
    name = _ACTS.get(type(mod))
    if name is None:
        raise LoweringError(f"unsupported activation {type(mod).__name__}", term="convert",
                            hint=f"supported: {', '.join(m.__name__ for m in _ACTS)}")
    if isinstance(mod, nn.Hardtanh):
        return get_activation("hardtanh", lo=mod.min_val, hi=mod.max_val)
    if isinstance(mod, nn.LeakyReLU):
        return get_activation("leaky_relu", slope=mod.negative_slope)
    if isinstance(mod, nn.Softplus) and (mod.beta != 1 or mod.threshold != 20):
        raise LoweringError("only Softplus(beta=1) is supported", term="convert")
    return get_activation(name)


def _layers(seq: nn.Sequential) -> list[tuple[nn.Linear, Activation]]:
    mods = list(seq)
    out: list[tuple[nn.Linear, Activation]] = []
    i = 0
    while i < len(mods):
        lin = mods[i]
        if not isinstance(lin, nn.Linear):
            raise LoweringError(f"expected nn.Linear at position {i}, got {type(lin).__name__}",
                                term="convert", hint="use Sequential(Linear, act, Linear, ...)")
        act = get_activation("identity")
        if i + 1 < len(mods) and not isinstance(mods[i + 1], nn.Linear):
            act = _activation(mods[i + 1])
            i += 1
        out.append((lin, act))
        i += 1
    if not out:
        raise LoweringError("empty network", term="convert")
    return out


@dataclass
class ConvertedNetwork:
    """The factors ``W̄_0..W̄_L``, biases, activations and per-layer hidden objectives."""

    #: the factors ``W̄_0, …, W̄_L`` (``W̄_k ∈ R^{n_k×m}``, ``A_k = W̄_{k+1} W̄_kᵀ``, Lemma 2)
    factors: list[np.ndarray]
    #: the biases ``c_0, …, c_{L−1}`` of the original layers
    biases: list[np.ndarray]
    #: the activations ``σ_0, …, σ_{L−1}`` of the original layers
    activations: list[Activation]
    #: the hidden objective ``φ_k = ψ_k* − ½||·||²`` of each hidden layer (Theorem 1)
    objectives: list[Objective]
    #: the scales ``μ_k = L_σ ||W̄_{k+1}||₂²`` with ``u_{k+1} = μ_k·prox_{φ_k}(u_k)``
    mus: list[float]
    #: the common width of the weight-tied state ``u_k = W̄_kᵀ x_k`` (``m ≥ n_k + n_{k+1}``)
    m: int

    def module(self, dtype: torch.dtype = torch.float64) -> OptEqFeedForward:
        """The reformulated network as a ``torch.nn.Module`` (outputs equal to the original
        network's up to round-off)."""
        return OptEqFeedForward(self, dtype)

    def describe(self) -> str:
        """The reformulation, one line per layer (``u_{k+1} = μ_k·prox_φk(u_k)``)."""
        lines = [f"weight-tied OptEq reformulation, m = {self.m}:",
                 f"  u_0 = W̄_0ᵀ x  (W̄_0: {self.factors[0].shape})"]
        for k, (obj, mu) in enumerate(zip(self.objectives, self.mus)):
            lines.append(f"  u_{k + 1} = μ_{k}·prox_φ{k}(u_{k}),  μ_{k} = {mu:.4g},  "
                         f"φ{k} = {obj}")
        lines.append(f"  output = {self.activations[-1].name}(W̄_L u_{{L-1}} + c)  "
                     f"(W̄_L: {self.factors[-1].shape})")
        return "\n".join(lines)


def convert(seq: nn.Sequential, m: int | None = None, seed: int = 0) -> ConvertedNetwork:
    """Rewrite ``seq`` (Linear + supported activations) as weight-tied OptEq layers."""
    layers = _layers(seq)
    sizes = [layers[0][0].in_features] + [lin.out_features for lin, _ in layers]
    need = max(sizes[k] + sizes[k + 1] for k in range(len(sizes) - 1))
    m = need if m is None else m
    if m < need:
        raise LoweringError(f"m = {m} < max(n_k + n_(k+1)) = {need}", term="convert",
                            hint="Lemma 2 needs m ≥ n_k + n_{k+1}")
    for k, (lin, _) in enumerate(layers):
        for what, t in (("weight", lin.weight), ("bias", lin.bias)):
            if t is not None and not bool(torch.isfinite(t).all()):
                raise NonFiniteError(f"Linear layer {k + 1} has a non-finite {what}",
                                     term=f"convert: Linear {k + 1}",
                                     hint="convert a network with finite parameters")
    g = np.random.default_rng(seed)
    wbar = [np.linalg.qr(g.standard_normal((m, sizes[0])))[0].T]  # orthonormal rows
    for k, (lin, _) in enumerate(layers):
        a = lin.weight.detach().double().cpu().numpy()
        amax = float(np.abs(a).max(initial=0.0))
        if amax and not 1e-100 <= amax <= 1e100:
            raise ScaleError(f"Linear layer {k + 1} has weights of magnitude {amax:.1e}: the "
                             "Lemma 2 factors W̄ and μ = L_σ||W̄||₂² leave float64 range",
                             term=f"convert: Linear {k + 1}",
                             hint="rescale the layer (weights within 1e-100 … 1e100)")
        prev = wbar[-1]
        base = a @ np.linalg.pinv(prev.T)
        proj = np.eye(m) - np.linalg.pinv(prev) @ prev  # onto the complement of row space
        n_k = g.standard_normal((a.shape[0], m)) @ proj
        # scale the correction like the particular solution (1 if the layer is zero: A_k = 0
        # would otherwise give W̄_(k+1) = 0 and lose full row rank)
        scale = np.linalg.norm(base, 2) or 1.0
        n_k *= scale / max(np.linalg.norm(n_k, 2), 1e-12)
        w_next = base + n_k
        if np.linalg.matrix_rank(w_next) < w_next.shape[0]:
            raise LoweringError(f"factor {k + 1} lost full row rank", term="convert",
                                hint="increase m or change the seed")
        wbar.append(w_next)
    biases = [(lin.bias.detach().double().cpu().numpy() if lin.bias is not None
               else np.zeros(lin.out_features)) for lin, _ in layers]
    acts = [act for _, act in layers]
    objectives, mus = [], []
    for k in range(len(layers) - 1):
        w = Weight(f"Wbar{k + 1}", wbar[k + 1].shape, wbar[k + 1])
        c = Weight(f"c{k}", biases[k].shape, biases[k])
        u = State(f"u{k}", m)
        nrm = float(np.linalg.norm(wbar[k + 1], 2))
        mu = acts[k].lipschitz * nrm * nrm
        if not (np.isfinite(mu) and mu > 0):
            raise ScaleError(f"factor W̄{k + 1} has ||W̄||₂ = {nrm:.1e}: μ = L_σ||W̄||₂² = {mu:g} "
                             "is outside float64 range", term=f"convert: Linear {k + 1}",
                             hint="rescale the network's weights towards unit scale")
        psi = Antiderivative(acts[k], w @ u + c) * (1.0 / mu)
        objectives.append(Objective([psi.conjugate(), -SqNorm(u)], name=f"phi{k}"))
        mus.append(mu)
    return ConvertedNetwork(wbar, biases, acts, objectives, mus, m)


class OptEqFeedForward(nn.Module):
    """Forward pass of the converted network (weight-tied factors)."""

    def __init__(self, net: ConvertedNetwork, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.net = net
        self.factors = nn.ParameterList([nn.Parameter(torch.as_tensor(w, dtype=dtype))
                                         for w in net.factors])
        self.biases = nn.ParameterList([nn.Parameter(torch.as_tensor(b, dtype=dtype))
                                        for b in net.biases])

    def hidden(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``u_0, …, u_{L-1}`` (each layer ``u_{k+1} = W̄ᵀσ(W̄u_k + c)``)."""
        us = [x @ self.factors[0]]
        for k in range(len(self.biases) - 1):
            w = self.factors[k + 1]
            us.append(self.net.activations[k].sigma(us[-1] @ w.T + self.biases[k]) @ w)
        return us

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.hidden(x)[-1]
        w = self.factors[-1]
        return self.net.activations[-1].sigma(u @ w.T + self.biases[-1])
