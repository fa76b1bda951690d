"""Higher-order derivatives of the activations' numeric proxes and potentials.

``prox_{t f_σ}(v) = σ(s)`` with ``t s + (1 − t) σ(s) = v`` is solved numerically; autograd must
see the implicit function itself, so that second and third derivatives include σ's curvature.
The reference is independent of the package: the same scalar equation solved by
``scipy.optimize.brentq`` on a numpy transcription of σ, differentiated by central differences
with one Richardson step (truncation O(h⁴)).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import sympy as sp
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy.optimize import brentq

from convex_eq.activations import from_sympy, get_activation

T64 = torch.float64

#: numpy transcriptions of σ, written here from their definitions (not the package's code)
SIGMA: dict[str, Callable[[float], float]] = {
    "tanh": np.tanh,
    "sigmoid": lambda s: 0.5 * (1.0 + np.tanh(0.5 * s)),
    "softplus": lambda s: float(np.logaddexp(0.0, s)),
    "relu": lambda s: max(s, 0.0),
    "leaky_relu": lambda s: s if s > 0 else 0.01 * s,
    "hardtanh": lambda s: min(max(s, -1.0), 1.0),
    "identity": lambda s: s,
}
#: points where σ has a kink (the prox is piecewise linear there)
KINKS = {"relu": (0.0,), "leaky_relu": (0.0,), "hardtanh": (-1.0, 1.0)}
SCALES = (0.3, 0.5, 1.0, 2.0)


def _prox_ref(name: str, v: float, t: float) -> float:
    """``σ(s)`` with ``t s + (1 − t) σ(s) = v`` by brentq (bracket: the left side has slope in
    ``[min(t, 1), max(t, 1)]``, so ``|s − v| ≤ |v − h(v)|/min(t, 1)``)."""
    sig = SIGMA[name]

    def h(s: float) -> float:
        return t * s + (1 - t) * sig(s) - v

    rad = abs(h(v)) / min(t, 1.0) + 1.0
    s = brentq(h, v - rad, v + rad, xtol=1e-15, rtol=1e-15, maxiter=500)
    return float(sig(s))


def _d2_ref(f: Callable[[float], float], v: float, h: float = 1e-2) -> float:
    """Second central difference with one Richardson step: error O(h⁴ f⁽⁶⁾) + O(ε/h²)."""
    def d2(k: float) -> float:
        return (f(v + k) - 2 * f(v) + f(v - k)) / (k * k)

    return (4 * d2(h / 2) - d2(h)) / 3


def _d3_ref(f: Callable[[float], float], v: float, h: float = 2e-2) -> float:
    """Third central difference with one Richardson step: error O(h⁴ f⁽⁷⁾) + O(ε/h³)."""
    def d3(k: float) -> float:
        return (f(v + 2 * k) - 2 * f(v + k) + 2 * f(v - k) - f(v - 2 * k)) / (2 * k**3)

    return (4 * d3(h / 2) - d3(h)) / 3


def _autograd(fn: Callable[[torch.Tensor], torch.Tensor], v: float, order: int) -> float:
    x = torch.tensor(v, dtype=T64, requires_grad=True)
    y = fn(x)
    for k in range(order):
        if not y.requires_grad:  # a derivative that autograd sees as constant in x
            return 0.0
        (y,) = torch.autograd.grad(y, x, create_graph=k < order - 1, materialize_grads=True)
    return float(y)


@given(name=st.sampled_from(sorted(SIGMA)), t=st.sampled_from(SCALES),
       v=st.floats(-4.0, 4.0, allow_nan=False))
def test_second_derivative_of_scaled_prox_matches_scipy_root_solve(name: str, t: float,
                                                                  v: float) -> None:
    """d²prox_{t f_σ}/dv² for every registered activation and scale.  Tolerance 1e-6 (absolute
    plus relative): the reference's Richardson truncation is ~h⁴ = 1e-8 times a sixth
    derivative of order ≤ 10² here, its rounding ~16·1e-15/h² ≈ 2e-9 (brentq to 1e-15);
    autograd's value is exact to ~1e-15.  Measured agreement ≤ 4e-9 on this range."""
    kinks = [t * k + (1 - t) * SIGMA[name](k) for k in KINKS.get(name, ())]
    assume(all(abs(v - k) > 0.05 for k in kinks))  # the differences must not straddle a kink
    act = get_activation(name)
    ad = _autograd(lambda x: act.prox(x, t), v, 2)
    ref = _d2_ref(lambda u: _prox_ref(name, u, t), v)
    assert abs(ad - ref) <= 1e-6 * (1 + abs(ref)), (name, t, v, ad, ref)


def test_scaled_tanh_prox_second_derivative_at_reported_points() -> None:
    """prox_{0.5 f_tanh}'' at v = 0.3, −0.7, 1.2 is −0.308, 0.752, −0.798 (scipy root solve and
    finite differences); a slope-detached Newton attachment read −0.590, 1.196, −0.943.
    Tolerances as in the property above."""
    act = get_activation("tanh")
    for v, expected in ((0.3, -0.308), (-0.7, 0.752), (1.2, -0.798)):
        ad = _autograd(lambda x: act.prox(x, 0.5), v, 2)
        ref = _d2_ref(lambda u: _prox_ref("tanh", u, 0.5), v)
        assert abs(ad - ref) <= 1e-6 * (1 + abs(ref))
        assert round(ref, 3) == expected


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "softplus"])
@pytest.mark.parametrize("v", [0.0, 0.4, -1.3])
def test_third_derivative_of_scaled_prox_matches_scipy_root_solve(name: str, v: float) -> None:
    """Any order autograd asks for, shown at the third (v = 0 included: the derivatives of
    tanh's σ' there must not be those of |t|).  Tolerance 1e-5 (absolute plus relative): the
    reference's truncation is ~h⁴ = 2e-7 times a seventh derivative of order ≤ 10 here, its
    rounding ~20·1e-15/h³ ≈ 3e-9; measured ≤ 5e-7."""
    act = get_activation(name)
    ad = _autograd(lambda x: act.prox(x, 0.5), v, 3)
    ref = _d3_ref(lambda u: _prox_ref(name, u, 0.5), v)
    assert abs(ref) > 1e-3 or name == "sigmoid"  # (sigmoid's third derivative is small here)
    assert abs(ad - ref) <= 1e-5 * (1 + abs(ref)), (name, v, ad, ref)


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "softplus"])
@pytest.mark.parametrize("w", [-0.7, -1.2, -0.05])
def test_second_derivative_of_conjugate_potential_matches_scipy(name: str, w: float) -> None:
    """``(f_σ*)'' (w) = d σ(s(w))/dw`` with ``s − σ(s) = w``: the derivative of the attached
    gradient, counted once (the value-plus-gradient attachment counted it twice).  Reference:
    brentq on ``s − σ(s) = w`` and Richardson differences of ``σ(s(w))``'s first difference;
    tolerance as for the prox."""
    act = get_activation(name)
    sig = SIGMA[name]

    def grad_ref(u: float) -> float:  # (f*)'(u) = σ(s(u))
        s = brentq(lambda s: s - sig(s) - u, -60.0, 60.0, xtol=1e-15, rtol=1e-15, maxiter=500)
        return float(sig(s))

    h = 1e-3
    ref = (4 * (grad_ref(w + h / 2) - grad_ref(w - h / 2)) / h
           - (grad_ref(w + h) - grad_ref(w - h)) / (2 * h)) / 3
    ad = _autograd(act.conjugate_potential, w, 2)
    assert abs(ad - ref) <= 1e-6 * (1 + abs(ref)), (name, w, ad, ref)


def test_second_derivative_of_numeric_inverse_matches_scipy() -> None:
    """An activation without a closed-form inverse, ``σ(t) = (t + tanh t)/2`` (sympy finds
    none): ``σ⁻¹`` is a numeric root whose second derivative ``−σ''/σ'³`` autograd must see,
    and with it ``∇f_σ = σ⁻¹ − id``.  Reference and tolerance as for the prox."""
    t = sp.Symbol("t")
    act = from_sympy((t + sp.tanh(t)) / 2, t, name="half_tanh_plus_id")

    def inv_ref(u: float) -> float:
        return brentq(lambda s: 0.5 * (s + np.tanh(s)) - u, -60.0, 60.0, xtol=1e-15,
                      rtol=1e-15, maxiter=500)

    for u in (0.2, -0.9, 1.7):
        ref = _d2_ref(inv_ref, u)
        assert abs(ref) > 1e-2
        assert abs(_autograd(act.inverse, u, 2) - ref) <= 1e-6 * (1 + abs(ref))
        assert abs(_autograd(act.potential_grad, u, 2) - ref) <= 1e-6 * (1 + abs(ref))
