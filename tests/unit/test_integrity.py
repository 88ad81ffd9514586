"""The manifest checksum (megatron_ucp.format.integrity), pure and fast: against its definition, element by element."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.format import integrity as I

KINDS = ["<u1", "<u2", "<u4", "<u8"]


def definition(values: np.ndarray, offset: int) -> int:
    """The module docstring's formula, one element at a time (slow, obviously right)."""
    per_word, bits = 8 // values.dtype.itemsize, 8 * values.dtype.itemsize
    total = 0
    for k, v in enumerate(values.tolist()):
        i = offset + k
        total += (v + 1) * ((2 * (i // per_word) + 1) << (bits * (i % per_word)))
    return total % 2 ** 64


def _values(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2 ** 63, size=n, dtype=np.uint64).astype(kind)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(KINDS), n=st.integers(0, 200), offset=st.integers(0, 10 ** 6), seed=st.integers(0, 999),
       shift=st.integers(0, 7))
def test_the_fast_sum_is_the_definition_at_any_offset_and_memory_alignment(kind, n, offset, seed, shift):
    values = _values(kind, n, seed)
    buf = np.zeros(values.nbytes + shift, np.uint8)  # start the data at an odd address too
    buf[shift:] = values.view(np.uint8)
    placed = buf[shift:].view(kind)
    assert I.fragment_sum(placed, offset) == definition(values, offset)
    assert I.fragment_sum(I.as_uints(values.tobytes(), values.itemsize), offset) == definition(values, offset)


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(KINDS), n=st.integers(1, 300), seed=st.integers(0, 999), data=st.data())
def test_fragments_and_streamed_pieces_add_up_to_the_whole(kind, n, seed, data):
    values = _values(kind, n, seed)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6))) | {0, n})
    assert I.combine(I.fragment_sum(values[a:b], a) for a, b in zip(cuts, cuts[1:])) == I.fragment_sum(values)
    raw = values.tobytes()
    stream = I.StreamingSum(values.itemsize)
    byte_cuts = sorted(set(data.draw(st.lists(st.integers(0, len(raw)), max_size=6))) | {0, len(raw)})
    for a, b in zip(byte_cuts, byte_cuts[1:]):  # pieces that split elements, as chunked writes do
        stream.update(raw[a:b])
    assert stream.result() == I.fragment_sum(values) and stream.offset == n


def test_large_tensors_cross_the_chunking():
    values = _values("<u4", 3 * (1 << 15) + 5, 1)
    half = values.size // 2 + 1
    assert I.combine([I.fragment_sum(values[:half]), I.fragment_sum(values[half:], half)]) == I.fragment_sum(values)
    assert I.fragment_sum(values[:4096], 7) == definition(values[:4096], 7)


@pytest.mark.parametrize("kind", KINDS)
def test_every_single_bit_flip_changes_it(kind):
    values = _values(kind, 19, 3)
    reference = I.fragment_sum(values, 5)
    bits = 8 * values.itemsize
    for k in range(values.size):
        for bit in range(bits):
            flipped = values.copy()
            flipped[k] ^= np.array(1 << bit, dtype=np.uint64).astype(kind)
            assert I.fragment_sum(flipped, 5) != reference, (k, bit)


def test_position_matters_even_for_zeros_and_a_missing_fragment_shows():
    zeros = np.zeros(8, "<u4")
    assert I.fragment_sum(zeros[:4], 0) != I.fragment_sum(zeros[:4], 1)
    assert I.fragment_sum(zeros[:4]) != I.fragment_sum(zeros)


def test_a_stream_that_ends_mid_element_is_an_error():
    stream = I.StreamingSum(4)
    stream.update(b"\x00" * 6)
    with pytest.raises(ValueError, match="left over"):
        stream.result()
    with pytest.raises(ValueError):
        I.fragment_sum(np.zeros(2, "<u4"), -1)
