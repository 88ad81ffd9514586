"""The read plan of a DP change from the native files (pure): every real element placed exactly once."""

from __future__ import annotations

import pytest

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.geometry import GroupGeometry, at_dp
from megatron_ucp.plan.llama_shapes import preset
from megatron_ucp.plan.reshard import DENSE, Placement, partition_reads, pieces_in, reshard_reads
from tests.support.native_reads import source_ranks


def _cover(old: GroupGeometry, dp_to: int) -> list[int]:
    """How many times each flat position is written, over every rank of the new job; checks offsets."""
    new = at_dp([old], dp_to)[0]
    hits = [0] * new.padded_total
    for rank in range(dp_to):
        at = 0
        for read in partition_reads(old, new, rank):
            assert read.target_offset == at  # pieces in order, no gap inside the real range
            assert 0 <= read.source_offset and read.source_offset + read.length <= old.true_length(read.source_rank)
            assert read.position == read.source_rank * old.partition_size + read.source_offset
            assert read.position == rank * new.partition_size + read.target_offset
            for i in range(read.position, read.position + read.length):
                hits[i] += 1
            at += read.length
        assert at == new.true_length(rank)
    return hits


@pytest.mark.parametrize("numel", [1, 9, 37, 1616, 4099])
@pytest.mark.parametrize("dp_from, dp_to", [(4, 3), (4, 2), (2, 4), (3, 7), (8, 1), (1, 8), (5, 5), (16, 768)])
def test_every_real_element_is_read_exactly_once_and_padding_never(numel, dp_from, dp_to):
    old = GroupGeometry(numel=numel, dp=dp_from)
    hits = _cover(old, dp_to)
    assert hits[:numel] == [1] * numel and not any(hits[numel:])


def test_all_padding_ranks_on_either_side_read_nothing():
    old = GroupGeometry(numel=40, dp=768)  # ranks 20.. of the old job hold only padding
    assert source_ranks(reshard_reads([old], 3, 2)) == list(range(14, 20))  # [28, 40) at S=2
    new_only_padding = reshard_reads([old], 768, 500)
    assert new_only_padding == [[]]


def test_a_rank_plans_only_its_own_reads_at_aurora_scale():
    groups = [GroupGeometry(numel=sum(p.numel for p in g), dp=768) for g in preset("aurora-7b").param_groups()]
    for rank in (0, 191, 383):
        reads = reshard_reads(groups, 384, rank)
        assert all(len(g) <= 3 for g in reads)  # 768 -> 384: two old partitions, plus one straddle at most


def test_another_model_is_refused():
    with pytest.raises(PlanError, match="not the same model"):
        partition_reads(GroupGeometry(numel=10, dp=2), GroupGeometry(numel=12, dp=3), 0)
    with pytest.raises(PlanError, match="out of range"):
        reshard_reads([GroupGeometry(numel=10, dp=2)], 3, 3)


def _saved_files(buffers: list[list[float]], geo: GroupGeometry, ep: int, expert: bool) -> dict[int, list[float]]:
    """Each DP rank file's partition of a group, written from the group's buffers the way DeepSpeed-MoE lays
    them out (an independent statement of the layout: rank d holds buffer d % EP, slice d // EP, for an expert
    group; buffer 0, slice d, for a dense one), padding as NaN."""
    files = {}
    for d in range(geo.dp * (ep if expert else 1)):
        buffer, part = (buffers[d % ep], d // ep) if expert else (buffers[0], d)
        lo = part * geo.partition_size
        files[d] = [buffer[i] if i < len(buffer) else float("nan") for i in range(lo, lo + geo.partition_size)]
    return files


@pytest.mark.parametrize("dp_from, dp_to, ep", [(8, 4, 2), (4, 8, 2), (8, 2, 2), (16, 8, 8), (768, 512, 8), (6, 9, 3)])
def test_a_dp_change_at_the_same_ep_reshards_each_expert_buffer_over_its_expert_dp_ranks(dp_from, dp_to, ep):
    numel = 37 * ep + 5
    placement = Placement.of(ep, [1])
    dense_geo, expert_geo = GroupGeometry(numel=numel, dp=dp_from), GroupGeometry(numel=numel, dp=dp_from // ep)
    dense = [[float(i) for i in range(numel)]]
    experts = [[1000.0 * (r + 1) + i for i in range(numel)] for r in range(ep)]  # each expert-parallel rank's own
    files = [_saved_files(dense, dense_geo, ep, False), _saved_files(experts, expert_geo, ep, True)]
    new = placement.geometries([dense_geo, expert_geo], dp_to)
    assert [g.dp for g in new] == [dp_to, dp_to // ep]
    for rank in range(dp_to):
        reads = reshard_reads([dense_geo, expert_geo], dp_to, rank, placement)
        for g, (buffer, geo) in enumerate(zip([dense[0], experts[rank % ep]], new, strict=True)):
            got = [0.0] * geo.true_length(placement.index(g, rank))
            for read in reads[g]:
                if g == 1:  # an expert group reads only files of this rank's expert-parallel rank
                    assert read.source_rank % ep == rank % ep
                got[read.target_offset : read.target_offset + read.length] = files[g][read.source_rank][
                    read.source_offset : read.source_offset + read.length
                ]
            lo = placement.index(g, rank) * geo.partition_size
            assert got == buffer[lo : lo + len(got)]  # DeepSpeed's partition at the new size, padding never read


def test_an_expert_placement_needs_dp_a_multiple_of_ep():
    placement = Placement.of(4, [0])
    assert placement.index(0, 6) == 1 and placement.position(0, 1, like=6) == 6 and placement.index(1, 6) == 6
    with pytest.raises(PlanError, match="DP=6 is not a multiple of EP=4"):
        placement.size(0, 6)
    assert Placement.of(1, [0]) == DENSE


@pytest.mark.parametrize("numel,dp_from,dp_to", [(1000, 4, 3), (9, 4, 3), (130, 3, 8)])
def test_each_offset_of_a_new_partition_is_traced_to_the_old_rank_file_holding_that_element(numel, dp_from, dp_to):
    """Where a value found after the copy came from (a NaN named with its file): for every offset of every new
    partition, the old rank whose partition holds that flat element (``position // S_old``), from the geometry
    alone; padding offsets come from no file."""
    old, new = GroupGeometry(numel, dp_from), GroupGeometry(numel, dp_to)
    for rank in range(dp_to):
        reads = partition_reads(old, new, rank)
        size = new.partition_size
        for offset in range(size):
            element = rank * size + offset
            want = [element // old.partition_size] if element < numel else []
            assert [r for r, _, _ in pieces_in(reads, offset, offset + 1)] == want, (rank, offset)
        whole = pieces_in(reads, 0, size)
        assert sum(end - first for _, first, end in whole) == max(0, min(size, numel - rank * size))
