"""Elastic resume straight from the native rank files: a DP change with no conversion and no second copy.

For ZeRO-1/2 (``BF16_Optimizer``, ``DeepSpeedZeroOptimizer``) a rank of the resized job needs one
contiguous range of each param group's flat order, held by a few old rank files
(:mod:`megatron_ucp.plan.reshard`). :func:`load_native_partitions` memory-maps those files and copies
only those ranges of the fp32 master and of every optimizer state into this rank's flat partition:
each old byte is read by one rank, nothing is written to disk.

Call order (collective over the optimizer's DP group, every rank calls it):

1. the group's first rank reads the facts once (:class:`SavedFacts`: the saved groups' names and
   shapes from the model states, the old DP size, the old rank files present, old rank 0's
   optimizer-level state) and broadcasts them;
2. every rank checks the live model against them (group order, names, shapes, partition sizes)
   and opens and checks the old files it needs (:func:`open_source`): a missing, truncated or
   damaged file, one from another DP size or another save, stops every rank before anything is copied;
3. copies, hashing what landed at its position in the new partitions; the source side of the
   ledger is the checksum each old rank file recorded of its partitions at save time
   (``zero_partition_checksums``, saved through the hooks), added by the rank that reads the
   file's first element, or, for files saved without it (stock DeepSpeed), the hash of what was
   read at its flat position in the old files. One all-reduce of the ledger
   (:mod:`megatron_ucp.plan.accounting`) proves every real element placed exactly once (and, with
   the record, unchanged since the save).

Size: the three steps are one collective protocol over the DP group (every rank must take each step
in the same order, or the group hangs); split, each part would need the others' types and order.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.reader import load_raw, load_torch_file
from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.format.paths import open_checkpoint_file
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.integration.collectives import Failure, comm, count_across, decide_on_first, device
from megatron_ucp.integration.partition_load import expected_state_keys, install_group_state, lp_groups_of
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Column,
    Ledger,
    Problem,
    add_sum,
    check_ledger,
    check_optimizer_states,
    checksum,
    ledger_totals,
)
from megatron_ucp.plan.geometry import GroupGeometry, at_dp
from megatron_ucp.plan.reshard import Read, reshard_reads, source_ranks

log = logging.getLogger(__name__)

_PARTITIONS = (F.BASE_OPTIMIZER_STATE, F.SINGLE_PARTITION_OF_FP32_GROUPS, F.PARAM_SLICE_MAPPINGS)
"""The per-rank parts of an optimizer file; the rest (loss scaler, clip_grad, ds_version) is global."""
RankFile = Callable[[int], Path]
"""Old DP rank -> its optimizer file for this rank's model-parallel coordinate (the engine names it)."""


@dataclass(frozen=True)
class SavedFacts:
    """What the DP group's first rank reads once and broadcasts."""

    dp_from: int
    shapes: list[list[tuple[str, tuple[int, ...]]]]
    """``param_shapes``: each group's parameters, in flat order, with their shapes."""
    global_state: dict
    """Old rank 0's optimizer-level state (loss scaler, clip_grad, ds_version, ...)."""
    param_groups: list[dict]
    """The base optimizer's hyperparameters per group (``params`` left out)."""
    states: list[tuple[str, ...]]
    """Each group's tensor states in the files (``exp_avg``, ``exp_avg_sq``, ...)."""
    steps: list[Any]
    algorithm: Optional[str] = None
    """The checksum algorithm of old rank 0's ``zero_partition_checksums``; None: saved without them."""


def _tag_rank_files(folder: Path, like: Path) -> list[str]:
    """The optimizer files of ``like``'s model-parallel rank in the tag folder (any DP index)."""
    head, _, tail = like.name.partition("_pp_rank_")
    suffix = tail[tail.index("_mp_rank_") :]
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(head + "_pp_rank_") and p.name.endswith(suffix))


def read_facts(model_states: Path, rank_file: RankFile, states: Optional[dict] = None) -> SavedFacts:
    """Step 1 (first rank): the facts, checked for the old files' presence and DP size. ``states``:
    the model states the load already read from ``model_states`` (else read here, memory-mapped)."""
    if states is None:
        states = load_torch_file(model_states, mmap=True)
    if not isinstance(states, dict) or not isinstance(states.get(F.PARAM_SHAPES), list):
        raise CheckpointFormatError(
            f"{model_states}: no param_shapes (not a ZeRO-1/2 model-states file)", subject=model_states
        )
    dp_from = states.get(F.DP_WORLD_SIZE)
    if not isinstance(dp_from, int) or dp_from < 1:
        raise CheckpointFormatError(f"{model_states}: no valid dp_world_size ({dp_from!r})", subject=model_states)
    expected = [rank_file(r) for r in range(dp_from)]
    missing = [p for p in expected if not p.is_file()]
    if missing:
        raise CheckpointFormatError(
            f"{missing[0]}: missing ({len(missing)} of the {dp_from} rank files the model states' DP={dp_from} needs)",
            subject=missing[0],
        )
    present = _tag_rank_files(model_states.parent, expected[0])
    if len(present) != dp_from:
        raise CheckpointFormatError(
            f"{model_states.parent}: {len(present)} rank files of this model-parallel rank "
            f"({expected[0].name} ...), but the model states say DP={dp_from}: files of "
            "another save in the same folder?",
            subject=model_states.parent,
        )
    first = _optimizer_state(expected[0])  # its tensors are located, not read (nor read ahead)
    record = first.get(F.ZERO_PARTITION_CHECKSUMS)
    algorithm = record.get("algorithm") if isinstance(record, dict) else None
    if algorithm is not None and algorithm not in integrity.KNOWN_ALGORITHMS:
        raise CheckpointFormatError(
            f"{expected[0]}: partition checksums of unknown algorithm {algorithm!r} "
            f"(known: {', '.join(integrity.KNOWN_ALGORITHMS)})",
            subject=expected[0],
        )
    base = first[F.BASE_OPTIMIZER_STATE]
    groups = base.get("param_groups") or []
    per_group = [base["state"].get(g, {}) for g in range(len(groups))]
    return SavedFacts(
        dp_from=dp_from,
        shapes=[[(name, tuple(shape)) for name, shape in group.items()] for group in states[F.PARAM_SHAPES]],
        global_state={k: v for k, v in first.items() if k not in _PARTITIONS},
        param_groups=[{k: v for k, v in group.items() if k != "params"} for group in groups],
        states=[
            tuple(k for k, v in sorted(s.items()) if isinstance(v, RawTensor) and k != F.STEP_STATE) for s in per_group
        ],
        steps=[_in_memory(s.get(F.STEP_STATE)) for s in per_group],
        algorithm=algorithm,
    )


def _in_memory(value: Any) -> Any:
    """A step as the optimizer keeps it: a torch tensor of its own (copied out of the file), or a number."""
    return value.to_torch().clone() if isinstance(value, RawTensor) else value


def _optimizer_state(path: Path) -> dict:
    """The optimizer dict of an old rank file, its tensors located but not read (readahead off)."""
    sd = load_raw(path, random_access=True)
    optim = sd.get(F.OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
    if (
        not isinstance(optim, dict)
        or not isinstance(optim.get(F.BASE_OPTIMIZER_STATE), dict)
        or not isinstance(optim.get(F.SINGLE_PARTITION_OF_FP32_GROUPS), list)
    ):
        raise CheckpointFormatError(
            f"{path}: not a ZeRO-1/2 optimizer file (no {F.OPTIMIZER_STATE_DICT} with "
            f"{F.BASE_OPTIMIZER_STATE} and {F.SINGLE_PARTITION_OF_FP32_GROUPS})",
            subject=path,
        )
    return optim


def check_live_model(
    facts: SavedFacts,
    names: list[list[str]],
    shapes: list[list[tuple[int, ...]]],
    flat_sizes: list[int],
    dp_to: int,
    where: Path,
) -> list[GroupGeometry]:
    """Step 2: the live groups are the saved ones (order, names, shapes), partitioned as the plan
    expects at ``dp_to``. Returns the saved groups' geometries. Raises naming the first difference."""
    if len(names) != len(facts.shapes):
        raise UcpError(
            f"{where}: the checkpoint has {len(facts.shapes)} param groups, the optimizer {len(names)}", subject=where
        )
    geos = []
    for g, (saved, live_names, live_shapes, flat) in enumerate(zip(facts.shapes, names, shapes, flat_sizes)):
        live = list(zip(live_names, live_shapes))
        if live != saved:
            at = next((i for i, (a, b) in enumerate(zip(saved, live)) if a != b), min(len(saved), len(live)))
            theirs = saved[at] if at < len(saved) else "nothing"
            ours = live[at] if at < len(live) else "nothing"
            raise UcpError(
                f"{where}: param group {g} differs from the model at position {at}: the checkpoint has "
                f"{theirs}, the model {ours} ({len(saved)} vs {len(live)} parameters)",
                subject=where,
            )
        numel = sum(int(torch.Size(shape).numel()) for _, shape in saved)
        geo = GroupGeometry(numel=numel, dp=facts.dp_from)
        if at_dp([geo], dp_to)[0].partition_size != flat:
            raise UcpError(
                f"{where}: param group {g} ({numel} elements) has a {flat}-element partition at DP={dp_to}; "
                "the plan expects ZeRO's alignment padding only (per-parameter padding?)",
                subject=where,
            )
        geos.append(geo)
    return geos


@dataclass
class Source:
    """One old rank file: its fp32 partitions and optimizer states per group (where they lie in the
    file), and the file, open, to read the planned ranges from."""

    path: Path
    fp32: list[RawTensor]
    states: list[dict[str, Any]]
    sums: Optional[list[dict[str, Any]]] = None
    """Per group, state -> [real elements, checksum] recorded at save (None: saved without them)."""
    handle: Any = None

    def read_into(self, tensor: RawTensor, start: int, dest: torch.Tensor) -> None:
        """Elements ``[start, start + dest.numel())`` of ``tensor`` into ``dest``: ``preadv`` straight
        into the destination's memory with the file's readahead off, so the kernel reads exactly
        those bytes, in large requests (a copy out of a mapping either reads ahead around every
        fault, 1.2x the bytes here, or with readahead off one page per fault, 5x slower)."""
        length = dest.numel()
        storage = tensor.storage
        if storage.region is None:  # a small record already in memory, or a tensor torch mapped
            dest.copy_(tensor.narrow(0, start, length).to_torch())
            return
        if self.handle is None:
            self.handle = open_checkpoint_file(self.path)
            if hasattr(os, "posix_fadvise"):  # no readahead past the ranges: each byte read by one rank
                os.posix_fadvise(self.handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        offset = storage.address - storage.region[0] + (tensor.offset + start) * tensor.element_size()
        buffer = dest if dest.device.type == "cpu" and dest.is_contiguous() else torch.empty(length, dtype=dest.dtype)
        view = memoryview(buffer.detach().numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.handle.fileno(), [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointFormatError(
                    f"{self.path}: ends at byte {offset + done}, inside the partition being "
                    "read (changed while loading?)",
                    subject=self.path,
                )
            done += got
        if buffer is not dest:
            dest.copy_(buffer)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def open_source(path: Path, rank: int, facts: SavedFacts, geos: list[GroupGeometry], reads: list[list[Read]]) -> Source:
    """Open one old file (metadata only: tensors are located, not read) and check it can give what the
    plan reads from it, before anything is copied."""
    optim = _optimizer_state(path)
    count = optim.get(F.PARTITION_COUNT)
    counts = count if isinstance(count, (list, tuple)) else [count]
    if any(c != facts.dp_from for c in counts):
        raise CheckpointFormatError(
            f"{path}: saved at DP={counts[0]}, the model states say DP={facts.dp_from} (a rank file of another save?)",
            subject=path,
        )
    fp32 = optim[F.SINGLE_PARTITION_OF_FP32_GROUPS]
    states = [optim[F.BASE_OPTIMIZER_STATE].get("state", {}).get(g, {}) for g in range(len(geos))]
    if len(fp32) != len(geos):
        raise CheckpointFormatError(f"{path}: {len(fp32)} fp32 partitions for {len(geos)} param groups", subject=path)
    for g, geo in enumerate(geos):
        need = max((r.source_offset + r.length for r in reads[g] if r.source_rank == rank), default=0)
        if not _flat_fp32(fp32[g]) or fp32[g].numel() < need:
            held = fp32[g].numel() if isinstance(fp32[g], RawTensor) else None
            raise CheckpointFormatError(
                f"{path}: param group {g}'s fp32 partition holds {held} float32 elements, "
                f"its first {need} are needed (truncated?)",
                subject=path,
            )
        for state in facts.states[g]:
            t = states[g].get(state)
            if not _flat_fp32(t) or t.numel() != geo.partition_size:
                raise CheckpointFormatError(
                    f"{path}: param group {g}'s {state!r} has "
                    f"{t.numel() if isinstance(t, RawTensor) else t!r} elements, not the "
                    f"{geo.partition_size} float32 of a DP={facts.dp_from} partition",
                    subject=path,
                )
        if not _same(states[g].get(F.STEP_STATE), facts.steps[g]):
            raise CheckpointFormatError(
                f"{path}: param group {g} is at step {states[g].get(F.STEP_STATE)!r}, old rank "
                f"0 at {facts.steps[g]!r} (a rank file of another save?)",
                subject=path,
            )
    return Source(path, fp32, states, _recorded_sums(path, optim, facts, geos, rank))


def _recorded_sums(
    path: Path, optim: dict, facts: SavedFacts, geos: list[GroupGeometry], rank: int
) -> Optional[list[dict[str, Any]]]:
    """The file's partition checksums, checked to be complete; None when rank 0's file has none."""
    if facts.algorithm is None:
        return None
    record = optim.get(F.ZERO_PARTITION_CHECKSUMS)
    groups = record.get("groups") if isinstance(record, dict) else None
    if not isinstance(groups, list) or record.get("algorithm") != facts.algorithm or len(groups) != len(geos):
        raise CheckpointFormatError(
            f"{path}: no {facts.algorithm} partition checksums for {len(geos)} groups, "
            "although old rank 0's file has them (a rank file of another save?)",
            subject=path,
        )
    for g, geo in enumerate(geos):
        for state in (F.FP32_STATE, *facts.states[g]):
            entry = groups[g].get(state) if isinstance(groups[g], dict) else None
            if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] != geo.true_length(rank):
                raise CheckpointFormatError(
                    f"{path}: param group {g}'s recorded checksum of {state!r} is {entry!r}, "
                    f"not [{geo.true_length(rank)}, <sum>]",
                    subject=path,
                )
    return groups


def _flat_fp32(t: Any) -> bool:
    return isinstance(t, RawTensor) and t.dim() == 1 and t.is_contiguous() and t.dtype.name == "float32"


def _same(a: Any, b: Any) -> bool:
    """Two steps (tensors of either kind, or numbers) equal."""

    def value(x: Any) -> Any:
        if isinstance(x, RawTensor) or torch.is_tensor(x):
            return float(x) if x.numel() == 1 else ("tensor", tuple(x.shape))
        return x

    return value(a) == value(b)


def _row_name(group: int) -> str:
    return f"param group {group}"


def reshard_ledger(facts: SavedFacts) -> Ledger:
    """One row per (param group, state): fp32 and each optimizer state."""
    return Ledger.from_listing({_row_name(g): (F.FP32_STATE, *states) for g, states in enumerate(facts.states)})


def copy_partitions(
    facts: SavedFacts,
    geos: list[GroupGeometry],
    reads: list[list[Read]],
    sources: dict[int, Source],
    rank: int,
    targets: list[dict[str, torch.Tensor]],
    ledger: Ledger,
    table: torch.Tensor,
) -> float:
    """Step 3 on one rank: copy the planned ranges of every state into ``targets`` (per group, state ->
    this rank's flat partition, zeroed: padding stays zero) and enter both sides in ``table``.
    Returns the seconds spent on the ledger. No collective: the caller all-reduces ``table``."""
    accounting = 0.0
    algorithm = facts.algorithm or integrity.ALGORITHM  # both sides of the ledger alike
    with torch.no_grad():
        for g, geo in enumerate(geos):
            for read in reads[g]:
                src = sources[read.source_rank]
                for state, target in targets[g].items():
                    stored = src.fp32[g] if state == F.FP32_STATE else src.states[g][state]
                    landed = target.narrow(0, read.target_offset, read.length)
                    src.read_into(stored, read.source_offset, landed)
                    t0 = time.perf_counter()
                    row = ledger.index(_row_name(g), state)
                    table[row, Column.CONSUMERS] += 1
                    table[row, Column.LOADED_COUNT] += read.length
                    add_sum(table, row, True, checksum(landed, rank * target.numel() + read.target_offset, algorithm))
                    if src.sums is None:  # the same bytes, at their place in the old files: the plan's arithmetic
                        add_sum(table, row, False, checksum(landed, read.position, algorithm))
                    elif read.source_offset == 0:  # the file's own record, added by the reader of its start
                        add_sum(table, row, False, int(src.sums[g][state][1]))
                    accounting += time.perf_counter() - t0
            if rank == 0:  # the rows' source counts: the group's real elements, once
                for state in targets[g]:
                    table[ledger.index(_row_name(g), state), Column.SOURCE_COUNT] += geo.padded_numel
    return accounting


def load_native_partitions(
    optimizer: Any, model_states: Path, rank_file: RankFile, states: Optional[dict] = None
) -> AccountingReport:
    """Load this rank's ZeRO-1/2 partitions from the native files of a save at another DP size.
    ``states``: what the load already read from ``model_states`` (:func:`read_facts`). Returns the
    report (the same on every rank); enforcing it is the caller's."""
    t_start = time.perf_counter()
    dist = comm()
    group = surface.dp_group(optimizer)
    dp_to, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    facts = decide_on_first(lambda: read_facts(model_states, rank_file, states), group)
    if isinstance(facts, Failure):
        raise CheckpointFormatError(f"cannot reshard {model_states.parent}: {facts.message}", subject=model_states)
    lp_groups = lp_groups_of(optimizer)
    live_names = surface.param_names(optimizer)
    base = surface.base_optimizer(optimizer)
    flats = [g["params"][0] for g in base.param_groups]
    geos = check_live_model(
        facts,
        [[live_names[lp] for lp in lps] for lps in lp_groups],
        [[tuple(lp.shape) for lp in lps] for lps in lp_groups],
        [f.numel() for f in flats],
        dp_to,
        model_states.parent,
    )
    reads = reshard_reads(geos, dp_to, rank)

    sources: dict[int, Source] = {}
    error: Optional[BaseException] = None
    try:
        for r in source_ranks(reads):
            sources[r] = open_source(rank_file(r), r, facts, geos, reads)
    except Exception as exc:
        error = exc
        log.error("megatron-ucp: rank %d cannot reshard from %s: %s", dist.get_rank(), model_states.parent, exc)
    failed = count_across(1 if error is not None else 0, group)  # nobody copies unless every rank can
    if error is not None:
        raise error
    if failed:
        raise CheckpointFormatError(
            f"cannot reshard {model_states.parent}: {failed} rank(s) found a bad rank file; see their log",
            subject=model_states.parent,
        )

    ledger = reshard_ledger(facts)
    table = ledger.new_table(device="cpu")
    targets = []
    with torch.no_grad():  # the fp32 partitions are leaves that require grad (DeepSpeedZeroOptimizer)
        for g, flat in enumerate(flats):
            flat.zero_()
            targets.append({F.FP32_STATE: flat, **{state: torch.zeros_like(flat) for state in facts.states[g]}})
    try:
        accounting = copy_partitions(facts, geos, reads, sources, rank, targets, ledger, table)
    finally:
        for source in sources.values():
            source.close()
    for g, (flat, lps) in enumerate(zip(flats, lp_groups)):
        buffers = {state: t for state, t in targets[g].items() if state != F.FP32_STATE}
        install_group_state(optimizer, flat, lps, buffers, facts.steps[g])
    surface.load_global_state(optimizer, facts.global_state)
    for param_group, saved in zip(base.param_groups, facts.param_groups):
        param_group.update(saved)

    t_wait = time.perf_counter()
    totals = table.to(device())
    dist.all_reduce(totals, group=group)
    totals = totals.cpu()
    collective = time.perf_counter() - t_wait
    problems: list[Problem] = check_ledger(ledger, totals, source=lambda p, s: f"{p} {s!r} of the rank files")
    for g in range(len(geos)):
        expected = expected_state_keys(base, g)
        keys = set(facts.states[g]) | ({F.STEP_STATE} if facts.steps[g] is not None else set())
        problems += check_optimizer_states(
            g, [name for name, _ in facts.shapes[g]], expected, keys, type(base).__name__
        )
    n_params = sum(len(group_shapes) for group_shapes in facts.shapes)
    n_states = sum(len(shapes) * (1 + len(states)) for shapes, states in zip(facts.shapes, facts.states))
    _, _, elements, names = ledger_totals(ledger, totals)
    if any(step is not None for step in facts.steps):
        names = (*names, F.STEP_STATE)
    load = time.perf_counter() - t_start - accounting - collective
    seconds = (("load", round(load, 4)), ("accounting", round(accounting, 4)), ("collective", round(collective, 4)))
    checked = (
        "checked against the save's partition checksums"
        if facts.algorithm
        else "rank files without partition checksums (not saved through the hooks): copies checked for "
        "placement, not against the save"
    )
    return AccountingReport(
        n_params,
        n_states,
        names,
        elements,
        facts.dp_from,
        dp_to,
        tuple(problems),
        (checked,),
        seconds=seconds,
        route="native reshard",
    )


def refresh_lp_params(optimizer: Any) -> bool:
    """The bf16 weights made the rounded fp32 masters, as ``update_lp_params`` does after a universal
    load, but its all-gather only when some rank's weights differ: DeepSpeed saved the module after
    copying the masters into it, so the weights it just loaded already are (1.1 s of a 1.6 s reshard
    of 100M parameters on 4 CPU ranks, for nothing). Collective over the DP group. Returns whether
    the weights had to be refreshed."""
    dist = comm()
    layout = surface.layout_of(optimizer)
    stale = 1
    if layout is not None and hasattr(optimizer, layout.lp_partitions) and hasattr(optimizer, layout.hp_partitions):
        stale = 0
        with torch.no_grad():
            for i, (parts, master) in enumerate(zip(layout.lp_partitions_of(optimizer), layout.masters(optimizer))):
                mine = parts[dist.get_rank(group=surface.group_dp_groups(optimizer)[i])]
                stale += int(not torch.equal(mine, master.to(mine.dtype)))
    if count_across(stale, surface.dp_group(optimizer)):
        optimizer.update_lp_params()
        return True
    return False
