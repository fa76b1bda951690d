"""Fuzz: malformed objective trees and calls.

Every drawn malformed case (``fuzz.strategies.malformed``: shape mismatches, invalid scales,
non-monotone / non-1-Lipschitz sympy σ, unsupported compositions, bad runtime arguments) raises a
project exception (``convex_eq.ConvexEqError`` subclass — never a bare ``AssertionError``,
``KeyError``, ``IndexError``, ``TypeError`` or a NumPy/torch broadcasting ``RuntimeError``) whose
message names the offending term.  Each kind is its own test (so every kind runs in CI), with
``max(3, max_examples // 5)`` drawn sizes/values per kind.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, note, settings

import convex_eq as ce
from tests.fuzz.stats import fuzz_stats, record  # noqa: F401  (autouse: writes the outcome counts)
from tests.fuzz.strategies import MALFORMED_KINDS, Malformed, malformed

PER_KIND = max(3, settings().max_examples // 5)


def run_malformed(case: Malformed) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            case.run()
        except ce.ConvexEqError as err:
            assert isinstance(err, case.types), (
                f"{case.kind}: expected {[t.__name__ for t in case.types]}, got "
                f"{type(err).__name__}: {err}")
            msg = str(err)
            assert any(n in msg for n in case.names), (
                f"{case.kind}: the message does not name the offending term (one of "
                f"{case.names}): {msg}")
            return type(err).__name__
        except Exception as err:  # the property: nothing untyped escapes
            raise AssertionError(
                f"{case.kind}: untyped {type(err).__name__} escaped: {err}") from err
    raise AssertionError(f"{case.kind}: no error raised")


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_raises_a_documented_error_naming_the_term(kind: str) -> None:
    @settings(max_examples=PER_KIND)
    @given(malformed(kinds=(kind,)))
    def inner(case: Malformed) -> None:
        note(repr(case))
        record("malformed", f"{kind}/{run_malformed(case)}")

    inner()
