"""Learnable hyper-parameters (``Scalar(..., learnable=True)``): parametrised onto their range,
reaching ``T`` differentiably, refused where a rule bakes them or the certificate depends on them
(docs/guide.md, "Learnable hyper-parameters")."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch

import lowering
import verify
from convex_eq.composition import DeepComposition
from convex_eq.errors import OptionError, ScaleError
from convex_eq.models import deep_opteq, geq, mopteq, opteq
from convex_eq.objective import Objective
from convex_eq.symbols import Scalar
from convex_eq.terms import L1, SqNorm
from convex_eq.terms.moreau import MoreauEnvelope
from lowering.runtime.scalars import PARAMETRIZATIONS, LearnableScalar

F64 = torch.float64


def _alpha(v: float = 0.5) -> Scalar:
    return Scalar("alpha", v, low=0.05, high=1.0, learnable=True)


def _deep(alpha: Scalar, seed: int = 0) -> DeepComposition:
    return DeepComposition(deep_opteq(L=2, n=6, m=6, d=3, seed=seed).layers, alpha, name="deep")


def _fd(module: torch.nn.Module, p: torch.nn.Parameter, loss, eps: float = 1e-6) -> float:
    th = p.data.clone()
    with torch.no_grad():
        p.data = th + eps
        lp = float(loss())
        p.data = th - eps
        lm = float(loss())
        p.data = th
    return (lp - lm) / (2 * eps)


def _assert_grad_matches_fd(module: torch.nn.Module, name: str, d_in: int, seed: int,
                            batch: int = 4) -> None:
    """``∂ℓ/∂θ`` of learnable scalar ``name`` (implicit backward) vs a central difference,
    ``ℓ = Σ z*²`` at a seeded float64 input.  Both solves run at 1e-12: the difference
    (h = 1e-6) is exact to O(h²) ≈ 1e-12 plus solver error/h ≈ 1e-6 relative; 1e-5 is ten
    times that."""
    x = torch.randn(batch, d_in, dtype=F64, generator=torch.Generator().manual_seed(seed))

    def loss() -> torch.Tensor:
        out = module(x)
        return sum((t ** 2).sum() for t in out) if isinstance(out, tuple) else (out ** 2).sum()

    loss().backward()
    p = module.scalar_params[name]
    g, fd = float(p.grad), _fd(module, p, loss)
    assert abs(g - fd) <= 1e-5 * max(1.0, abs(fd)), (name, g, fd)


@pytest.mark.parametrize("key", list(PARAMETRIZATIONS))
def test_parametrization_round_trip_and_range(key: tuple[bool, bool]) -> None:
    lo, hi = (-1.0 if key[0] else None), (3.0 if key[1] else None)
    s = Scalar("s", 0.7, low=lo, high=hi, learnable=True)
    m = LearnableScalar(s)
    th = torch.tensor(m.initial_raw(0.7), dtype=F64)
    # float64 round trip of log/exp/sigmoid: relative error ~1e-15, 1e-12 leaves 1000× room
    assert abs(float(m.value(th)) - 0.7) < 1e-12
    for t in (-30.0, -3.0, 0.0, 3.0, 30.0):
        v = float(m.value(torch.tensor(t, dtype=F64)))
        assert (lo is None or v > lo) and (hi is None or v <= hi)


def test_learnable_scalar_must_start_inside_its_range() -> None:
    with pytest.raises(ScaleError, match="starts on a bound"):
        Scalar("alpha", 1.0, low=0.0, low_open=True, high=1.0, learnable=True)
    with pytest.raises(ScaleError, match="needs 0 < low and high ≤ 1"):
        DeepComposition(deep_opteq(L=2, n=4, m=4, d=2).layers,
                        Scalar("alpha", 0.5, low=0.0, high=2.0, learnable=True))


def test_deep_alpha_gradient_matches_finite_differences_and_verify_uses_trained_alpha() -> None:
    module = lowering.lower(_deep(_alpha())).torch_module(
        dtype=F64, tol=1e-12, backward_tol=1e-12, max_iter=500, backward_max_iter=500)
    assert "scalar_params.alpha" in dict(module.named_parameters())
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1))

    def loss() -> torch.Tensor:
        return (module(x) ** 2).sum()

    loss().backward()
    p = module.scalar_params["alpha"]
    g, fd = float(p.grad), _fd(module, p, loss)
    # both solves at 1e-12: the central difference (h = 1e-6) is exact to O(h²) ≈ 1e-12 plus
    # solver error/h ≈ 1e-6 relative; 1e-5 is ten times that
    assert abs(g - fd) <= 1e-5 * max(1.0, abs(fd)), (g, fd)
    with torch.no_grad():
        p.fill_(1.5)  # α = 0.05 + 0.95·sigmoid(1.5) ≈ 0.82, far from the declared 0.5
    assert abs(module.scalar_values()["alpha"] - (0.05 + 0.95 / (1 + math.exp(-1.5)))) < 1e-12
    rep = verify.check(module, x)
    assert rep.passed, rep.failures
    # the reference is the Corollary 1 objective at the trained α: with the declared α it fails
    module2 = lowering.lower(_deep(_alpha())).torch_module(dtype=F64, tol=1e-12)
    module2.load_state_dict(module.state_dict())
    assert module2.scalar_values()["alpha"] == pytest.approx(module.scalar_values()["alpha"])


def test_deep_alpha_trains_inside_range_with_certificate_every_step() -> None:
    """300 Adam steps at lr 3e-2 (weight control on by default): α ∈ (0, 1) and every controlled
    norm within its bound at every step, α actually moves, and the trained layer verifies."""
    torch.manual_seed(0)
    module = lowering.lower(_deep(_alpha(0.3))).torch_module(dtype=F64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 3, dtype=F64, generator=g)
    y = torch.randn(32, 6, dtype=F64, generator=g)
    opt = torch.optim.Adam(module.parameters(), lr=3e-2)
    alphas = []
    for _ in range(300):
        loss = ((module(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        a = module.scalar_values()["alpha"]
        assert 0.0 < a < 1.0
        for bound, target in module.weight_norms().values():
            assert bound <= target * (1 + 1e-12)  # a guaranteed upper bound, not an estimate
        alphas.append(a)
    assert abs(alphas[-1] - 0.3) > 1e-3  # α is trained, not frozen
    assert verify.check(module, x[:4]).passed


def test_l1_lambda_learnable_and_l2_lambda_refused() -> None:
    base = opteq(n=6, m=6, d=3)
    z = base.states[0]
    lam = Scalar("lam", 0.1, low=0.0, learnable=True)
    module = lowering.lower(Objective([*base.terms, lam * L1(z)])).torch_module(
        dtype=F64, tol=1e-12, backward_tol=1e-12)
    _assert_grad_matches_fd(module, "lam", 3, 3)
    lam2 = Scalar("lam", 0.1, low=0.0, learnable=True)
    with pytest.raises(OptionError, match="derivation depends on its value"):
        lowering.lower(Objective([*base.terms, lam2 * SqNorm(z)])).torch_module(dtype=F64)


@pytest.mark.parametrize("kw", [{}, {"patch": 2, "image": (1, 4, 4)}], ids=["whole", "patch"])
def test_geq_gamma_learnable(kw: dict) -> None:
    """GEQ's bandwidth γ (whole and patch-split kernels): the certificate does not depend on
    γ > 0, the gradient matches finite differences."""
    g = geq(n=16, p=16, d=3, **kw)
    gamma = next(s for s in g.symbols if s.name == "gamma")
    gamma.learnable = True
    module = lowering.lower(g).torch_module(dtype=F64, tol=1e-12, backward_tol=1e-12)
    _assert_grad_matches_fd(module, "gamma", 3, 6)


class _BakedL1(L1):
    """ℓ1 whose prox turns the level into a python float (what a careless term would do)."""

    def raw_prox(self, v: torch.Tensor, t, env):
        return super().raw_prox(v, float(t), env)


def test_scalar_baked_by_its_term_is_refused() -> None:
    base = opteq(n=6, m=6, d=3)
    lam = Scalar("lam", 0.1, low=0.0, learnable=True)
    obj = Objective([*base.terms, _BakedL1(base.states[0]) * lam])
    with pytest.raises(OptionError, match="does not read it differentiably"):
        lowering.lower(obj).torch_module(dtype=F64)


def test_fixed_scalar_still_a_buffer_and_pickle_round_trip() -> None:
    module = lowering.lower(_deep(_alpha())).torch_module(dtype=F64)
    with torch.no_grad():
        module.scalar_params["alpha"].fill_(-0.4)
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.scalar_values() == module.scalar_values()
    assert pickle.loads(pickle.dumps(module)).scalar_values() == module.scalar_values()
    fixed = lowering.lower(_deep(Scalar("alpha", 0.5, low=0.0, low_open=True, high=1.0))
                           ).torch_module(dtype=F64)
    assert "scalar_alpha" in fixed.state_dict() and not list(fixed.scalar_params)


def test_mopteq_decorrelation_lambda_learnable() -> None:
    """λ of MOptEq's decorrelation term (a stationary-point layer: the certificate is
    "nonconvex" whatever λ is) trains: its gradient matches finite differences."""
    obj = mopteq()
    lam = next(s for s in obj.symbols if s.name == "lam")
    lam.learnable = True
    module = lowering.lower(obj).torch_module(dtype=F64, tol=1e-12, backward_tol=1e-12)
    _assert_grad_matches_fd(module, "lam", 8, 4, batch=3)


def test_moreau_envelope_mu_learnable() -> None:
    """μ of a Moreau envelope (M^μ[‖·‖₁], the Huber smoothing) added to OptEq: the certificate
    (‖W‖₂ ≤ 1) does not depend on μ, the gradient matches finite differences."""
    base = opteq(n=6, m=6, d=3)
    z = base.states[0]
    mu = Scalar("mu", 0.5, low=0.0, low_open=True, learnable=True)
    module = lowering.lower(Objective([*base.terms, MoreauEnvelope(L1(z), mu) * 0.3])
                            ).torch_module(dtype=F64, tol=1e-12, backward_tol=1e-12)
    _assert_grad_matches_fd(module, "mu", 3, 5)


def test_value_dependent_condition_and_step_size_are_refused() -> None:
    """Two ways a learnable scalar could move what the lowering computed from its declared value
    without changing any condition's text: the generic condition "λ_min(Q) ≥ 0" (its measured
    value moves with λ), and a forward–backward step τ = 1/L computed from λ."""
    from convex_eq import Input, State, Weight
    from convex_eq.models import spectral_weight

    base = opteq(n=6, m=6, d=3, weight_norm=0.5)
    z = base.states[0]
    w2 = spectral_weight("W2", (6, 6), 0.5, seed=7)
    lam = Scalar("lam", 0.5, low=0.0, learnable=True)
    with pytest.raises(OptionError, match="value of λ_min"):
        lowering.lower(Objective([*base.terms, -(lam * SqNorm(w2 @ z))])).torch_module(
            dtype=F64, weight_control=None)
    zz, x = State("z", 6), Input("x", 8)
    a = Weight("A", (8, 6), torch.randn(8, 6, dtype=F64,
                                        generator=torch.Generator().manual_seed(0)) / 3)
    lam2 = Scalar("lam", 1.0, low=0.0, learnable=True)
    with pytest.raises(OptionError, match="derivation step"):
        lowering.lower(Objective([0.1 * L1(zz), lam2 * SqNorm(a @ zz - x)])).torch_module(
            dtype=F64)
