"""The native load's copy: each rank's new partitions out of the few ranges of the old rank files the plan gives it
(:mod:`megatron_ucp.plan.reshard`), every layout alike, each old byte read by one rank, nothing written; the ledger
that proves every real element placed exactly once, unchanged since the save; the saved weights held against the
masters. A same-DP restart checks what DeepSpeed's own load put in place instead (:func:`verify_loaded`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron_ucp.deepspeed import stage3_runtime
from megatron_ucp.deepspeed.tensor_reads import Source
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.integration.collectives import Collective
from megatron_ucp.integration.live_job import LiveJob, expected_state_keys, install_group_state, restore_global_state
from megatron_ucp.integration.resume.native.binding import BoundSave, RankFile, SavedFacts
from megatron_ucp.integration.resume.native.requantize import requantize_partitions
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Ledger,
    Problem,
    check_ledger,
    check_optimizer_states,
    checksum,
    enter_old_file_copy,
    ledger_totals,
)
from megatron_ucp.plan.partitioned import Partitioned, first_real, real_length
from megatron_ucp.plan.rank_binding import WeightTally, binding_message, blame_weights, step_value
from megatron_ucp.plan.reshard import Read
from megatron_ucp.plan.save_record import runs_checksum

log = logging.getLogger(__name__)

STRICT_OVERRIDE = (
    "after a ZeRO-1/2 save every saved bf16 weight is its fp32 master rounded, so these files were not saved "
    "together; a module deliberately changed after the save (model surgery) is the one legitimate case: "
    "MEGATRON_UCP_STRICT=0 loads it, the masters winning"
)

SavedSlice = Callable[[int], Optional[torch.Tensor]]
"""Group -> this rank's real range of the saved weights, at its place in the new partition (the module DeepSpeed
loaded, or the range read from the model-states file); None: not compared."""
Targets = list[dict[str, torch.Tensor]]
"""Per live group: state (``fp32`` first) -> this rank's partition, zeroed (padding stays zero)."""


@dataclass(frozen=True)
class OldFiles:
    """A save's old rank files as the ledger counts them: a row per (file, its group, state) holding real elements;
    ``layout`` says where each file's real elements sit."""

    rank_file: RankFile
    layout: Partitioned
    states: Sequence[tuple[str, ...]]
    algorithm: Optional[str]

    @classmethod
    def of(cls, facts: SavedFacts, rank_file: RankFile) -> "OldFiles":
        return cls(rank_file, facts.layout, facts.states, facts.algorithm)

    def row(self, position: int, group: int) -> str:
        return f"{self.rank_file(position)}: {self.layout.unit} {group}"

    def ledger(self) -> Ledger:
        return Ledger.from_listing(
            {
                self.row(r, g): (F.FP32_STATE, *states)
                for g, states in enumerate(self.states)
                for r in range(self.layout.dp)
                if real_length(self.layout, r, g) > 0
            }
        )

    def source(self, row: str, state: str) -> str:
        """What a ledger row stands for, in a problem's words."""
        return f"{row.replace(f': {self.layout.unit}', f', {self.layout.unit}', 1)}'s {state!r}"


def copy_reads(
    files: OldFiles,
    reads: Sequence[Sequence[Read]],
    sources: dict[int, Source],
    targets: Targets,
    ledger: Ledger,
    table: torch.Tensor,
    only: Optional[tuple[str, ...]] = None,
) -> float:
    """Every planned read of every state (of ``only``) copied into ``targets`` and entered in ``table``, in the row of
    the file read: what landed hashed at its place in its param group; the file's real count and recorded checksum by
    the reader of its first real element. No collective. Returns the seconds spent on the ledger."""
    accounting = 0.0
    algorithm = files.algorithm or integrity.ALGORITHM  # both sides of the ledger alike
    firsts: dict[tuple[int, int], int] = {}
    with torch.no_grad():
        for h, group_reads in enumerate(reads):
            wanted = [(state, t) for state, t in targets[h].items() if only is None or state in only]
            for read in group_reads:
                src, g, r = sources[read.source_rank], read.source_group, read.source_rank
                if (g, r) not in firsts:
                    firsts[g, r] = first_real(files.layout, r, g)
                first = read.source_offset == firsts[g, r]
                for state, target in wanted:
                    stored = src.fp32[g] if state == F.FP32_STATE else src.states[g][state]
                    landed = target.narrow(0, read.target_offset, read.length)
                    held = src.read_into(stored, read.source_offset, landed)  # 8-bit codes: what the save hashed
                    t0 = time.perf_counter()
                    enter_old_file_copy(
                        table,
                        ledger.index(files.row(r, g), state),
                        read.length,
                        checksum(held, read.position, algorithm),  # the same at the old and the new size
                        real_length(files.layout, r, g) if first else None,
                        int(src.sums[g][state][1]) if first and src.sums is not None else None,
                        has_record=src.sums is not None,
                    )
                    accounting += time.perf_counter() - t0
    return accounting


def loaded_weights(job: LiveJob, bound: BoundSave) -> SavedSlice:
    """The saved weights as DeepSpeed's own module load put them in this rank's partition."""
    new = bound.new
    parts = [parts[new.index(g, bound.rank)] for g, parts in enumerate(job.lp_partitions())]
    reals = new.true_lengths(bound.rank)
    return lambda g: parts[g][: reals[g]]


def load_native_partitions(
    job: LiveJob, bound: BoundSave, strict: bool = True, saved: Optional[SavedSlice] = None, weights: bool = True
) -> AccountingReport:
    """This rank's partitions of a save at another DP size (or another ZeRO-3 sub-group cut), from the bound files,
    after DeepSpeed loaded the rest: the masters first, held against the saved weights (``saved``; default, ZeRO-1/2,
    the loaded module; ``weights`` False: the save holds none to hold them against), then the states, then the ledger
    closed over the DP group. Returns the report (the same on every rank); enforcing it is the caller's, except for
    weights that are not the masters rounded (``strict``)."""
    t_start = time.perf_counter()
    optimizer, calls, base = job.optimizer, Collective(job.dp_group), job.base
    facts, new, reads = bound.facts, bound.new, bound.reads
    masters = job.masters()
    links = [[] for _ in masters] if job.per_parameter else job.groups
    if saved is None and weights and not job.per_parameter:
        saved = loaded_weights(job, bound)
    files = OldFiles.of(facts, bound.rank_file)
    ledger = files.ledger()
    table = ledger.new_table(device="cpu")
    try:
        states = [_states_of(bound, h) for h in range(len(masters))]
        steps = [_drawn_value(bound, h, facts.steps, "are at different optimizer steps") for h in range(len(masters))]
        scalars = [dict(_drawn_value(bound, h, facts.scalars, _DIFFERENT_SCALARS) or {}) for h in range(len(masters))]
        targets = [_targets(base, master, names) for master, names in zip(masters, states)]
        accounting = copy_reads(files, reads, bound.sources, targets, ledger, table, (F.FP32_STATE,))
        if saved is not None:
            _check_weights(bound, targets, saved, calls, strict)
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
    requantized = requantize_partitions(base, masters, job.dp_group) if facts.requantized else None
    old = bound.old
    groups = range(len(old.partition_sizes()))
    what = f"{old.unit}s {len(groups)} -> {len(masters)}; rank files bound to their positions"
    what += " and the saved weights" if saved is not None else ""
    t_wait = time.perf_counter()
    totals = calls.total(table)
    collective = time.perf_counter() - t_wait
    _, _, elements, names = ledger_totals(ledger, totals)
    load = time.perf_counter() - t_start - accounting - collective
    report = AccountingReport(
        sum(len(old.names(g)) for g in groups),
        sum(len(old.names(g)) * (1 + len(facts.states[g])) for g in groups),
        (
            *names,
            *([F.STEP_STATE] if any(s is not None for s in facts.steps) else []),
            *sorted({name for extra in scalars for name in extra}),
        ),
        elements,
        facts.dp_from,
        bound.dp_to,
        tuple(check_ledger(ledger, totals, source=files.source) + problems),
        (_against_the_save(facts.algorithm, what),),
        seconds=(
            ("bind", round(bound.seconds, 4)),
            ("load", round(load, 4)),
            ("accounting", round(accounting, 4)),
            ("collective", round(collective, 4)),
        ),
        route="native reshard",
    )
    return report.with_more(extras=[requantized]) if requantized else report


_DIFFERENT_SCALARS = "hold different values of their per-partition optimizer states"


def _against_the_save(algorithm: Optional[str], what: str) -> str:
    """The report's line on what the copies were checked against (``algorithm``: the save's checksums')."""
    if algorithm:
        return f"{what}; checked against the save's partition checksums"
    return (
        f"{what}; rank files without partition checksums (not saved through the hooks): copies checked for "
        "placement, not against the save"
    )


def _targets(base: Any, master: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """One live group's fp32 partition and one buffer per saved state, all zeroed: the optimizer's own tensor where it
    has one of the right size (so that it stays where the engine keeps it: host memory under offload), else a new one
    beside the master."""
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


def _drawn_value(bound: BoundSave, h: int, per_group: Sequence[Any], what: str) -> Any:
    """The value live group ``h`` gets of something each saved group holds once (its step, its states of one value
    per partition): that of the saved groups it draws from, which must agree (None: it draws from none)."""
    drawn = bound.new.drawn_from(bound.old, h)
    found = [per_group[g] for g in drawn]
    values = {_comparable(v) for v in found}
    if len(values) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved {bound.old.unit}s {list(drawn)} {what} {sorted(values, key=str)}",
            subject=bound.facts.model_states,
        )
    return found[0] if found else None


def _comparable(value: Any) -> Any:
    """A step, or a group's states of one value per partition, as one hashable value to compare."""
    if isinstance(value, Mapping):
        return tuple((k, _comparable(v)) for k, v in sorted(value.items()))
    value = step_value(value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


_BF16_LOW = 0xFFFF
_CHUNK = 1 << 22


def bracket_misses(master: torch.Tensor, weight: torch.Tensor) -> int:
    """How many saved weights are not their fp32 masters rounded (same number of elements, flat).

    A bf16 weight must be one of the two bf16 values around its master (only itself when the master is exact): round
    to nearest, truncation and stochastic rounding all give one of them, a weight of another save or position almost
    never. Weights of another dtype must equal the master cast to it. Compared where the masters live."""
    master, weight = master.detach().reshape(-1), weight.detach().reshape(-1)
    if master.numel() != weight.numel():
        raise ValueError(f"{master.numel()} masters against {weight.numel()} weights")
    missed = 0
    for lo in range(0, master.numel(), _CHUNK):
        m = master[lo : lo + _CHUNK].float()
        w = weight[lo : lo + _CHUNK]
        w = w if w.device == m.device else w.to(m.device)
        rounded = m.to(w.dtype)
        if torch.equal(w, rounded):  # rounded to nearest, as DeepSpeed copies: the common case
            continue
        differ = w != rounded
        if w.dtype != torch.bfloat16:
            missed += int(differ.sum())
            continue
        m, w = m[differ], w[differ]  # the bracket for the rest
        bits = m.contiguous().view(torch.int32)
        base = bits & ~_BF16_LOW
        got = w.contiguous().view(torch.int16).to(torch.int32) << 16
        inexact = (bits & _BF16_LOW) != 0
        missed += int((~((got == base) | (inexact & (got == base + 0x10000)))).sum())
    return missed


def _check_weights(bound: BoundSave, targets: Targets, saved: SavedSlice, calls: Collective, strict: bool) -> None:
    """The masters just copied against the saved weights, per old file (collective): a file whose ranges are not its
    masters rounded is named on every rank before any optimizer state is read."""
    tally = torch.zeros((bound.facts.dp_from, 2), dtype=torch.int64)
    with torch.no_grad():
        for g, group_reads in enumerate(bound.reads):
            weights = saved(g)
            for read in group_reads if weights is not None else ():
                at = slice(read.target_offset, read.target_offset + read.length)
                tally[read.source_rank, 0] += read.length
                tally[read.source_rank, 1] += bracket_misses(targets[g][F.FP32_STATE][at], weights[at])
    _refuse(bound, calls.total(tally).tolist(), calls, strict)


def _refuse(bound: BoundSave, totals: list[list[int]], calls: Collective, strict: bool) -> None:
    """What the checks after the copy or the load found, per old file (``totals``: rows of elements compared, weights
    outside their masters' bracket and, when counted, partitions changed since their recorded checksum), refused on
    every rank naming the files (``strict``), else said once: the weights first, then the partitions. Weights of a save
    whose record binds its files are that save's weights: said, never refused."""
    facts = bound.facts
    tally = WeightTally({r: row[0] for r, row in enumerate(totals)}, {r: row[1] for r, row in enumerate(totals)})
    missed = {r: str(bound.rank_file(r)) for r, row in enumerate(totals) if row[1]}  # only the files named
    weights = blame_weights(facts.model_states, missed, tally)
    if weights and facts.save_id is not None:
        if calls.first:
            for problem in weights:
                log.warning(
                    "megatron-ucp: %s (the files are of one save, by its record: its weights were not its "
                    "masters rounded when it was saved, or the file changed since)",
                    problem,
                )
        weights = []
    changed = [
        f"{bound.rank_file(r)}: a partition differs from the checksum its save recorded (changed on disk since the "
        "save)"
        for r, row in enumerate(totals)
        if len(row) > 2 and row[2]
    ]
    folder = Path(facts.model_states).parent
    for problems, why, then in (
        (weights, f"\n({STRICT_OVERRIDE})", "the fp32 masters win"),
        (changed, "", "continuing"),
    ):
        if problems:
            culprit = problems[0].split(": ", 1)[0]
            error = CheckpointFormatError(
                binding_message(folder, problems, loaded=True) + why, subject=culprit, damaged=culprit
            )
            calls.refuse_or_warn(strict, error, problems, log, then=then)


def changed_states(
    layout: Partitioned,
    position: int,
    group: int,
    recorded: Mapping[str, Sequence[int]],
    live: Callable[[str], Optional[torch.Tensor]],
    algorithm: str,
) -> int:
    """How many of the states a rank file recorded for its partition of ``group`` differ from the live ones
    (``live(state)``: this rank's partition of it, None when the optimizer has no such state), each hashed over the
    partition's real runs at their positions, as the save hashed them."""
    runs = layout.runs(position, group)
    changed = 0
    for state, (_, expected) in recorded.items():
        tensor = live(state)
        changed += int(tensor is None or runs_checksum(tensor.detach(), runs, algorithm) != expected)
    return changed


def verify_loaded(job: LiveJob, bound: BoundSave, strict: bool = True, saved: Optional[SavedSlice] = None) -> str:
    """After DeepSpeed's own load at the saved DP size, any ZeRO stage (collective over the DP group): the masters it
    loaded against the saved weights (``saved``; None: not compared) and, saved through the hooks, every partition
    against the checksum its file recorded. Refused on every rank naming the files (``strict``; else said once).
    Returns what was checked, for the log."""
    base, masters = job.base, job.masters()
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
    calls = Collective(job.dp_group)
    _refuse(bound, calls.total(tally).tolist(), calls, strict)
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
