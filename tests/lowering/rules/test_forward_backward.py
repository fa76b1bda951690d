"""The forward–backward rule (lowering/rules/forward_backward.py): a prox step on one prox-able
term after a gradient step on the smooth rest, also when every term is smooth; negative
multiples of prox-able terms are never taken as the prox term; an envelope whose inner objective
reads an input is proxed with the input's values."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import convex_eq as ce
import lowering
import verify
from convex_eq import (
    L1,
    Input,
    Linear,
    Objective,
    Potential,
    SqNorm,
    State,
    Weight,
    moreau,
)
from convex_eq.operators import Dense

T64 = torch.float64


def test_forward_backward_with_only_smooth_terms_uses_one_as_the_prox_term() -> None:
    """``M^μ[c||z||₁](z) + ½||z − Ux||²`` (all smooth): one prox-able term becomes g, the
    printed gradient step keeps its parentheses, and T's fixed point is the minimizer."""
    z, x = ce.State("z", 4), ce.Input("x", 3)
    U = ce.Weight("U", (4, 3), np.random.default_rng(0).normal(size=(4, 3)))
    phi = ce.moreau(ce.L1(z) * 0.3, 0.5) + ce.SqNorm(z - U @ x)
    d = lowering.lower(phi)
    assert d.derivation.steps[-1].rule == "forward–backward fallback"
    assert "(z - (z - U x))" in d.describe()
    xv = torch.as_tensor(np.random.default_rng(1).normal(size=(2, 3)))
    m = d.torch_module(dtype=T64, tol=1e-12, max_iter=500)
    zs = m(xv).detach()
    u = xv @ torch.as_tensor(U.value).T  # the unregularized minimizer, which z* must not be
    zz = zs.clone().requires_grad_()
    g = torch.autograd.grad(phi.value_tensor({"z": zz, "x": xv}).sum(), zz)[0]
    assert float(g.abs().max()) < 1e-9, "gradient of the (smooth) objective vanishes at z*"
    assert not torch.allclose(zs, u)


@pytest.mark.parametrize("neg", ["l1", "potential"])
def test_negative_multiple_of_a_proxable_term_is_not_lowered_as_a_prox_step(neg: str) -> None:
    """−||z||₁ or −Σf_σ(z) (``Term.prox`` refuses a negative coefficient) is not taken as the
    prox term: the objective is refused at lowering, naming it.

    Pins: such a term was taken as the prox term, and the derived T raised ScaleError on every
    evaluation."""
    z = State("z", 3)
    t = L1(z) * -1.0 if neg == "l1" else Potential("tanh", z) * -1.0
    obj = Objective([t, SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z)])
    with pytest.raises(ce.LoweringError) as err:
        lowering.lower(obj)
    assert str(obj) in str(err.value)


def test_negative_l1_in_canonical_form_is_not_an_extra_prox() -> None:
    """The canonical form with an extra ``−0.1·||z||₁``: refused at lowering, not proxed."""
    z = State("z", 3)
    obj = Objective([Potential("relu", z), SqNorm(z), L1(z) * -0.1,
                     SqNorm(Dense(Weight("W", (3, 3), 0.5 * np.eye(3))) @ z) * -1.0])
    with pytest.raises(ce.LoweringError):
        lowering.lower(obj)


def test_prox_of_an_envelope_whose_inner_objective_reads_an_input() -> None:
    """M¹[c||z||₁ + <Ux, z>] as the prox term of forward–backward: T evaluates (the Prox node
    passes the input values to the envelope's prox) and verify passes the layer.

    Pins: the Prox node called the envelope's prox without the input values, and T raised "no
    value given for input 'x'"."""
    rng = np.random.default_rng(0)
    z, x = State("z1", 4), Input("x", 3)
    U = Weight("U3", (4, 3), rng.normal(size=(4, 3)))
    phi = moreau(L1(z) * 0.5 + Linear(U @ x, z), 2.0) * 2 + moreau(ce.LinfBallIndicator(z), 1.0)
    d = lowering.lower(phi)
    assert "prox_{2·M^2[0.5·||z1||₁ + <U3 x, z1>](z1)}" in d.describe()  # the envelope is g
    out = d.torch_module(dtype=T64)(torch.ones(2, 3, dtype=T64))
    assert torch.isfinite(out).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify.check(d, rng.normal(size=(2, 3)))
    assert rep.passed, rep
