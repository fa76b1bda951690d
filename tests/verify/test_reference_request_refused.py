"""A ``reference=`` request that cannot verify a layer's claim is a typed error naming the
reason and the requests that apply, never silently replaced by another reference."""

from __future__ import annotations

import numpy as np
import pytest

import convex_eq as ce
import lowering
import verify
from convex_eq import models

X = np.random.default_rng(0).normal(size=(1, 4))


@pytest.mark.parametrize("requested", ["cvxpy", "numeric"])
def test_a_convex_reference_on_a_non_convex_claim_is_refused(requested: str) -> None:
    """GEQ's claim is a stationary point: CVXPY and the numeric reference verify minimizers of
    certified-convex objectives, so asking for them names the local reference instead."""
    d = lowering.lower(models.geq(n=6, p=6, d=4, seed=0))
    assert d.claim.kind == "stationary point"
    with pytest.raises(ce.OptionError) as err:
        verify.check(d, X, reference=requested)
    text = str(err.value)
    assert f"reference={requested!r} does not apply" in text and "stationary point" in text
    assert "'auto' or 'local'" in text


def test_the_local_reference_of_a_deep_composition_is_refused() -> None:
    """A deep composition is verified by Theorem 2 and, for L = 2, Corollary 1 (CVXPY or the
    numeric reference); there is no local reference to ask for."""
    d = lowering.lower(models.deep_opteq(L=2, n=4, m=4, d=4, alpha=0.5, seed=0))
    with pytest.raises(ce.OptionError, match="'auto' or 'cvxpy' or 'numeric'"):
        verify.check(d, X, reference="local")
    with pytest.raises(ce.OptionError, match="Theorem 2"):
        verify.check(lowering.lower(models.deep_opteq(L=3, n=4, m=4, d=4, seed=0)), X,
                     reference="cvxpy")


def test_a_non_cvxpy_reference_of_an_inclusion_layer_is_refused() -> None:
    d = lowering.lower(models.mon(n=4, d=4, seed=0))
    with pytest.raises(ce.OptionError, match="inclusion and saddle layers"):
        verify.check(d, X, reference="local")
    with pytest.raises(ce.OptionError, match="unknown reference"):
        verify.check(d, X, reference="magic")


def test_a_request_that_applies_still_runs() -> None:
    """A certified convex claim takes every request; the refusal is static (a certificate
    violated at the current weights is reported by the check, not refused)."""
    d = lowering.lower(models.opteq(n=4, m=4, d=4, form="conjugate", weight_norm=0.8, seed=0))
    assert verify.check(d, X, reference="cvxpy").reference.kind == "cvxpy"
    assert verify.check(d, X, reference="local", starts=1).reference.kind == "local"
    bad = lowering.lower(models.opteq(n=4, m=4, d=4, form="conjugate", weight_norm=1.3, seed=0))
    rep = verify.check(bad, X, reference="numeric", starts=1)
    assert not rep.passed and rep.status.startswith("claim not certified here")
