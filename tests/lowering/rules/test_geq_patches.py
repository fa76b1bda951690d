"""GEQ patch splitting with a channel split ``c_s`` and non-square ``p_h × p_w`` patches (a
``1×40`` signal takes ``1×4`` patches): T against a hand-written patch loop, and verify."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import models
from convex_eq.errors import ShapeError
from verify.check import check

T64 = torch.float64


def _hand_layer(g, z: torch.Tensor, x: torch.Tensor, image, cs: int, ph: int, pw: int
                ) -> torch.Tensor:
    """σ(Wᵀm), m = Σ_i e^{-γ||(x̃_i − z̃_i)W_h||²}(x̃_i − z̃_i)W_h W_hᵀ scattered to patch i."""
    w, u, b, wh = (g.symbol(n).value.detach().double() for n in ("W", "U", "b", "W_h"))
    gam = float(g.symbol("gamma").value)
    c, h, wd = image
    r = (x @ u.T + b - z @ w.T).reshape(-1, c, h, wd)
    m = torch.zeros_like(r)
    for k in range(c // cs):
        for i in range(h // ph):
            for j in range(wd // pw):
                sl = (slice(None), slice(k * cs, (k + 1) * cs), slice(i * ph, (i + 1) * ph),
                      slice(j * pw, (j + 1) * pw))
                v = r[sl].reshape(r.shape[0], -1)  # the patch in (c_s, p_h, p_w) order
                y = v @ wh
                e = torch.exp(-gam * (y * y).sum(-1, keepdim=True))
                m[sl] = (e * (y @ wh.T)).reshape(r[sl].shape)
    return torch.relu(m.reshape(r.shape[0], -1) @ w)


@pytest.mark.parametrize("image,cs,patch", [((4, 2, 6), 2, (1, 3)), ((1, 1, 40), None, (1, 4))])
def test_channel_split_and_rectangular_patches(image, cs, patch) -> None:
    n = int(np.prod(image))
    g = models.geq(n=n, p=n, d=3, patch=patch, image=image, channel_split=cs, h=3, seed=1)
    term = next(t for t in g.terms if hasattr(t, "patch_hw"))
    c_s = cs or image[0]
    assert term.patch_dim == c_s * patch[0] * patch[1]
    assert term.n_patches == (image[0] // c_s) * (image[1] // patch[0]) * (image[2] // patch[1])
    d = lowering.lower(g)
    gen = torch.Generator().manual_seed(2)
    z, x = torch.randn(3, n, generator=gen, dtype=T64), torch.randn(3, 3, generator=gen, dtype=T64)
    # the same float64 formula evaluated patch by patch vs reshaped: rounding only
    torch.testing.assert_close(d.apply({"z": z, "x": x})["z"],
                               _hand_layer(g, z, x, image, c_s, *patch), atol=1e-12, rtol=1e-12)
    rep = check(d, x[:1].numpy(), starts=2)
    assert rep.passed and rep.label in ("stationary point", "local minimizer"), rep


def test_channel_split_must_divide_the_channels() -> None:
    with pytest.raises(ShapeError, match="channel split 3 does not divide the 4 channels"):
        models.geq(n=48, p=48, patch=2, image=(4, 2, 6), channel_split=3)
