"""Weight normalisation of the emitted module's weights: ``W = g·V/||V||``, one gain per output
row (dense) or output filter (convolution), the convergence device of MDEQ and of the GEQ paper
(docs/theory.md §3.2), by ``torch.nn.utils.parametrizations.weight_norm`` on the module's
weight dictionary.

``V`` starts at the declared weight and ``g`` at its row norms, so the layer is unchanged at
construction; training then moves ``g`` and ``V`` (``state_dict`` holds them as
``weights.parametrizations.<name>.original0/1``).  It bounds no operator norm: a certified
condition on a normalised weight is not kept by it, and the module refuses to put a weight under
both weight normalisation and spectral-norm weight control (two controls of one weight, the
second silently undoing the first).  Parametrized modules pickle only through ``state_dict``
(torch's own refusal says so).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch.nn.utils.parametrizations import weight_norm

from convex_eq.errors import OptionError


def normalize_weights(m: Any, names: Collection[str]) -> None:
    """Reparametrise the weights ``names`` of module ``m`` as ``g·V/||V||`` (per output row or
    filter); a name that is not a trainable weight of ``m`` is a typed error."""
    known = list(m.weights.keys())
    for name in names:
        if name not in known:
            raise OptionError(f"weight_normalization names '{name}', which is not a trained "
                              "weight of this layer", term="torch_module",
                              hint=f"trained weights: {known}")
        weight_norm(m.weights, name, dim=0)


def refuse_double_control(names: Collection[str], control: Any) -> None:
    """A typed error when weight control also rescales a normalised weight."""
    both = sorted(set(names) & {n for _, n, _ in (control.targets if control else [])})
    if both:
        raise OptionError(
            f"weight(s) {both} would be under two controls: weight normalisation and "
            f"spectral-norm weight control ({control.mode}, from the certificate's norm "
            "conditions)", term="torch_module",
            hint="pass weight_control=None (weight normalisation then controls them, and the "
            "certificate's conditions on them are not kept), or drop them from "
            "weight_normalization")
