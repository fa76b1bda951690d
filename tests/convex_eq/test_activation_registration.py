"""``register_activation`` checks what it registers as ``from_sympy`` checks a ``σ``:
nondecreasing and 1-Lipschitz (and within the Lipschitz constant it declares), refused with a
typed error naming the condition at registration, not later with an unrelated message."""

from __future__ import annotations

import pytest
import torch

from convex_eq import ActivationError, get_activation, register_activation
from convex_eq.activations import Tanh, registry


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations of these tests stay here."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_CHECKED", set(), raising=False)


class GainTanh(Tanh):
    """``σ(t) = tanh(g t)/g``-style steepness: ``σ'(0) = g``, 1-Lipschitz iff ``g ≤ 1``."""

    def __init__(self, gain: float = 1.0) -> None:
        self.gain, self.name = gain, f"gain_tanh_{gain:g}"

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.gain * t)

    def sigma_prime(self, t: torch.Tensor) -> torch.Tensor:
        return self.gain / torch.cosh(self.gain * t) ** 2


def test_a_non_monotone_sigma_is_refused_at_registration() -> None:
    """sin decreases (σ'(π) = −1): refused as not nondecreasing, and not registered."""
    with pytest.raises(ActivationError, match="not nondecreasing") as err:
        register_activation("mysin", torch.sin)
    assert "min σ' = -1" in str(err.value) and "1-Lipschitz" in err.value.hint
    with pytest.raises(ActivationError, match="unknown activation"):
        get_activation("mysin")


def test_a_steep_activation_is_refused_at_registration() -> None:
    with pytest.raises(ActivationError, match="not 1-Lipschitz: max σ' = 3"):
        register_activation("steep", lambda: GainTanh(3.0))


def test_a_lipschitz_constant_below_the_slope_is_refused() -> None:
    """The declared ``L_σ`` enters contraction bounds: tanh declared 0.5-Lipschitz is refused
    (σ'(0) = 1)."""
    class Understated(Tanh):
        lipschitz = 0.5

    with pytest.raises(ActivationError, match="0.5-Lipschitz as it declares") as err:
        register_activation("understated", Understated)
    assert "declare lipschitz" in err.value.hint


def test_a_valid_sigma_in_place_of_a_factory_names_the_way_to_declare_it() -> None:
    with pytest.raises(ActivationError, match="takes a factory that returns an Activation") as e:
        register_activation("mytanh", torch.tanh)
    assert "from_sympy" in e.value.hint


def test_valid_factories_register_and_parameters_are_checked_when_built() -> None:
    register_activation("gain_tanh", GainTanh)
    assert get_activation("gain_tanh", gain=0.5).sigma_prime(torch.zeros(())) == 0.5
    with pytest.raises(ActivationError, match="not 1-Lipschitz: max σ' = 2"):
        get_activation("gain_tanh", gain=2.0)

    def needs_gain(gain: float) -> GainTanh:  # cannot be built without parameters
        return GainTanh(gain)

    register_activation("needs_gain", needs_gain)
    assert get_activation("needs_gain", gain=1.0).name == "gain_tanh_1"
    with pytest.raises(ActivationError, match="not 1-Lipschitz"):
        get_activation("needs_gain", gain=1.5)
