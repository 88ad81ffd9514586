"""The manifest checksum (megatron_ucp.format.integrity), pure and fast: against its definition, element by element."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.format import integrity as I

KINDS = ["<u1", "<u2", "<u4", "<u8"]


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def definition(values: np.ndarray, offset: int) -> int:
    """The module docstring's v3 formula, one element at a time in Python ints (slow, obviously right)."""
    total = 0
    for k, v in enumerate(values.tolist()):
        q, r = divmod(offset + k, 1 << 14)
        total += (v + 1) * ((_splitmix64(r) | 1) * (2 * q + 1))
    return total % 2**64


def legacy_definition(values: np.ndarray, offset: int) -> int:
    """v2, still used to check manifests written with it: elements packed into 64-bit words."""
    per_word, bits = 8 // values.dtype.itemsize, 8 * values.dtype.itemsize
    total = 0
    for k, v in enumerate(values.tolist()):
        i = offset + k
        total += (v + 1) * ((2 * (i // per_word) + 1) << (bits * (i % per_word)))
    return total % 2**64


def _values(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**63, size=n, dtype=np.uint64).astype(kind)


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(0, 200),
    offset=st.integers(0, 10**6),
    seed=st.integers(0, 999),
    shift=st.integers(0, 7),
)
def test_the_fast_sum_is_the_definition_at_any_offset_and_memory_alignment(kind, n, offset, seed, shift):
    values = _values(kind, n, seed)
    buf = np.zeros(values.nbytes + shift, np.uint8)  # start the data at an odd address too
    buf[shift:] = values.view(np.uint8)
    placed = buf[shift:].view(kind)
    assert I.fragment_sum(placed, offset) == definition(values, offset)
    assert I.fragment_sum(I.as_uints(values.tobytes(), values.itemsize), offset) == definition(values, offset)
    assert I.fragment_sum(placed, offset, I.LEGACY_ALGORITHM) == legacy_definition(values, offset)


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(KINDS), n=st.integers(1, 300), seed=st.integers(0, 999), data=st.data())
def test_fragments_and_streamed_pieces_add_up_to_the_whole(kind, n, seed, data):
    values = _values(kind, n, seed)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6))) | {0, n})
    assert I.combine(I.fragment_sum(values[a:b], a) for a, b in pairwise(cuts)) == I.fragment_sum(values)
    raw = values.tobytes()
    stream = I.StreamingSum(values.itemsize)
    byte_cuts = sorted(set(data.draw(st.lists(st.integers(0, len(raw)), max_size=6))) | {0, len(raw)})
    for a, b in pairwise(byte_cuts):  # pieces that split elements, as chunked writes do
        stream.update(raw[a:b])
    assert stream.result() == I.fragment_sum(values) and stream.offset == n


@pytest.mark.parametrize("algorithm", I.KNOWN_ALGORITHMS)
def test_large_tensors_cross_the_chunking(algorithm):
    values = _values("<u4", 3 * (1 << 15) + 5, 1)
    half = values.size // 2 + 1
    assert I.combine(
        [I.fragment_sum(values[:half], 0, algorithm), I.fragment_sum(values[half:], half, algorithm)]
    ) == I.fragment_sum(values, 0, algorithm)
    assert I.fragment_sum(values[16380:16390], 16380) == definition(values[16380:16390], 16380)  # across a period
    assert I.fragment_sum(values[:70], (1 << 14) * 5 - 20) == definition(values[:70], (1 << 14) * 5 - 20)


def test_no_two_sign_bit_flips_cancel_where_v2_let_every_odd_pair_cancel():
    """v2: any two sign-bit flips at odd-indexed float32 elements added 2**63 + 2**63 = 0. v3: two
    flips at positions i, j cancel only when c_i = -+c_j modulo 2**33 (the room a change of bit 31
    leaves in a 64-bit sum); over the first 4096 positions, and across periods, no pair does."""
    values = _values("<u4", 64, 5)
    flipped = values.copy()
    flipped[[1, 3]] ^= np.uint32(1 << 31)
    assert I.fragment_sum(flipped, 0, I.LEGACY_ALGORITHM) == I.fragment_sum(values, 0, I.LEGACY_ALGORITHM)
    assert I.fragment_sum(flipped) != I.fragment_sum(values)
    residues = {}
    for i in [*range(4096), *(k * (1 << 14) + 7 for k in range(1, 64))]:
        c = I.weight(i) % (1 << 33)
        assert c not in residues and (-c) % (1 << 33) not in residues, (i, residues.get(c))
        residues[c] = i


@pytest.mark.parametrize("algorithm", I.KNOWN_ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_single_bit_flip_changes_it(kind, algorithm):
    values = _values(kind, 19, 3)
    reference = I.fragment_sum(values, 5, algorithm)
    bits = 8 * values.itemsize
    for k in range(values.size):
        for bit in range(bits):
            flipped = values.copy()
            flipped[k] ^= np.array(1 << bit, dtype=np.uint64).astype(kind)
            assert I.fragment_sum(flipped, 5, algorithm) != reference, (k, bit)


def test_manifests_name_the_algorithm_and_old_ones_stay_checkable():
    files = {"w/fp32": {"numel": 3, "sum": 1}}
    assert I.recorded_checksums({"checksums": {"algorithm": I.ALGORITHM, "files": files}}) == I.RecordedChecksums(
        I.ALGORITHM, files
    )
    assert (
        I.recorded_checksums({"checksums": {"algorithm": "ucp-wsum64-v2", "files": files}}).algorithm
        == I.LEGACY_ALGORITHM
    )
    assert I.recorded_checksums({"checksums": {"algorithm": "crc99", "files": files}}) is None
    assert I.recorded_checksums({}) is None
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        I.fragment_sum(np.zeros(2, "<u4"), 0, "crc99")


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
