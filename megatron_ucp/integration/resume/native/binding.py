"""Every old rank file of a save bound to its position and its save, before DeepSpeed's own load touches the
engine: one entry for every layout and every route that reads the native files.

Call order (collective over the optimizer's DP group, every rank calls :func:`bind_save`):

1. the facts, read once by the group's first rank and broadcast (:class:`~megatron_ucp.deepspeed.rank_files.
   SavedFacts`, whose ``layout`` says where every saved element sits);
2. the live optimizer described by a layout of the same kind (:func:`live_layout`), checked against the facts
   (the same parameters, in the same groups, partitioned as the plan expects) and this rank's reads planned
   from one layout to the other (``facts.layout.reads_to(new, rank)``);
3. every old file this rank reads, and the padding-only ones that fall to it, opened (metadata only) and
   checked against what its position must hold, and one verdict on every rank
   (:func:`megatron_ucp.deepspeed.rank_files.bind_rank_files`). Files that do not belong together stop
   every rank here, naming the file(s), with the engine untouched.

What differs between the ZeRO stages is only what their files and their live optimizers are
(one :func:`~megatron_ucp.deepspeed.rank_files.read_facts`, a ZeRO-3 file seen through
:func:`megatron_ucp.deepspeed.stage3_files.flat_view`;
:func:`megatron_ucp.integration.live_job.live_stage3_groups`);
everything after the binding (the copy, the ledger, the checks after a load) takes the :class:`BoundSave`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.optimizer_files import optimizer_state
from megatron_ucp.deepspeed.rank_files import (
    RankFile,
    SavedFacts,
    Source,
    binding_message,
    expectation,
    inspect_file,
    read_facts,
    verdict,
)
from megatron_ucp.deepspeed.stage3_files import flat_view
from megatron_ucp.deepspeed.state_kinds import unplaceable_error
from megatron_ucp.errors import CheckpointFormatError, PlanError, StockFormError, UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import Failure, comm, decide_on_first
from megatron_ucp.integration.live_job import LiveJob, live_stage3_groups
from megatron_ucp.integration.resume.native.requantize import blocksize_of_live
from megatron_ucp.plan.param_geometry import first_difference, group_count_difference
from megatron_ucp.plan.partitioned import FlatGroups, Partitioned, checked_positions
from megatron_ucp.plan.rank_binding import FileFacts
from megatron_ucp.plan.reshard import Read

log = logging.getLogger(__name__)


@dataclass
class BoundSave:
    """What the binding established on this rank, before DeepSpeed's own load."""

    facts: SavedFacts
    new: Partitioned
    """The live optimizer's layout (this job's DP size)."""
    reads: list[list[Read]]
    """Per live group, what this rank copies out of which old file."""
    sources: dict[int, Source]
    rank_file: RankFile
    rank: int
    seconds: float
    files: list[FileFacts]
    """What every rank saw of every old file (the same on every rank)."""

    @property
    def old(self) -> Partitioned:
        return self.facts.layout

    @property
    def dp_to(self) -> int:
        return self.new.dp

    def close(self) -> None:
        for source in self.sources.values():
            source.close()


def bind_save(
    job: LiveJob,
    model_states: Path,
    rank_file: RankFile,
    states: Optional[dict] = None,
    same_dp: bool = False,
    requantize: bool = False,
) -> Optional[BoundSave]:
    """Steps 1 to 3 (collective over the optimizer's DP group); raises the same error on every rank when the
    files do not belong together. ``model_states``: this rank's model-states file as the engine names it (at
    ZeRO-3 the facts are read from DP rank 0's). ``states``: the model states the first rank already read
    (else read here, without the weights). ``same_dp``: a restart at the saved DP size, where DeepSpeed reads
    each rank's own file itself; a ZeRO-1/2 model the flat plan cannot describe (per-parameter padding, other
    names) is then left to DeepSpeed unbound (returns None) instead of refused. ``requantize``: at a DP change,
    bitsandbytes' 8-bit state is read as values, to be quantized again (``--ucp-requantize-8bit``)."""
    t0 = time.perf_counter()
    group, rank = job.dp_group, job.dp_rank
    per_parameter = job.per_parameter
    if per_parameter:  # every ZeRO-3 rank saves its own model states; the facts are in DP rank 0's
        model_states = model_states.parent / F.zero3_model_file(0, F.mp_rank_of(rank_file(0).name))
    facts = decide_on_first(
        lambda: read_facts(
            model_states,
            rank_file,
            states,
            None if per_parameter else _live_shapes(job),
            per_parameter,
            requantize=requantize and not same_dp,
        ),
        group,
    )
    if isinstance(facts, Failure):  # StockFormError: a form DeepSpeed's own load takes (the caller steps aside)
        kind = StockFormError if facts.kind == StockFormError.__name__ else CheckpointFormatError
        damaged = Path(facts.damaged) if facts.damaged is not None else None
        raise kind(f"cannot resume from {model_states.parent}: {facts.message}", subject=model_states, damaged=damaged)
    if facts.requantized:  # the same facts on every rank; the live optimizer is the same class everywhere
        blocksize_of_live(job.base)
        if rank == 0:
            log.warning(
                "megatron-ucp: --ucp-requantize-8bit: bitsandbytes' 8-bit states %s are read as values and quantized "
                "again in the new partitions (not exact: one more quantization, measured in the summary)",
                "/".join(facts.requantized),
            )
    if facts.unplaceable:  # the same facts on every rank: the same decision everywhere
        name = type(job.base).__name__
        error = unplaceable_error(facts.unplaceable_file, facts.unplaceable, name)
        if not same_dp:
            raise error
        if rank == 0:
            log.warning("megatron-ucp: %s; at the saved DP size DeepSpeed's own load reads it as it is", error)
        return None
    try:
        new = live_layout(job, facts, model_states, same_dp)
        reads = facts.layout.reads_to(new, rank)
    except PlanError as exc:  # the same facts and model on every rank: the same error everywhere
        raise UcpError(f"{model_states.parent}: {exc}", subject=model_states.parent) from exc
    except UcpError:
        if same_dp and not per_parameter:
            return None  # the same answer on every rank: the facts and the live model are the same everywhere
        raise
    positions = checked_positions(facts.layout, new.dp, rank, reads)
    view = facts.view(flat_view if per_parameter else optimizer_state)
    sources, files = bind_rank_files(facts, reads, positions, rank_file, group, view)
    return BoundSave(facts, new, reads, sources, rank_file, rank, time.perf_counter() - t0, files)


def live_layout(job: LiveJob, facts: SavedFacts, model_states: Path, same_dp: bool = False) -> Partitioned:
    """The live optimizer as a layout of the save's kind, checked against the facts; raises naming the first
    difference (another model, another expert layout, padding the plan does not describe). ``same_dp``: a
    restart at the saved DP size and sub-groups (DeepSpeed's own load follows)."""
    where = model_states.parent
    if not isinstance(facts.layout, FlatGroups):
        if facts.frozen and not same_dp:
            raise UnsupportedError(
                f"{model_states}: frozen parameters ({', '.join(facts.frozen[:3])}) in a ZeRO-3 save: their slices "
                "live in every rank's model states and are not resharded yet; resume at the saved DP size",
                subject=model_states,
            )
        return live_stage3_groups(job.optimizer, job.names)
    dp_to = job.dp_size
    check_expert_groups(job, facts.layout, dp_to, where)
    flats = [g["params"][0] for g in job.base.param_groups]
    return check_live_model(facts.layout, _live_shapes(job), [f.numel() for f in flats], dp_to, where)


def _live_shapes(job: LiveJob) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The live flat groups' parameters, in flat order, with their shapes."""
    return [[(job.names[lp], tuple(lp.shape)) for lp in lps] for lps in job.groups]


def check_live_model(
    saved: FlatGroups, live: list[list[tuple[str, tuple[int, ...]]]], flat_sizes: list[int], dp_to: int, where: Path
) -> FlatGroups:
    """The live flat groups are the saved ones (order, names, shapes), partitioned as the plan expects at
    ``dp_to``. Returns the live layout. Raises naming the first difference."""
    if len(live) != len(saved.shapes):
        raise UcpError(f"{where}: {group_count_difference(len(saved.shapes), len(live))}", subject=where)
    for g, (saved_params, live_params) in enumerate(zip(saved.shapes, live, strict=True)):
        if list(live_params) != list(saved_params):
            at = first_difference(saved_params, live_params)
            theirs = saved_params[at] if at < len(saved_params) else "nothing"
            ours = live_params[at] if at < len(live_params) else "nothing"
            raise UcpError(
                f"{where}: param group {g} differs from the model at position {at}: the checkpoint has "
                f"{theirs}, the model {ours} ({len(saved_params)} vs {len(live_params)} parameters)",
                subject=where,
            )
    new = saved.at_dp(dp_to)
    for g, (geo, new_geo, flat) in enumerate(zip(saved.geometries, new.geometries, flat_sizes, strict=True)):
        if new_geo.partition_size != flat:
            raise UcpError(
                f"{where}: param group {g} ({geo.numel} elements) has a {flat}-element partition at DP={dp_to}; "
                f"the plan expects ZeRO's alignment padding only over {new_geo.dp} partitions (per-parameter padding?)",
                subject=where,
            )
    return new


def check_expert_groups(job: LiveJob, saved: FlatGroups, dp_to: int, where: Path) -> None:
    """The live groups are partitioned over as many ranks as the save's placement gives them at this DP size
    (the same expert-parallel size), and this rank holds the partition the placement says (its place in each
    group's own process group). Raises naming what differs: an expert layout change is the universal route's."""
    dist = comm()
    placement, rank = saved.placement, job.dp_rank
    groups = job.group_dp_groups
    if placement.ep == 1 and all(dist.get_world_size(group=pg) == dp_to for pg in groups):
        return  # no experts on either side: every group over the DP group, as the plan takes it
    for g, pg in enumerate(groups):
        size, mine = dist.get_world_size(group=pg), dist.get_rank(group=pg)
        want = placement.size(g, dp_to) if g < len(saved.shapes) else size
        if (size, mine) != (want, placement.index(g, rank)):
            raise UcpError(
                f"{where}: param group {g} is partitioned over {size} ranks in this job (this rank holds partition "
                f"{mine}); the save's experts (EP={placement.ep}) put it over {want} (partition "
                f"{placement.index(g, rank)}): an expert-parallel change goes through the universal folder",
                subject=where,
            )


def engine_save_files(job: LiveJob, load_dir: str, tag: str) -> tuple[RankFile, Path]:
    """How the engine names the files of a tag for this rank: old DP rank -> its optimizer file of this
    rank's model-parallel coordinate, and this rank's model-states file."""
    own = Path(surface.own_optimizer_file(job.engine, load_dir, tag)).name
    found = F.OPTIM_FILE_RE.match(own)
    if found is None:
        raise UnsupportedError(
            f"this DeepSpeed names its optimizer files {own!r}; the native reshard does not know "
            "the pattern (use --ucp-resume-route universal)",
            subject=own,
        )
    mp_rank, bf16 = int(found["mp"]), found["prefix"] == "bf16_"

    def rank_file(dp_rank: int) -> Path:
        return Path(surface.rank_optimizer_file(job.engine, load_dir, tag, mp_rank, dp_rank, bf16))

    return rank_file, Path(surface.model_states_file(job.engine, load_dir, tag))


def bind_rank_files(
    facts: SavedFacts,
    reads: Sequence[Sequence[Read]],
    positions: Sequence[int],
    rank_file: RankFile,
    group: Any,
    view: Callable[[Path], dict] = optimizer_state,
) -> tuple[dict[int, Source], list[FileFacts]]:
    """Steps 2 and 3 (collective over ``group``): this rank opens ``positions`` (the files it reads,
    and the padding-only ones that fall to it), every rank shares what it saw, and every rank
    raises the same error when any file, or the set, is wrong. Returns the sources this rank reads and
    what every rank saw of every file (the same on every rank). ``view``: as :func:`inspect_file`."""
    readers = {r.source_rank for g in reads for r in g}

    def inspect(position: int) -> tuple[Optional[Source], FileFacts]:
        return inspect_file(rank_file(position), facts, expectation(facts, position, reads), view)

    return bind_positions(facts, positions, readers, inspect, group)


def bind_positions(
    facts: SavedFacts,
    positions: Sequence[int],
    readers: set[int],
    inspect: Callable[[int], tuple[Optional[Source], FileFacts]],
    group: Any,
) -> tuple[dict[int, Source], list[FileFacts]]:
    """The collective part of binding (over ``group``): this rank inspects ``positions`` and keeps the
    sources of those it reads (``readers``), every rank shares what it saw, and every rank raises the
    same error when any file, or the set, is wrong."""
    mine: list[FileFacts] = []
    sources: dict[int, Source] = {}
    for position in positions:
        source, seen = inspect(position)
        mine.append(replace(seen, sums=None))
        if source is not None and position in readers:
            sources[position] = source
    dist = comm()
    everyone: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(everyone, mine, group=group)
    seen = [f for box in everyone for f in box]
    problems = verdict(facts, seen)
    if problems:
        for source in sources.values():
            source.close()
        folder = Path(facts.model_states).parent  # every problem the verdict finds is in the tag's own files
        raise CheckpointFormatError(
            binding_message(folder, problems), subject=problems[0].split(": ", 1)[0], damaged=folder
        )
    return sources, seen
