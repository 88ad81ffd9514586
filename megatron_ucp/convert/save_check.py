"""What a save made through the hooks recorded, checked by the converter before it commits anything.

The native routes bind every rank file to its position and its save, and hash what they copy against the
checksums the save recorded, at load. A conversion (the universal route at load, the background converter,
``megatron-ucp convert``) reads the same files, so it makes the same checks, the one set every route shares:

* the save's identity (``ucp_save_record``), before anything is written: every rank file, and at ZeRO-3 every
  rank's model states, of the save the model states name (:func:`megatron_ucp.plan.rank_binding.cross_check`
  names the odd one out); each rank file at the DP position it was saved from is the reader's check
  (``zero_partition_info``), made first;
* each partition's real elements against the checksum its rank file recorded (``zero_partition_checksums``),
  before the output is committed: a file changed on disk since the save (a flipped bit, a partial overwrite)
  is named, and the staged output discarded.

The checksums are summed from the fragments the conversion reads anyway (:class:`PartitionSums`: the writers
and the replica comparison report what they read, and the shares of a multi-node conversion hand their partial
sums to the share that commits), so a hooked save's files are read once, not once to check and once to write;
a partition whose real elements were not all read that way is hashed whole at the check. A save without the
record (stock DeepSpeed) has nothing to be checked against and costs nothing here: its structure is checked by
the reader, and what cannot be told apart (two rank files of one stock save swapped) is a documented limit.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from megatron_ucp.convert.writer import RankFileCache
from megatron_ucp.deepspeed.reader import CheckpointMeta
from megatron_ucp.deepspeed.stage3_files import model_states_of_another_save
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, osio, save_files
from megatron_ucp.plan.conversion import CopyItem, ParamPlan
from megatron_ucp.plan.param_geometry import Run
from megatron_ucp.plan.rank_binding import FileFacts, cross_check

log = logging.getLogger(__name__)

SHOWN = 20

Key = tuple[int, int, str]
"""(rank file index, param group or sub-group, state)."""


class PartitionCheck(NamedTuple):
    checked: int
    """Partitions that matched their recorded checksums (0: a save without them)."""
    hashed_again: int
    """Of those, how many were hashed whole because the conversion's reads did not cover them."""


class PartitionSums:
    """Each recorded partition's checksum, summed from the fragments the conversion reads (thread-safe).

    :meth:`add` takes what a writer read (a parameter's items of one state and their bytes); each fragment
    is hashed at its position in the saved param group, where the save hook hashed it. A fragment that is
    not all real elements of its partition (padding) leaves its partition to be hashed whole."""

    def __init__(self, meta: CheckpointMeta, cache: RankFileCache):
        self.meta, self.cache = meta, cache
        self._lock = threading.Lock()
        self._layouts: dict[int, Optional[tuple[str, list[tuple[list[int], list[Run]]]]]] = {}
        self.sums: dict[Key, tuple[int, int]] = {}
        self.unplaced: set[Key] = set()

    def _layout(self, index: int) -> Optional[tuple[str, list[tuple[list[int], list[Run]]]]]:
        """The file's checksum algorithm and, per group, its real runs (and their offsets); None when it
        recorded no checksums."""
        with self._lock:
            if index in self._layouts:
                return self._layouts[index]
        rf = self.cache.get(index)
        recorded = rf.sd.get(F.ZERO_PARTITION_CHECKSUMS)
        algorithm = recorded.get("algorithm") if isinstance(recorded, dict) else None
        layout = None
        if algorithm in integrity.KNOWN_ALGORITHMS:
            layout = (algorithm, [([run.offset for run in runs], runs) for runs in _runs_of(self.meta, index)])
        with self._lock:
            self._layouts[index] = layout
        return layout

    def add(self, p: ParamPlan, state: str, items: Sequence[CopyItem], fragments: Sequence[Any]) -> None:
        for item, fragment in zip(items, fragments):
            layout = self._layout(item.rank)
            if layout is None:
                continue
            algorithm, groups = layout
            g = p.group if item.group is None else item.group
            key = (item.rank, g, state)
            got = _hash_at(fragment, item.src_offset, groups[g] if g < len(groups) else ([], []), algorithm)
            with self._lock:
                if got is None:
                    self.unplaced.add(key)
                    continue
                n, total = self.sums.get(key, (0, 0))
                self.sums[key] = (n + item.length, integrity.combine((total, got)))

    def to_record(self) -> dict[str, list[int]]:
        """For a share's record (JSON): ``"<file>/<group>/<state>"`` -> [elements, sum]; a partition with a
        fragment that could not be placed gets -1 elements (hashed whole at the check)."""
        out = {f"{r}/{g}/{s}": [n, total] for (r, g, s), (n, total) in self.sums.items()}
        out.update({f"{r}/{g}/{s}": [-1, 0] for r, g, s in self.unplaced})
        return out

    def totals(self) -> dict[Key, tuple[int, int]]:
        """What :func:`partition_problems` takes: the sums per partition, unplaced ones left out (hashed whole)."""
        return {key: value for key, value in self.sums.items() if key not in self.unplaced}


def merge_records(records: Iterable[Optional[dict]]) -> dict[Key, tuple[int, int]]:
    """The shares' partial sums (:meth:`PartitionSums.to_record`) added up per partition (-1: not usable)."""
    out: dict[Key, tuple[int, int]] = {}
    for record in records:
        for key, (n, total) in (record or {}).items():
            r, g, state = key.split("/", 2)
            k = (int(r), int(g), state)
            had_n, had = out.get(k, (0, 0))
            out[k] = (-1, 0) if n < 0 or had_n < 0 else (had_n + int(n), integrity.combine((had, int(total))))
    return out


def _hash_at(fragment: Any, offset: int, group: tuple[list[int], list[Run]], algorithm: str) -> Optional[int]:
    """The checksum of a fragment read at partition ``offset``, each piece at its param-group position; None
    when part of it lies outside every real run."""
    offsets, runs = group
    length, covered, parts = fragment.numel(), 0, []
    k = max(0, bisect.bisect_right(offsets, offset) - 1)
    while covered < length and k < len(runs):
        run = runs[k]
        lo, hi = max(offset + covered, run.offset), min(offset + length, run.offset + run.length)
        if lo != offset + covered:
            return None
        if hi > lo:
            piece = fragment.narrow(0, lo - offset, hi - lo)
            values = integrity.as_uints(piece.bytes_view(), piece.element_size())
            parts.append(integrity.fragment_sum(values, run.position + lo - run.offset, algorithm))
            covered += hi - lo
        k += 1
    return integrity.combine(parts) if covered == length else None


def _refuse(meta: CheckpointMeta, problems: list[str]) -> None:
    shown = "\n  ".join(problems[:SHOWN])
    more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    raise CheckpointFormatError(
        f"cannot convert {meta.files.tag_dir}: its files are not what the save recorded ({len(problems)} "
        f"problem(s)); nothing was written to the output:\n  {shown}{more}",
        subject=problems[0].split(": ", 1)[0],
    )


def check_save_identity(meta: CheckpointMeta, cache: RankFileCache) -> None:
    """Raise :class:`CheckpointFormatError` naming every file of another save (before anything is written)."""
    problems = identity_problems(meta, cache)
    if problems:
        _refuse(meta, problems)


def check_partitions(
    meta: CheckpointMeta, cache: RankFileCache, read: Optional[dict[Key, tuple[int, int]]] = None
) -> PartitionCheck:
    """Raise :class:`CheckpointFormatError` naming every partition that differs from its recorded checksum."""
    problems, checked = partition_problems(meta, cache, read)
    if problems:
        _refuse(meta, problems)
    return checked


def partition_problems(
    meta: CheckpointMeta, cache: RankFileCache, read: Optional[dict[Key, tuple[int, int]]] = None
) -> tuple[list[str], PartitionCheck]:
    """Every partition that differs from the checksum its file recorded (each problem naming its file);
    ``read``: the sums of what was read (:func:`merge_records`), used where they cover a whole partition,
    and the rest hashed whole."""
    problems: list[str] = []
    checked = again = 0
    for index in range(len(meta.files.rank_files)):
        found, count, hashed = _checksum_problems(meta, cache.get(index), index, read or {})
        problems += found
        checked += count
        again += hashed
    return problems, PartitionCheck(checked, again)


def _save_id(raw: Any) -> Optional[str]:
    record = raw.get(F.UCP_SAVE_RECORD) if isinstance(raw, dict) else None
    save_id = record.get("save_id") if isinstance(record, dict) else None
    return str(save_id) if save_id is not None else None


def identity_problems(meta: CheckpointMeta, cache: RankFileCache) -> list[str]:
    """Per model-parallel coordinate: one save for the model states and every rank file; at ZeRO-3, every rank's
    model states of that save too; and every file the save's list records (model states, layer and expert files
    alike) there as it was written (:func:`megatron_ucp.format.save_files.problems`, with the zip directories)."""
    problems: list[str] = []
    if meta.coordinates:
        problems += save_files.problems(meta.files.tag_dir, _save_id(meta.coordinates[0].model.raw), deep=True)
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


def _checksum_problems(
    meta: CheckpointMeta, rf: Any, index: int, read: dict[Key, tuple[int, int]]
) -> tuple[list[str], int, int]:
    recorded = rf.sd.get(F.ZERO_PARTITION_CHECKSUMS)
    if not isinstance(recorded, dict):
        return [], 0, 0
    algorithm = recorded.get("algorithm")
    if algorithm not in integrity.KNOWN_ALGORITHMS:
        return [f"{rf.path}: partition checksums of unknown algorithm {algorithm!r}"], 0, 0
    groups = recorded.get("groups") or []
    runs: Optional[list[list[Run]]] = None
    unit = "sub-group" if meta.files.partitioned_weights else "param group"
    problems, checked, again = [], 0, 0
    for g, states in enumerate(groups):
        for state, (real, expected) in sorted(states.items()):
            n, got = read.get((index, g, state), (0, 0))
            if n != int(real) or got != int(expected):  # not all read by the conversion, or to be sure: whole
                try:
                    tensor = rf.state_tensor(g, state)
                except (KeyError, IndexError):
                    problems.append(f"{rf.path}: {state!r} of {unit} {g} is recorded by its save but missing")
                    continue
                runs = runs if runs is not None else _runs_of(meta, index)
                n, got = _whole_partition_sum(tensor, runs[g], algorithm)
                again += 1 if read else 0
            checked += 1
            if n != int(real) or got != int(expected):
                problems.append(
                    f"{rf.path}: {state!r} of {unit} {g} differs from the checksum its save recorded (changed on "
                    "disk since the save)"
                )
    if again:
        log.debug("%s: %d partition(s) hashed whole (not covered by the conversion's reads)", rf.path, again)
    return problems, checked, again


def _whole_partition_sum(tensor: Any, runs: Sequence[Run], algorithm: str) -> tuple[int, int]:
    got = integrity.combine(
        integrity.fragment_sum(
            integrity.as_uints(tensor.narrow(0, run.offset, run.length).bytes_view(), tensor.element_size()),
            run.position,
            algorithm,
        )
        for run in runs
    )
    if tensor.storage.mapped:  # this process is done with these pages (the writer maps them again)
        osio.done_with(tensor.data_ptr(), tensor.nbytes, tensor.storage.region)
    return sum(run.length for run in runs), got


def _runs_of(meta: CheckpointMeta, index: int) -> list[list[Run]]:
    """Per group, the real runs of rank file ``index``'s partition and where each sits in its param group: what
    the save hook hashed, as the save's layout value says (:meth:`CheckpointMeta.partitioned`)."""
    layout = meta.partitioned(meta.coordinates[index // meta.dp])
    return [layout.runs(index % meta.dp, g) for g in range(len(layout.partition_sizes()))]
