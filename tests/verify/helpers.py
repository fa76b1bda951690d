"""Helpers shared by the verify tests."""

from __future__ import annotations

import warnings

import lowering
import verify
from convex_eq import Objective


def verified(phi: Objective, x: object = None) -> object:
    """``verify.check`` of the lowered ``phi`` at inputs ``x`` (none: an input-free objective)
    with two numeric starts, warnings silenced (the report is what is checked)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify.check(lowering.lower(phi), {} if x is None else x, starts=2)
