"""A ZeRO-3 save into the live ZeRO-3 optimizer, straight from its native rank files: a DP change (or another
sub-group cut) with no conversion, and the checks of a restart at the saved DP size.

Call order (collective over the optimizer's DP group, every rank calls each step):

1. :func:`bind_stage3_save`, before DeepSpeed's own load touches the engine: the facts (first rank), the live
   optimizer's sub-groups checked against them (the same parameters in the same param groups), this rank's
   reads (:func:`megatron_ucp.plan.reshard.per_parameter_reads`: a few slices per parameter), and every old
   rank file bound to its position and its save (:mod:`megatron_ucp.integration.stage3_files`). Files that
   do not belong together stop every rank here, naming the file(s), with the engine untouched.
2. DeepSpeed loads the module's buffers, the scheduler and the counters (the caller's part), and instead of
   its optimizer load (which refuses another DP size) :func:`load_stage3_partitions` runs: every planned
   slice of the fp32 masters and of every optimizer state copied straight into the live partitions (the
   engine's own tensors: host memory under optimizer offload), the states' steps, hyperparameters and loss
   scaler restored, the bf16 partitions made the masters rounded. What landed is hashed at its position in
   its param group into the ledger row of the old file it came from; the source side is the checksum that
   file recorded of its partition at save time (saved through the hooks), or the hash of what was read
   (stock saves: placement and counts). One all-reduce proves every real element placed exactly once.

A restart at the saved DP size runs step 1, DeepSpeed's own load, then :func:`verify_stage3_loaded`: every
partition DeepSpeed loaded against the checksum its file recorded (saved through the hooks).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.errors import CheckpointFormatError, PlanError, UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import Failure, comm, decide_on_first, device
from megatron_ucp.integration.live_partitions import live_stage3_groups
from megatron_ucp.integration.old_file_copy import (
    OldFiles,
    Timing,
    against_the_save,
    changed_states,
    copy_reads,
    refuse_changed,
    settle,
)
from megatron_ucp.integration.partition_load import expected_state_keys, install_stage3_state
from megatron_ucp.integration.rank_files import RankFile, Source
from megatron_ucp.integration.stage3_files import (
    Stage3Facts,
    bind_stage3_files,
    read_stage3_facts,
)
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Problem,
    check_optimizer_states,
)
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.partitioned import checked_positions
from megatron_ucp.plan.rank_binding import FileFacts
from megatron_ucp.plan.reshard import Read, per_parameter_reads

log = logging.getLogger(__name__)


@dataclass
class Stage3Bound:
    """What step 1 established on this rank, before DeepSpeed's own load."""

    facts: Stage3Facts
    new: Stage3Groups
    """The live optimizer's layout (this job's DP size and sub-groups)."""
    reads: list[list[Read]]
    sources: dict[int, Source]
    rank_file: RankFile
    rank: int
    seconds: float
    files: list[FileFacts]

    @property
    def old(self) -> Stage3Groups:
        return self.facts.groups

    @property
    def dp_to(self) -> int:
        return self.new.dp

    def close(self) -> None:
        for source in self.sources.values():
            source.close()


def bind_stage3_save(
    engine: Any, model_states: Path, rank_file: RankFile, states: Optional[dict] = None, same_dp: bool = False
) -> Stage3Bound:
    """Step 1 (collective over the optimizer's DP group): facts, live layout, reads, and every old rank file
    bound to its position and its save; raises the same error on every rank when they do not belong
    together. ``states``: the model states the first rank already read (else read here, without weights).
    ``same_dp``: a restart at the saved DP size and sub-groups (DeepSpeed's own load follows)."""
    t0 = time.perf_counter()
    optimizer = engine.optimizer
    group = surface.dp_group(optimizer)
    rank = comm().get_rank(group=group)
    facts = decide_on_first(lambda: read_stage3_facts(model_states, rank_file, states), group)
    if isinstance(facts, Failure):
        raise CheckpointFormatError(f"cannot resume from {model_states.parent}: {facts.message}", subject=model_states)
    if facts.frozen and not same_dp:
        raise UnsupportedError(
            f"{model_states}: frozen parameters ({', '.join(facts.frozen[:3])}) in a ZeRO-3 save: their slices "
            "live in every rank's model states and are not resharded yet; resume at the saved DP size",
            subject=model_states,
        )
    new = live_stage3_groups(optimizer, surface.param_names(engine))
    try:
        reads = per_parameter_reads(facts.groups, new, rank)
    except PlanError as exc:  # the same facts and model on every rank: the same error everywhere
        raise UcpError(f"{model_states.parent}: {exc}", subject=model_states.parent) from exc
    positions = checked_positions(facts.groups, new.dp, rank, reads)
    sources, files = bind_stage3_files(facts, reads, positions, rank_file, group)
    return Stage3Bound(facts, new, reads, sources, rank_file, rank, time.perf_counter() - t0, files)


def _targets(optimizer: Any, bound: Stage3Bound) -> list[dict[str, torch.Tensor]]:
    """Per live sub-group: the fp32 partition and one buffer per saved state (the optimizer's own tensor
    where it has one of the right size, so that it stays where the engine keeps it), all zeroed."""
    base = surface.base_optimizer(optimizer)
    masters = surface.layout_of(optimizer).masters(optimizer)
    out = []
    for h, master in enumerate(masters):
        names = _states_of(bound, h)
        kept = base.state.get(master, {})
        buffers = {F.FP32_STATE: master}
        for name in names:
            held = kept.get(name)
            usable = torch.is_tensor(held) and held.shape == master.shape and held.dtype == master.dtype
            buffers[name] = held if usable else torch.zeros_like(master)
        with torch.no_grad():
            for t in buffers.values():
                t.zero_()
        out.append(buffers)
    return out


def _old_sub_groups(bound: Stage3Bound, h: int) -> list[int]:
    """The old sub-groups the parameters of live sub-group ``h`` come from."""
    return sorted({bound.old.places[name].sub_group for name, _ in bound.new.sub_groups[h]})


def _states_of(bound: Stage3Bound, h: int) -> tuple[str, ...]:
    """The states live sub-group ``h`` gets: those of the old sub-groups its parameters come from (one set)."""
    found = {bound.facts.states[g] for g in _old_sub_groups(bound, h)}
    if len(found) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved sub-groups {_old_sub_groups(bound, h)} hold different optimizer "
            f"states {sorted(found)}; the live sub-group {h} needs one set",
            subject=bound.facts.model_states,
        )
    return found.pop() if found else ()


def _step_of(bound: Stage3Bound, h: int) -> Any:
    steps = [bound.facts.steps[g] for g in _old_sub_groups(bound, h)]
    values = {float(s) if torch.is_tensor(s) or isinstance(s, (int, float)) else repr(s) for s in steps}
    if len(values) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved sub-groups {_old_sub_groups(bound, h)} are at different optimizer "
            f"steps {sorted(values, key=str)}",
            subject=bound.facts.model_states,
        )
    return steps[0] if steps else None


def load_stage3_partitions(engine: Any, bound: Stage3Bound, strict: bool = True) -> AccountingReport:
    """Step 2 on every rank: this rank's partitions from the files step 1 bound. Returns the report (the
    same on every rank); enforcing it is the caller's."""
    t_start = time.perf_counter()
    optimizer = engine.optimizer
    group = surface.dp_group(optimizer)
    facts, old = bound.facts, bound.old
    base = surface.base_optimizer(optimizer)
    masters = surface.layout_of(optimizer).masters(optimizer)
    files = OldFiles.of(facts, bound.rank_file)
    ledger = files.ledger()
    table = ledger.new_table(device="cpu")
    try:
        targets = _targets(optimizer, bound)
        accounting = copy_reads(files, bound.reads, bound.sources, targets, ledger, table)
        for h, (master, buffers) in enumerate(zip(masters, targets)):
            install_stage3_state(
                optimizer, master, {k: v for k, v in buffers.items() if k != F.FP32_STATE}, _step_of(bound, h)
            )
        for param_group, saved in zip(base.param_groups, facts.param_groups):
            param_group.update(saved)
        stage3_runtime.load_stage3_global_state(optimizer, facts.global_state)
        stage3_runtime.stage3_weights_from_masters(optimizer)
    finally:
        bound.close()
    problems: list[Problem] = []
    new = bound.new
    for h in range(len(new.sub_groups)):
        keys = set(targets[h]) - {F.FP32_STATE} | ({F.STEP_STATE} if _step_of(bound, h) is not None else set())
        expected = expected_state_keys(base, new.param_group_of[h])
        problems += check_optimizer_states(h, [n for n, _ in new.sub_groups[h]], expected, keys, type(base).__name__)
    n_states = sum(len(params) * (1 + len(facts.states[h])) for h, params in enumerate(old.sub_groups))
    cut = f"ZeRO-3 sub-groups {len(old.sub_groups)} -> {len(new.sub_groups)}; rank files bound to their positions"
    return settle(
        files,
        ledger,
        table,
        group,
        counts=(len(old.places), n_states),
        dp_to=bound.dp_to,
        problems=problems,
        has_step=any(step is not None for step in facts.steps),
        checked=against_the_save(facts.algorithm, cut),
        timing=Timing(t_start, bound.seconds, accounting),
    )


def verify_stage3_loaded(engine: Any, bound: Stage3Bound, strict: bool = True) -> str:
    """After DeepSpeed's own load at the saved DP size and sub-groups (collective over the DP group): every
    partition it loaded against the checksum its file recorded (saved through the hooks). Raises the same
    error on every rank naming the file(s) (``strict``; else warns once). Returns what was checked."""
    optimizer = engine.optimizer
    group = surface.dp_group(optimizer)
    facts, rank = bound.facts, bound.rank
    mine = bound.sources.get(rank)
    bound.close()
    if facts.algorithm is None or mine is None or mine.sums is None:
        return "rank files bound to their positions (no partition checksums: not saved through the hooks)"
    base = surface.base_optimizer(optimizer)
    bad = torch.zeros(facts.dp_from, dtype=torch.int64)
    for h, master in enumerate(surface.layout_of(optimizer).masters(optimizer)):
        state = base.state.get(master, {})
        bad[rank] += changed_states(
            bound.old,
            rank,
            h,
            mine.sums[h],
            lambda name, master=master, state=state: master if name == F.FP32_STATE else state.get(name),
            facts.algorithm,
        )
    totals = bad.to(device())
    comm().all_reduce(totals, group=group)
    culprits = [str(bound.rank_file(r)) for r, n in enumerate(totals.cpu().tolist()) if n]
    refuse_changed(culprits, Path(facts.model_states).parent, strict, group)
    return "every partition checked against the save's checksums"
