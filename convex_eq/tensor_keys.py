"""Cache keys of tensor *contents*: a value computed from weights is reused only while the
weights' bits are unchanged (docs/guide.md, "Caches and in-place writes").

``data_ptr`` and ``_version`` alone do not identify contents: a write through ``.data`` (e.g.
``W.data.mul_(2)`` under ``no_grad``, as optimisers and weight-surgery code do) changes neither,
and a cache keyed on them keeps answering for the old weights.  :func:`content_key` adds a
checksum of the bits: a linear hash modulo ``2⁶⁴`` of the tensor's raw bit patterns against a
fixed pseudo-random odd weighting.  :func:`checksums` is the cheaper floating-point variant for
per-call checks (finiteness, and caches whose entries stay valid for tiny changes).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ._lazy import torch

#: integer dtype of the same width as each floating / complex-component dtype
_BITS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
#: the weightings kept per (length, device): a few small vectors (weights of one model)
_WEIGHTINGS: OrderedDict[tuple[int, str], Any] = OrderedDict()
_MAX_WEIGHTINGS = 64
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _signed(c: int) -> int:
    """The int64 with the bits of the unsigned 64-bit constant ``c``."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _weighting(n: int, device: Any) -> torch.Tensor:
    """``n`` fixed pseudo-random odd int64 weights (splitmix64 of the index, on ``device``)."""
    key = (n, str(device))
    w = _WEIGHTINGS.get(key)
    if w is not None:
        _WEIGHTINGS.move_to_end(key)
        return w
    h = torch.arange(n, dtype=torch.int64, device=device) + _signed(_MIX[0])
    for mult in _MIX[1:]:
        h = (h ^ ((h >> 31) & ((1 << 33) - 1))) * _signed(mult)  # (logical shift, wrapping)
    w = h | 1  # odd: invertible modulo 2⁶⁴, so a change of one entry always changes the sum
    _WEIGHTINGS[key] = w
    if len(_WEIGHTINGS) > _MAX_WEIGHTINGS:
        _WEIGHTINGS.popitem(last=False)
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t``'s entries as int64 (a view where the width is 64)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    width = t.element_size()
    ints = t.view(getattr(torch, _BITS[width]))
    return ints if width == 8 else ints.to(torch.int64)


def _readable(t: Any) -> bool:
    """A dense tensor with storage (not meta, sparse, or a ``torch.func`` wrapper)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        return False
    try:
        t.data_ptr()
    except RuntimeError:  # a functorch wrapper has no storage
        return False
    return True


def content_key(*tensors: torch.Tensor) -> tuple | None:
    """A hashable key of the tensors' current contents, or None when one of them has no
    readable storage (meta, sparse, a ``torch.func`` wrapper: do not cache).

    Per tensor: ``(shape, dtype, device, data_ptr, _version, checksum)`` with ``checksum =
    Σ_i bits(t_i)·w_i mod 2⁶⁴`` over the raw bit patterns of the entries and fixed odd
    pseudo-random weights ``w_i``.

    Guarantee: any write that changes any bit of an entry — in place, through ``.data``, or a
    new tensor — changes the key, except when the bit changes of several entries cancel in the
    weighted sum modulo 2⁶⁴ (for a change of one entry this is impossible: ``w_i`` is odd;
    for unstructured changes the chance is about 2⁻⁶⁴; the weighting is fixed, so the key is not
    a defence against writes crafted to collide).  Equal contents at the same storage give equal
    keys; a key never asserts equality across storages.

    Cost: one elementwise product and one sum per tensor on its own device (plus a widening
    copy for 8/16/32-bit dtypes) and one host synchronisation per device for all of them
    together; no host copy of the data."""
    meta: list[tuple] = []
    sums: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        if not _readable(t):
            return None
        meta.append((tuple(t.shape), t.dtype, str(t.device), t.data_ptr(), t._version))
        bits = _bits(t)
        sums.setdefault(str(t.device), []).append(
            (bits * _weighting(bits.numel(), t.device)).sum() if bits.numel()
            else torch.zeros((), dtype=torch.int64, device=t.device))
    checksums: dict[str, list[int]] = {d: torch.stack(s).tolist() for d, s in sums.items()}
    order = {d: iter(c) for d, c in checksums.items()}
    return tuple((*m, next(order[m[2]])) for m in meta)


_HALF = ("float16", "bfloat16")
#: the floating weightings of :func:`checksums` per (length, dtype, device)
_FLOAT_WEIGHTINGS: OrderedDict[tuple[int, Any, str], Any] = OrderedDict()


def _float_weighting(n: int, dtype: Any, device: Any) -> torch.Tensor:
    key = (n, dtype, str(device))
    r = _FLOAT_WEIGHTINGS.get(key)
    if r is None:
        g = torch.Generator().manual_seed(0x5EED + n)
        # in [1, 2): no weight is 0, so a change of any single entry moves the sum
        with torch.inference_mode(False):
            r = (1.0 + torch.rand(n, generator=g, dtype=torch.float64)).to(dtype=dtype,
                                                                              device=device)
        _FLOAT_WEIGHTINGS[key] = r
        if len(_FLOAT_WEIGHTINGS) > _MAX_WEIGHTINGS:
            _FLOAT_WEIGHTINGS.popitem(last=False)
    return r


def checksums(tensors: Any) -> list[float]:
    """``Σ_i t_i r_i`` per tensor (``r`` a fixed pseudo-random weighting in ``[1, 2)``), one host
    synchronisation for all: a cheap key of a floating tensor's values.

    Guarantee: non-finite exactly when an entry is NaN or Inf (or the sum overflows: confirm
    with ``torch.isfinite`` before reporting); changes with every write that moves the weighted
    sum beyond its rounding (a change of one entry by a relative ``δ`` registers when ``δ``
    exceeds about the dtype's epsilon times the sum's condition); unlike :func:`content_key`
    it can miss changes at the last bits.  Cost: one dot product per tensor in its own dtype
    (float32 for half precision)."""
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)  # (detached: no graph, no grad-mode switch)
        if str(flat.dtype).rpartition(".")[2] in _HALF:
            flat = flat.float()
        sums.append(torch.dot(flat, _float_weighting(flat.numel(), flat.dtype, flat.device))
                    if flat.numel() else flat.new_zeros(()))
    if not sums:
        return []
    if len(sums) == 1:
        return [sums[0].item()]
    dt = sums[0].dtype
    same = all(s.dtype == dt for s in sums)
    return torch.stack(sums if same else [s.double() for s in sums]).tolist()
