"""Elastic resume straight from the native rank files: a DP change with no conversion and no second copy.

Every layout the same way: a rank of the resized job needs a few ranges of a few old rank files
(``old.reads_to(new, rank)``: one contiguous range of each ZeRO-1/2 param group's flat order, a slice of each
parameter of a ZeRO-3 sub-group; :mod:`megatron_ucp.plan.reshard`). Those files are memory-mapped and only those
ranges of the fp32 master and of every optimizer state are copied into this rank's partitions: each old byte is
read by one rank, nothing is written to disk.

Call order (collective over the optimizer's DP group, every rank calls each step):

1. :func:`megatron_ucp.integration.resume.native.binding.bind_save`, before DeepSpeed's own load touches the engine
   (the one binding of every layout): the facts, the live model checked against them, the plan, and
   every old rank file bound to its position and to this save.
2. DeepSpeed loads the module, the scheduler and the counters (the caller's part; at ZeRO-3 step 3 runs in
   place of its optimizer load).
3. :func:`load_native_partitions`: the fp32 masters' ranges copied first and, at ZeRO-1/2, each compared with
   the bf16 weights DeepSpeed just loaded (:func:`megatron_ucp.plan.rank_binding.bracket_misses`: after a
   ZeRO-1/2 save they are the masters rounded); a file whose ranges are not is named on every rank
   before any optimizer state is read. Then the states; what landed is hashed at its place in the new
   partitions, and the source side of the ledger is the checksum each old rank file recorded of its
   partitions at save time (``zero_partition_checksums``, saved through the hooks), added by the rank
   that reads the file's first element, or, for files saved without it (stock DeepSpeed), the hash of
   what was read at its flat position in the old files. One all-reduce of the ledger
   (:mod:`megatron_ucp.plan.accounting`) proves every real element placed exactly once (and, with the
   record, unchanged since the save).

A same-DP restart, at any ZeRO stage, runs step 1, DeepSpeed's own load and then :func:`verify_loaded`: the
masters DeepSpeed loaded against the saved weights (ZeRO-1/2), and (saved through the hooks) every partition
against its recorded checksum.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_ucp.deepspeed import stage3_runtime
from megatron_ucp.deepspeed.rank_files import RankFile, SavedFacts, binding_message
from megatron_ucp.errors import CheckpointFormatError, refuse_or_warn
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import all_reduce, comm, device
from megatron_ucp.integration.live_job import LiveJob, expected_state_keys, install_group_state, restore_global_state
from megatron_ucp.integration.resume.native.binding import BoundSave
from megatron_ucp.integration.resume.native.old_file_copy import (
    OldFiles,
    Timing,
    against_the_save,
    changed_states,
    copy_reads,
    refuse_changed,
    settle,
)
from megatron_ucp.integration.resume.native.requantize import requantize_partitions
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Problem,
    check_optimizer_states,
)
from megatron_ucp.plan.rank_binding import WeightTally, blame_weights, bracket_misses

log = logging.getLogger(__name__)

STRICT_OVERRIDE = (
    "after a ZeRO-1/2 save every saved bf16 weight is its fp32 master rounded, so these files were not saved "
    "together; a module deliberately changed after the save (model surgery) is the one legitimate case: "
    "MEGATRON_UCP_STRICT=0 loads it, the masters winning"
)


SavedSlice = Callable[[int], Optional[torch.Tensor]]
"""Group -> this rank's real range of the saved weights, at its place in the new partition (the module
DeepSpeed loaded, or the range read from the model-states file); None: not compared (saved through the
hooks, whose records bind the files instead)."""


def loaded_weights(job: LiveJob, bound: BoundSave) -> SavedSlice:
    """The saved weights as DeepSpeed's own module load put them in this rank's partition."""
    new = bound.new
    lp = job.lp_partitions()
    parts = [parts[new.index(g, bound.rank)] for g, parts in enumerate(lp)]
    reals = new.true_lengths(bound.rank)
    return lambda g: parts[g][: reals[g]]


def load_native_partitions(
    job: LiveJob, bound: BoundSave, strict: bool = True, saved: Optional[SavedSlice] = None
) -> AccountingReport:
    """Steps 3 and 4, every layout: this rank's partitions of a save at another DP size (or another ZeRO-3
    sub-group cut), from the files step 1 bound, after DeepSpeed loaded the rest (``saved``: where the saved
    weights are; default, ZeRO-1/2, the loaded module; ZeRO-3 keeps none to compare). Returns the report (the
    same on every rank); enforcing it is the caller's, except for saved weights that are not the masters
    rounded (raised here when ``strict``)."""
    t_start = time.perf_counter()
    optimizer, group, base = job.optimizer, job.dp_group, job.base
    facts, new, reads = bound.facts, bound.new, bound.reads
    masters = job.masters()
    links = [[] for _ in masters] if job.per_parameter else job.groups
    if saved is None and not job.per_parameter:
        saved = loaded_weights(job, bound)
    files = OldFiles.of(facts, bound.rank_file)
    ledger = files.ledger()
    table = ledger.new_table(device="cpu")
    try:
        states = [_states_of(bound, h) for h in range(len(masters))]
        steps = [_step_of(bound, h) for h in range(len(masters))]
        scalars = [_scalars_of(bound, h) for h in range(len(masters))]
        targets = [_targets(base, master, names) for master, names in zip(masters, states)]
        accounting = copy_reads(files, reads, bound.sources, targets, ledger, table, (F.FP32_STATE,))
        if saved is not None:
            _check_weights(bound, targets, saved, group, strict)
        rest = tuple(sorted({name for names in states for name in names}))
        accounting += copy_reads(files, reads, bound.sources, targets, ledger, table, rest)
        for master, lps, buffers, step, extra in zip(masters, links, targets, steps, scalars):
            carried = {k: v for k, v in buffers.items() if k != F.FP32_STATE}
            install_group_state(optimizer, master, lps, carried, step, extra)
        for param_group, saved_group in zip(base.param_groups, facts.param_groups):
            param_group.update(saved_group)
        restore_global_state(optimizer, facts.global_state)
        if job.per_parameter:  # inside DeepSpeed's stage-3 load, which rounds them itself after its own
            stage3_runtime.stage3_weights_from_masters(optimizer)
    finally:
        bound.close()
    problems: list[Problem] = []
    for h, names in enumerate(states):
        keys = set(names) | set(scalars[h]) | ({F.STEP_STATE} if steps[h] is not None else set())
        expected = expected_state_keys(base, new.param_group(h))
        problems += check_optimizer_states(h, new.names(h), expected, keys, type(base).__name__)
    # after the check of what the live optimizer holds: its 8-bit form adds scales and code books to the states
    requantized = requantize_partitions(base, masters, group) if facts.requantized else None
    old = bound.old
    groups = range(len(old.partition_sizes()))
    n_states = sum(len(old.names(g)) * (1 + len(facts.states[g])) for g in groups)
    what = f"{old.unit}s {len(groups)} -> {len(masters)}; rank files bound to their positions"
    report = settle(
        files,
        ledger,
        table,
        group,
        counts=(sum(len(old.names(g)) for g in groups), n_states),
        dp_to=bound.dp_to,
        problems=problems,
        carried=([F.STEP_STATE] if any(step is not None for step in facts.steps) else [])
        + sorted({name for extra in scalars for name in extra}),
        checked=against_the_save(facts.algorithm, what + (" and the saved weights" if saved is not None else "")),
        timing=Timing(t_start, bound.seconds, accounting),
    )
    return report.with_more(extras=[requantized]) if requantized else report


def _targets(base: Any, master: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """One live group's fp32 partition and one buffer per saved state, all zeroed: the optimizer's own
    tensor where it has one of the right size (so that it stays where the engine keeps it: host memory
    under offload), else a new one beside the master."""
    kept = base.state.get(master, {})
    buffers = {F.FP32_STATE: master}
    for name in names:
        held = kept.get(name)
        usable = torch.is_tensor(held) and held.shape == master.shape and held.dtype == master.dtype
        buffers[name] = held if usable else torch.zeros_like(master)
    with torch.no_grad():
        for t in buffers.values():
            t.zero_()
    return buffers


def _states_of(bound: BoundSave, h: int) -> tuple[str, ...]:
    """The states live group ``h`` gets: those of the saved groups it draws from (one set)."""
    drawn = bound.new.drawn_from(bound.old, h)
    found = {bound.facts.states[g] for g in drawn}
    if len(found) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved {bound.old.unit}s {list(drawn)} hold different optimizer "
            f"states {sorted(found)}; the live {bound.new.unit} {h} needs one set",
            subject=bound.facts.model_states,
        )
    return found.pop() if found else ()


def _drawn_value(
    bound: BoundSave, h: int, per_group: Sequence[Any], comparable: Callable[[Any], Any], what: str
) -> Any:
    """The value live group ``h`` gets of something each saved group holds once (its step, its states of one value
    per partition): that of the saved groups it draws from, which must agree (None: it draws from none)."""
    drawn = bound.new.drawn_from(bound.old, h)
    found = [per_group[g] for g in drawn]
    values = {comparable(v) for v in found}
    if len(values) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved {bound.old.unit}s {list(drawn)} {what} {sorted(values, key=str)}",
            subject=bound.facts.model_states,
        )
    return found[0] if found else None


def _step_of(bound: BoundSave, h: int) -> Any:
    """The optimizer step live group ``h`` gets."""
    return _drawn_value(
        bound,
        h,
        bound.facts.steps,
        lambda s: float(s) if torch.is_tensor(s) or isinstance(s, (int, float)) else repr(s),
        "are at different optimizer steps",
    )


def _scalars_of(bound: BoundSave, h: int) -> dict[str, Any]:
    """The states of one value per partition live group ``h`` gets (each saved partition's are the same in every
    rank file: the binding checks)."""
    found = _drawn_value(
        bound,
        h,
        bound.facts.scalars,
        lambda s: tuple((k, float(v) if torch.is_tensor(v) else v) for k, v in sorted(s.items())),
        "hold different values of their per-partition optimizer states",
    )
    return dict(found or {})


def _check_weights(bound: BoundSave, targets: list, saved: SavedSlice, group: Any, strict: bool) -> None:
    """The masters just copied against the saved weights, per old file (collective): a file whose ranges are
    not its masters rounded is named on every rank before any optimizer state is read."""
    facts = bound.facts
    tally = torch.zeros((facts.dp_from, 2), dtype=torch.int64)
    with torch.no_grad():
        for g, group_reads in enumerate(bound.reads):
            weights = saved(g)
            for read in group_reads if weights is not None else ():
                at = slice(read.target_offset, read.target_offset + read.length)
                tally[read.source_rank, 0] += read.length
                tally[read.source_rank, 1] += bracket_misses(targets[g][F.FP32_STATE][at], weights[at])
    _judge_weights(facts, bound.rank_file, _summed(tally, group), group, strict)


def _summed(tally: torch.Tensor, group: Any) -> list[list[int]]:
    """A per-old-file tally (rows: old DP ranks) summed over the group: the same rows on every rank."""
    totals = tally.to(device())
    all_reduce(totals, group)
    return totals.cpu().tolist()


def _judge_weights(facts: SavedFacts, rank_file: RankFile, totals: list[list[int]], group: Any, strict: bool) -> None:
    """Saved weights that are not their masters rounded (``totals``: per old file, elements compared and
    missed) stop every rank (``strict``), naming the files, or are reported once and the masters win."""
    tally = WeightTally({r: row[0] for r, row in enumerate(totals)}, {r: row[1] for r, row in enumerate(totals)})
    problems = blame_weights(
        facts.model_states, {r: str(rank_file(r)) for r, row in enumerate(totals) if row[1]}, tally
    )
    if not problems:
        return
    if facts.save_id is not None:  # the save's identity binds the files: weights of this save, not its masters
        if comm().get_rank(group=group) == 0:
            for problem in problems:
                log.warning(
                    "megatron-ucp: %s (the files are of one save, by its record: its weights were not its "
                    "masters rounded when it was saved, or the file changed since)",
                    problem,
                )
        return
    error = CheckpointFormatError(
        binding_message(Path(facts.model_states).parent, problems, loaded=True) + f"\n({STRICT_OVERRIDE})",
        subject=problems[0].split(": ", 1)[0],
        damaged=problems[0].split(": ", 1)[0],
    )
    refuse_or_warn(strict, error, problems, log, say=comm().get_rank(group=group) == 0, then="the fp32 masters win")


def verify_loaded(job: LiveJob, bound: BoundSave, strict: bool = True, saved: Optional[SavedSlice] = None) -> str:
    """After DeepSpeed's own load at the saved DP size, any ZeRO stage (collective over the DP group): the masters
    it loaded against the saved weights (``saved``, where the route has them; None: not compared), and, saved
    through the hooks, every partition against the checksum its file recorded. Raises the same error on every
    rank naming the file(s) (``strict``; else warns once). Returns what was checked, for the log."""
    group, base, masters = job.dp_group, job.base, job.masters()
    facts, rank = bound.facts, bound.rank
    tally = torch.zeros((facts.dp_from, 3), dtype=torch.int64)
    mine = bound.sources.get(rank)
    with torch.no_grad():
        for g, (master, real) in enumerate(zip(masters, facts.layout.true_lengths(rank), strict=True)):
            weights = saved(g) if saved is not None else None
            if weights is not None:
                tally[rank, 0] += real
                tally[rank, 1] += bracket_misses(master[:real], weights)
            if mine is None or mine.sums is None:
                continue
            state = base.state.get(master, {})
            tally[rank, 2] += changed_states(
                facts.layout,
                rank,
                g,
                mine.sums[g],
                lambda name, master=master, state=state: master if name == F.FP32_STATE else state.get(name),
                facts.algorithm,
            )
    bound.close()
    totals = _summed(tally, group)
    _judge_weights(facts, bound.rank_file, totals, group, strict)
    bad = [str(bound.rank_file(r)) for r, row in enumerate(totals) if row[2]]
    refuse_changed(bad, Path(facts.model_states).parent, strict, group)
    if saved is None:
        return (
            "every partition checked against the save's checksums"
            if facts.algorithm
            else "rank files bound to their positions (no partition checksums: not saved through the hooks)"
        )
    return (
        "every partition checked against the save's checksums and the saved weights"
        if facts.algorithm
        else "the masters checked against the saved weights (rank files without partition checksums)"
    )
