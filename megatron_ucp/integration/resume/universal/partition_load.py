"""Our loader of ZeRO partitions from a universal folder, with the ledger that proves it: each rank copies only its
fragments of fp32 and every state out of the mapped files, hashes what landed, and one all-reduce closes the account
(:func:`load_universal_partitions`). It replaces ZeRO-1/2's ``load_hp_checkpoint_state_from_checkpoint_dir`` for good
(:func:`install_partition_loader`) and ZeRO-3's optimizer load for one universal load.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from megatron_ucp.config import UcpConfig
from megatron_ucp.convert.universal import list_zero_folder, read_manifest
from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.deepspeed.reader import load_torch_file
from megatron_ucp.errors import CheckpointFormatError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.format.integrity import RecordedChecksums, recorded_checksums
from megatron_ucp.integration.collectives import JOB, Collective, Failure, comm, is_first
from megatron_ucp.integration.live_job import (
    LiveGroup,
    TpPlace,
    expected_state_keys,
    install_group_state,
    live_groups,
    live_tp_layout,
    live_value,
    restore_global_state,
    tensor_parallel_of,
)
from megatron_ucp.integration.resume.universal.names import live_expert_names, saved_names
from megatron_ucp.integration.resume.universal.state_layout import StateLayout, gather, state_layout, tensor_of
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Column,
    Ledger,
    Problem,
    ProblemKind,
    add_sum,
    check_folders,
    check_ledger,
    check_optimizer_states,
    checksum,
    group_tensor_states,
    ledger_totals,
)
from megatron_ucp.plan.param_geometry import group_count_difference
from megatron_ucp.plan.rank_binding import step_value
from megatron_ucp.plan.tensor_parallel import full_shape, runs_between, slice_runs

log = logging.getLogger(__name__)


_REPORTS: contextvars.ContextVar[Optional[list[AccountingReport]]] = contextvars.ContextVar(
    "megatron_ucp_universal_reports", default=None
)
"""Inside the universal route (:func:`collecting_reports`): where the loader DeepSpeed calls puts its report."""


def install_partition_loader(patches: Any, config: UcpConfig) -> None:
    """Our loader in place of ZeRO-1/2's ``load_hp_checkpoint_state_from_checkpoint_dir`` (every universal load,
    ours or stock DeepSpeed's)."""
    surface.replace(
        patches, surface.ZERO_BASE, surface.OPTIMIZER_LOADER, lambda original: _partition_loader(original, config)
    )


def _partition_loader(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_hp_checkpoint_state_from_checkpoint_dir(self: Any, lp_groups_name: str, checkpoint_dir: str) -> None:
        layout = surface.layout_of(self)
        if layout is None or layout.lp_groups != lp_groups_name:
            return original(self, lp_groups_name, checkpoint_dir)
        hand_in(load_universal_partitions(self, Path(checkpoint_dir), strict=config.strict), config, self)

    return load_hp_checkpoint_state_from_checkpoint_dir


@contextlib.contextmanager
def collecting_reports() -> Iterator[list[AccountingReport]]:
    """For one universal load: the reports the loader makes (DeepSpeed calls it, not the route) go to the list
    yielded instead of being enforced by the loader."""
    reports: list[AccountingReport] = []
    token = _REPORTS.set(reports)
    try:
        yield reports
    finally:
        _REPORTS.reset(token)


def hand_in(report: AccountingReport, config: UcpConfig, optimizer: Any) -> None:
    """To the route when inside it (one summary with the training state's checks), else enforced here."""
    box = _REPORTS.get()
    if box is not None:
        box.append(report)
    else:
        report.enforce(config.strict, log, verbose=is_first(surface.dp_group(optimizer)))


def _state_listing(zero_dir: Path) -> dict[str, tuple[str, ...]]:
    """Parameter folder -> its state files (names without ``.pt``)."""
    return {
        name: tuple(f[:-3] for f in files if f.endswith(".pt")) for name, files in list_zero_folder(zero_dir).items()
    }


class _Clock:
    """Adds up the time spent inside ``with clock:`` blocks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> "_Clock":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._t0


@dataclass(frozen=True)
class _FolderFacts:
    """What the group's first rank reads once and broadcasts (no metadata storm on the file system)."""

    listing: dict[str, tuple[str, ...]]
    sums: Optional[RecordedChecksums]


def _recorded_source(
    sums: RecordedChecksums, name: str, state: str, layout: StateLayout, path: Path
) -> tuple[int, int]:
    """(elements, checksum) the manifest says the file holds, for what this layout restores."""
    record = sums.files.get(f"{name}/{state}")
    if not isinstance(record, dict) or "numel" not in record or "sum" not in record:
        raise CheckpointFormatError(
            f"{path}: not in the manifest's checksums although the folder has them "
            "(a file added after the conversion?)",
            subject=path,
        )
    count, value = int(record["numel"]), int(record["sum"])
    if layout.dropped is not None:  # the rows past the new padded size: the file's sum less theirs
        count -= layout.dropped.numel()
        value = (value - checksum(layout.dropped, count, sums.algorithm)) & integrity.MASK
    elif layout.rows_cut:  # the manifest sums every kept row; the restored ones are hashed here (a few rows)
        rows = layout.pieces[1]
        count += rows.numel()
        value = integrity.combine([value, checksum(rows, layout.pieces[0].numel(), sums.algorithm)])
    elif layout.rows_restored:
        count += int(record.get("rows_numel", 0))
        value = integrity.combine([value, int(record.get("rows_sum", 0))])
    return count, value


def load_universal_partitions(
    optimizer: Any,
    checkpoint_dir: Path,
    strict: bool = True,
    names: Optional[dict[Any, str]] = None,
    tensor_parallel: Optional[TpPlace] = None,
) -> AccountingReport:
    """Load this rank's ZeRO partitions from ``<checkpoint_dir>/zero`` and account for them.

    Collective over the optimizer's DP group: every rank must call it. Returns the report (the
    same on every rank); raising is left to the caller, except when a rank failed to load at all.
    With ``strict=False`` optimizer tensor states missing from the checkpoint start at zero (as a
    fresh optimizer's would) instead of being absent, so that the first step does not fail. ``names``:
    live parameter -> name (default the optimizer's own map; ZeRO-3 optimizers before DeepSpeed 0.18 have
    none, the engine's is passed); ``tensor_parallel``: this rank's TP place (default from the optimizer's
    ``mpu``; a ZeRO-3 optimizer keeps none, the engine's is passed).
    """

    t_start = time.perf_counter()
    clock = _Clock()
    dist = comm()
    dp_group = surface.dp_group(optimizer)
    dp_to = dist.get_world_size(group=dp_group)
    tensor_parallel = tensor_parallel if tensor_parallel is not None else tensor_parallel_of(optimizer)
    # With TP or PP every element of a file lands on the ranks of several DP groups (TP slices,
    # pipeline stages): the ledger is summed over the world, and each file is expected once per
    # TP copy that holds it whole (replicated parameters) and once per stage that holds it. Decided
    # from the optimizer's own DP group against the world, not from the mpu's axes: whatever groups
    # the job made, a world larger than the group means copies of the files' elements elsewhere.
    model_parallel = dist.get_world_size() != dp_to
    group = None if model_parallel else dp_group
    zero_dir = checkpoint_dir / F.UNIVERSAL_ZERO_DIR
    base = surface.base_optimizer(optimizer)
    per_parameter = surface.layout_of(optimizer).per_parameter
    live_names = names if names is not None else surface.param_names(optimizer)
    experts = (
        {}
        if per_parameter
        else live_expert_names(
            live_names,
            surface.layout_of(optimizer).groups(optimizer),
            surface.group_dp_groups(optimizer),
            surface.dp_group(optimizer),
        )
    )
    if experts:  # this rank's experts under their global names, as the folder keeps them
        live_names = {**live_names, **experts}
    # Every rank counts every file when ranks hold different parameters (TP slices, pipeline stages, experts)
    shared_rows = model_parallel or bool(experts)
    groups = live_groups(optimizer, live_names)
    names = [[live_names[lp] for lp in group.lps] for group in groups]
    optimized = {n for group_names in names for n in group_names}
    frozen = set(live_names.values()) - optimized

    facts = Collective(group).decide(
        lambda: _FolderFacts(_state_listing(zero_dir), recorded_checksums(read_manifest(checkpoint_dir)))
    )
    if isinstance(facts, Failure):
        raise CheckpointFormatError(f"cannot read {zero_dir}: {facts.message}", subject=zero_dir)
    listing, sums = facts.listing, facts.sums
    mapping = saved_names(live_names, listing, group)
    if mapping is not None:
        names = [[mapping.get(n, n) for n in group_names] for group_names in names]
        optimized = {mapping.get(n, n) for n in optimized}
        frozen = {mapping.get(n, n) for n in frozen}
    if sums is None and is_first(group):
        log.info(
            "megatron-ucp: %s has no checksums in %s (stock's folder, or converted by an older megatron-ucp): "
            "accounting checks against the files themselves, which reads each parameter in full on one rank "
            "(slower; `megatron-ucp convert --force` records them)",
            checkpoint_dir,
            F.MANIFEST_FILE,
        )
    if model_parallel and JOB.count(1 if frozen else 0):  # rows must agree on every rank of the world
        raise UnsupportedError(
            f"{zero_dir}: frozen parameters in a model with TP or PP > 1 are not supported yet "
            "(their state is restored per TP slice by no one)",
            subject=zero_dir,
        )
    # Frozen parameters' folders are the engine hook's to restore (they are not in the optimizer).
    # Across pipeline stages every rank keeps every row; a file no stage consumed is then reported.
    accountable = {k: v for k, v in listing.items() if k in optimized}
    ledger = Ledger.from_listing({k: v for k, v in listing.items() if k not in frozen} if shared_rows else accountable)
    table = ledger.new_table(device="cpu")
    failure: Optional[BaseException] = None
    dp_from: Optional[int] = None
    restored_keys: list[set[str]] = []
    group_states = group_tensor_states(names, accountable)
    problems: list[Problem] = []
    context = _LoadContext(optimizer, zero_dir, accountable, ledger, table, sums, clock, tensor_parallel)
    try:
        optim_path = zero_dir / F.UNIVERSAL_OPTIMIZER_STATE_FILE
        optim_sd = load_torch_file(optim_path, mmap=False)
        if not any(F.STEP_STATE in states for states in accountable.values()):
            context = dataclasses.replace(context, common_step=_common_step(optim_sd, optim_path))
        restore_global_state(optimizer, optim_sd)
        dp_from = _source_dp(optim_sd)
        carried = optim_sd.get(F.UCP_PARTITION_SCALARS) or {}
        loaded_groups = optim_sd.get(F.PARAM_GROUPS) or []
        if len(loaded_groups) != len(base.param_groups):
            problems.append(
                Problem(
                    ProblemKind.PARAM_GROUPS,
                    None,
                    None,
                    f"{group_count_difference(len(loaded_groups), len(base.param_groups))}: "
                    "hyperparameters not restored",
                )
            )
            loaded_groups = [None] * len(base.param_groups)
        for i, live in enumerate(groups):
            keys, buffers, step = _load_group(context, live, names[i], group_states[i])
            scalars = {name: live_value(v) for name, v in carried.get(live.param_group, {}).items()}
            restored_keys.append(keys | set(scalars))
            install_group_state(optimizer, live.flat, () if per_parameter else live.lps, buffers, step, scalars)
        for param_group, saved in zip(base.param_groups, loaded_groups):
            if saved is not None:
                param_group.update({key: value for key, value in saved.items() if key != "params"})
        if per_parameter:
            stage3_runtime.stage3_weights_from_masters(optimizer)
    except Exception as exc:
        failure = exc
        log.error("megatron-ucp: rank %d failed to load %s: %s", dist.get_rank(), zero_dir, exc)

    t_wait = time.perf_counter()  # the all-reduce also waits for the slowest rank: timed on its own
    flags = torch.zeros((1, len(Column)), dtype=torch.int64)
    flags[0, 0] = 1 if failure is not None else 0
    totals = Collective(group).total(torch.cat([table, flags]))
    collective = time.perf_counter() - t_wait
    if int(totals[-1, 0]):
        Collective(group).raise_gathered(failure, f"loading {zero_dir}", subject=zero_dir)
    totals = totals[:-1]

    with clock:
        # other stages' folders are not extra: the ledger proves some rank consumed each of them
        problems += check_folders(
            names, accountable if shared_rows else {k: v for k, v in listing.items() if k not in frozen}
        )
        problems += check_ledger(ledger, totals)
        for i, keys in enumerate(restored_keys):
            expected = expected_state_keys(base, groups[i].param_group)
            problems += check_optimizer_states(i, names[i], expected, keys, type(base).__name__)
            if not strict and expected is not None:
                _start_missing_states_fresh(base, groups[i].flat, expected - keys)
        n_params, n_files, elements, state_names = ledger_totals(ledger, totals)
        state_names = (*state_names, *sorted({k for keys in restored_keys for k in keys} - set(state_names)))
    load = time.perf_counter() - t_start - clock.seconds - collective
    seconds = (("load", round(load, 4)), ("accounting", round(clock.seconds, 4)), ("collective", round(collective, 4)))
    return AccountingReport(n_params, n_files, state_names, elements, dp_from, dp_to, tuple(problems), seconds=seconds)


def _start_missing_states_fresh(base: torch.optim.Optimizer, flat: torch.Tensor, missing: Iterable[str]) -> None:
    """Non-strict partial load: a state the checkpoint lacks starts at zero, as a fresh one would."""
    state = base.state[flat]
    for key in sorted(missing):
        if key != F.STEP_STATE and key not in state:
            state[key] = torch.zeros_like(flat)


def _source_dp(optim_sd: dict) -> Optional[int]:
    info = optim_sd.get(F.ZERO_PARTITION_INFO)
    if isinstance(info, dict) and info.get("dp_size"):
        return int(info["dp_size"])
    count = optim_sd.get(F.PARTITION_COUNT)
    if isinstance(count, (list, tuple)) and count:
        count = count[0]
    return int(count) if isinstance(count, int) else None


@dataclass(frozen=True)
class _LoadContext:
    """What every param group of one universal load shares: the folder's facts (its listing of the
    optimized parameters, the manifest's checksums), this rank's TP place, and the ledger being filled."""

    optimizer: Any
    zero_dir: Path
    listing: dict[str, tuple[str, ...]]
    ledger: Ledger
    table: torch.Tensor
    sums: Optional[RecordedChecksums]
    clock: "_Clock"
    tensor_parallel: TpPlace
    common_step: Any = None
    """The step ``optimizer_state.pt`` holds for every group, for a folder without ``step.pt`` files (stock's
    ZeRO-3 conversions: its loader takes the step from there)."""


def _common_step(optim_sd: dict, path: Path) -> Any:
    """The one step of the wrapped optimizer's state in a folder's ``optimizer_state.pt``; None without one.
    Steps that differ between its groups are refused, naming the file."""
    inner = optim_sd.get(F.OPTIMIZER_STATE_DICT) if isinstance(optim_sd, dict) else None
    state = inner.get("state") if isinstance(inner, dict) else None
    steps = [v.get(F.STEP_STATE) for v in (state or {}).values() if isinstance(v, dict) and F.STEP_STATE in v]
    if not steps:
        return None
    values = {step_value(s) for s in steps}
    if len(values) > 1:
        raise CheckpointFormatError(
            f"{path}: its optimizer groups are at different steps {sorted(values, key=str)}", subject=path
        )
    return steps[0]


def _load_group(
    context: _LoadContext, live: LiveGroup, names: list[str], states: tuple[str, ...]
) -> tuple[set[str], dict[str, torch.Tensor], Any]:
    """Fill one live group's flat fp32 partition on this rank and its optimizer states' buffers; return
    the keys restored, the buffers and the group's step (the caller installs them).

    A rank whose partition of the group is all padding reads no fragment but still gets every state
    key (zeros) and the group's step, so the optimizer and the next save look like everyone else's.
    A rank reads only its fragments' bytes; the owner of a parameter's first element adds what the
    file holds to the ledger: from the manifest's ``sums`` when there are some, else from the file.
    Under TP a rank's parameter is its TP slice: its fragment maps to runs of the whole parameter
    (:func:`~megatron_ucp.plan.tensor_parallel.slice_runs`), each copied and hashed at its own offset.
    ``names``: the saved name of each of ``live.lps``.
    """

    zero_dir, listing, ledger = context.zero_dir, context.listing, context.ledger
    table, sums, clock, tensor_parallel = context.table, context.sums, context.clock, context.tensor_parallel
    flat = live.flat
    if live.padding_unset:
        with torch.no_grad():
            flat.zero_()
    buffers = {state: torch.zeros_like(flat) for state in states}
    group_step: Any = None
    step_source = next((n for n in names if F.STEP_STATE in listing.get(n, ())), None)
    if step_source is not None:
        group_step = load_torch_file(zero_dir / step_source / f"{F.STEP_STATE}.pt", mmap=False)
    elif context.common_step is not None:
        group_step = context.common_step.clone() if torch.is_tensor(context.common_step) else context.common_step
    saved_name = {id(lp): name for lp, name in zip(live.lps, names)}

    algorithm = sums.algorithm if sums is not None else integrity.ALGORITHM  # both sides of the ledger alike
    with torch.no_grad():
        for fragment in live.fragments:
            lp, name = fragment.lp, saved_name[id(fragment.lp)]
            if name not in listing:
                continue
            for state in listing[name]:
                row = ledger.index(name, state)
                path = zero_dir / name / f"{state}.pt"
                if state == F.STEP_STATE:
                    step = load_torch_file(path, mmap=False)
                    table[row, Column.CONSUMERS] += 1
                    table[row, Column.STEP_MISMATCH] += 0 if step_value(step) == step_value(group_step) else 1
                    continue
                if state != F.FP32_STATE and state not in buffers:
                    continue  # not one of this group's states: check_folders reports the odd file
                entry = load_torch_file(path, mmap=True)
                full = tensor_of(entry, path)
                if full.dtype != torch.float32:  # fp32 masters and Adam states: a bf16 file would load silently
                    raise CheckpointFormatError(
                        f"{path}: {full.dtype} tensor; universal optimizer states are float32", subject=path
                    )
                tp_layout = live_tp_layout(lp, entry, tensor_parallel.size, tuple(full.shape), fragment.shape)
                whole = full_shape(fragment.shape, tp_layout, tensor_parallel.size)
                layout = state_layout(full, entry, whole, name, state, path)
                runs = runs_between(
                    slice_runs(whole, tp_layout, tensor_parallel.size, tensor_parallel.rank, name),
                    fragment.start,
                    fragment.numel,
                )
                target = (flat if state == F.FP32_STATE else buffers[state]).narrow(0, fragment.offset, fragment.numel)
                target.copy_(gather(layout, runs))
                table[row, Column.CONSUMERS] += 1
                with clock:
                    at = 0
                    for run in runs:  # what landed in the engine's tensor (on an accelerator: read back)
                        real = max(0, min(run.length, layout.held - run.full_offset))
                        table[row, Column.LOADED_COUNT] += real
                        if real:
                            add_sum(table, row, True, checksum(target.narrow(0, at, real), run.full_offset, algorithm))
                        at += run.length
                    if any(run.full_offset == 0 for run in runs):
                        count, value = (
                            (layout.held, layout.source_sum())
                            if sums is None
                            else _recorded_source(sums, name, state, layout, path)
                        )
                        table[row, Column.SOURCE_COUNT] += count
                        add_sum(table, row, False, value)

    return set(buffers) | ({F.STEP_STATE} if group_step is not None else set()), buffers, group_step
