"""Hypothesis strategies for the theorem properties: weights that satisfy each theorem's
assumptions (spectral scaling), registry activations, inputs, α, γ and sizes.

Every strategy draws plain arrays and passes them to a *builder* (``opteq_case``, ``deep_case``,
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

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from convex_eq import models

T64 = torch.float64

#: every activation of the registry (all nondecreasing and 1-Lipschitz)
ACTIVATIONS = ("identity", "relu", "leaky_relu", "hardtanh", "tanh", "sigmoid", "softplus")
#: potentials that cancel exactly against quadratics: the objectives are QPs
#: (docs/theory.md §1, §9.1)
DCP_ACTIVATIONS = ("identity", "relu", "leaky_relu", "hardtanh")
#: activations whose potential has a closed form (softplus uses numeric quadrature)
CLOSED_FORM_ACTIVATIONS = ("identity", "relu", "leaky_relu", "hardtanh", "tanh", "sigmoid")

_unit = st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False, allow_subnormal=False)


def activations(names: tuple[str, ...] = ACTIVATIONS) -> st.SearchStrategy[str]:
    """Activation names from the registry."""
    return st.sampled_from(names)


def arrays(shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0
           ) -> st.SearchStrategy[np.ndarray]:
    """Float64 arrays with entries in ``[lo, hi]``."""
    el = st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    return hnp.arrays(np.float64, shape, elements=el)


def orthogonal_from(a: np.ndarray) -> np.ndarray:
    """An orthogonal matrix from any square array (QR with the sign of R's diagonal fixed)."""
    n = a.shape[0]
    q, r = np.linalg.qr(a + 1e-3 * np.eye(n))
    d = np.sign(np.diag(r))
    d[d == 0] = 1.0
    return q * d


@st.composite
def orthogonal(draw: Any, n: int) -> np.ndarray:
    """A drawn ``n×n`` orthogonal matrix."""
    return orthogonal_from(draw(arrays((n, n))))


def matrix_with_spectrum(q: np.ndarray, s: np.ndarray, v: np.ndarray, rows: int, cols: int
                         ) -> np.ndarray:
    k = len(s)
    return q[:, :k] @ np.diag(s) @ v[:, :k].T if k else np.zeros((rows, cols))


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


def scaled_to_norm(a: np.ndarray, norm: float) -> np.ndarray:
    n = float(np.linalg.norm(a, 2))
    return a * (norm / n) if n > 0 else a


# ----------------------------------------------------------------------------- OptEq
@dataclass
class OptEqCase:
    """One OptEq instance: the declared objective with drawn weights, inputs and probes.

    ``form="conjugate"``: ``φ = ψ* − ½||·||²``, ``ψ = (1/μ)Σσ̃(Wz + Ux + b)`` (Theorem 1);
    ``form="canonical"``: ``Σf_σ(z) + ½||z||² − <Ux + b, z> − ½||Wz||²``
    (docs/theory.md §3 row 1)."""

    objective: Any
    x: torch.Tensor                      # (B, d) inputs
    z: torch.Tensor                      # (B, n) probe states
    z2: torch.Tensor                     # (B, n) second probe states
    activation: str
    form: str
    mu: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def W(self) -> torch.Tensor:
        return self.objective.symbol("W").value

    @property
    def U(self) -> torch.Tensor:
        return self.objective.symbol("U").value

    @property
    def b(self) -> torch.Tensor:
        return self.objective.symbol("b").value

    @property
    def state(self) -> Any:
        return self.objective.states[0]

    def __repr__(self) -> str:  # readable falsifying examples
        return (f"OptEqCase(form={self.form}, act={self.activation}, mu={self.mu:g}, "
                f"W{tuple(self.W.shape)} ||W||={float(torch.linalg.matrix_norm(self.W, 2)):.4g}, "
                f"B={self.x.shape[0]}, extra={self.extra})")


def set_weights(obj: Any, **values: Any) -> None:
    """Overwrite weight/constant symbol values of a seed objective (float64 tensors)."""
    for k, v in values.items():
        obj.symbol(k).value = torch.as_tensor(np.asarray(v, dtype=np.float64), dtype=T64)


def opteq_case(W: np.ndarray, U: np.ndarray, b: np.ndarray, x: np.ndarray, z: np.ndarray,
               z2: np.ndarray | None = None, *, activation: str = "relu",
               form: str = "conjugate", mu: float = 1.0, **extra: Any) -> OptEqCase:
    """Builder: ``W: m×n``, ``U: (m or n)×d``, ``b``, inputs ``x: B×d``, probes ``z: B×n``."""
    m, n = W.shape
    d = U.shape[1]
    obj = models.opteq(n=n, m=m, d=d, activation=activation, form=form, mu=mu)
    set_weights(obj, W=W, U=U, b=b)
    z2 = np.zeros_like(z) if z2 is None else z2
    return OptEqCase(obj, torch.as_tensor(x, dtype=T64), torch.as_tensor(z, dtype=T64),
                     torch.as_tensor(z2, dtype=T64), activation, form, float(mu), dict(extra))


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


# ----------------------------------------------------------------------------- deep OptEq
@dataclass
class DeepCase:
    """Deep OptEq ``T = f_L∘…∘f_1`` with drawn ``W_l`` (``||W_l||₂ ≤ 1``), ``α`` and inputs."""

    composition: Any
    x: torch.Tensor
    activation: str
    alpha: float

    def __repr__(self) -> str:
        norms = [float(torch.linalg.matrix_norm(p.symbol(f"W{i + 1}").value, 2))
                 for i, p in enumerate(self.composition.layers)]
        return (f"DeepCase(L={self.composition.L}, act={self.activation}, alpha={self.alpha:g}, "
                f"||W_l|| = {[round(v, 4) for v in norms]}, B={self.x.shape[0]})")

    def weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(W_i, U_i, b_i)`` of layer ``i`` (1-based)."""
        phi = self.composition.layers[i - 1]
        return tuple(phi.symbol(f"{k}{i}").value for k in "WUb")  # type: ignore[return-value]


def deep_case(Ws: list[np.ndarray], Us: list[np.ndarray], bs: list[np.ndarray], x: np.ndarray,
              *, activation: str = "relu", alpha: float = 0.5) -> DeepCase:
    """Builder: one ``(W_l: m×n, U_l: m×d, b_l)`` per layer."""
    L = len(Ws)
    m, n = Ws[0].shape
    d = Us[0].shape[1]
    comp = models.deep_opteq(L=L, n=n, m=m, d=d, activation=activation, alpha=alpha)
    for i, phi in enumerate(comp.layers, start=1):
        set_weights(phi, **{f"W{i}": Ws[i - 1], f"U{i}": Us[i - 1], f"b{i}": bs[i - 1]})
    return DeepCase(comp, torch.as_tensor(x, dtype=T64), activation, float(alpha))


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


# ----------------------------------------------------------------------------- SAM
@dataclass
class SAMCase:
    """Theorem 5 instance: identity activation, ``W = Q diag(s) Vᵀ`` with ``k`` singular values
    exactly 1 and ``b ⟂`` their left singular vectors (a subspace of fixed points), and
    ``R(z) = ½||z − c||²``."""

    objective: Any
    Q: np.ndarray
    s: np.ndarray
    V: np.ndarray
    b: np.ndarray
    c: np.ndarray
    k: int

    def __repr__(self) -> str:
        return f"SAMCase(n={len(self.s)}, k={self.k}, s={np.round(self.s, 4).tolist()})"


def sam_case(Q: np.ndarray, s: np.ndarray, V: np.ndarray, b: np.ndarray, c: np.ndarray
             ) -> SAMCase:
    n = len(s)
    W = Q @ np.diag(s) @ V.T
    obj = models.opteq(n=n, m=n, d=1, activation="identity", form="conjugate")
    set_weights(obj, W=W, U=np.zeros((n, 1)), b=b)
    return SAMCase(obj, Q, s, V, b, c, int(np.sum(s == 1.0)))


@st.composite
def sam_cases(draw: Any, n: tuple[int, int] = (2, 6), rest_norm: float = 0.8) -> SAMCase:
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


# ----------------------------------------------------------------------------- converter
@dataclass
class MLPCase:
    """A feed-forward network ``Linear → act → … → Linear`` and a batch of inputs."""

    net: torch.nn.Sequential
    x: torch.Tensor
    activation: str
    widths: tuple[int, ...]

    def __repr__(self) -> str:
        return f"MLPCase(act={self.activation}, widths={self.widths}, B={self.x.shape[0]})"


_TORCH_ACTS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid,
               "leaky_relu": torch.nn.LeakyReLU, "hardtanh": torch.nn.Hardtanh,
               "identity": torch.nn.Identity}


def mlp_case(weights: list[np.ndarray], biases: list[np.ndarray], x: np.ndarray,
             activation: str = "relu") -> MLPCase:
    layers: list[torch.nn.Module] = []
    for k, (w, b) in enumerate(zip(weights, biases)):
        lin = torch.nn.Linear(w.shape[1], w.shape[0]).double()
        with torch.no_grad():
            lin.weight.copy_(torch.as_tensor(w))
            lin.bias.copy_(torch.as_tensor(b))
        layers.append(lin)
        if k < len(weights) - 1:
            layers.append(_TORCH_ACTS[activation]())
    widths = (weights[0].shape[1], *[w.shape[0] for w in weights])
    return MLPCase(torch.nn.Sequential(*layers), torch.as_tensor(x, dtype=T64), activation,
                   widths)


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


# ----------------------------------------------------------------------------- MOptEq
@dataclass
class MOptEqCase:
    objective: Any
    x: torch.Tensor
    activation: str
    lam: float
    shapes: tuple[tuple[int, int, int], ...]

    def __repr__(self) -> str:
        return (f"MOptEqCase(shapes={self.shapes}, act={self.activation}, lam={self.lam:g}, "
                f"B={self.x.shape[0]})")


def mopteq_case(shapes: tuple[tuple[int, int, int], ...], Ws: list[np.ndarray],
                Us: list[np.ndarray], bs: list[np.ndarray], x: np.ndarray, *,
                activation: str = "relu", lam: float = 0.1) -> MOptEqCase:
    obj = models.mopteq(shapes=shapes, d=Us[0].shape[1], activation=activation, lam=lam)
    for i in range(len(shapes)):
        set_weights(obj, **{f"W{i + 1}": Ws[i], f"U{i + 1}": Us[i], f"b{i + 1}": bs[i]})
    return MOptEqCase(obj, torch.as_tensor(x, dtype=T64), activation, float(lam), tuple(shapes))


#: branch layouts (channels must agree; spatial sizes differ by integer factors).  Two branches of
#: EQUAL shape are excluded: then P = I and the cyclic coupling −½(H(z1,z2) + H(z2,z1)) = −z1ᵀz2
#: has Hessian norm 1, so ``Lip ∇S ≥ 1``: G is unbounded below along z1 = z2 and the iteration
#: does not converge (measured: relative residual ≈ 0.1 after 300 Anderson steps).
_MOPTEQ_SHAPES = (((2, 2, 2), (2, 1, 1)), ((2, 4, 4), (2, 2, 2)), ((3, 2, 2), (3, 1, 1)),
                  ((2, 2, 2), (2, 2, 2), (2, 1, 1)))


@st.composite
def mopteq_cases(draw: Any, acts: tuple[str, ...] = ACTIVATIONS,
                 norm: tuple[float, float] = (0.1, 0.5), lam: tuple[float, float] = (0.0, 0.1)
                 ) -> MOptEqCase:
    """MOptEq with ``||W_i||₂ ≤ 0.5`` (so ``||W_i||² + ||P||₂ < 1`` for the linear-kernel and H
    parts) and ``λ ≤ 0.1``.  The decorrelation D has a discontinuous gradient (sign changes), so
    no contraction certificate exists; instances whose solve does not converge are rejected by
    the property (``ReferenceFailure``)."""
    shapes = draw(st.sampled_from(_MOPTEQ_SHAPES))
    d = draw(st.integers(1, 4))
    sizes = [int(np.prod(s)) for s in shapes]
    Ws = [draw(spectral_matrices(k, k, norm)) for k in sizes]
    Us = [draw(arrays((k, d))) / np.sqrt(d) for k in sizes]
    bs = [draw(arrays((k,), -0.5, 0.5)) for k in sizes]
    x = draw(arrays((draw(st.integers(1, 3)), d), -2.0, 2.0))
    return mopteq_case(shapes, Ws, Us, bs, x, activation=draw(activations(acts)),
                       lam=draw(st.floats(*lam)))


# ----------------------------------------------------------------------------- GEQ
@dataclass
class GEQCase:
    objective: Any
    x: torch.Tensor          # (B, d) inputs
    x2: torch.Tensor         # (B, d) second inputs (input-Lipschitz bound)
    z: torch.Tensor          # (B, n) probe states
    z2: torch.Tensor
    activation: str
    gamma: float
    patch: bool

    def __repr__(self) -> str:
        w = self.objective.symbol("W").value
        return (f"GEQCase(act={self.activation}, gamma={self.gamma:g}, patch={self.patch}, "
                f"W{tuple(w.shape)} ||W||={float(torch.linalg.matrix_norm(w, 2)):.4g})")


def geq_case(W: np.ndarray, U: np.ndarray, b: np.ndarray, x: np.ndarray, x2: np.ndarray,
             z: np.ndarray, z2: np.ndarray, *, activation: str = "relu", gamma: float = 0.5,
             W_h: np.ndarray | None = None) -> GEQCase:
    """Builder; with ``W_h`` (``4×h``) the patch-split kernel on a ``(1, 4, 4)`` layout."""
    p, n = W.shape
    d = U.shape[1]
    if W_h is None:
        obj = models.geq(n=n, p=p, d=d, activation=activation, gamma=gamma)
        set_weights(obj, W=W, U=U, b=b)
    else:
        obj = models.geq(n=n, p=16, d=d, activation=activation, gamma=gamma, patch=2,
                         image=(1, 4, 4), h=W_h.shape[1])
        set_weights(obj, W=W, U=U, b=b, W_h=W_h)
    tt = lambda a: torch.as_tensor(a, dtype=T64)  # noqa: E731
    return GEQCase(obj, tt(x), tt(x2), tt(z), tt(z2), activation, float(gamma), W_h is not None)


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
    U = draw(arrays((p, d))) / np.sqrt(d)
    b = draw(arrays((p,), -0.5, 0.5))
    wh = draw(spectral_matrices(4, draw(st.integers(1, 4)), (0.3, 1.0))) if use_patch else None
    xs = [draw(arrays((bsz, d), -2.0, 2.0)) for _ in range(2)]
    zs = [draw(arrays((bsz, n), -2.0, 2.0)) for _ in range(2)]
    return geq_case(W, U, b, xs[0], xs[1], zs[0], zs[1], activation=draw(activations(acts)),
                    gamma=draw(st.floats(0.05, 2.0)), W_h=wh)


def rng_arrays(seed: int) -> np.random.Generator:
    """A numpy generator for fixed examples (tests' broken-rule witnesses)."""
    return np.random.default_rng(seed)


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
