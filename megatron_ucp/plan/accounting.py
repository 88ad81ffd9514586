"""Proof that a universal load put every tensor of the checkpoint somewhere (the PyTorch DCP lesson).

A load that quietly leaves some state at its initial value is the worst failure a resume can
have. So after the elastic loader has copied its fragments, every rank describes what it consumed
in a small integer table, the table is summed across the DP group (one ``all_reduce``), and
:func:`check_ledger` compares, for every (parameter, state) file of the checkpoint:

* how many ranks read it (zero: a state nobody consumed);
* the elements the ranks wrote vs the elements in the file (each element exactly once);
* an additive, position-weighted checksum (:mod:`megatron_ucp.format.integrity`) of the written
  fragments vs the same checksum of the full tensor: recorded by the converter in the manifest,
  or (folders without it) computed from the file by the rank owning the first element. A fragment
  in the wrong place or a wrong byte changes it.

It is additive over fragments at any offsets, so ranks each hash their own pieces, and exact
(modulo 2**64, summed as two 32-bit halves so an int64 all-reduce cannot overflow), so the sum is
independent of reduction order and device. Everything here is pure: no I/O, no
``torch.distributed``; the hook does the reading and the collective.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from megatron_ucp.errors import AccountingError, refuse_or_warn
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensor: torch.Tensor, offset: int = 0, algorithm: str = integrity.ALGORITHM) -> int:
    """:func:`megatron_ucp.format.integrity.fragment_sum` of ``tensor`` (flattened) placed at flat element ``offset``.

    ``checksum(full) == combine(checksum(full[a:b], a) for each piece [a, b) of a partition of full)``.
    Hashes raw bits (dtype-generic); a tensor on an accelerator is copied to the CPU first.
    """
    if offset < 0:
        raise AccountingError(f"negative fragment offset {offset}", subject=offset)
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        offset *= 2
    int_dtype = _INT_OF_SIZE.get(flat.element_size())
    if int_dtype is None:
        raise AccountingError(f"cannot checksum tensors of dtype {flat.dtype}", subject=flat.dtype)
    values = flat.contiguous().view(int_dtype).cpu().numpy()
    return integrity.fragment_sum(integrity.as_uints(values, flat.element_size()), offset, algorithm)


def combine(sums: Iterable[int]) -> int:
    """Sum of fragment checksums (the value to compare with the full tensor's checksum)."""
    return integrity.combine(sums)


# ------------------------------------------------------------------------------------------------
# problems and the report
# ------------------------------------------------------------------------------------------------


class ProblemKind(enum.Enum):
    MISSING_FOLDER = "parameter without a folder in the checkpoint"
    EXTRA_FOLDER = "checkpoint folder without a parameter"
    MISSING_STATE_FILE = "state file missing"
    UNCONSUMED = "state in the checkpoint that no rank consumed"
    COUNT_MISMATCH = "element count mismatch"
    CHECKSUM_MISMATCH = "checksum mismatch"
    NOT_RESTORED = "live optimizer state not restored"
    UNUSED_STATE = "checkpoint state the live optimizer does not use"
    STRAY_STATE_FILE = "state file the rest of its param group lacks"
    STEP_MISMATCH = "step differs within a param group"
    PARAM_GROUPS = "param groups not restored"
    TRAINING_STATE = "training state not restored"
    MODULE_TENSOR = "module buffer or frozen parameter not restored"
    RANK_FAILURE = "a rank failed while loading"
    COMMAND_LINE = "this run's command line differs from the checkpoint"


@dataclass(frozen=True)
class Problem:
    """One thing the load did not account for, naming the parameter and state it concerns."""

    kind: ProblemKind
    param: Optional[str]
    state: Optional[str]
    detail: str

    def __str__(self) -> str:
        where = []
        if self.param is not None:
            where.append(f"parameter {self.param!r}")
        if self.state is not None:
            where.append(f"state {self.state!r}")
        location = (" " + ", ".join(where)) if where else ""
        return f"{self.kind.value}:{location}: {self.detail}"


@dataclass(frozen=True)
class AccountingReport:
    """The outcome of one universal load, across all DP ranks (identical on every rank)."""

    params: int
    state_files: int
    """(parameter, tensor state) files loaded, fp32 included; step files not counted."""
    state_names: tuple[str, ...]
    elements: int
    dp_from: Optional[int]
    dp_to: int
    problems: tuple[Problem, ...] = ()
    extras: tuple[str, ...] = field(default=())
    """Further facts for the summary line (training state, buffers), added by the engine hook."""
    seconds: tuple[tuple[str, float], ...] = field(default=(), compare=False)
    """This rank's time per phase of the optimizer load (``load``: reading and copying fragments;
    ``accounting``: checksums and checks; ``collective``: the one all-reduce, which also waits for
    the slowest rank), for benchmarks and debugging."""
    route: str = "universal load"
    """``universal load`` (from a universal folder) or ``native reshard`` (from the saved rank files)."""

    def with_more(
        self, problems: Sequence[Problem] = (), extras: Sequence[str] = (), dp_from: Optional[int] = None
    ) -> "AccountingReport":
        return dataclasses.replace(
            self,
            dp_from=self.dp_from if dp_from is None else dp_from,
            problems=self.problems + tuple(problems),
            extras=self.extras + tuple(extras),
        )

    def summary_line(self) -> str:
        dp_from = "?" if self.dp_from is None else str(self.dp_from)
        verdict = "every element placed exactly once" if not self.problems else f"{len(self.problems)} PROBLEM(S)"
        line = (
            f"megatron-ucp {self.route}: {self.params} params, {self.state_files} state tensors "
            f"({', '.join(self.state_names)}), {self.elements} elements, DP {dp_from} -> {self.dp_to}: {verdict}"
        )
        if self.extras:
            line += "; " + "; ".join(self.extras)
        return line

    def enforce(self, strict: bool, logger: logging.Logger, verbose: bool = True, folder: Any = None) -> None:
        """Raise :class:`AccountingError` listing every problem (strict), else warn about each.

        ``verbose``: log the warnings and the summary line (the hooks pass True on one rank only). ``folder``: the
        checkpoint folder the load read, named as damaged when every problem is a checksum its files recorded that the
        elements read from them do not match (the files changed since their save, not the job).
        """
        if self.problems:
            shown = "\n  ".join(str(p) for p in self.problems[:40])
            more = f"\n  ... and {len(self.problems) - 40} more" if len(self.problems) > 40 else ""
            error = AccountingError(
                f"{'universal checkpoint load' if self.route == 'universal load' else self.route} is incomplete "
                f"({len(self.problems)} problem(s)):\n  {shown}{more}\n"
                + (
                    "The checkpoint is not at fault: run with the checkpoint's values, or with the flag named above."
                    if all(p.kind is ProblemKind.COMMAND_LINE for p in self.problems)
                    else "Fix or reconvert the checkpoint; pass strict=False (MEGATRON_UCP_STRICT=0) only for a "
                    "deliberate partial load."
                ),
                subject=list(self.problems),
                damaged=folder if all(p.kind is ProblemKind.CHECKSUM_MISMATCH for p in self.problems) else None,
            )
            refuse_or_warn(strict, error, [str(p) for p in self.problems], logger, say=verbose)
        if verbose:
            logger.info("%s", self.summary_line())


# ------------------------------------------------------------------------------------------------
# folder-level checks
# ------------------------------------------------------------------------------------------------


def _state_counts(names: Sequence[str], listing: Mapping[str, Sequence[str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        for state in listing.get(name, ()):
            counts[state] = counts.get(state, 0) + 1
    return counts


def group_tensor_states(groups: Sequence[Sequence[str]], listing: Mapping[str, Sequence[str]]) -> list[tuple[str, ...]]:
    """Optimizer tensor states per live param group: those at least half its parameters' folders hold.

    A state file in fewer folders than that is a stray (reported by :func:`check_folders`), not a
    state every other parameter lacks. ``fp32`` (the master weights) and ``step`` (a scalar) are not
    optimizer tensors.
    """
    out = []
    for names in groups:
        present = sum(1 for n in names if n in listing)
        counts = _state_counts(names, listing)
        states = {s for s, c in counts.items() if 2 * c >= present}
        states.discard(F.FP32_STATE)
        states.discard(F.STEP_STATE)
        out.append(tuple(sorted(states)))
    return out


def check_folders(groups: Sequence[Sequence[str]], listing: Mapping[str, Sequence[str]]) -> list[Problem]:
    """Every live parameter has a folder with fp32 and all its group's states; no stray folders or files."""
    problems: list[Problem] = []
    live = {name for names in groups for name in names}
    for name in sorted(set(listing) - live):
        problems.append(
            Problem(
                ProblemKind.EXTRA_FOLDER,
                name,
                None,
                f"zero/{name}/ holds {sorted(listing[name])} but the model has no optimized parameter of that name",
            )
        )
    group_states = group_tensor_states(groups, listing)
    for names, states in zip(groups, group_states):
        group_has_step = any(F.STEP_STATE in listing.get(n, ()) for n in names)
        known = {F.FP32_STATE, F.STEP_STATE, *states}
        for name in names:
            if name not in listing:
                problems.append(
                    Problem(
                        ProblemKind.MISSING_FOLDER,
                        name,
                        None,
                        f"no zero/{name}/ folder: its weights and optimizer states would stay at their initial values",
                    )
                )
                continue
            have = set(listing[name])
            wanted = [F.FP32_STATE, *states] + ([F.STEP_STATE] if group_has_step else [])
            for state in wanted:
                if state not in have:
                    problems.append(
                        Problem(
                            ProblemKind.MISSING_STATE_FILE,
                            name,
                            state,
                            f"zero/{name}/{state}.pt is missing (other parameters of its param group have it)",
                        )
                    )
            for state in sorted(have - known):
                problems.append(
                    Problem(
                        ProblemKind.STRAY_STATE_FILE,
                        name,
                        state,
                        f"zero/{name}/{state}.pt: most parameters of its param group have no {state!r} state",
                    )
                )
    return problems


def check_optimizer_states(
    group_index: int,
    group_params: Sequence[str],
    expected: Optional[frozenset[str]],
    restored: Iterable[str],
    optimizer_name: str,
) -> list[Problem]:
    """States the live optimizer would use vs the states the load restored, for one param group.

    ``expected`` is None when the optimizer's states could not be discovered: nothing to check.
    """
    if expected is None:
        return []
    restored = set(restored)
    example = group_params[0] if group_params else None
    problems = []
    for state in sorted(expected - restored):
        problems.append(
            Problem(
                ProblemKind.NOT_RESTORED,
                example,
                state,
                f"{optimizer_name} keeps {state!r} for param group {group_index} "
                f"({len(group_params)} parameters) and would create it lazily at its first "
                f"step, but the checkpoint has no {state}.pt for it",
            )
        )
    for state in sorted(restored - expected):
        problems.append(
            Problem(
                ProblemKind.UNUSED_STATE,
                example,
                state,
                f"the checkpoint has {state!r} for param group {group_index} but "
                f"{optimizer_name} does not keep such a state; it would be ignored",
            )
        )
    return problems


# ------------------------------------------------------------------------------------------------
# the ledger: one row per (parameter, state) file, summed across ranks
# ------------------------------------------------------------------------------------------------


class Column(enum.IntEnum):
    CONSUMERS = 0
    """Ranks that read the file and wrote at least one of its elements (step: that read it)."""
    LOADED_COUNT = 1
    LOADED_SUM_HI = 2
    LOADED_SUM_LO = 3
    SOURCE_COUNT = 4
    """Contributed once, by the rank owning the parameter's first element."""
    SOURCE_SUM_HI = 5
    SOURCE_SUM_LO = 6
    STEP_MISMATCH = 7


def add_sum(table: torch.Tensor, row: int, loaded: bool, value: int) -> None:
    """Add a checksum to a row as two 32-bit halves (see :func:`megatron_ucp.format.integrity.split`)."""
    high, low = integrity.split(value)
    hi_col, lo_col = (
        (Column.LOADED_SUM_HI, Column.LOADED_SUM_LO) if loaded else (Column.SOURCE_SUM_HI, Column.SOURCE_SUM_LO)
    )
    table[row, hi_col] += high
    table[row, lo_col] += low


def enter_old_file_copy(
    table: torch.Tensor,
    row: int,
    length: int,
    landed: int,
    file_real: Optional[int] = None,
    recorded: Optional[int] = None,
    has_record: bool = False,
) -> None:
    """One copy out of an old rank file into its ledger row (a native reshard, any stage): ``length`` elements
    whose checksum at their position is ``landed``. The copy holding the file's first real element passes
    ``file_real`` (the file's real elements, counted once) and, saved through the hooks (``has_record``),
    ``recorded`` (the file's own checksum of them at save time); a file without that record is checked for
    placement and counts only (the same bytes on both sides)."""
    table[row, Column.CONSUMERS] += 1
    table[row, Column.LOADED_COUNT] += length
    add_sum(table, row, True, landed)
    if file_real is not None:
        table[row, Column.SOURCE_COUNT] += file_real
    if not has_record:
        add_sum(table, row, False, landed)
    elif file_real is not None:
        add_sum(table, row, False, int(recorded))


def row_sums(values: Sequence[int]) -> tuple[int, int]:
    """(loaded, source) checksums of one all-reduced row."""
    return (
        integrity.join(values[Column.LOADED_SUM_HI], values[Column.LOADED_SUM_LO]),
        integrity.join(values[Column.SOURCE_SUM_HI], values[Column.SOURCE_SUM_LO]),
    )


@dataclass(frozen=True)
class Ledger:
    """Row layout shared by every rank: the (parameter, state) files of the checkpoint, sorted."""

    rows: tuple[tuple[str, str], ...]

    @classmethod
    def from_listing(cls, listing: Mapping[str, Sequence[str]]) -> "Ledger":
        return cls(tuple(sorted((param, state) for param, states in listing.items() for state in states)))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {row: i for i, row in enumerate(self.rows)})

    def index(self, param: str, state: str) -> int:
        return self._index[(param, state)]  # type: ignore[attr-defined]

    def new_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros((len(self.rows), len(Column)), dtype=torch.int64, device=device)


def universal_file(param: str, state: str) -> str:
    return f"zero/{param}/{state}.pt"


def check_ledger(
    ledger: Ledger, totals: torch.Tensor, source: Callable[[str, str], str] = universal_file
) -> list[Problem]:
    """Problems in the all-reduced table: unconsumed files, miscounted or misplaced elements.
    ``source(param, state)`` names what a row stands for (a universal folder's state file by default)."""
    table = totals.detach().cpu().tolist()
    problems = []
    for (param, state), row in zip(ledger.rows, table):
        if row[Column.CONSUMERS] == 0:
            problems.append(
                Problem(ProblemKind.UNCONSUMED, param, state, f"{source(param, state)} was read by no rank")
            )
            continue
        if state == F.STEP_STATE:
            if row[Column.STEP_MISMATCH]:
                problems.append(
                    Problem(
                        ProblemKind.STEP_MISMATCH,
                        param,
                        state,
                        f"{source(param, state)} differs from the step of its param group "
                        f"({row[Column.STEP_MISMATCH]} rank(s) saw the difference)",
                    )
                )
            continue
        if row[Column.LOADED_COUNT] != row[Column.SOURCE_COUNT]:
            problems.append(
                Problem(
                    ProblemKind.COUNT_MISMATCH,
                    param,
                    state,
                    f"{source(param, state)}: the checkpoint holds {row[Column.SOURCE_COUNT]} "
                    f"elements, the ranks wrote {row[Column.LOADED_COUNT]}",
                )
            )
        elif row_sums(row)[0] != row_sums(row)[1]:
            problems.append(
                Problem(
                    ProblemKind.CHECKSUM_MISMATCH,
                    param,
                    state,
                    f"{source(param, state)}: the fragments written into the ranks do not "
                    "reassemble it (an element landed in the wrong place or changed)",
                )
            )
    return problems


def ledger_totals(ledger: Ledger, totals: torch.Tensor) -> tuple[int, int, int, tuple[str, ...]]:
    """(parameters, tensor state files, elements, state names), for the summary line."""
    table = totals.detach().cpu().tolist()
    params = {param for param, _ in ledger.rows}
    tensor_rows = [(row, values) for row, values in zip(ledger.rows, table) if row[1] != F.STEP_STATE]
    names = sorted({state for (_, state), _ in tensor_rows}, key=lambda s: (s != F.FP32_STATE, s))
    if any(state == F.STEP_STATE for _, state in ledger.rows):
        names.append(F.STEP_STATE)
    elements = sum(values[Column.SOURCE_COUNT] for _, values in tensor_rows)
    return len(params), len(tensor_rows), elements, tuple(names)
