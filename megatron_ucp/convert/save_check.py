"""What a save made through the hooks recorded, checked by the converter before it writes anything.

The native routes bind every rank file to its position and its save, and hash what they copy against the
checksums the save recorded, at load. A conversion (the universal route at load, the background converter,
``megatron-ucp convert``) reads the same files, so it makes the same checks, the one set every route shares:

* the save's identity (``ucp_save_record``): every rank file, and at ZeRO-3 every rank's model states, of the
  save the model states name (:func:`megatron_ucp.plan.rank_binding.cross_check` names the odd one out); each
  rank file at the DP position it was saved from is the reader's check (``zero_partition_info``), made first;
* each partition's real elements against the checksum its rank file recorded (``zero_partition_checksums``):
  a file changed on disk since the save (a flipped bit, a partial overwrite) is named, not converted.

A save without the record (stock DeepSpeed) has nothing to be checked against: its structure is checked by the
reader, and what cannot be told apart (two rank files of one stock save swapped) is a documented limit. The
hashing is one pass over the mapped partitions (about as fast as a memory copy); a share of a multi-node
conversion hashes its own share of the rank files.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from megatron_ucp.convert.writer import RankFileCache
from megatron_ucp.deepspeed.reader import CheckpointMeta
from megatron_ucp.deepspeed.stage3_files import model_states_of_another_save, sub_group_owners
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, osio
from megatron_ucp.plan.param_geometry import Run, Stage3Groups
from megatron_ucp.plan.rank_binding import FileFacts, cross_check

SHOWN = 20


def check_save_record(meta: CheckpointMeta, cache: RankFileCache, share_index: int = 0, share_count: int = 1) -> int:
    """Raise :class:`CheckpointFormatError` naming every file that is not what the save recorded; returns how
    many partitions were checked against their recorded checksums (0: a save without them)."""
    problems, checked = save_record_problems(meta, cache, share_index, share_count)
    if problems:
        shown = "\n  ".join(problems[:SHOWN])
        more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise CheckpointFormatError(
            f"cannot convert {meta.files.tag_dir}: its files are not what the save recorded ({len(problems)} "
            f"problem(s)); nothing was written:\n  {shown}{more}",
            subject=problems[0].split(": ", 1)[0],
        )
    return checked


def save_record_problems(
    meta: CheckpointMeta, cache: RankFileCache, share_index: int = 0, share_count: int = 1
) -> tuple[list[str], int]:
    """Every file that is not what the save recorded (each problem naming its file), and how many partitions
    matched their recorded checksums; this share's rank files only."""
    problems = identity_problems(meta, cache)
    checked = 0
    if not problems:
        for index in range(share_index, len(meta.files.rank_files), share_count):
            found, count = _checksum_problems(meta, cache.get(index), index)
            problems += found
            checked += count
    return problems, checked


def _save_id(raw: Any) -> Optional[str]:
    record = raw.get(F.UCP_SAVE_RECORD) if isinstance(raw, dict) else None
    save_id = record.get("save_id") if isinstance(record, dict) else None
    return str(save_id) if save_id is not None else None


def identity_problems(meta: CheckpointMeta, cache: RankFileCache) -> list[str]:
    """Per model-parallel coordinate: one save for the model states and every rank file; at ZeRO-3, every rank's
    model states of that save too."""
    problems: list[str] = []
    per_rank_models = list(meta.files.zero3_model_files)
    for coordinate in meta.coordinates:
        model_id = _save_id(coordinate.model.raw)
        # the identity only: each file's recorded position (zero_partition_info) is the reader's to check, the
        # steps the reader's and the plan's (their own messages)
        facts = [
            FileFacts(position=r, path=str(rf.path), steps=(0,), save_id=_save_id(rf.sd))
            for r in range(meta.dp)
            for rf in (cache.get(coordinate.first_file + r),)
        ]
        unit = "sub-group" if per_rank_models else "param group"
        problems += cross_check(str(coordinate.model.path), model_id, facts, unit)
        if model_id is not None and per_rank_models:
            problems += model_states_of_another_save(per_rank_models, coordinate.model.path, model_id)
    return problems


def _checksum_problems(meta: CheckpointMeta, rf: Any, index: int) -> tuple[list[str], int]:
    recorded = rf.sd.get(F.ZERO_PARTITION_CHECKSUMS)
    if not isinstance(recorded, dict):
        return [], 0
    algorithm = recorded.get("algorithm")
    if algorithm not in integrity.KNOWN_ALGORITHMS:
        return [f"{rf.path}: partition checksums of unknown algorithm {algorithm!r}"], 0
    groups = recorded.get("groups") or []
    runs = _runs_of(meta, rf, index)
    unit = "sub-group" if meta.files.partitioned_weights else "param group"
    problems, checked = [], 0
    for g, states in enumerate(groups):
        for state, (real, expected) in sorted(states.items()):
            try:
                tensor = rf.state_tensor(g, state)
            except (KeyError, IndexError):
                problems.append(f"{rf.path}: {state!r} of {unit} {g} is recorded by its save but missing")
                continue
            got = integrity.combine(
                integrity.fragment_sum(
                    integrity.as_uints(tensor.narrow(0, run.offset, run.length).bytes_view(), tensor.element_size()),
                    run.position,
                    algorithm,
                )
                for run in runs[g]
            )
            if tensor.storage.mapped:  # this process is done with these pages (the writer maps them again)
                osio.done_with(tensor.data_ptr(), tensor.nbytes, tensor.storage.region)
            checked += 1
            if sum(run.length for run in runs[g]) != int(real) or got != int(expected):
                problems.append(
                    f"{rf.path}: {state!r} of {unit} {g} differs from the checksum its save recorded (changed on "
                    "disk since the save)"
                )
    return problems, checked


def _runs_of(meta: CheckpointMeta, rf: Any, index: int) -> list[list[Run]]:
    """Per group, the real runs of this rank file's partition and where each sits in its param group: what the
    save hook hashed. ZeRO-1/2: one run, the group's true length from ``dp_rank * partition_size``; ZeRO-3: a
    run per parameter (:meth:`~megatron_ucp.plan.param_geometry.Stage3Groups.runs`)."""
    r = index % meta.dp
    if meta.files.partitioned_weights:
        coordinate = meta.coordinates[index // meta.dp]
        sub_groups = tuple(tuple((p.name, p.numel) for p in specs) for specs in coordinate.model.param_groups)
        owners = tuple(sub_group_owners(rf.param_groups(), len(sub_groups), rf.path))
        groups = _stage3_groups(sub_groups, owners, meta.dp)
        return [groups.runs(r, h) for h in range(len(sub_groups))]
    info = rf.sd.get(F.ZERO_PARTITION_INFO) or {}
    true = rf.sd.get(F.GROUP_TRUE_LENGTHS) or []
    sizes = info.get("partition_sizes") or []
    ranks = info.get("group_dp_ranks") or [info.get("dp_rank", r)] * len(sizes)
    return [[Run("", 0, 0, int(t), int(ranks[g]) * int(sizes[g]))] if t else [] for g, t in enumerate(true)]


@functools.lru_cache(maxsize=8)
def _stage3_groups(sub_groups: tuple, owners: tuple[int, ...], dp: int) -> Stage3Groups:
    """One coordinate's layout, built once for all its rank files (they list the same sub-groups and owners)."""
    return Stage3Groups(sub_groups, owners, dp)
