"""The layout value: every layout answers where each rank file's real elements sit, and the answers agree with
the geometry they come from, with what the save hook hashes, and cover every file of a save."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.plan.accounting import checksum
from megatron_ucp.plan.geometry import GroupGeometry
from megatron_ucp.plan.param_geometry import Stage3Groups, per_parameter_reads
from megatron_ucp.plan.partitioned import FlatGroups, checked_positions, first_real, real_length
from megatron_ucp.plan.reshard import Placement, reshard_reads
from megatron_ucp.plan.save_record import runs_checksum


@settings(deadline=None, max_examples=60)
@given(
    numels=st.lists(st.integers(1, 400), min_size=1, max_size=3),
    dp=st.integers(1, 40),
)
def test_flat_groups_runs_tile_each_group_once(numels, dp):
    geos = [GroupGeometry(numel=n, dp=dp) for n in numels]
    layout = FlatGroups(geos, dp)
    for g, geo in enumerate(geos):
        runs = [run for r in range(dp) for run in layout.runs(r, g)]
        assert [(run.position, run.length) for run in runs] == [
            (r * geo.partition_size, geo.true_length(r)) for r in range(dp) if geo.true_length(r)
        ]
        assert sum(real_length(layout, r, g) for r in range(dp)) == geo.numel
        assert all(first_real(layout, r, g) == (0 if geo.true_length(r) else -1) for r in range(dp))
    assert layout.padding_only_ranks() == [r for r in range(dp) if all(geo.true_length(r) == 0 for geo in geos)]


def test_an_expert_group_counts_its_own_partitions():
    """EP 2 over DP 4: the expert group is cut over expert-DP 2, and file r holds partition r // 2 of its EP
    rank's buffer."""
    dense, expert = GroupGeometry(numel=10, dp=4), GroupGeometry(numel=6, dp=2)
    layout = FlatGroups([dense, expert], 4, Placement.of(2, [1]))
    assert expert.partition_size == 4  # 6 elements aligned to 2 x expert-DP, over 2 partitions
    assert [layout.runs(r, 1)[0].position for r in range(4)] == [0, 0, 4, 4]
    assert [real_length(layout, r, 1) for r in range(4)] == [4, 4, 2, 2]
    assert [real_length(layout, r, 0) for r in range(4)] == [dense.true_length(r) for r in range(4)]
    assert layout.partition_counts() == (4, 2)  # what each rank file's partition_count must say
    assert [g.dp for g in layout.at_dp(8).geometries] == [8, 4]  # DP 8 at the same EP: expert-DP 4


def test_the_flat_runs_hash_as_the_save_hook_does():
    """What the hook records for a flat partition (its real elements at ``dp_rank * partition_size``) is the
    runs' checksum: the restart's check and the save's record meet."""
    geo = GroupGeometry(numel=37, dp=4)
    layout = FlatGroups([geo], 4)
    whole = torch.arange(geo.padded_numel, dtype=torch.float32)
    for r in range(4):
        part = whole[r * geo.partition_size : (r + 1) * geo.partition_size]
        recorded = checksum(part[: geo.true_length(r)], r * geo.partition_size)
        assert runs_checksum(part, layout.runs(r, 0)) == recorded
        assert runs_checksum(part + 1, layout.runs(r, 0)) != recorded or geo.true_length(r) == 0


@pytest.mark.parametrize("dp_from,dp_to", [(4, 3), (3, 8), (96, 64), (8, 768)])
def test_every_old_file_is_checked_by_some_new_rank(dp_from, dp_to):
    """Flat and per-parameter alike: the files the new ranks open (read, or padding only and theirs by
    position) are every file of the save, each read one at least once where it holds real elements."""
    flat = [GroupGeometry(numel=700, dp=dp_from), GroupGeometry(numel=5, dp=dp_from)]
    stage3 = Stage3Groups(((("a", 700), ("b", 5)),), (0,), dp_from)
    for layout, reads_of in (
        (FlatGroups(flat, dp_from), lambda rank: reshard_reads(flat, dp_to, rank)),
        (stage3, lambda rank: per_parameter_reads(stage3, stage3.at_dp(dp_to), rank)),
    ):
        if dp_from == 96:
            assert layout.padding_only_ranks() == list(range(88, 96))  # files only the padding rule opens
        seen = set()
        for rank in range(dp_to):
            seen |= set(checked_positions(layout, dp_to, rank, reads_of(rank)))
        assert seen == set(range(dp_from)), type(layout).__name__


@pytest.mark.parametrize("dp_from,dp_to", [(4, 3), (3, 8), (96, 64)])
def test_each_layout_plans_its_reads_and_says_what_each_file_must_hold(dp_from, dp_to):
    """``reads_to`` is the layout's own rule (the flat cut, or per parameter); every read lies inside what the
    file at its position must hold (``needs``: the flat layout only what is read, ZeRO-3 the whole partition,
    never beyond the partition); the real lengths add up to the parameters; only the flat layout derives a
    fragment map, and it is the one ``param_slice_mappings`` must record."""
    from megatron_ucp.plan.rank_binding import expected_fragments

    shapes = [[("w", (20, 35)), ("b", (5,))]]
    flat = FlatGroups.of(shapes, dp_from)
    stage3 = Stage3Groups(((("w", 700), ("b", 5)),), (0,), dp_from)
    assert list(flat.geometries) == [GroupGeometry(numel=705, dp=dp_from)]
    for layout, new, rule in (
        (flat, flat.at_dp(dp_to), lambda rank: reshard_reads(flat.geometries, dp_to, rank)),
        (stage3, stage3.at_dp(dp_to), lambda rank: per_parameter_reads(stage3, stage3.at_dp(dp_to), rank)),
    ):
        assert new.dp == dp_to
        assert sum(sum(layout.true_lengths(r)) for r in range(dp_from)) == 705
        for rank in range(dp_to):
            reads = layout.reads_to(new, rank)
            assert reads == rule(rank)
            for position in {r.source_rank for g in reads for r in g}:
                needs, sizes = layout.needs(position, reads), layout.partition_sizes()
                for read in (r for g in reads for r in g if r.source_rank == position):
                    assert read.source_offset + read.length <= needs[read.source_group] <= sizes[read.source_group]
        assert layout.partition_counts() is None
    assert stage3.fragments(0) is None
    assert flat.fragments(1) == (expected_fragments(shapes[0], flat.geometries[0], 1),)
    assert FlatGroups(flat.geometries, dp_from).fragments(1) is None  # no shapes: nothing to check against
    assert flat.starts(1) == [flat.geometries[0].partition_size]


@settings(deadline=None, max_examples=40)
@given(dp_from=st.integers(1, 12), dp_to=st.integers(1, 12), cut=st.integers(1, 300))
def test_each_live_group_says_which_saved_groups_it_draws_from(dp_from, dp_to, cut):
    """What the one native load installs per live group: its parameters, its param group, and the saved groups
    whose states and step it takes. A flat group is the same group at every DP size; a ZeRO-3 sub-group cut
    anew takes exactly the saved sub-groups its parameters came from, all of its own param group."""
    shapes = [[("a", (7, 9)), ("b", (30,))], [("n", (5,))]]
    flat = FlatGroups.of(shapes, dp_from)
    live = flat.at_dp(dp_to)
    for g in range(len(shapes)):
        assert live.names(g) == [name for name, _ in shapes[g]] and live.param_group(g) == g
        assert live.drawn_from(flat, g) == (g,)

    old = Stage3Groups(((("a", 63), ("b", 30)), (("c", 200),), (("n", 5),)), (0, 0, 1), dp_from)
    new = old.at_dp(dp_to, sub_group_size=cut)
    assert [n for h in range(len(new.sub_groups)) for n in new.names(h)] == ["a", "b", "c", "n"]
    for h in range(len(new.sub_groups)):
        drawn = new.drawn_from(old, h)
        assert set(drawn) == {old.places[name].sub_group for name in new.names(h)}
        assert {old.param_group(g) for g in drawn} == {new.param_group(h)}
