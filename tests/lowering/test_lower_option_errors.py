"""``lower``'s input errors: an objective without a state, option values that are not valid,
and options that do not apply are typed errors naming the fix, never ignored."""

from __future__ import annotations

import math

import numpy as np
import pytest

import convex_eq as ce
import lowering
from convex_eq import L1, Input, Linear, LoweringError, OptionError, SqNorm, State, models


def test_an_objective_without_a_state_is_a_typed_error() -> None:
    x = Input("x", 3)
    with pytest.raises(LoweringError, match="no state") as err:
        lowering.lower(ce.objective(SqNorm(x)))
    assert "State(" in err.value.hint


@pytest.mark.parametrize(("option", "value", "listed"), [
    ("deep_form", "bogus", "'composition', 'multiblock'"),
    ("regularizer", "bogus", "'auto', 'prox', 'gradient'"),
    ("regularizer", None, "'auto', 'prox', 'gradient'"),
    ("tau", -1.0, "> 0"),
    ("tau", math.nan, "> 0"),
    ("tau", "0.5", "> 0"),
])
def test_invalid_option_values_are_refused_with_the_valid_ones(option: str, value: object,
                                                                listed: str) -> None:
    target = (models.deep_opteq(L=2, n=4, m=4, d=2) if option == "deep_form"
              else models.opteq(n=4, m=4, d=2))
    with pytest.raises(OptionError, match=f"{option}=") as err:
        lowering.lower(target, **{option: value})
    assert listed in err.value.hint


def test_options_that_do_not_apply_are_refused() -> None:
    phi = models.opteq(n=4, m=4, d=2)
    with pytest.raises(OptionError, match="DeepComposition only"):
        lowering.lower(phi, deep_form="multiblock")
    with pytest.raises(OptionError, match="forward–backward rule only"):
        lowering.lower(phi, tau=0.5)


def test_valid_options_still_lower() -> None:
    comp = models.deep_opteq(L=2, n=4, m=4, d=2)
    assert len(lowering.lower(comp, deep_form="multiblock").blocks) == 2
    z = State("z", 3)
    q = ce.Constant("Q", np.diag([2.0, 3.0, 4.0]))
    fb = L1(z) * 0.3 + ce.QuadraticForm(q, z) - Linear(ce.Constant("c", np.ones(3)), z)
    assert lowering.lower(fb, tau=0.2).lower_options == {"tau": 0.2}
