"""Content keys of the layer's tensors, what the runtime's caches are keyed on:
``(shape, dtype, device, checksum)`` with the floating checksum of
:func:`convex_eq.tensor_keys.checksums` — any write (through ``.data``, ``copy_``, an optimizer
step, a loaded state_dict) that moves it changes the key, which a version counter or a data
pointer does not promise.  All keys of a call come from one host synchronisation; a NaN or Inf
entry makes its key's checksum non-finite, so the same reduction checks finiteness.
"""

from __future__ import annotations

import math

import torch

from convex_eq.tensor_keys import checksums


class Checksums:
    """Keys of name → tensor maps (a small object, so that a module can hold its own)."""

    def keys(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
        """``name → key`` for every tensor, one host synchronisation for all."""
        values = checksums(tensors.values())
        return {n: (tuple(t.shape), t.dtype, t.device, v)
                for (n, t), v in zip(tensors.items(), values)}


def finite(key: tuple) -> bool:
    """Whether the tensor of this key may have only finite entries (its checksum is finite; a
    non-finite one is confirmed entry by entry by the caller: the sum may have overflowed)."""
    return math.isfinite(key[3])
