"""The one copy out of old rank files into live partitions, with its ledger, for every layout.

A native load at a new size (ZeRO-1/2 flat groups, expert groups, ZeRO-3 sub-groups alike) is a list of
:class:`~megatron_ucp.plan.reshard.Read` per live group, planned by :mod:`megatron_ucp.plan.reshard`, and a
set of old rank files bound to their positions and their save (:mod:`megatron_ucp.deepspeed.rank_files`).
What differs between layouts is only where a file's real elements sit in its partition, which
:class:`OldFiles` says; the copy, the ledger rows (one per old file, group and state), the all-reduce that
closes them, the report and the refusal of a partition changed since its save are written once here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron_ucp.deepspeed.rank_files import RankFile, SavedFacts, Source, binding_message
from megatron_ucp.errors import CheckpointFormatError, refuse_or_warn
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.integration.collectives import all_reduce, comm, device
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Ledger,
    Problem,
    check_ledger,
    checksum,
    enter_old_file_copy,
    ledger_totals,
)
from megatron_ucp.plan.partitioned import Partitioned, first_real, real_length
from megatron_ucp.plan.reshard import Read
from megatron_ucp.plan.save_record import runs_checksum

log = logging.getLogger(__name__)

Targets = list[dict[str, torch.Tensor]]
"""Per live group: state (``fp32`` first) -> this rank's partition, zeroed (padding stays zero)."""


@dataclass(frozen=True)
class OldFiles:
    """A save's old rank files as the ledger counts them: a row per (file, its group, state) holding real
    elements; ``layout`` says where each file's real elements sit (any layout,
    :class:`~megatron_ucp.plan.partitioned.Partitioned`)."""

    rank_file: RankFile
    layout: Partitioned
    states: Sequence[tuple[str, ...]]
    algorithm: Optional[str]

    @property
    def unit(self) -> str:
        return self.layout.unit

    @property
    def dp_from(self) -> int:
        return self.layout.dp

    def true_length(self, group: int, position: int) -> int:
        return real_length(self.layout, position, group)

    def first_real(self, group: int, position: int) -> int:
        return first_real(self.layout, position, group)

    @classmethod
    def of(cls, facts: SavedFacts, rank_file: RankFile) -> "OldFiles":
        """A save's files from its facts (its layout, states and checksum algorithm)."""
        return cls(rank_file, facts.layout, facts.states, facts.algorithm)

    def row(self, position: int, group: int) -> str:
        return f"{self.rank_file(position)}: {self.unit} {group}"

    def ledger(self) -> Ledger:
        return Ledger.from_listing(
            {
                self.row(r, g): (F.FP32_STATE, *states)
                for g, states in enumerate(self.states)
                for r in range(self.dp_from)
                if self.true_length(g, r) > 0
            }
        )

    def source(self, row: str, state: str) -> str:
        """What a ledger row stands for, in a problem's words."""
        return f"{row.replace(f': {self.unit}', f', {self.unit}', 1)}'s {state!r}"


def copy_reads(
    files: OldFiles,
    reads: Sequence[Sequence[Read]],
    sources: dict[int, Source],
    targets: Targets,
    ledger: Ledger,
    table: torch.Tensor,
    only: Optional[tuple[str, ...]] = None,
) -> float:
    """Every planned read of every state (of ``only``, when given) copied into ``targets`` and entered in
    ``table``, in the row of the file read: what landed hashed at its place in its param group; the
    file's real count and recorded checksum by the reader of its first real element. No collective: the
    caller all-reduces ``table``. Returns the seconds spent on the ledger."""
    accounting = 0.0
    algorithm = files.algorithm or integrity.ALGORITHM  # both sides of the ledger alike
    firsts: dict[tuple[int, int], int] = {}
    with torch.no_grad():
        for h, group_reads in enumerate(reads):
            wanted = [(state, t) for state, t in targets[h].items() if only is None or state in only]
            for read in group_reads:
                src, g = sources[read.source_rank], read.source_group
                key = (g, read.source_rank)
                if key not in firsts:
                    firsts[key] = files.first_real(*key)
                first = read.source_offset == firsts[key]
                for state, target in wanted:
                    stored = src.fp32[g] if state == F.FP32_STATE else src.states[g][state]
                    landed = target.narrow(0, read.target_offset, read.length)
                    held = src.read_into(stored, read.source_offset, landed)  # 8-bit codes: what the save hashed
                    t0 = time.perf_counter()
                    enter_old_file_copy(
                        table,
                        ledger.index(files.row(read.source_rank, g), state),
                        read.length,
                        checksum(held, read.position, algorithm),  # the same at the old and the new size
                        files.true_length(g, read.source_rank) if first else None,
                        int(src.sums[g][state][1]) if first and src.sums is not None else None,
                        has_record=src.sums is not None,
                    )
                    accounting += time.perf_counter() - t0
    return accounting


@dataclass(frozen=True)
class Timing:
    started: float
    """``time.perf_counter()`` when the load began."""
    bind: float
    accounting: float


def settle(
    files: OldFiles,
    ledger: Ledger,
    table: torch.Tensor,
    group: Any,
    *,
    counts: tuple[int, int],
    dp_to: int,
    problems: Sequence[Problem],
    carried: Sequence[str],
    checked: str,
    timing: Timing,
) -> AccountingReport:
    """The ledger all-reduced over the DP group and closed: the report of the load, the same on every rank
    (``counts``: parameters and (parameter, tensor state) pairs saved; ``problems``: those found before,
    such as missing optimizer states; ``carried``: the states of one value per partition installed as they were
    saved, ``step`` among them). Enforcing it is the caller's."""
    t_wait = time.perf_counter()
    totals = table.to(device())
    all_reduce(totals, group)
    totals = totals.cpu()
    collective = time.perf_counter() - t_wait
    found = check_ledger(ledger, totals, source=files.source) + list(problems)
    _, _, elements, names = ledger_totals(ledger, totals)
    names = (*names, *carried)
    load = time.perf_counter() - timing.started - timing.accounting - collective
    return AccountingReport(
        counts[0],
        counts[1],
        names,
        elements,
        files.dp_from,
        dp_to,
        tuple(found),
        (checked,),
        seconds=(
            ("bind", round(timing.bind, 4)),
            ("load", round(load, 4)),
            ("accounting", round(timing.accounting, 4)),
            ("collective", round(collective, 4)),
        ),
        route="native reshard",
    )


def against_the_save(algorithm: Optional[str], what: str) -> str:
    """The report's line on what the copies were checked against (``algorithm``: the save's checksums')."""
    if algorithm:
        return f"{what}; checked against the save's partition checksums"
    return (
        f"{what}; rank files without partition checksums (not saved through the hooks): copies checked for "
        "placement, not against the save"
    )


def changed_states(
    layout: Partitioned,
    position: int,
    group: int,
    recorded: Mapping[str, Sequence[int]],
    live: Callable[[str], Optional[torch.Tensor]],
    algorithm: str,
) -> int:
    """How many of the states a rank file recorded for its partition of ``group`` differ from the live ones
    (``live(state)``: this rank's partition of it, None when the optimizer has no such state), each hashed
    over the partition's real runs at their positions, as the save hashed them."""
    runs = layout.runs(position, group)
    changed = 0
    for state, (_, expected) in recorded.items():
        tensor = live(state)
        changed += int(tensor is None or runs_checksum(tensor.detach(), runs, algorithm) != expected)
    return changed


def refuse_changed(culprits: Sequence[str], folder: Path, strict: bool, group: Any) -> None:
    """Partitions that DeepSpeed loaded and that differ from the checksum their file recorded: the same error
    on every rank naming the files (``strict``), else one warning each."""
    if not culprits:
        return
    problems = [
        f"{path}: a partition differs from the checksum its save recorded (changed on disk since the save)"
        for path in culprits
    ]
    error = CheckpointFormatError(
        binding_message(folder, problems, loaded=True), subject=culprits[0], damaged=culprits[0]
    )
    refuse_or_warn(strict, error, problems, log, say=comm().get_rank(group=group) == 0)
