"""Coercion of weights/arrays into operators."""

from __future__ import annotations

from typing import Any

from .base import LinOp
from .dense import Dense


def as_operator(x: Any) -> LinOp:
    """``x`` if it is a LinOp; a ``Dense`` for a Weight/Constant/array (``v ↦ X v``)."""
    if isinstance(x, LinOp):
        return x
    return Dense(x)
