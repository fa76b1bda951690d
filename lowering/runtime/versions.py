"""Content keys of the layer's tensors: what every cache of the runtime is keyed on.

A key is ``(shape, dtype, device, Σ_i w_i r_i)`` with ``r`` a fixed pseudo-random vector per size:
any write into a tensor — through ``.data``, ``copy_``, an optimizer step, a loaded state_dict —
changes it (except with negligible probability), which a version counter or a data pointer does
not promise (a write through ``.data`` bumps neither).  All keys of a call come from one stacked
reduction and one host synchronisation; a NaN or Inf entry makes its key's sum non-finite, so
the same reduction checks finiteness.
"""

from __future__ import annotations

import math

import torch

_HALF = (torch.float16, torch.bfloat16)


class Checksums:
    """The fixed pseudo-random weightings (one per size, dtype and device) and the keys."""

    def __init__(self) -> None:
        self._r: dict[tuple, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        return {"_r": {}}  # (tensors on some device: made again on use)

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        dt = torch.float32 if t.dtype in _HALF else t.dtype
        key = (t.numel(), dt, t.device)
        r = self._r.get(key)
        if r is None:
            g = torch.Generator().manual_seed(0x5EED + t.numel())
            # in [1, 2): no weight is 0, so a change of any single entry moves the sum
            r = 1.0 + torch.rand(t.numel(), generator=g, dtype=torch.float64)
            with torch.inference_mode(False):
                r = self._r[key] = r.to(dtype=dt, device=t.device)
        return r

    def keys(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
        """``name → key`` for every tensor, one host synchronisation for all."""
        if not tensors:
            return {}
        sums = []
        for t in tensors.values():
            flat = t.detach().reshape(-1)  # (detached: no graph, no grad-mode switch)
            if flat.dtype in _HALF:
                flat = flat.float()
            sums.append(torch.dot(flat, self._weights(flat)) if flat.numel()
                        else flat.new_zeros(()))
        if len(sums) == 1:
            values = [sums[0].item()]
        else:
            dt = sums[0].dtype
            same = all(s.dtype == dt for s in sums)
            values = torch.stack(sums if same else [s.double() for s in sums]).tolist()
        return {n: (tuple(t.shape), t.dtype, t.device, v)
                for (n, t), v in zip(tensors.items(), values)}


def finite(key: tuple) -> bool:
    """Whether the tensor of this key has only finite entries (its weighted sum is finite)."""
    return math.isfinite(key[3])
