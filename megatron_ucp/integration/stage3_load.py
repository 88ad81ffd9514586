"""A ZeRO-3 save into the live ZeRO-3 optimizer, straight from its native rank files: a DP change (or another
sub-group cut) with no conversion, and the checks of a restart at the saved DP size.

Call order (collective over the optimizer's DP group, every rank calls each step):

1. :func:`megatron_ucp.integration.binding.bind_save`, before DeepSpeed's own load touches the engine (the one
   binding of every layout): the facts, the live optimizer's sub-groups checked against them (the same
   parameters in the same param groups), this rank's reads (a few slices per parameter), and every old rank
   file bound to its position and its save. Files that do not belong together stop every rank here, naming
   the file(s), with the engine untouched.
2. DeepSpeed loads the module's buffers, the scheduler and the counters (the caller's part), and instead of
   its optimizer load (which refuses another DP size) :func:`load_stage3_partitions` runs: every planned
   slice of the fp32 masters and of every optimizer state copied straight into the live partitions (the
   engine's own tensors: host memory under optimizer offload), the states' steps, hyperparameters and loss
   scaler restored, the bf16 partitions made the masters rounded. What landed is hashed at its position in
   its param group into the ledger row of the old file it came from; the source side is the checksum that
   file recorded of its partition at save time (saved through the hooks), or the hash of what was read
   (stock saves: placement and counts). One all-reduce proves every real element placed exactly once.

A restart at the saved DP size runs step 1, DeepSpeed's own load, then the one check of every stage
(:func:`megatron_ucp.integration.native_reshard.verify_loaded`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.binding import BoundSave
from megatron_ucp.integration.old_file_copy import (
    OldFiles,
    Timing,
    against_the_save,
    copy_reads,
    settle,
)
from megatron_ucp.integration.partition_load import expected_state_keys, install_stage3_state
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Problem,
    check_optimizer_states,
)

log = logging.getLogger(__name__)


def _targets(optimizer: Any, bound: BoundSave) -> list[dict[str, torch.Tensor]]:
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


def _old_sub_groups(bound: BoundSave, h: int) -> list[int]:
    """The old sub-groups the parameters of live sub-group ``h`` come from."""
    return sorted({bound.old.places[name].sub_group for name, _ in bound.new.sub_groups[h]})


def _states_of(bound: BoundSave, h: int) -> tuple[str, ...]:
    """The states live sub-group ``h`` gets: those of the old sub-groups its parameters come from (one set)."""
    found = {bound.facts.states[g] for g in _old_sub_groups(bound, h)}
    if len(found) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved sub-groups {_old_sub_groups(bound, h)} hold different optimizer "
            f"states {sorted(found)}; the live sub-group {h} needs one set",
            subject=bound.facts.model_states,
        )
    return found.pop() if found else ()


def _step_of(bound: BoundSave, h: int) -> Any:
    steps = [bound.facts.steps[g] for g in _old_sub_groups(bound, h)]
    values = {float(s) if torch.is_tensor(s) or isinstance(s, (int, float)) else repr(s) for s in steps}
    if len(values) > 1:
        raise CheckpointFormatError(
            f"{bound.facts.model_states}: the saved sub-groups {_old_sub_groups(bound, h)} are at different optimizer "
            f"steps {sorted(values, key=str)}",
            subject=bound.facts.model_states,
        )
    return steps[0] if steps else None


def load_stage3_partitions(engine: Any, bound: BoundSave, strict: bool = True) -> AccountingReport:
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
