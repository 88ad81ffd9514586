"""The read plan of a DP change from the native files (pure): every real element placed exactly once."""

from __future__ import annotations

import pytest

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.geometry import GroupGeometry, at_dp
from megatron_ucp.plan.llama_shapes import preset
from megatron_ucp.plan.reshard import partition_reads, reshard_reads, source_ranks


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
