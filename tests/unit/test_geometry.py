"""Partition geometry and the stock-failure predictions, from numbers alone (no files, no DeepSpeed)."""

from __future__ import annotations

from typing import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import UcpError
from megatron_ucp.plan.geometry import (
    GroupGeometry,
    PaddingStyle,
    parse_dp_range,
    stock_converter_crashes,
    stock_loader_crash_ranks,
)
from tests.support.aurora_shapes import aurora_7b_param_groups


def dp_sizes_where_stock_loader_crashes(groups: Sequence[GroupGeometry], dp_sizes: Iterable[int]) -> list[int]:
    return [dp for dp in dp_sizes if stock_loader_crash_ranks(groups, dp)]


def aurora_groups(dp: int) -> list[GroupGeometry]:
    return [GroupGeometry(numel=sum(p.numel for p in g), dp=dp) for g in aurora_7b_param_groups()]


def test_aurora_7b_norm_group_at_dp768_matches_the_bug_report():
    wd, norms = aurora_groups(768)
    assert norms.numel == 65 * 4096 == 266_240
    assert (norms.alignment, norms.padded_total, norms.partition_size) == (1536, 267_264, 348)
    assert norms.total_padding == 1024 > norms.partition_size
    assert norms.true_length(765) == 20
    assert norms.padding_only_ranks() == [766, 767]
    # what stock ds_to_universal computes for rank 767's exp_avg: the -676 of the bug report
    crashes = stock_converter_crashes([wd, norms], PaddingStyle.LAST_RANK_ONLY)
    assert [(c.group, c.rank, c.raw_length) for c in crashes] == [(1, 767, -676)]
    assert stock_converter_crashes([wd, norms], PaddingStyle.PER_RANK) == []
    # the stock universal loader cannot load it back even at the DP it came from
    assert stock_loader_crash_ranks([wd, norms], 768) == {1: [766, 767]}
    assert wd.padding_only_ranks() == []


def test_design_example_dp4():
    geo = GroupGeometry(numel=9, dp=4)
    assert (geo.alignment, geo.padded_total, geo.partition_size, geo.total_padding) == (8, 16, 4, 7)
    assert geo.true_lengths() == [4, 4, 1, 0]
    assert geo.padding_only_ranks() == [3]
    assert [geo.recorded_padding(r, PaddingStyle.LAST_RANK_ONLY) for r in range(4)] == [0, 0, 0, 7]
    assert [geo.padding(r) for r in range(4)] == [0, 0, 3, 4]


def test_loader_crash_dp_sizes_for_tiny_norm_group():
    groups = [GroupGeometry(numel=9, dp=4)]
    assert dp_sizes_where_stock_loader_crashes(groups, range(1, 9)) == [4, 6, 7, 8]


@settings(max_examples=400, deadline=None)
@given(numel=st.integers(0, 10**7), dp=st.integers(1, 1024), extra=st.integers(0, 64))
def test_geometry_invariants(numel, dp, extra):
    geo = GroupGeometry(numel=numel, dp=dp, padded_numel=numel + extra)
    s = geo.partition_size
    assert geo.padded_total % geo.alignment == 0 and geo.padded_total == s * dp
    assert geo.padded_numel <= geo.padded_total < geo.padded_numel + geo.alignment
    lengths = geo.true_lengths()
    assert sum(lengths) == geo.padded_numel
    # real data is a prefix: full partitions, at most one partial one, then padding only
    assert lengths == sorted(lengths, reverse=True)
    assert sum(1 for t in lengths if 0 < t < s) <= 1
    assert geo.padding_only_ranks() == [r for r, t in enumerate(lengths) if t == 0]
    assert sum(geo.padding(r) for r in range(dp)) == geo.total_padding
    # per-rank paddings never exceed a partition; the last-rank-only style does exactly when P-N > S
    assert all(0 <= geo.padding(r) <= s for r in range(dp))
    crash = stock_converter_crashes([geo], PaddingStyle.LAST_RANK_ONLY)
    assert bool(crash) == (geo.total_padding > s)


def test_parse_dp_range():
    assert parse_dp_range("1-4") == [1, 2, 3, 4]
    assert parse_dp_range("512,768, 8-24:8") == [8, 16, 24, 512, 768]
    for bad in ("", "0-4", "4-1", "x", "8-16:0"):
        with pytest.raises(UcpError):
            parse_dp_range(bad)


def test_invalid_geometry_rejected():
    with pytest.raises(UcpError):
        GroupGeometry(numel=4, dp=0)
    with pytest.raises(UcpError):
        GroupGeometry(numel=4, dp=2).true_length(2)
