"""Multi-branch GEQ (``models.conv_geq``, docs/theory.md §3.2): the derived layer's ``T``
against an independent numpy transcription of the GEQ paper's iteration (Eq. 16 with Alg. 1:
patch and channel split, ``m̃ = diag(e^{−γ||(x̃_j − z̃_j)W_h||²})(x̃ − z̃)W_hW_hᵀ``,
``z ← σ(Wᵀm)``) for every bandwidth rule, on signals and images; and the model's typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import OptionError, ShapeError

# ----------------------------------------------------------------------------- the transcription
# Written from the paper, with numpy loops over kernel taps: a convolution, its adjoint (the
# transposed convolution, by its definition <Wz, m> = <z, Wᵀm>), Alg. 1's rearrangement into
# c_s × p_h × p_w patches (the documented layout: patches row-major over the (C/c_s, H/p_h,
# W/p_w) grid, entries row-major over (c_s, p_h, p_w)), and the three bandwidth rules.


def conv(v: np.ndarray, w: np.ndarray, stride: int, pad: tuple[int, int]) -> np.ndarray:
    """``out[o, i, j] = Σ_{c,a,b} w[o, c, a, b]·v[c, s·i + a − p_h, s·j + b − p_w]`` (zeros
    outside ``v``)."""
    _, kh, kw = w.shape[1:]
    vp = np.pad(v, ((0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    ho = (vp.shape[1] - kh) // stride + 1
    wo = (vp.shape[2] - kw) // stride + 1
    out = np.zeros((w.shape[0], ho, wo))
    for a in range(kh):
        for b in range(kw):
            win = vp[:, a:a + stride * (ho - 1) + 1:stride, b:b + stride * (wo - 1) + 1:stride]
            out += np.einsum("oc,chw->ohw", w[:, :, a, b], win)
    return out


def conv_adjoint(m: np.ndarray, w: np.ndarray, pad: tuple[int, int]) -> np.ndarray:
    """``Wᵀm`` for the stride-1 ``conv`` with ``W = w``: every output position ``(o, i, j)``
    sends ``w[o, c, a, b]·m[o, i, j]`` back to the input position it read."""
    _, kh, kw = w.shape[1:]
    h, wd = m.shape[1:]
    out = np.zeros((w.shape[1], h + 2 * pad[0], wd + 2 * pad[1]))
    for a in range(kh):
        for b in range(kw):
            out[:, a:a + h, b:b + wd] += np.einsum("oc,ohw->chw", w[:, :, a, b], m)
    return out[:, pad[0]:pad[0] + h, pad[1]:pad[1] + wd]


def to_patches(v: np.ndarray, cs: int, ph: int, pw: int) -> np.ndarray:
    """Alg. 1's rearrangement ``(C, H, W) → (CHW/(c_s p_h p_w), c_s p_h p_w)``."""
    c, h, w = v.shape
    out = np.empty((c // cs, h // ph, w // pw, cs * ph * pw))
    for g in range(c // cs):
        for i in range(h // ph):
            for j in range(w // pw):
                out[g, i, j] = v[g * cs:(g + 1) * cs, i * ph:(i + 1) * ph,
                                 j * pw:(j + 1) * pw].reshape(-1)
    return out.reshape(-1, cs * ph * pw)


def from_patches(t: np.ndarray, shape: tuple[int, int, int], cs: int, ph: int, pw: int
                 ) -> np.ndarray:
    """The inverse rearrangement (Alg. 1's ``m̃ → m``)."""
    c, h, w = shape
    out = np.empty(shape)
    grid = t.reshape(c // cs, h // ph, w // pw, cs, ph, pw)
    for g in range(c // cs):
        for i in range(h // ph):
            for j in range(w // pw):
                out[g * cs:(g + 1) * cs, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw] = grid[g, i, j]
    return out


def paper_step(x: np.ndarray, z: np.ndarray, u: np.ndarray, b: np.ndarray, w: np.ndarray,
               wh: np.ndarray, stride: int, cs: int, patch: tuple[int, int], rule: object
               ) -> tuple[np.ndarray, np.ndarray]:
    """One application of GEQ's iteration to one branch of one sample: ``(z_new, factors)``.
    ``x``: ``(C0, H, W)``; ``z``: ``(C, H_i, W_i)``; ``rule``: a number (fixed ``γ``),
    ``"input"`` (``γ = 0.2/min_j ||x̃_j W_h||²``) or ``"paper"``
    (``γ = 0.2/min_j ||(x̃_j − z̃_j)W_h||²``, the current state)."""
    k = w.shape[-2:]
    pad = (k[0] // 2, k[1] // 2)
    q = conv(x, u, stride, pad) + b.reshape(z.shape)  # Ux + b
    wz = conv(z, w, 1, pad)  # Wz
    xt, zt = to_patches(q, cs, *patch), to_patches(wz, cs, *patch)
    n = np.sum(((xt - zt) @ wh) ** 2, axis=1)  # ||(x̃_j − z̃_j)W_h||²
    if rule == "input":
        gamma = 0.2 / np.min(np.sum((xt @ wh) ** 2, axis=1))
    elif rule == "paper":
        gamma = 0.2 / np.min(n)
    else:
        gamma = float(rule)
    factors = np.exp(-gamma * n)
    mt = np.diag(factors) @ (xt - zt) @ wh @ wh.T  # Alg. 1, m̃
    m = from_patches(mt, z.shape, cs, *patch)
    return np.maximum(conv_adjoint(m, w, pad), 0.0), factors  # σ(Wᵀm), σ = ReLU


# ----------------------------------------------------------------------------- the tests
#: (image, channels, scales, patch, channel split, hidden): a signal as MNIST-1D is, and an
#: image with a non-square W_h (c_s p² = 32 > c_hid = 16: a transpose of W_h would not fit)
CASES = {
    "signal": ((1, 40), 8, (1, 2, 4, 4), 2, 4, 8),
    "image": ((3, 8, 8), 8, (1, 2, 4), 2, 8, 16),
}
RULES = {"fixed": 0.5, "input": "input", "paper": "paper"}


def _branch_weights(obj, i: int, spatial_dims: int) -> tuple[np.ndarray, ...]:
    """``U_i, b_i, W_i, W_{h,i}`` as float64 arrays, convolution kernels as ``(O, C, kh, kw)``."""
    u, b, w, wh = (obj.symbol(f"{n}{i}").value.detach().double().numpy()
                   for n in ("U", "b", "W", "W_h"))
    if spatial_dims == 1:  # a signal's kernel (O, C, k) is the 1 × k kernel of its 1-row image
        u, w = u[:, :, None, :], w[:, :, None, :]
    return u, b, w, wh


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("case", list(CASES))
def test_each_branch_is_the_papers_iteration(case: str, rule: str) -> None:
    image, ch, scales, p, cs, hidden = CASES[case]
    obj = models.conv_geq(image, ch, scales=scales, patch=p, channel_split=cs, hidden=hidden,
                          gamma=RULES[rule], seed=3)
    rng = np.random.default_rng(5)
    for i in range(1, len(scales) + 1):
        # a generic W_h: the model starts from an orthonormal one, whose W_hW_hᵀ = I when it is
        # square would hide a W_h ↔ W_hᵀ mix-up
        wh = obj.symbol(f"W_h{i}")
        wh.value = torch.as_tensor(rng.standard_normal(wh.shape) / np.sqrt(wh.shape[0]))
        b = obj.symbol(f"b{i}")  # (and a bias, which starts at 0)
        b.value = torch.as_tensor(0.3 * rng.standard_normal(b.shape))
    d = lowering.lower(obj)
    bsz = 3
    x = rng.standard_normal((bsz, *image))
    zs = {b.name: 0.3 * rng.standard_normal((bsz, *b.shape)) for b in d.blocks}
    out = d.T(x=x, **zs)
    sd = len(image) - 1
    factors = []
    for i, sc in enumerate(scales, start=1):
        u, b, w, wh = _branch_weights(obj, i, sd)
        patch = (p, p) if sd == 2 else (1, p)
        for s in range(bsz):
            xs = x[s] if sd == 2 else x[s][:, None, :]
            z = zs[f"z{i}"][s]
            z = z if sd == 2 else z[:, None, :]
            ref, f = paper_step(xs, z, u, b, w, wh, sc, cs, patch, RULES[rule])
            got = out[f"z{i}"][s].reshape(ref.shape)
            # float64 sums of at most a few hundred products and one exp per patch, in two
            # different orders: rounding ~1e-14 relative; 1e-10 leaves four orders of margin
            # on any BLAS
            assert np.max(np.abs(got - ref)) <= 1e-10 * max(1.0, np.max(np.abs(ref))), \
                (case, rule, i, s, np.max(np.abs(got - ref)))
            factors.append(f)
    f = np.concatenate(factors)
    # not vacuous: the kernel factors are spread (an always-1 or always-0 kernel would hide a
    # wrong factor), and the paper's rule gives each branch's nearest patch exactly e^{-0.2}
    assert f.min() < 0.5 < f.max(), (f.min(), f.max())
    if rule == "paper":
        assert np.isclose(f.max(), np.exp(-0.2), rtol=1e-12)


def test_branches_are_independent_equilibria() -> None:
    """No term couples the branches: ``T``'s branch ``i`` reads ``z_i`` only (changing ``z_2``
    leaves ``T(z)_1`` bit for bit), and the derivation has one step per branch."""
    obj = models.conv_geq((1, 40), 8, scales=(1, 2), channel_split=4, hidden=8, seed=0)
    d = lowering.lower(obj)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 40))
    z1, z2 = rng.standard_normal((2, 8, 40)), rng.standard_normal((2, 8, 20))
    a = d.T(x=x, z1=z1, z2=z2)
    b = d.T(x=x, z1=z1, z2=z2 + 1.0)
    assert np.array_equal(a["z1"], b["z1"]) and not np.allclose(a["z2"], b["z2"])
    assert d.claim.kind == "fixed point of the iteration"


def test_the_papers_defaults_and_a_full_size_w_h() -> None:
    obj = models.conv_geq()  # CIFAR: 32×32×3, scales 32/16/8/8/4/4, p = 2, c_s = 8, c_hid = 32
    assert [s.shape for s in obj.states] == [(32, 32, 32), (32, 16, 16), (32, 8, 8),
                                             (32, 8, 8), (32, 4, 4), (32, 4, 4)]
    wh = obj.symbol("W_h1").value.detach().double().numpy()
    assert wh.shape == (32, 32)
    # orthonormal W_h: ||W_h||₂ = 1 up to QR rounding (~1e-15), so the contraction bound
    # starts at ||W||₂² = 0.81 for a fixed bandwidth
    assert abs(np.linalg.norm(wh, 2) - 1.0) < 1e-12
    fixed = lowering.lower(models.conv_geq((1, 8), 8, scales=(1, 2), gamma=0.1))
    assert fixed.contraction.value() == pytest.approx(0.81, rel=1e-5)


def test_bad_branch_settings_are_typed_errors() -> None:
    with pytest.raises(ShapeError, match="patch .* does not tile"):
        models.conv_geq((1, 40), 8, scales=(1, 8))  # length 5 at scale 8, patch 2
    with pytest.raises(ShapeError, match="scale 3 must divide"):
        models.conv_geq((1, 40), 8, scales=(1, 3))
    with pytest.raises(ShapeError, match="channel split 3 does not divide"):
        models.conv_geq((1, 40), 8, scales=(1,), channel_split=3)
    with pytest.raises(OptionError, match="not a bandwidth rule"):
        models.conv_geq((1, 40), 8, scales=(1,), gamma="median")
    with pytest.raises(ShapeError, match="must be odd"):
        models.conv_geq((1, 40), 8, scales=(1,), kernel=4)
