"""ZeRO-3 resharding from metadata alone: the layout value, the slice reads, the save record's checksums.

The oracle is a simulation with NumPy: every element of every parameter gets a distinct value, the old
rank files' partitions are laid out as ZeRO-3 lays them (each parameter cut on its own, slices one after
the other per sub-group, tail padding zero), the planned reads fill the new partitions, and those must
equal the new partitions laid out directly. No DeepSpeed, no files.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import PlanError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.plan.accounting import checksum
from megatron_ucp.plan.param_geometry import Stage3Groups, per_parameter_reads, same_parameters
from megatron_ucp.plan.partitioned import first_real
from megatron_ucp.plan.save_record import runs_checksum, stage3_partition_checksums, stage3_partition_record
from tests.support.aurora_shapes import aurora_7b_param_groups
from tests.support.native_reads import source_ranks


def _groups(numels: list[list[int]], dp: int, sub_group_size=None) -> Stage3Groups:
    named = [[(f"g{g}.p{i}", n) for i, n in enumerate(group)] for g, group in enumerate(numels)]
    one = Stage3Groups(tuple(tuple(g) for g in named), tuple(range(len(named))), dp)
    return one.at_dp(dp, sub_group_size)


def _values(groups: Stage3Groups) -> dict[str, np.ndarray]:
    """Each parameter's elements: distinct values (1-based, so padding's zeros never look like data)."""
    out, at = {}, 1
    for params in groups.param_groups:
        for name, n in params:
            out[name] = np.arange(at, at + n, dtype=np.int64)
            at += n
    return out


def _partitions(groups: Stage3Groups, values: dict[str, np.ndarray]) -> list[list[np.ndarray]]:
    """[rank][sub-group] -> the partition ZeRO-3 holds there."""
    out = []
    for r in range(groups.dp):
        per = []
        for h, params in enumerate(groups.sub_groups):
            geo = groups.geometry(h)
            part = np.zeros(geo.partition_size, dtype=np.int64)
            for (name, n), offset, p in zip(params, geo.offsets, geo.params, strict=True):
                lo = min(n, r * p.partition_size)
                hi = min(n, lo + p.partition_size)
                part[offset : offset + hi - lo] = values[name][lo:hi]
            per.append(part)
        out.append(per)
    return out


def _reshard(old: Stage3Groups, new: Stage3Groups, old_parts, rank: int) -> list[np.ndarray]:
    reads = per_parameter_reads(old, new, rank)
    out = []
    for h, group_reads in enumerate(reads):
        target = np.zeros(new.geometry(h).partition_size, dtype=np.int64)
        for read in group_reads:
            piece = old_parts[read.source_rank][read.source_group][
                read.source_offset : read.source_offset + read.length
            ]
            assert not target[read.target_offset : read.target_offset + read.length].any(), "written twice"
            target[read.target_offset : read.target_offset + read.length] = piece
        out.append(target)
    return out


numels_strategy = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=5), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(
    numels=numels_strategy,
    dp_from=st.integers(1, 9),
    dp_to=st.integers(1, 9),
    cut_from=st.one_of(st.none(), st.integers(1, 30)),
    cut_to=st.one_of(st.none(), st.integers(1, 30)),
)
def test_reads_rebuild_every_new_partition_exactly(numels, dp_from, dp_to, cut_from, cut_to):
    old, new = _groups(numels, dp_from, cut_from), _groups(numels, dp_to, cut_to)
    values = _values(old)
    old_parts, new_parts = _partitions(old, values), _partitions(new, values)
    for rank in range(dp_to):
        got = _reshard(old, new, old_parts, rank)
        assert [g.tolist() for g in got] == [g.tolist() for g in new_parts[rank]], rank


@settings(max_examples=100, deadline=None)
@given(numels=numels_strategy, dp_from=st.integers(1, 8), dp_to=st.integers(1, 8), cut=st.integers(1, 30))
def test_every_real_old_element_is_read_once_and_the_ledger_rows_close(numels, dp_from, dp_to, cut):
    """Rows per (old file, old sub-group): what all new ranks hash at the read positions combines to the
    file's own record (the save's checksum of its real runs), and each row's first element is read once."""
    old, new = _groups(numels, dp_from, cut), _groups(numels, dp_to, None)
    values = _values(old)
    old_parts = _partitions(old, values)
    seen: dict[tuple[int, int], list[int]] = {}
    counts: dict[tuple[int, int], int] = {}
    firsts: dict[tuple[int, int], int] = {}
    for rank in range(dp_to):
        for group_reads in per_parameter_reads(old, new, rank):
            for read in group_reads:
                row = (read.source_rank, read.source_group)
                piece = old_parts[read.source_rank][read.source_group][read.source_offset :][: read.length]
                seen.setdefault(row, []).append(checksum(torch.from_numpy(piece.copy()), read.position))
                counts[row] = counts.get(row, 0) + read.length
                if read.source_offset == first_real(old, read.source_rank, read.source_group):
                    firsts[row] = firsts.get(row, 0) + 1
    for r in range(dp_from):
        for h in range(len(old.sub_groups)):
            runs = old.runs(r, h)
            real = sum(run.length for run in runs)
            assert counts.get((r, h), 0) == real
            if real:
                recorded = runs_checksum(torch.from_numpy(old_parts[r][h]), runs)
                assert integrity.combine(seen[(r, h)]) == recorded, (r, h)
                assert firsts[(r, h)] == 1


def test_positions_do_not_depend_on_dp_or_the_sub_group_cut():
    a, b = _groups([[5, 3, 9], [4]], 2, 4), _groups([[5, 3, 9], [4]], 7, None)
    assert {n: (p.param_group, p.position) for n, p in a.places.items()} == {
        n: (p.param_group, p.position) for n, p in b.places.items()
    }
    assert [p.position for p in a.places.values()] == [0, 5, 8, 0]
    assert len(a.sub_groups) > len(b.sub_groups)


def test_a_small_parameter_leaves_ranks_of_padding_only_on_both_sides():
    """3 elements at DP 4 (rank 3: padding) resharded to DP 8 (ranks 3..7: padding): nothing read there."""
    old, new = _groups([[3, 64]], 4), _groups([[3, 64]], 8)
    for rank in range(3, 8):
        reads = [r for r in per_parameter_reads(old, new, rank)[0] if r.param == "g0.p0"]
        assert reads == []
    assert [r.source_rank for r in per_parameter_reads(old, new, 2)[0] if r.param == "g0.p0"] == [2]
    assert old.param_true_lengths(3) == [[0, 16]] and new.param_true_lengths(5) == [[0, 8]]
    assert old.padding_only_ranks() == [] and _groups([[3]], 4).padding_only_ranks() == [3]


def test_another_model_is_named_by_its_first_difference():
    with pytest.raises(PlanError, match=r"param group 0 differs .* position 1: the checkpoint has g0\.p1 \(3"):
        same_parameters(_groups([[5, 3]], 2), _groups([[5, 4]], 2))
    with pytest.raises(PlanError, match="2 param groups, the optimizer 1 .*a ZeRO stage change"):
        per_parameter_reads(_groups([[5], [3]], 2), _groups([[5, 3]], 2), 0)


def test_layout_values_validate_themselves():
    with pytest.raises(UcpError, match="listed twice"):
        Stage3Groups(((("a", 1), ("a", 2)),), (0,), 2)
    with pytest.raises(UcpError, match="follow their param groups"):
        Stage3Groups(((("a", 1),), (("b", 2),)), (1, 0), 2)


def test_aurora_7b_at_dp768_from_metadata():
    """One sub-group per param group (sub_group_size 1e9 > every 7B partition at 768): 768 -> 512 and 512 -> 768,
    sampled ranks, including ranks whose slice of a norm weight (4096 elements: S=6 at 768, 683 ranks real)
    is all padding, on the old side and on the new."""
    specs = aurora_7b_param_groups()
    named = tuple(tuple((s.name, math.prod(s.shape)) for s in group) for group in specs)
    at768 = Stage3Groups(named, tuple(range(len(named))), 768).at_dp(768, 10**9)
    at512 = at768.at_dp(512, 10**9)
    norm = "language_model.encoder.final_layernorm.weight"
    assert at768.partition_of(norm).padding_only_ranks() == list(range(683, 768))
    for old, new, ranks in ((at768, at512, (0, 341, 454, 455, 511)), (at512, at768, (0, 511, 682, 683, 767))):
        for rank in ranks:
            reads = per_parameter_reads(old, new, rank)
            got = sum(r.length for g in reads for r in g)
            assert got == sum(new.true_lengths(rank)), rank
            # each parameter's slice from the one or two old slices it crosses (ceil rounding puts a small
            # parameter's slice elsewhere than a large one's: a rank opens a few files, not many)
            for name in {r.param for g in reads for r in g}:
                ranks = {r.source_rank for g in reads for r in g if r.param == name}
                ratio = new.partition_of(name).partition_size // old.partition_of(name).partition_size
                assert len(ranks) <= ratio + 2, (rank, name, ranks)
            assert len(source_ranks(reads)) <= 6
            norm_reads = [r for g in reads for r in g if r.param == norm]
            assert sum(r.length for r in norm_reads) == new.partition_of(norm).true_length(rank)


def test_save_record_of_a_rank():
    groups = _groups([[3, 10], [7]], 4, 1)  # sub_group_size 1: every parameter a sub-group of its own
    record = stage3_partition_record(groups, 3)
    assert record[F.GROUP_TRUE_LENGTHS] == groups.true_lengths(3) == [0, 1, 1]
    assert record[F.PARAM_TRUE_LENGTHS] == [[0], [1], [1]]  # 3 at DP 4: rank 3 holds padding of it
    info = record[F.ZERO_PARTITION_INFO]
    assert (info["zero_stage"], info["dp_size"], info["dp_rank"]) == (3, 4, 3)
    assert info["sub_group_numels"] == [[3], [10], [7]] and info["sub_group_param_groups"] == [0, 0, 1]
    values = _values(groups)
    parts = _partitions(groups, values)[3]
    fp32 = [torch.from_numpy(p.astype(np.float32)) for p in parts]
    states = [{"exp_avg": t * 2, "step": torch.tensor(4.0), "odd": torch.zeros(5)} for t in fp32]
    sums = stage3_partition_checksums(fp32, states, groups, 3)[F.ZERO_PARTITION_CHECKSUMS]
    assert [sorted(g) for g in sums["groups"]] == [["exp_avg", "fp32"]] * 3
    assert [g["fp32"][0] for g in sums["groups"]] == [0, 1, 1]
    # the run of g0.p1 on rank 3 is elements 9 of 10 (S=3), at position 3 + 9 of param group 0
    assert sums["groups"][1]["fp32"][1] == checksum(fp32[1][:1], 12)
