"""Helpers shared by the verify tests."""

from __future__ import annotations

import warnings

import lowering
from convex_eq import (
    Objective,
)


# ----------------------------------------------------------------- verify (false FAILs)
def verified(phi: Objective, x: object = None) -> object:
    import verify

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify.check(lowering.lower(phi), {} if x is None else x, starts=2)
