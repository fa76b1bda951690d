"""Lemma 1 / Lemma 2 (TPAMI, docs/theory.md §5): every feed-forward network is an OptEq-style
network
whose hidden layers are proximal operators of convex functions, output unchanged."""

from __future__ import annotations

import numpy as np
import torch

import convex_eq as ce
import lowering

from .cases import MLPCase
from .common import ROUND, check, rel_err

#: output agreement required by the issue (float64 gives ~1e-13; the factorization goes through
#: pseudo-inverses, so ill-conditioned drawn layers lose a few digits, never 8)
CONVERTER_TOL = 1e-5
#: layer identities (factorization, prox form) — pinv-based, so relative 1e-9
FACTOR_TOL = 1e-9


def _original_hidden(case: MLPCase) -> list[torch.Tensor]:
    """``x_0 = x``, ``x_{k+1} = σ(A_k x_k + c_k)`` of the original network, layer by layer."""
    xs = [case.x]
    h = case.x
    for mod in case.net:
        h = mod(h)
        if not isinstance(mod, torch.nn.Linear):
            xs.append(h)
    return xs


def lemma12_converter(case: MLPCase) -> dict[str, float]:
    """Lemma 1 / Lemma 2 (docs/theory.md §5): ``lowering.convert`` rewrites
    ``z_{k+1} = σ(A_k z_k + c_k)``
    with factors ``A_k = W̄_{k+1}W̄_kᵀ`` (``W̄_k ∈ R^{n_k×m}``, ``m ≥ n_k + n_{k+1}``), and

    * the rewritten network's output equals the original's (``CONVERTER_TOL``);
    * the factorization holds and ``u_k = W̄_kᵀ x_k`` tracks the original hidden states;
    * each hidden layer is ``u_{k+1} = μ_k·prox_{φ_k}(u_k)`` with ``φ_k`` the declared objective
      (lowered by the toolkit, ``is_prox``) and ``μ_k ≥ L_σ||W̄_{k+1}||₂²`` (Theorem 1's condition,
      so ``φ_k`` is convex).  Tolerance ``FACTOR_TOL``."""
    net = lowering.convert(case.net)
    mod = net.module()
    with torch.no_grad():
        out = mod(case.x)
        ref = case.net(case.x)
        hidden = mod.hidden(case.x)
    err = float((out - ref).abs().max()) / max(1.0, float(ref.abs().max()))
    check(err <= CONVERTER_TOL, f"Lemma 1/2: converted network output differs by {err:.3e}")
    sizes = case.widths
    check(net.m >= max(sizes[k] + sizes[k + 1] for k in range(len(sizes) - 1)),
          f"Lemma 2: m = {net.m} < max(n_k + n_(k+1))")
    lins = [m for m in case.net if isinstance(m, torch.nn.Linear)]
    worst = 0.0
    for k, lin in enumerate(lins):
        a = lin.weight.detach().double().numpy()
        prod = net.factors[k + 1] @ net.factors[k].T
        e = float(np.linalg.norm(prod - a)) / max(1.0, float(np.linalg.norm(a)))
        worst = max(worst, e)
        check(e <= FACTOR_TOL, f"Lemma 2: A_{k} ≠ W̄_{k + 1}W̄_{k}ᵀ (relative error {e:.3e})")
    xs = _original_hidden(case)
    for k, u in enumerate(hidden):
        w = torch.as_tensor(net.factors[k], dtype=torch.float64)
        e = rel_err(u, xs[k] @ w)
        worst = max(worst, e)
        check(e <= FACTOR_TOL, f"Lemma 1: u_{k} ≠ W̄_{k}ᵀ x_{k} ({e:.3e})")
    for k, obj in enumerate(net.objectives):
        d = lowering.lower(obj)
        check(d.is_prox,
              f"Lemma 1: layer {k} does not lower to a prox (rules {d.derivation.rules()})")
        wbar = net.factors[k + 1]
        lip = ce.get_activation(case.activation).lipschitz if k < len(lins) - 1 else 1.0
        need = lip * float(np.linalg.norm(wbar, 2)) ** 2
        check(net.mus[k] >= need * (1 - ROUND),
              f"Theorem 1 condition violated for φ_{k}: μ = {net.mus[k]:.6g} < L_σ||W̄||² = "
              f"{need:.6g}")
        name = obj.states[0].name
        pk = d.apply({name: hidden[k]})[name]
        e = rel_err(net.mus[k] * pk, hidden[k + 1])
        worst = max(worst, e)
        check(e <= FACTOR_TOL, f"Lemma 1: hidden layer {k + 1} ≠ μ_{k}·prox_φ{k}(u_{k}) ({e:.3e})")
    return {"output_error": err, "layer_error": worst}
