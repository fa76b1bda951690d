"""``content_key``: a cache key that every write to a tensor's bits changes, ``.data`` writes
included.  Reference: whether the bits changed, read from a clone taken before the write
(``torch.equal`` of the raw bit patterns), never the key itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from convex_eq.tensor_keys import content_key

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.complex64]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal raw bit patterns (NaN payloads and signed zeros count as different)."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def test_data_write_changes_the_key_while_pointer_and_version_stay() -> None:
    w = torch.nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
    before, ptr, version = content_key(w), w.data_ptr(), w._version
    with torch.no_grad():
        w.data.mul_(2)
    assert (w.data_ptr(), w._version) == (ptr, version)  # what a pointer/version key sees
    assert content_key(w) != before


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_unit_in_the_last_place_of_one_entry_changes_the_key(dtype: torch.dtype) -> None:
    """A change of one entry always changes the key (its weight is odd, so invertible modulo
    2⁶⁴), however large the tensor: here one ulp of one entry of 10⁶."""
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(1000, 1000, generator=g) * 100).to(dtype)
    before = content_key(t)
    flat = t.view(-1)
    if dtype.is_floating_point:
        flat[123_457] = torch.nextafter(flat[123_457], torch.tensor(float("inf"), dtype=dtype))
    else:
        flat[123_457] += 1
    assert content_key(t) != before


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300),
       changes=st.integers(0, 5), dtype=st.sampled_from(DTYPES))
def test_key_changes_exactly_when_the_bits_change(seed: int, n: int, changes: int,
                                                  dtype: torch.dtype) -> None:
    """Writes of random values to random entries through ``.data``: the key is equal iff the
    bits are (collisions of unstructured changes have probability ~2⁻⁶⁴)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.nn.Parameter((torch.randn(n, generator=g) * 4).to(dtype), requires_grad=False)
    clone, before = t.detach().clone(), content_key(t)
    idx = torch.randint(0, n, (changes,), generator=g)
    vals = (torch.randn(changes, generator=g) * 4).to(dtype)
    with torch.no_grad():
        t.data[idx] = vals
    assert (content_key(t) == before) == _same_bits(t.detach(), clone)


def test_keys_of_several_tensors_and_tensors_without_storage() -> None:
    a, b = torch.randn(3), torch.randn(2, 2, dtype=torch.float64)
    key = content_key(a, b)
    assert len(key) == 2 and key == content_key(a, b)
    b.data[0, 0] += 1.0
    new = content_key(a, b)
    assert new[0] == key[0] and new[1] != key[1]
    assert content_key(torch.empty(3, device="meta")) is None  # nothing to read: no caching
    assert content_key(torch.zeros(0)) == content_key(torch.zeros(0))
