"""The lifted problem of verify reads each term's own domain box and lifting role
(``Term.domain_box``, ``Term.lift_role``, ``Term.lift_prox``) instead of a type switch."""

from __future__ import annotations

import numpy as np

import convex_eq as ce
from convex_eq.terms.base import Term
from convex_eq.terms.potential import Potential
from verify.lifting import lift


def test_built_in_terms_state_their_domain_boxes():
    z = ce.State("z", 3)
    lo, hi = Potential("relu", z).domain_box(3)
    assert np.all(lo == 0) and np.all(np.isinf(hi))  # dom f_relu = [0, ∞)
    lo, hi = ce.LinfBallIndicator(z, 2.0).domain_box(3)
    assert np.all(lo == -2) and np.all(hi == 2)
    lo, hi = Potential("tanh", z).domain_box(3)  # open (−1, 1): moved inside by 1e-12
    assert np.all(-1 < lo) and np.all(lo < -1 + 1e-11) and np.all(hi < 1)
    assert Term.domain_box(ce.SqNorm(z), 3) is None
    assert ce.L1(z).lift_role == "value" and Potential("relu", z).lift_prox is False


def test_lifting_takes_the_box_a_term_declares():
    """A term that declares a different box changes the lifted bounds: the lifting has no
    private table of domains."""
    z = ce.State("z", 2)
    obj = ce.Objective([Potential("relu", z), ce.SqNorm(z)])
    p = lift(obj, {}, None)
    assert np.all(p.bounds()[0][0] == 0.0)

    class Shifted(Potential):
        def domain_box(self, size, env=None):
            return np.full(size, 0.5), np.full(size, np.inf)

    p2 = lift(ce.Objective([Shifted("relu", z), ce.SqNorm(z)]), {}, None)
    assert p2.bounds()[0][0] == 0.5
