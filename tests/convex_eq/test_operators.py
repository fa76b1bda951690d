"""Tests of ``convex_eq.operators``: adjointness, dense matrices, norms, shapes, dtypes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from convex_eq.errors import NonFiniteError, ScaleError, ShapeError
from convex_eq.operators import (
    Adjoint,
    AvgDownsample,
    BlockDiag,
    Compose,
    Conv2d,
    CyclicPermutation,
    Dense,
    Identity,
    LinOp,
    Upsample,
    as_operator,
    downsample_or_identity,
)
from convex_eq.symbols import Constant, State, Weight

# Dot-product test tolerance.  Both sides are float64 sums of n <= ~1000 products; summing in a
# different order changes a sum by at most ~ n·eps·Σ|a_i b_i| <= n·eps·||a||·||b|| (eps = 2.2e-16,
# Cauchy-Schwarz), i.e. <= ~2e-13 relative to the scale used below.  1e-12 keeps a margin for
# that rounding, while a wrong adjoint (off-by-one output_padding, a permutation rotated the wrong
# way, a missing 1/f²) is off by O(1e-2 .. 1) relative to the same scale.
ADJ_RTOL = 1e-12


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def conv(c_in: int, c_out: int, h: int, w: int, k, stride=1, padding=0, seed: int = 1) -> Conv2d:
    kh, kw = (k, k) if isinstance(k, int) else k
    K = Weight("K", (c_out, c_in, kh, kw), seed=seed)
    return Conv2d(K, (c_in, h, w), stride=stride, padding=padding)


# name -> factory; every operator of the package (and nested combinations) appears here.
CATALOG: dict[str, Callable[[], LinOp]] = {
    "dense": lambda: Dense(Weight("W", (5, 7))),
    "dense_array": lambda: Dense(rand(4, 3, seed=3).numpy()),
    "conv_k3_s1_p0": lambda: conv(1, 1, 5, 5, 3),
    "conv_k3_s2_p1_odd": lambda: conv(3, 2, 7, 7, 3, 2, 1),
    "conv_k3_s2_p1_even": lambda: conv(2, 3, 8, 8, 3, 2, 1),
    "conv_k2_s3_p0_odd": lambda: conv(2, 2, 9, 7, 2, 3, 0),
    "conv_k4_s2_p2": lambda: conv(1, 2, 5, 6, 4, 2, 2),
    "conv_rect_k_tuple_stride": lambda: conv(2, 2, 7, 6, (3, 2), (2, 1), (1, 0)),
    "conv_k1": lambda: conv(3, 4, 3, 5, 1),
    "avgdown2": lambda: AvgDownsample(2, (3, 4, 6)),
    "avgdown3": lambda: AvgDownsample(3, (2, 6, 9)),
    "avgdown_T": lambda: AvgDownsample(2, (3, 4, 6)).T,
    "upsample": lambda: Upsample(2, (2, 4, 4)),
    "identity": lambda: Identity(6),
    "identity_shape": lambda: Identity((2, 3, 3)),
    "blockdiag": lambda: BlockDiag(
        [Dense(Weight("W1", (3, 4))), conv(2, 1, 5, 5, 3, 2, 1), Identity(3)]
    ),
    "cyclic": lambda: CyclicPermutation([2, 3, 4]),
    "cyclic_shapes": lambda: CyclicPermutation([(2, 2, 2), 3, (1, 5)]),
    "compose_dense_pool": lambda: Compose(
        Dense(Weight("V", (10, 18))), AvgDownsample(2, (2, 6, 6))
    ),
    "compose_gram_conv": lambda: conv(2, 3, 7, 7, 3, 2, 1).T @ conv(2, 3, 7, 7, 3, 2, 1),
    "compose_perm_blocks": lambda: (
        CyclicPermutation([4, 3])
        @ BlockDiag([Dense(Weight("A", (3, 5))), Dense(Weight("B", (4, 2)))])
    ),
    "adjoint_dense": lambda: Adjoint(Dense(Weight("W", (5, 7)))),
    "adjoint_conv": lambda: Adjoint(conv(3, 2, 7, 7, 3, 2, 1)),
    "adjoint_compose": lambda: Adjoint(Dense(Weight("V", (6, 4))) @ Dense(Weight("U", (4, 5)))),
    "adjoint_cyclic": lambda: CyclicPermutation([1, 2, 3]).T,
    "P_down": lambda: downsample_or_identity((2, 8, 8), (2, 4, 4)),
    "P_up": lambda: downsample_or_identity((2, 2, 2), (2, 6, 6)),
}
NAMES = sorted(CATALOG)


def dot_residual(op: LinOp, B: int, seed: int = 0, dtype: torch.dtype = torch.float64):
    v = rand(B, op.in_size, seed=seed, dtype=dtype)
    w = rand(B, op.out_size, seed=seed + 100, dtype=dtype)
    Av, Atw = op.apply(v), op.adjoint(w)
    assert Av.shape == (B, op.out_size)
    assert Atw.shape == (B, op.in_size)
    lhs, rhs = (Av * w).sum(-1), (v * Atw).sum(-1)
    scale = Av.norm(dim=-1) * w.norm(dim=-1) + v.norm(dim=-1) * Atw.norm(dim=-1)
    return (lhs - rhs).abs(), scale


# --------------------------------------------------------------------------- adjointness
@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("name", NAMES)
def test_adjoint_dot_product(name: str, B: int) -> None:
    """<A v, w> == <v, Aᵀ w> for every operator (see ADJ_RTOL for the tolerance)."""
    op = CATALOG[name]()
    res, scale = dot_residual(op, B)
    assert (scale > 0).all()
    assert (res <= ADJ_RTOL * scale).all(), (res / scale).max().item()


@settings(max_examples=60, deadline=None)
@given(
    c_in=st.integers(1, 3),
    c_out=st.integers(1, 3),
    h=st.integers(3, 10),
    w=st.integers(3, 10),
    k=st.integers(1, 4),
    stride=st.integers(1, 3),
    padding=st.integers(0, 2),
)
def test_conv_adjoint_random_geometry(c_in, c_out, h, w, k, stride, padding) -> None:
    """The transposed-conv adjoint (with output_padding) is exact for any stride/padding/size."""
    assume(k <= h + 2 * padding and k <= w + 2 * padding)
    op = conv(c_in, c_out, h, w, k, stride, padding)
    res, scale = dot_residual(op, 2)
    assert (res <= ADJ_RTOL * scale).all()
    assert op.adjoint(rand(2, op.out_size)).shape == (2, c_in * h * w)


@settings(max_examples=60, deadline=None)
@given(
    nd=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 3]),
    per_group=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    size=st.integers(3, 9),
    ks=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    stride=st.integers(1, 2),
    padding=st.integers(0, 4),
)
def test_conv_adjoint_as_flipped_convolution(nd, groups, per_group, size, ks, stride,
                                             padding) -> None:
    """The adjoint of a stride-1 convolution whose padding is at most k − 1 runs as a forward
    convolution of the flipped kernel; it equals torch's transposed convolution (the
    definition) for grouped, rectangular 1-d and 2-d kernels, and any other geometry keeps the
    transposed one.  Both are float64 sums of at most 3·4·4 = 48 products per entry, in
    different orders: they agree to ~48·eps relative to the sum of |products|, far below
    1e-12 of the output's scale; a wrong flip, channel order or padding is off by O(1)."""
    from convex_eq.operators import Conv1d

    kshape = ks[:nd]
    assume(all(k <= size + 2 * padding for k in kshape))
    c_in, c_out = per_group[0] * groups, per_group[1] * groups
    shape = (c_in,) + (size,) * nd
    K = rand(c_out, c_in // groups, *kshape, seed=1)
    cls = Conv1d if nd == 1 else Conv2d
    op = cls(K.numpy(), shape, stride=stride, padding=padding,
             groups=groups)
    flipped = stride == 1 and all(padding <= k - 1 for k in kshape)
    assert (op._flip_padding is not None) == flipped
    w = rand(3, op.out_size, seed=2)
    got = op.adjoint(w)
    t = F.conv_transpose1d if nd == 1 else F.conv_transpose2d
    want = t(w.reshape(3, *op.out_shape), K, stride=stride, padding=padding,
             output_padding=op.output_padding, groups=groups).reshape(3, -1)
    assert got.shape == want.shape == (3, op.in_size)
    assert (got - want).abs().max() <= 1e-12 * max(1.0, float(want.abs().max()))


# --------------------------------------------------------------------------- dense matrix & norm
@pytest.mark.parametrize("name", NAMES)
def test_matrix_matches_apply_and_adjoint(name: str) -> None:
    op = CATALOG[name]()
    M = op.matrix()
    assert isinstance(M, np.ndarray) and M.dtype == np.float64
    assert M.shape == (op.out_size, op.in_size)
    v, w = rand(5, op.in_size, seed=7), rand(5, op.out_size, seed=8)
    np.testing.assert_allclose(op.apply(v).numpy(), v.numpy() @ M.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(op.adjoint(w).numpy(), w.numpy() @ M, rtol=1e-12, atol=1e-12)
    # the generic identity-basis construction agrees with any specialised override
    np.testing.assert_allclose(LinOp.matrix(op), M, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_norm_within_one_percent(name: str) -> None:
    op = CATALOG[name]()
    exact = np.linalg.norm(op.matrix(), 2)
    for est in (op.norm(), LinOp.norm(op)):  # the override and the generic power iteration
        assert abs(est - exact) <= 0.01 * exact, (est, exact)
    assert op.norm() == op.norm()  # deterministic


def test_norm_power_iteration_close_singular_values() -> None:
    """Nearly tied top singular values (slow power iteration) still give a 1% estimate."""
    g = np.random.default_rng(0)
    U, _ = np.linalg.qr(g.standard_normal((30, 30)))
    V, _ = np.linalg.qr(g.standard_normal((20, 20)))
    s = np.linspace(0.5, 1.0, 20)
    s[-2] = 0.999
    op = Dense(U[:, :20] @ np.diag(s) @ V.T)
    assert abs(op.norm() - 1.0) <= 0.01
    assert op.norm(seed=0) == op.norm(seed=0)


def test_known_norms() -> None:
    assert AvgDownsample(2, (1, 4, 4)).norm() == pytest.approx(0.5)
    assert LinOp.norm(AvgDownsample(3, (1, 6, 6))) == pytest.approx(1 / 3, rel=1e-8)
    assert LinOp.norm(CyclicPermutation([2, 3])) == pytest.approx(1.0, rel=1e-8)
    assert Dense(np.diag([3.0, -4.0, 1.0])).norm() == pytest.approx(4.0, rel=1e-8)


# --------------------------------------------------------------------------- shapes & errors
@pytest.mark.parametrize("name", NAMES)
def test_shape_mismatch_names_operator(name: str) -> None:
    op = CATALOG[name]()
    with pytest.raises(ShapeError) as e:
        op.apply(rand(2, op.in_size + 1))
    assert str(op) in str(e.value)
    with pytest.raises(ShapeError) as e:
        op.adjoint(rand(2, op.out_size + 1))
    assert str(op) in str(e.value)


def test_shape_error_message_for_dense() -> None:
    op = Dense(Weight("W_enc", (3, 4)))
    with pytest.raises(ShapeError, match=r"Dense operator 'W_enc'.*\(B, 4\).*\(2, 5\)"):
        op.apply(rand(2, 5))
    with pytest.raises(ShapeError, match=r"W_enc.*adjoint.*\(B, 3\)"):
        op.adjoint(rand(2, 4))


def test_compose_shape_mismatch_names_both() -> None:
    A, B = Dense(Weight("A", (3, 4))), Dense(Weight("B", (5, 6)))
    with pytest.raises(ShapeError) as e:
        Compose(A, B)
    assert "A" in str(e.value) and "B" in str(e.value) and "4" in str(e.value)
    with pytest.raises(ShapeError):
        A @ B


def test_constructor_errors() -> None:
    with pytest.raises(ShapeError):
        Dense(Weight("w", (3,)))
    with pytest.raises(ShapeError):
        Dense(State("z", (3, 3)))
    with pytest.raises(ShapeError, match="channels"):
        Conv2d(Weight("K", (2, 3, 3, 3)), (2, 5, 5))
    with pytest.raises(ShapeError):
        Conv2d(Weight("K", (2, 3, 5, 5)), (3, 3, 3))
    with pytest.raises(ScaleError):
        Conv2d(Weight("K", (2, 3, 3, 3)), (3, 5, 5), stride=0)
    with pytest.raises(ShapeError, match="divisible"):
        AvgDownsample(2, (1, 5, 4))
    with pytest.raises(ScaleError):
        AvgDownsample(0, (1, 4, 4))
    with pytest.raises(ShapeError):
        CyclicPermutation([])
    with pytest.raises(ShapeError):
        BlockDiag([])


def test_env_weight_wrong_shape_is_shape_error() -> None:
    op = Dense(Weight("W", (3, 4)))
    with pytest.raises(ShapeError, match="W"):
        op.apply(rand(2, 4), {"W": torch.zeros(4, 4)})


def test_non_finite_weight() -> None:
    op = Dense(Weight("W", (3, 4)))
    bad = {"W": torch.full((3, 4), float("nan"))}
    with pytest.raises(NonFiniteError):
        op.matrix(bad)
    with pytest.raises(NonFiniteError):
        op.norm(bad)


# --------------------------------------------------------------------------- hand-computed
def test_cyclic_permutation_direction() -> None:
    """P (b_1, b_2, b_3) = (b_3, b_1, b_2); Pᵀ = P⁻¹ rotates the other way."""
    P = CyclicPermutation([1, 2, 3])
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])  # b1=[1], b2=[2,3], b3=[4,5,6]
    assert P.apply(v).tolist() == [[4.0, 5.0, 6.0, 1.0, 2.0, 3.0]]
    w = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0, 60.0]])  # c1=[10,20,30], c2=[40], c3=[50,60]
    assert P.adjoint(w).tolist() == [[40.0, 50.0, 60.0, 10.0, 20.0, 30.0]]
    assert P.adjoint(P.apply(v)).tolist() == v.tolist()
    assert P.in_shape == ((1,), (2,), (3,)) and P.out_shape == ((3,), (1,), (2,))


def test_avg_downsample_hand_example() -> None:
    op = AvgDownsample(2, (2, 2, 4))
    x = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    v = torch.stack([x, 10 * x]).reshape(1, -1)  # two channels
    assert op.out_shape == (2, 1, 2)
    assert op.apply(v).tolist() == [[3.5, 5.5, 35.0, 55.0]]
    w = torch.tensor([[4.0, 8.0, 0.0, -4.0]])
    # nearest upsampling divided by f² = 4
    expected = [[[1, 1, 2, 2], [1, 1, 2, 2]], [[0, 0, -1, -1], [0, 0, -1, -1]]]
    assert op.adjoint(w).reshape(2, 2, 4).tolist() == expected


def test_dense_and_conv_match_torch() -> None:
    W = Weight("W", (3, 4))
    v = rand(5, 4)
    torch.testing.assert_close(Dense(W).apply(v), v @ W.value.T)
    op = conv(2, 3, 7, 6, 3, 2, 1)
    x = rand(5, 2, 7, 6)
    y = F.conv2d(x, op.weight.value, stride=2, padding=1)
    assert op.out_shape == tuple(y.shape[1:])
    torch.testing.assert_close(op.apply(x.reshape(5, -1)), y.reshape(5, -1))


def test_downsample_or_identity() -> None:
    P = downsample_or_identity((2, 4, 4), (2, 4, 4))
    assert isinstance(P, Identity)
    P = downsample_or_identity((2, 8, 8), (2, 4, 4))
    assert isinstance(P, AvgDownsample) and P.factor == 2
    P = downsample_or_identity((2, 2, 2), (2, 6, 6), name="P_{1:2}")
    assert isinstance(P, Adjoint) and P.in_size == 8 and P.out_size == 72
    assert P.latex() == "P_{1:2}" and str(P) == "P_{1:2}"
    np.testing.assert_allclose(P.matrix(), AvgDownsample(3, (2, 6, 6)).matrix().T)
    assert isinstance(downsample_or_identity(5, 5), Identity)
    with pytest.raises(ShapeError, match="channel"):
        downsample_or_identity((2, 4, 4), (3, 2, 2))
    with pytest.raises(ShapeError):
        downsample_or_identity((2, 6, 6), (2, 4, 4))
    with pytest.raises(ShapeError):
        downsample_or_identity((2, 8, 4), (2, 4, 4))
    with pytest.raises(ShapeError):
        downsample_or_identity(5, 6)


# --------------------------------------------------------------------------- dtypes, env, batch
@pytest.mark.parametrize("name", NAMES)
def test_float32(name: str) -> None:
    op = CATALOG[name]()
    v, w = rand(5, op.in_size), rand(5, op.out_size)
    y32, x32 = op.apply(v.float()), op.adjoint(w.float())
    assert y32.dtype == torch.float32 and x32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), op.apply(v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x32.double(), op.adjoint(w), rtol=1e-5, atol=1e-5)
    res, scale = dot_residual(op, 5, dtype=torch.float32)
    assert (res <= 1e-5 * scale).all()


def test_extra_leading_batch_dims() -> None:
    op = conv(2, 3, 5, 5, 3, 2, 1)
    v = rand(2, 3, op.in_size)
    torch.testing.assert_close(op.apply(v), op.apply(v.reshape(6, -1)).reshape(2, 3, -1))


def test_env_parameters_and_gradients() -> None:
    """Weights are resolved from env at call time (nn.Parameter, float32) and get gradients."""
    W = Weight("W", (3, 4))
    op = Dense(W)
    p = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float32))
    v = rand(5, 4, dtype=torch.float32)
    y = op.apply(v, {"W": p})
    torch.testing.assert_close(y, v.sum(-1, keepdim=True).expand(5, 3))
    y.sum().backward()
    torch.testing.assert_close(p.grad, v.sum(0).expand(3, 4))
    np.testing.assert_allclose(op.matrix({"W": p}), np.ones((3, 4)))
    K = torch.nn.Parameter(rand(2, 1, 3, 3, dtype=torch.float32))
    c = Conv2d(Weight("K", (2, 1, 3, 3)), (1, 5, 5), stride=2, padding=1)
    c.adjoint(rand(4, c.out_size, dtype=torch.float32), {"K": K}).pow(2).sum().backward()
    assert K.grad is not None and K.grad.abs().sum() > 0


def test_array_weights_become_constants() -> None:
    a, b = Dense(np.eye(3)), Dense(torch.ones(2, 3))
    (sa,), (sb,) = a.symbols(), b.symbols()
    assert isinstance(sa, Constant) and isinstance(sb, Constant) and sa.name != sb.name
    assert sb.value.dtype == torch.float64
    assert as_operator(np.eye(2)).matrix().tolist() == np.eye(2).tolist()
    assert as_operator(a) is a
    assert isinstance(as_operator(Weight("W", (2, 2))), Dense)


def test_symbols_of_composites() -> None:
    W, V = Weight("W", (3, 3)), Weight("V", (3, 3))
    op = BlockDiag([Dense(W).T @ Dense(W), Dense(V)])
    assert [s.name for s in op.symbols()] == ["W", "V"]
    assert Identity(3).symbols() == []


# --------------------------------------------------------------------------- display & algebra
def test_display() -> None:
    W = Dense(Weight("W", (3, 4)))
    assert (str(W), W.latex()) == ("W", "W")
    assert (str(W.T), W.T.latex()) == ("W^T", "W^\\top")
    assert str(conv(1, 1, 5, 5, 3)) == "conv(K)"
    gram = W.T @ W
    assert isinstance(gram, Compose) and str(gram) == "W^T W"
    assert str(gram.T) == "(W^T W)^T" and gram.T.latex() == "\\left(W^\\top W\\right)^\\top"
    assert W.T.T is W
    assert str(CyclicPermutation([1, 2])) == "P_cyc"
    assert "W" in repr(W) and "4" in repr(W)


def test_matmul_with_expression() -> None:
    W = Dense(Weight("W", (3, 4)))
    z = State("z", 4)
    u = W @ z
    v = rand(5, 4)
    torch.testing.assert_close(u.evaluate({"z": v}), W.apply(v))
    with pytest.raises(ShapeError):
        W @ State("y", 5)
