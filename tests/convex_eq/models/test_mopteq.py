"""MOptEq's layer against a numpy transcription of the paper: Eq. 6 with ``h_i`` of Proposition 1,
written from the paper's formulas (``vec⁻¹``, ``M_{i:i+1}``, ``sign[M − diag M]``), convolutions
and average sampling built as explicit matrices by loops — nothing of the toolkit's operators."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models

T64 = torch.float64
#: float64 evaluations of the same sums in different orders: ~1e-15 relative on values of order
#: 1–10, far below 1e-10 on every BLAS (no iteration, no cancellation-prone difference)
TOL = 1e-10


# ------------------------------------------------------------------ the paper, in numpy
def conv_matrix(w: np.ndarray, l_in: int, stride: int, pad: int) -> np.ndarray:
    """Dense matrix of the 1-D cross-correlation ``out[o, t] = Σ_{i,k} w[o, i, k]·x[i, s·t + k −
    pad]`` (zero padding), on channel-major flat vectors."""
    c_out, c_in, k = w.shape
    l_out = (l_in + 2 * pad - k) // stride + 1
    m = np.zeros((c_out * l_out, c_in * l_in))
    for o in range(c_out):
        for t in range(l_out):
            for i in range(c_in):
                for kk in range(k):
                    s = stride * t + kk - pad
                    if 0 <= s < l_in:
                        m[o * l_out + t, i * l_in + s] += w[o, i, kk]
    return m


def avg_down(c: int, l_big: int, l_small: int) -> np.ndarray:
    """Average down-sampling per channel: ``(P z)^c[t] = mean(z^c[f t : f t + f])``."""
    f = l_big // l_small
    m = np.zeros((c * l_small, c * l_big))
    for ch in range(c):
        for t in range(l_small):
            m[ch * l_small + t, ch * l_big + f * t: ch * l_big + f * t + f] = 1.0 / f
    return m


def sampling(c: int, l_from: int, l_to: int) -> np.ndarray:
    """``P`` from a branch of length ``l_from`` to one of length ``l_to``: the identity, average
    down-sampling, or its transpose (the paper's weighted nearest up-sampling)."""
    if l_from == l_to:
        return np.eye(c * l_from)
    if l_from > l_to:
        return avg_down(c, l_from, l_to)
    return avg_down(c, l_to, l_from).T


def vec_inv(z: np.ndarray, c: int) -> np.ndarray:
    """``vec⁻¹``: the ``(d/C) × C`` matrix whose column ``k`` is channel ``k``."""
    return z.reshape(c, -1).T


def vec(m: np.ndarray) -> np.ndarray:
    """Stack the columns (channels) of a ``(d/C) × C`` matrix."""
    return m.T.reshape(-1)


def paper_T(ys, Ws, Us, bs, g, lens, c, lam, phi_prime) -> list[np.ndarray]:
    """MOptEq Eq. 6 in Algorithm 2's variable ``y`` (``z̃_i = W_iᵀ y_i``):
    ``y_i ← σ(W_i h_i(z̃_i, z̃_{i−1}, z̃_{i+1}) + U_i g + b_i)``, ``h_i`` of Proposition 1 with
    ``sign`` replaced by ``phi_prime`` (``np.sign`` for the paper's D)."""
    n = len(ys)
    zt = [W.T @ y for W, y in zip(Ws, ys)]
    out = []
    for i in range(n):
        nxt, prv = (i + 1) % n, (i - 1) % n
        p_next = sampling(c, lens[nxt], lens[i])   # P_{i:i+1}: z_{i+1} → size of z_i
        p_prev = sampling(c, lens[i], lens[prv])   # P_{i−1:i}: z_i → size of z_{i−1}
        a = p_next @ zt[nxt]
        bq = p_prev.T @ zt[prv]
        m_next = vec_inv(a, c).T @ vec_inv(zt[i], c)       # M_{i:i+1}
        m_prev = vec_inv(zt[i], c).T @ vec_inv(bq, c)      # M_{i−1:i}
        s_next = phi_prime(m_next - np.diag(np.diag(m_next)))
        s_prev = phi_prime(m_prev.T - np.diag(np.diag(m_prev)))
        h = (0.5 * (a + bq) - lam / 2 * vec(vec_inv(a, c) @ s_next)
             - lam / 2 * vec(vec_inv(bq, c) @ s_prev))
        out.append(np.maximum(Ws[i] @ h + Us[i] @ g + bs[i], 0.0))
    return out


# ------------------------------------------------------------------ the toolkit's layer
def _weights(obj, i: int) -> tuple[np.ndarray, np.ndarray]:
    w = obj.symbol(f"W{i + 1}").value.numpy()
    u = obj.symbol(f"U{i + 1}").value.numpy()
    return w, u


@pytest.mark.parametrize("kernels,scales,decorrelation", [
    ((3, 5), (1, 2), "sign"), ((3, 5), (1, 2), "smooth"),
    ((3, 5, 3), (1, 2, 4), "sign"), ((5, 3, 3), (1, 1, 2), "smooth"),
])
def test_conv_mopteq_layer_is_the_papers_eq6(kernels, scales, decorrelation) -> None:
    c, length, lam, width = 3, 8, 0.3, 0.7
    rng = np.random.default_rng(7)
    obj = models.conv_mopteq(image=(2, length), channels=c, kernels=kernels, scales=scales,
                             lam=lam, fusion="HD", decorrelation=decorrelation, width=width,
                             seed=3)
    for i in range(len(kernels)):  # non-zero biases, to see that they enter
        b = obj.symbol(f"b{i + 1}")
        b.value = torch.as_tensor(rng.standard_normal(b.value.shape))
    d = lowering.lower(obj)
    lens = [length // s for s in scales]
    Ws, Us, bs = [], [], []
    for i, (k, s) in enumerate(zip(kernels, scales)):
        w, u = _weights(obj, i)
        Ws.append(conv_matrix(w, lens[i], 1, k // 2))
        Us.append(conv_matrix(u, length, s, k // 2))
        bs.append(obj.symbol(f"b{i + 1}").value.numpy())
    phi = np.sign if decorrelation == "sign" else (lambda m: np.clip(m / width, -1.0, 1.0))
    for trial in range(3):
        ys = [rng.standard_normal(c * n) for n in lens]
        g = rng.standard_normal(2 * length)
        want = paper_T(ys, Ws, Us, bs, g, lens, c, lam, phi)
        got = d.T(**{f"y{i + 1}": torch.as_tensor(y)[None] for i, y in enumerate(ys)},
                  x=torch.as_tensor(g)[None])
        for i, w in enumerate(want):
            err = float(np.abs(got[f"y{i + 1}"][0].numpy() - w).max())
            assert err <= TOL, f"branch {i + 1}, trial {trial}: |T − paper| = {err:.3e}"


def test_popteq_layer_is_the_papers_eq10() -> None:
    """POptEq (paper Eq. 10 in ``y``): ``y_i ← σ(W_i W_iᵀ y_i + U_i g + b_i)``, no fusion."""
    rng = np.random.default_rng(1)
    obj = models.conv_mopteq(image=(1, 8), channels=2, kernels=(3, 5), scales=(1, 2),
                             fusion="none", seed=4)
    d = lowering.lower(obj)
    ys = [rng.standard_normal(16), rng.standard_normal(8)]
    g = rng.standard_normal(8)
    got = d.T(y1=torch.as_tensor(ys[0])[None], y2=torch.as_tensor(ys[1])[None],
              x=torch.as_tensor(g)[None])
    for i, (k, s, n) in enumerate(zip((3, 5), (1, 2), (8, 4))):
        w, u = _weights(obj, i)
        W, U = conv_matrix(w, n, 1, k // 2), conv_matrix(u, 8, s, k // 2)
        want = np.maximum(W @ (W.T @ ys[i]) + U @ g, 0.0)
        assert np.abs(got[f"y{i + 1}"][0].numpy() - want).max() <= TOL


def test_mopteq_refuses_unknown_fusion_and_decorrelation() -> None:
    from convex_eq.errors import ShapeError

    with pytest.raises(ShapeError, match="fusion"):
        models.conv_mopteq(fusion="sum")
    with pytest.raises(ShapeError, match="decorrelation"):
        models.conv_mopteq(decorrelation="abs")
    with pytest.raises(ShapeError, match="width"):
        models.mopteq(width=0.0)
