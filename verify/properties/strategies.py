"""Hypothesis strategies for the theorem properties: weights that satisfy each theorem's
assumptions (spectral scaling), registry activations, inputs, α, γ and sizes.

Every strategy draws plain arrays and passes them to a *builder* of
:mod:`verify.properties.cases` (``opteq_case``, ``deep_case``,
…), which puts them into the seed objectives of ``convex_eq.models`` (the symbols' values are
overwritten, so lowering, CVXPY export, contraction bounds and emitted modules all see the drawn
weights).  The builders are public: fixed examples and users' own instances go through the same
code as the drawn ones.

Spectral control: a matrix is drawn as ``Q diag(s) Vᵀ`` with ``Q, V`` orthogonal (QR of drawn
arrays, sign-fixed so any array gives an orthogonal factor) and singular values ``s`` drawn
explicitly, so ``||W||₂``, ``σ_min(W)`` and exact unit singular values (Theorem 5) are chosen,
not hoped for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError as err:  # hypothesis is a test extra
    raise ImportError(
        "verify.properties.strategies draws instances with hypothesis, which is not installed: "
        "pip install 'convex-eq[test]' (the properties and verify.properties.cases, the "
        "builders of fixed instances, work without it)") from err

from .cases import (
    ACTIVATIONS,
    CLOSED_FORM_ACTIVATIONS,
    DCP_ACTIVATIONS,
    MOPTEQ_SHAPES,
    DeepCase,
    GEQCase,
    MLPCase,
    MOptEqCase,
    OptEqCase,
    SAMCase,
    deep_case,
    geq_case,
    matrix_with_spectrum,
    mlp_case,
    mopteq_case,
    opteq_case,
    orthogonal_from,
    rng_arrays,
    sam_case,
    scaled_to_norm,
    set_weights,
)

__all__ = [
    "ACTIVATIONS",
    "CLOSED_FORM_ACTIVATIONS",
    "DCP_ACTIVATIONS",
    "DeepCase",
    "GEQCase",
    "MLPCase",
    "MOptEqCase",
    "OptEqCase",
    "SAMCase",
    "activations",
    "arrays",
    "deep_case",
    "deep_cases",
    "geq_case",
    "geq_cases",
    "matrix_with_spectrum",
    "mlp_case",
    "mlp_cases",
    "mopteq_case",
    "mopteq_cases",
    "moreau_cases",
    "opteq_case",
    "opteq_cases",
    "orthogonal",
    "orthogonal_from",
    "perturbation_cases",
    "regularized_cases",
    "rng_arrays",
    "sam_case",
    "sam_cases",
    "scaled_to_norm",
    "set_weights",
    "spectral_matrices",
]

_unit = st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False, allow_subnormal=False)


def activations(names: tuple[str, ...] = ACTIVATIONS) -> st.SearchStrategy[str]:
    """Activation names from the registry."""
    return st.sampled_from(names)


def arrays(shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0
           ) -> st.SearchStrategy[np.ndarray]:
    """Float64 arrays with entries in ``[lo, hi]``."""
    el = st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    return hnp.arrays(np.float64, shape, elements=el)


@st.composite
def orthogonal(draw: Any, n: int) -> np.ndarray:
    """A drawn ``n×n`` orthogonal matrix."""
    return orthogonal_from(draw(arrays((n, n))))


@st.composite
def spectral_matrices(draw: Any, rows: int, cols: int, norm: tuple[float, float] = (0.1, 0.95),
                      min_ratio: float = 0.0) -> np.ndarray:
    """``rows×cols`` matrices with ``||W||₂`` drawn in ``norm`` and every singular value
    ``≥ min_ratio·||W||₂`` (``min_ratio > 0``: full rank, bounded condition number)."""
    k = min(rows, cols)
    q = draw(orthogonal(rows))
    v = draw(orthogonal(cols))
    top = draw(st.floats(*norm))
    rest = draw(st.lists(st.floats(min_ratio, 1.0), min_size=k - 1, max_size=k - 1))
    s = np.array(sorted([1.0, *rest], reverse=True)) * top
    return matrix_with_spectrum(q, s, v, rows, cols)


@st.composite
def opteq_cases(draw: Any, form: str = "conjugate", acts: tuple[str, ...] = ACTIVATIONS,
                n: tuple[int, int] = (2, 7), m: tuple[int, int] = (1, 7),
                d: tuple[int, int] = (1, 4),
                batch: tuple[int, int] = (1, 3), norm: tuple[float, float] = (0.1, 0.95),
                mu: tuple[float, float] = (1.0, 1.0), wide: bool = True,
                u_norm: float | None = None, min_ratio: float = 0.0) -> OptEqCase:
    """OptEq instances satisfying Theorem 1's assumption ``μ ≥ L_σ||W||₂²`` (with margin
    ``norm < 1``).  ``wide=False`` forces ``m ≤ n`` (``Wᵀ`` injective: ``φ`` evaluable in closed
    form).  ``u_norm`` scales ``U`` to that spectral norm (Proposition 2 needs ``||U||₂ ≤ 1``)."""
    nn_ = draw(st.integers(*n))
    mm = draw(st.integers(m[0], nn_ if not wide else m[1])) if form == "conjugate" else \
        draw(st.integers(*m))
    dd = draw(st.integers(*d))
    bb = draw(st.integers(*batch))
    act = draw(activations(acts))
    mu_v = draw(st.floats(*mu)) if mu[0] < mu[1] else mu[0]
    w = draw(spectral_matrices(mm, nn_, norm, min_ratio)) * np.sqrt(mu_v)
    inj = mm if form == "conjugate" else nn_
    if u_norm is not None:
        u = draw(spectral_matrices(inj, dd, (u_norm * 0.5, u_norm)))
    else:
        u = draw(arrays((inj, dd))) / np.sqrt(dd)
    b = draw(arrays((inj,), -0.5, 0.5))
    x = draw(arrays((bb, dd), -2.0, 2.0))
    z = draw(arrays((bb, nn_), -2.0, 2.0))
    z2 = draw(arrays((bb, nn_), -2.0, 2.0))
    return opteq_case(w, u, b, x, z, z2, activation=act, form=form, mu=mu_v)


@st.composite
def regularized_cases(draw: Any, kind: str = "sq", acts: tuple[str, ...] = DCP_ACTIVATIONS
                      ) -> OptEqCase:
    """Theorem 4: ``φ`` (Theorem 1 form, μ = 1) with ``γ`` in ``extra`` and ``R`` = ``kind``
    (``"sq"``: ½||z||², ``"l1"``: ||z||₁)."""
    case = draw(opteq_cases(form="conjugate", acts=acts, n=(2, 6), m=(1, 6), batch=(1, 2)))
    case.extra.update(gamma=draw(st.floats(0.2, 1.5)), R=kind)
    return case


@st.composite
def deep_cases(draw: Any, L: tuple[int, int] = (2, 4), acts: tuple[str, ...] = ACTIVATIONS,
               alpha: tuple[float, float] = (0.2, 0.9), norm: tuple[float, float] = (0.1, 0.95),
               n: tuple[int, int] = (2, 6), batch: tuple[int, int] = (1, 3)) -> DeepCase:
    """Deep OptEq satisfying Assumption 2 (``||W_l||₂ ≤ 1``, ``L_σ = 1``) with every
    ``||W_l||₂ < 1`` (the composition is then a contraction: a unique equilibrium)."""
    LL = draw(st.integers(*L))
    nn_ = draw(st.integers(*n))
    mm = draw(st.integers(1, 6))
    dd = draw(st.integers(1, 3))
    Ws = [draw(spectral_matrices(mm, nn_, norm)) for _ in range(LL)]
    Us = [draw(arrays((mm, dd))) / np.sqrt(dd) for _ in range(LL)]
    bs = [draw(arrays((mm,), -0.5, 0.5)) for _ in range(LL)]
    x = draw(arrays((draw(st.integers(*batch)), dd), -2.0, 2.0))
    a = draw(st.floats(*alpha))
    return deep_case(Ws, Us, bs, x, activation=draw(activations(acts)), alpha=a)


@st.composite
def sam_cases(draw: Any, n: tuple[int, int] = (2, 6), rest_norm: float = 0.8) -> SAMCase:
    """Hypothesis strategy: an affine ``T`` whose fixed points form a subspace, and ``R``
    (docs/theory.md §6)."""
    nn_ = draw(st.integers(*n))
    k = draw(st.integers(1, nn_ - 1))
    Q = draw(orthogonal(nn_))
    V = draw(orthogonal(nn_))
    rest = sorted(draw(st.lists(st.floats(0.0, rest_norm), min_size=nn_ - k, max_size=nn_ - k)),
                  reverse=True)
    s = np.array([1.0] * k + rest)
    coef = draw(arrays((nn_ - k,), -1.0, 1.0))
    b = Q[:, k:] @ coef  # b ⟂ left singular vectors with s = 1: Fix T is non-empty
    c = draw(arrays((nn_,), -2.0, 2.0))
    return sam_case(Q, s, V, b, c)


_mlp_weight = st.one_of(st.just(0.0), st.floats(1e-3, 2.0), st.floats(-2.0, -1e-3))


@st.composite
def mlp_cases(draw: Any, acts: tuple[str, ...] = ("relu", "tanh"), depth: tuple[int, int] = (1, 4),
              width: tuple[int, int] = (1, 7)) -> MLPCase:
    """Random MLPs (depth = number of Linear layers); zero and rank-deficient layers included
    (a zero layer was a converter bug, now a regression test).  Weight entries are 0 or of
    magnitude in ``[1e-3, 2]``: the converter's factor scales telescope
    (``||W̄_(k+1)|| ≈ ||A_k||/||W̄_k||``) and ``μ_k = ||W̄_(k+1)||²`` under/overflows for layers of
    norm ~1e-200 (a reported robustness limit, outside this property's domain)."""
    widths = [draw(st.integers(*width)) for _ in range(draw(st.integers(*depth)) + 1)]
    ws, bs = [], []
    for k in range(len(widths) - 1):
        shape = (widths[k + 1], widths[k])
        ws.append(draw(hnp.arrays(np.float64, shape, elements=_mlp_weight)) / np.sqrt(widths[k]))
        bs.append(draw(arrays((widths[k + 1],), -1.0, 1.0)))
    x = draw(arrays((draw(st.integers(1, 4)), widths[0]), -2.0, 2.0))
    return mlp_case(ws, bs, x, draw(activations(acts)))


@st.composite
def mopteq_cases(draw: Any, acts: tuple[str, ...] = ACTIVATIONS,
                 norm: tuple[float, float] = (0.1, 0.5), lam: tuple[float, float] = (0.0, 0.1)
                 ) -> MOptEqCase:
    """MOptEq with ``||W_i||₂ ≤ 0.5`` (so ``||W_i||² + ||P||₂ < 1`` for the linear-kernel and H
    parts) and ``λ ≤ 0.1``.  The decorrelation D has a discontinuous gradient (sign changes), so
    no contraction certificate exists; instances whose solve does not converge are rejected by
    the property (``ReferenceFailure``)."""
    shapes = draw(st.sampled_from(MOPTEQ_SHAPES))
    d = draw(st.integers(1, 4))
    sizes = [int(np.prod(s)) for s in shapes]
    Ws = [draw(spectral_matrices(k, k, norm)) for k in sizes]
    Us = [draw(arrays((k, d))) / np.sqrt(d) for k in sizes]
    bs = [draw(arrays((k,), -0.5, 0.5)) for k in sizes]
    x = draw(arrays((draw(st.integers(1, 3)), d), -2.0, 2.0))
    return mopteq_case(shapes, Ws, Us, bs, x, activation=draw(activations(acts)),
                       lam=draw(st.floats(*lam)))


@st.composite
def geq_cases(draw: Any, acts: tuple[str, ...] = ACTIVATIONS, patch: bool | None = None,
              norm: tuple[float, float] = (0.1, 0.95)) -> GEQCase:
    """GEQ with ``||W||₂ < 1`` (and ``||W_h||₂ ≤ 1`` for the patch kernel): ``T`` is then a
    contraction by the derived bound, so the equilibrium exists and is unique."""
    use_patch = draw(st.booleans()) if patch is None else patch
    n = draw(st.integers(2, 7))
    p = 16 if use_patch else draw(st.integers(1, 7))
    d = draw(st.integers(1, 4))
    bsz = draw(st.integers(1, 3))
    W = draw(spectral_matrices(p, n, norm))
    U = draw(spectral_matrices(p, d, (0.3, 1.0), min_ratio=0.2))  # never 0: x moves q
    b = draw(arrays((p,), -0.5, 0.5))
    wh = draw(spectral_matrices(4, draw(st.integers(1, 4)), (0.3, 1.0))) if use_patch else None
    x = draw(arrays((bsz, d), -2.0, 2.0))
    x2 = x + draw(_offsets(bsz, d))  # never x₂ = x₁ (a vacuous input-Lipschitz pair)
    zs = [draw(arrays((bsz, n), -2.0, 2.0)) for _ in range(2)]
    return geq_case(W, U, b, x, x2, zs[0], zs[1], activation=draw(activations(acts)),
                    gamma=draw(st.floats(0.05, 2.0)), W_h=wh)


@st.composite
def _offsets(draw: Any, bsz: int, d: int) -> np.ndarray:
    """Per-row offsets ``δ`` with ``||δ|| ∈ [0.05, 1]`` (a shrunk all-zero direction → ones)."""
    dirs = draw(arrays((bsz, d), -1.0, 1.0))
    dirs[np.linalg.norm(dirs, axis=1) < 1e-3] = 1.0
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    return dirs * draw(arrays((bsz, 1), 0.05, 1.0))


@st.composite
def geq_prop3_cases(draw: Any) -> GEQCase:
    """GEQ Proposition 3's assumptions, drawn so that the statement is informative: σ = ReLU,
    the whole-vector kernel, ``||W||₂, ||U||₂ ∈ [0.1, 0.9]`` (``μ < 1``), ``U`` of full column
    rank (``Δx ≠ 0`` moves ``q``), ``b ∈ [0.2, 1]`` and ``W``'s column signs with
    ``Wᵀb ≥ 0`` (ReLU units on; ``||W||₂`` unchanged), ``γ ∈ [0.005, 0.25]``
    (``κ < 1`` for most draws) and a second input ``x₂ = x₁ + δ`` with ``||δ|| ∈ [0.05, 1]``
    (never ``x₂ = x₁``: the vacuous pairs of independent draws)."""
    n = draw(st.integers(2, 6))
    p = draw(st.integers(2, 6))
    d = draw(st.integers(1, min(4, p)))
    bsz = draw(st.integers(1, 3))
    W = draw(spectral_matrices(p, n, (0.1, 0.9)))
    U = draw(spectral_matrices(p, d, (0.1, 0.9), min_ratio=0.2))
    b = draw(arrays((p,), 0.2, 1.0))
    sign = np.sign(W.T @ b)
    W = W * np.where(sign == 0, 1.0, sign)  # columns with Wᵀb ≥ 0: ReLU units on at z = 0
    x = draw(arrays((bsz, d), -2.0, 2.0))
    x2 = x + draw(_offsets(bsz, d))
    zs = [draw(arrays((bsz, n), -2.0, 2.0)) for _ in range(2)]
    return geq_case(W, U, b, x, x2, zs[0], zs[1], activation="relu",
                    gamma=draw(st.floats(0.005, 0.25)))


@st.composite
def moreau_cases(draw: Any, acts: tuple[str, ...] = ACTIVATIONS) -> OptEqCase:
    """OptEq (Theorem 1 form) with ``α ∈ [0.05, 0.99]`` in ``extra["alpha"]``."""
    case = draw(opteq_cases(form="conjugate", acts=acts, mu=(1.0, 2.0)))
    case.extra["alpha"] = draw(st.floats(0.05, 0.99))
    return case


@st.composite
def perturbation_cases(draw: Any, acts: tuple[str, ...] = CLOSED_FORM_ACTIVATIONS
                       ) -> OptEqCase:
    """Proposition 2: canonical OptEq with ``||W||₂ ≤ 0.95``, ``||U||₂ ≤ 1`` and ``ε`` in
    ``extra["eps"]``."""
    case = draw(opteq_cases(form="canonical", acts=acts, n=(2, 6), m=(1, 6), d=(1, 4),
                            u_norm=1.0))
    case.extra["eps"] = draw(st.floats(1e-3, 0.3))
    return case
