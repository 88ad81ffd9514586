"""The universal route: a tag's universal twin (``<tag>_universal``), converted first when the decision says so (one
converter per node, every rank waiting), loaded by DeepSpeed's universal mode with our partition loader
(:mod:`.partition_load`); its report returned in the route's
:class:`~megatron_ucp.integration.resume.engine_load.LoadOutcome` for the one finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp import launchenv
from megatron_ucp.background.queue import node_assignment
from megatron_ucp.config import UcpConfig
from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import COMPLETE, ConversionInProgress, inspect_staging, universal_state
from megatron_ucp.errors import CheckpointFormatError, OutputExistsError, UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import read_tag_file
from megatron_ucp.format.torchload import structure_problems, torch_reader_problem
from megatron_ucp.integration.collectives import JOB, comm
from megatron_ucp.integration.live_job import LiveJob, LoadCall
from megatron_ucp.integration.resume.engine_load import (
    LoadOutcome,
    loaded_path,
    model_states_for,
    replacing_optimizer_load,
    universal_mode,
)
from megatron_ucp.integration.resume.module_read import how_module_is_read
from megatron_ucp.integration.resume.universal.partition_load import (
    collecting_reports,
    hand_in,
    load_universal_partitions,
)
from megatron_ucp.plan.accounting import AccountingReport, Problem, ProblemKind
from megatron_ucp.plan.resume import ResumeDecision

log = logging.getLogger(__name__)


def _stage3_partition_loader(job: LiveJob, config: UcpConfig) -> Any:
    """For one universal load of a ZeRO-3 engine: our loader of its partitions in place of DeepSpeed's optimizer
    load. A load without optimizer states (the weights only) stays DeepSpeed's."""

    def load(original: Callable[..., bool], engine: Any, load_dir: str, tag: str, load_optimizer_states: bool) -> bool:
        if not load_optimizer_states:
            return original(engine, load_dir, tag, load_optimizer_states=load_optimizer_states)
        report = load_universal_partitions(
            job.optimizer, Path(load_dir) / tag, strict=config.strict, names=job.names, tensor_parallel=job.tp
        )
        hand_in(report, config, job.optimizer)
        return True

    return replacing_optimizer_load(load)


def universal_load(
    call: LoadCall, decision: ResumeDecision, native_tag: Optional[str], from_latest: bool
) -> LoadOutcome:
    """Route UNIVERSAL (a TP/PP change, ``--ucp-resume-route universal``, or the explicit universal flag): the twin
    converted when missing or stale, then DeepSpeed's universal load with our partition loader; the report and
    what the finish restores (the module tensors universal mode skips)."""
    job, load_dir, config = call.job, call.load_dir, call.config
    engine = job.engine
    if decision.convert and job.node_local_storage:
        raise UnsupportedError(
            f"{decision.message}, but checkpoint.use_node_local_storage keeps each node's "
            "files on its own disk; converting needs them on one shared filesystem. Convert "
            "with `megatron-ucp convert` where all rank files are, then load again.",
            subject=load_dir,
        )
    if decision.convert:
        convert_synchronously(Path(load_dir), native_tag, decision, from_latest, config)
    _check_model_states_loadable(Path(load_dir), decision.tag)
    folder = _universal_folder(Path(load_dir), decision.tag)
    with (
        collecting_reports() as reports,
        universal_mode(
            engine,
            lazy=how_module_is_read(call, decision.route).lazy,
            path=model_states_for(job, folder) if folder is not None else None,
        ) as read,
        _stage3_partition_loader(job, config) if job.per_parameter else contextlib.nullcontext(),
    ):
        result = call.deepspeed(decision.tag)
    load_path = loaded_path(result)
    if load_path is None:
        return LoadOutcome(result)
    dp_from = engine.loaded_checkpoint_dp_world_size
    report = reports[-1] if reports else None  # the last, as DeepSpeed calls it once per load
    if report is None:
        report = AccountingReport(0, 0, (), 0, dp_from, int(engine.seq_dp_world_size)).with_more(
            [
                Problem(
                    ProblemKind.TRAINING_STATE,
                    None,
                    None,
                    f"the optimizer did not load {load_path.parent / F.UNIVERSAL_ZERO_DIR}: no tensors were restored",
                )
            ]
        )
    states = read.of(load_path)  # what DeepSpeed's load read of the file, for the finish: not read again
    if states is not None:
        states = {**states, F.MODULE: read.module}
    return LoadOutcome(result, load_path, report, dp_from, restore_module=True, states=states)


def _universal_folder(load_dir: Path, tag: Optional[str]) -> Optional[Path]:
    """The universal folder DeepSpeed's load reads: the tag the decision named (it names one when ``latest_universal``
    lags ``latest``, :func:`~megatron_ucp.format.paths.tag_to_load`), else the one ``latest_universal`` names, as
    DeepSpeed reads it itself."""
    tag = tag if tag is not None else read_tag_file(load_dir / F.LATEST_UNIVERSAL)
    return load_dir / tag if tag is not None else None


def _check_model_states_loadable(load_dir: Path, tag: Optional[str]) -> None:
    """DeepSpeed's load starts with ``torch.load`` of the folder's model states, whose errors name no
    file (``PytorchStreamReader failed reading zip archive``): check its structure, and open it with
    torch's own zip reader, first and say which file is damaged. Headers only (a few ``pread`` calls)."""

    if tag is None:
        return
    folder = load_dir / tag
    path = folder / F.MODEL_STATES_FILE
    if not folder.is_dir() or not path.is_file():
        return  # DeepSpeed reports a missing tag or file in its own words
    problems = structure_problems(path) or [p for p in (torch_reader_problem(path),) if p]
    if problems:
        raise CheckpointFormatError(
            f"{path}: damaged ({problems[0]}); torch.load cannot read it. Reconvert: "
            f"megatron-ucp convert {load_dir} --tag {tag.removesuffix(F.UNIVERSAL_SUFFIX)} "
            "--force",
            subject=path,
        )


# ================================================================================================
# Converting a tag to its universal twin at load time, while every rank waits. One converter per node
# (:func:`~megatron_ucp.background.queue.node_assignment` picks it) runs its share; when another live
# converter (the asynchronous one) already owns the twin, it waits for that one instead. Every rank then
# checks the twin is complete before anyone loads it.
# ================================================================================================


def convert_synchronously(
    load_dir: Path, native_tag: Optional[str], decision: ResumeDecision, from_latest: bool, config: UcpConfig
) -> None:
    """Convert the native tag to its universal twin while every rank waits (one converter per node)."""
    dist = comm()
    if native_tag is None or decision.tag is None:
        raise UcpError("internal: a conversion needs a native tag", subject=decision)
    rank, world = dist.get_rank(), dist.get_world_size()
    where = node_assignment(
        rank, world, launchenv.local_rank(os.environ), launchenv.local_size(os.environ), config.ranks_per_node
    )
    share = (where.node, where.nodes) if where.launcher else None
    attempt = JOB.broadcast(f"elastic-load-{uuid.uuid4().hex}" if rank == 0 else None)
    twin = load_dir / decision.tag
    error: Optional[BaseException] = None
    t0 = time.perf_counter()
    if share is not None:
        try:
            _convert_or_wait(load_dir / native_tag, twin, share, attempt, from_latest, config)
        except Exception as exc:
            error = exc
            log.error("megatron-ucp: converting %s on rank %d failed: %s", native_tag, rank, exc)
    # also the barrier: every converter finished
    JOB.together(error, f"converting {native_tag} to {decision.tag}", subject=twin)
    if universal_state(twin) != COMPLETE:
        raise UcpError(
            f"{twin}: conversion reported success but the folder is not complete on rank {rank} "
            "(is the checkpoint directory shared by every node?)",
            subject=twin,
        )
    if rank == 0:
        log.info("megatron-ucp: converted %s -> %s in %.1fs", native_tag, decision.tag, time.perf_counter() - t0)


def _convert_or_wait(
    source: Path, twin: Path, share: tuple[int, int], attempt: str, from_latest: bool, config: UcpConfig
) -> None:
    """Run this rank's share; if another live converter (e.g. the async one) owns it, wait for it."""
    options = ConvertOptions(
        source=source,
        output=twin,
        workers=config.converter_workers,
        replace_stale=True,
        update_latest=from_latest,
        share_index=share[0],
        share_count=share[1],
        attempt_id=attempt,
        progress=False,
    )
    for _ in range(2):
        try:
            convert(options)
            return
        except OutputExistsError:
            if universal_state(twin, source) == COMPLETE:
                return
            raise
        except ConversionInProgress as exc:
            log.info("megatron-ucp: %s; waiting for it", exc)
            while universal_state(twin) != COMPLETE:
                info = inspect_staging(twin)
                if info is None or not info.is_live(options.stale_after):
                    break
                time.sleep(2.0)
            if universal_state(twin) == COMPLETE:
                return
    raise UcpError(f"{twin}: could not convert (another converter kept failing or died)", subject=twin)
