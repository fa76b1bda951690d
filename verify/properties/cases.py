"""Instances of the theorem properties: case types and their builders (no hypothesis needed).

A builder (``opteq_case``, ``deep_case``, …) puts plain arrays into the seed objectives of
``convex_eq.models`` (the symbols' values are overwritten, so lowering, CVXPY export, contraction
bounds and emitted modules all see the given weights).  ``verify.properties.strategies`` draws
the arrays with hypothesis and calls these builders; fixed examples and users' own instances go
through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convex_eq import models

T64 = torch.float64


#: every activation of the registry (all nondecreasing and 1-Lipschitz)
ACTIVATIONS = ("identity", "relu", "leaky_relu", "hardtanh", "tanh", "sigmoid", "softplus")


#: potentials that cancel exactly against quadratics: the objectives are QPs
#: (docs/theory.md §1, §9.1)
DCP_ACTIVATIONS = ("identity", "relu", "leaky_relu", "hardtanh")


#: activations whose potential has a closed form (softplus uses numeric quadrature)
CLOSED_FORM_ACTIVATIONS = ("identity", "relu", "leaky_relu", "hardtanh", "tanh", "sigmoid")


def orthogonal_from(a: np.ndarray) -> np.ndarray:
    """An orthogonal matrix from any square array (QR with the sign of R's diagonal fixed)."""
    n = a.shape[0]
    q, r = np.linalg.qr(a + 1e-3 * np.eye(n))
    d = np.sign(np.diag(r))
    d[d == 0] = 1.0
    return q * d


def matrix_with_spectrum(q: np.ndarray, s: np.ndarray, v: np.ndarray, rows: int, cols: int
                         ) -> np.ndarray:
    """``Q[:, :k] diag(s) V[:, :k]ᵀ``: a ``rows × cols`` matrix with singular values ``s``."""
    k = len(s)
    return q[:, :k] @ np.diag(s) @ v[:, :k].T if k else np.zeros((rows, cols))


def scaled_to_norm(a: np.ndarray, norm: float) -> np.ndarray:
    """``a · norm/||a||₂`` (``a`` unchanged when it is zero)."""
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
        """The current value of the weight ``W``."""
        return self.objective.symbol("W").value

    @property
    def U(self) -> torch.Tensor:
        """The current value of the weight ``U``."""
        return self.objective.symbol("U").value

    @property
    def b(self) -> torch.Tensor:
        """The current value of the bias ``b``."""
        return self.objective.symbol("b").value

    @property
    def state(self) -> Any:
        """The state symbol ``z`` of the objective."""
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
    """Identity OptEq with ``W = Q diag(s) Vᵀ`` (``s_i = 1`` gives a subspace of fixed points) for
    SAM."""
    n = len(s)
    W = Q @ np.diag(s) @ V.T
    obj = models.opteq(n=n, m=n, d=1, activation="identity", form="conjugate")
    set_weights(obj, W=W, U=np.zeros((n, 1)), b=b)
    return SAMCase(obj, Q, s, V, b, c, int(np.sum(s == 1.0)))


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
    """An ``nn.Sequential`` of the given linear layers and activations, and its input ``x``."""
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


# ----------------------------------------------------------------------------- MOptEq
@dataclass
class MOptEqCase:
    """A MOptEq objective with drawn weights and a batch of inputs."""
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
    """``models.mopteq`` on ``shapes`` with the drawn weights ``W_i, U_i, b_i``."""
    obj = models.mopteq(shapes=shapes, d=Us[0].shape[1], activation=activation, lam=lam)
    for i in range(len(shapes)):
        set_weights(obj, **{f"W{i + 1}": Ws[i], f"U{i + 1}": Us[i], f"b{i + 1}": bs[i]})
    return MOptEqCase(obj, torch.as_tensor(x, dtype=T64), activation, float(lam), tuple(shapes))


#: branch layouts (channels must agree; spatial sizes differ by integer factors).  Two branches of
#: EQUAL shape are excluded: then P = I and the cyclic coupling −½(H(z1,z2) + H(z2,z1)) = −z1ᵀz2
#: has Hessian norm 1, so ``Lip ∇S ≥ 1``: G is unbounded below along z1 = z2 and the iteration
#: does not converge (measured: relative residual ≈ 0.1 after 300 Anderson steps).
MOPTEQ_SHAPES = (((2, 2, 2), (2, 1, 1)), ((2, 4, 4), (2, 2, 2)), ((3, 2, 2), (3, 1, 1)),
                  ((2, 2, 2), (2, 2, 2), (2, 1, 1)))


# ----------------------------------------------------------------------------- GEQ
@dataclass
class GEQCase:
    """A GEQ objective with inputs, second inputs and probe states for the Lipschitz bounds."""
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


def rng_arrays(seed: int) -> np.random.Generator:
    """A numpy generator for fixed examples (tests' broken-rule witnesses)."""
    return np.random.default_rng(seed)
