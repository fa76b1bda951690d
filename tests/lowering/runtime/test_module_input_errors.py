"""Typed errors for inputs the emitted module cannot take: what was wrong, which input, and what
to do (never an untyped IndexError / RuntimeError from deep inside, never an input ignored)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowering
from convex_eq import Antiderivative, SqNorm, State, Weight, models
from convex_eq.errors import InputTypeError, ShapeError


def _module() -> torch.nn.Module:
    return lowering.lower(models.opteq()).torch_module()


def test_a_numpy_input_is_a_type_error_naming_the_conversion() -> None:
    with pytest.raises(InputTypeError, match="numpy.ndarray.*torch.from_numpy") as err:
        _module()(np.zeros((2, 8)))
    assert isinstance(err.value, TypeError)


def test_a_meta_input_is_refused_before_the_solve() -> None:
    with pytest.raises(InputTypeError, match="meta device"):
        _module()(torch.zeros(2, 8, device="meta"))


def test_an_unknown_input_name_is_refused() -> None:
    with pytest.raises(ShapeError, match=r"unknown input name\(s\) \['bogus'\]"):
        _module()({"x": torch.zeros(2, 8), "bogus": torch.zeros(2, 3)})


def test_a_layer_without_input_refuses_a_tensor() -> None:
    """A layer whose objective declares no input, called with ``torch.zeros(3, 0)``: a typed
    error saying to call it without one (it used to raise ``IndexError``); without an input it
    returns the equilibrium of ``z = Wᵀ relu(W z + b)`` with ``W = I/2``, ``b = 1``:
    ``z = ½ relu(z/2 + 1)``, so ``z = 2/3`` (rate 1/4: tol 1e-12 gives it to 1e-12)."""
    z = State("z", 4)
    w = Weight("W", (4, 4), np.eye(4) * 0.5)
    b = Weight("b", 4, np.ones(4))
    m = lowering.lower(Antiderivative("relu", w @ z + b).conjugate() - SqNorm(z)).torch_module(
        dtype=torch.float64, tol=1e-12)
    with pytest.raises(ShapeError, match="no input"):
        m(torch.zeros(3, 0))
    torch.testing.assert_close(m(), torch.full((1, 4), 2 / 3, dtype=torch.float64),
                               rtol=1e-10, atol=0)
