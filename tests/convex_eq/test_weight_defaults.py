"""Default weights: each ``Weight`` without a value is its own draw from torch's global
generator (``torch.manual_seed`` reproduces it), and a default that enters a norm condition of
the certificate starts inside it.  References: the distribution's own draw from a generator in
the same state, a dense SVD (numpy) for norms, CVXPY through ``verify.check``."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import lowering
import verify
from convex_eq import Antiderivative, Input, Potential, ShapeError, SqNorm, State, Weight

ROOT = Path(__file__).resolve().parents[2]
T64 = torch.float64


def _norm2(w: Weight) -> float:
    return float(np.linalg.svd(w.value.numpy(), compute_uv=False)[0])


def _theorem1(w: Weight, u: Weight) -> object:
    """``φ = (Σ σ̃(Wz + Ux))* − ½||z||²``: convex iff ``||W||₂ ≤ 1`` (docs/theory.md §2)."""
    z, x = State("z", w.shape[1]), Input("x", u.shape[1])
    return Antiderivative("relu", w @ z + u @ x).conjugate() - SqNorm(z)


def test_default_weights_are_separate_draws_of_the_global_generator() -> None:
    """Two same-shape defaults differ, each is ``N(0, 1/fan_in)`` drawn in declaration order
    from the global generator (reference: the same draws after the same ``manual_seed``), and
    re-seeding reproduces them."""
    torch.manual_seed(1234)
    a, b = Weight("A", (3, 3)), Weight("B", (3, 3))
    torch.manual_seed(1234)
    ref_a = torch.randn(3, 3, dtype=T64) / math.sqrt(3)
    ref_b = torch.randn(3, 3, dtype=T64) / math.sqrt(3)
    assert not torch.equal(a.value, b.value)
    assert torch.equal(a.value, ref_a) and torch.equal(b.value, ref_b)
    torch.manual_seed(99)
    assert not torch.equal(Weight("A", (3, 3)).value, ref_a)  # the seed reaches them


def test_seeded_and_given_weights_keep_their_values() -> None:
    """``seed=`` uses a private generator (the documented alternative), a given value is bound
    as given."""
    w = Weight("W", (4, 2), seed=5)
    draw = torch.randn(4, 2, dtype=T64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(w.value, draw / math.sqrt(2))
    assert torch.equal(Weight("V", 2, np.array([1.0, -2.0])).value,
                       torch.tensor([1.0, -2.0], dtype=T64))


def test_default_weight_starts_inside_the_certificate_norm_condition() -> None:
    """``Weight("W", (6, 6))`` enters Theorem 1's condition ``||W||₂ ≤ 1``: it is scaled to
    0.9 when the objective is built (a 6×6 default draws ||W||₂ ≈ 1.5).  Reference: numpy's
    SVD; 1e-12 is a few roundings of one 6×6 SVD."""
    torch.manual_seed(0)
    w, u = Weight("W", (6, 6)), Weight("U", (6, 4))
    raw = _norm2(w)
    assert raw > 1.0  # (1.61 at this seed: outside the condition as drawn)
    phi = _theorem1(w, u)
    assert abs(_norm2(w) - 0.9) <= 1e-12
    cert = phi.certificate()
    assert cert.holds and "(now 0.9)" in cert.text


def test_default_weight_layer_passes_verify() -> None:
    """The library's own default layer is verified (CVXPY reference) without weight control
    changing it."""
    torch.manual_seed(0)
    w, u = Weight("W", (6, 6)), Weight("U", (6, 4))
    report = verify.check(lowering.lower(_theorem1(w, u)),
                          torch.randn(3, 4, dtype=T64, generator=torch.Generator().manual_seed(1)))
    assert report.passed and report.label == "minimizer", report


def test_given_and_small_weights_are_never_rescaled() -> None:
    """A value you give is kept even outside the condition (the certificate then says so), and
    a default already inside it is not scaled up."""
    torch.manual_seed(0)
    big = np.eye(6) * 1.6
    w = Weight("W", (6, 6), big)
    _theorem1(w, Weight("U", (6, 4)))
    assert np.array_equal(w.value.numpy(), big)
    small = Weight("S", (6, 6), seed=3)
    small.value = small.value * 0.1  # bound by the user: no longer the default
    before = small.value.clone()
    _theorem1(small, Weight("U2", (6, 4)))
    assert torch.equal(small.value, before)
    tiny = Weight("T", (40, 2))  # fan-in 2: ||T||₂ ≈ 5 > 1, scaled; a second build keeps it
    _theorem1(tiny, Weight("U3", (40, 3)))
    first = tiny.value.clone()
    _theorem1(tiny, Weight("U4", (40, 3)))
    assert torch.equal(tiny.value, first) and abs(_norm2(tiny) - 0.9) <= 1e-12


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_weights_declared_before_torch_draw_in_declaration_order() -> None:
    """Declaring (and building an objective) imports no torch; the draws happen at the first
    read of any of them, in declaration order, each inside its norm condition."""
    out = _run("""
        import sys
        import numpy as np
        from convex_eq import Antiderivative, Input, SqNorm, State, Weight
        a, b = Weight("A", (6, 6)), Weight("B", (6, 6))
        z, x = State("z", 6), Input("x", 6)
        phi = Antiderivative("relu", a @ z + b @ x).conjugate() - SqNorm(z)
        print("torch" in sys.modules)
        import torch
        torch.manual_seed(7)
        first = torch.randn(6, 6, dtype=torch.float64) / 6 ** 0.5
        second = torch.randn(6, 6, dtype=torch.float64) / 6 ** 0.5
        torch.manual_seed(7)
        vb = b.value.clone()  # read B first: A still draws first
        print(torch.equal(vb, second), torch.allclose(a.value / np.linalg.norm(a.value, 2),
                                                      first / np.linalg.norm(first, 2)))
        print(round(float(np.linalg.norm(a.value.numpy(), 2)), 12))
    """)
    assert out.split() == ["False", "True", "True", "0.9"]


def test_redeclared_symbol_hint_names_the_fix() -> None:
    """An edit that declares ``State("z", 6)`` again instead of reusing the object."""
    z = State("z", 6)
    phi = SqNorm(z) + Potential("relu", z)
    with pytest.raises(ShapeError) as err:
        phi + Potential("tanh", State("z", 6))
    hint = err.value.hint
    assert "reuse" in hint and "State('z', …)" in hint and "unique name" not in hint
