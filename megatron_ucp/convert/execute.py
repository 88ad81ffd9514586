"""Convert a ZeRO-1/2 checkpoint into DeepSpeed's universal layout, streaming and bit-exact.

Call order, one step each: :func:`convert` reads the source's facts (``_read_source``: the tag
resolved, its folder listed once, the output's state), checks the output (``_check_output``), reads
the metadata of every rank file once (memory-mapped, no tensor bytes) and builds the checked
:class:`~megatron_ucp.plan.conversion.ConversionPlan` (``_plan``), then opens the staging sibling and
writes this share's parameters (``_write_and_commit``): each state file is written once, straight
from the fragments in the memory-mapped rank files (:mod:`megatron_ucp.format.torchfile`: the bytes
``torch.save`` would write, without assembling the tensor first), and the pages read are released
as soon as the file is written. Nothing on this path imports torch (files are read by
:mod:`megatron_ucp.format.torchload`); ``torch.save`` is the fallback for what the direct writer
refuses. There are no per-fragment temporary files; resident memory is bounded by the state
being written in each writer thread. Work is split deterministically by
bytes between shares (e.g. one converter per node) and, inside a share, between writer threads.
The last share to finish commits (:mod:`megatron_ucp.convert.commit`: the common files, the folder checked
whole, the manifest, the rename into place; :mod:`megatron_ucp.convert.universal`). Writing the state files is
:mod:`megatron_ucp.convert.writer`.

Size: :func:`convert` is one sequence (facts, output check, plan, stage, write, repair what an interrupted run
left), and the functions here are its steps.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tqdm import tqdm

from megatron_ucp.convert.commit import commit_conversion, copy_model_files, files_copied_as_they_are
from megatron_ucp.convert.finite import FiniteCheck
from megatron_ucp.convert.save_check import PartitionSums, check_save_identity
from megatron_ucp.convert.universal import (
    COMPLETE,
    STALE,
    Staging,
    inspect_staging,
    source_identity,
    stale_reason,
    universal_state,
    write_latest_universal,
)
from megatron_ucp.convert.writer import (
    Chunk,
    RankFileCache,
    ReadObserver,
    Writer,
    torch_save_forced,
    write_chunk,
)
from megatron_ucp.deepspeed.reader import (
    CheckpointFiles,
    CheckpointMeta,
    ResolvedCheckpoint,
    find_checkpoint_files,
    human_bytes,
    read_checkpoint,
    resolve_checkpoint,
)
from megatron_ucp.errors import (
    AlreadyConvertedError,
    CheckpointFormatError,
    OutputExistsError,
    PlanError,
    UcpError,
    described,
)
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio
from megatron_ucp.format.paths import check_output_placement, special_kind
from megatron_ucp.format.torch_archive import unproven
from megatron_ucp.format.torchload import TorchReaderCheck, structure_problems
from megatron_ucp.plan.conversion import ConversionPlan, ParamPlan, build_plan, share_of, split_by_bytes
from megatron_ucp.plan.expert_plan import build_expert_plan
from megatron_ucp.plan.model_parallel import CoordinateInput, build_model_parallel_plan

log = logging.getLogger(__name__)

__all__ = ["ConvertOptions", "ConvertResult", "convert", "resolve_checkpoint", "default_output", "plan_checkpoint"]


@dataclass(frozen=True)
class ConvertOptions:
    source: Path
    """A checkpoint root (tag from ``tag`` or ``latest``) or a tag folder."""
    output: Optional[Path] = None
    """Default: ``<root>/<tag>_universal`` (next to the tag folder)."""
    tag: Optional[str] = None
    workers: int = 1
    force: bool = False
    replace_stale: bool = False
    """Replace an existing output made from an earlier save of the tag (the async converter and the
    elastic loader do; the CLI asks for --force)."""
    update_latest: Optional[bool] = None
    """Write ``<root>/latest_universal``; default: when the output lives in the checkpoint root."""
    share_index: int = 0
    share_count: int = 1
    attempt_id: Optional[str] = None
    """Shares of one conversion pass the same id so they join one staging folder."""
    progress: bool = True
    stale_after: float = 60.0
    verify_complete: bool = True
    on_progress: Optional[Callable[[int, int], None]] = field(default=None, compare=False)
    """Called in the converting process as parameters finish: (bytes done, bytes expected) of this share."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UcpError(f"workers must be >= 1 (got {self.workers})")
        if not 0 <= self.share_index < self.share_count:
            raise UcpError(f"share index {self.share_index} out of range for {self.share_count} shares")


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    tag: str
    committed: bool
    """True when this call renamed the output into place (the last share to finish)."""
    params: int
    """Parameters this call wrote."""
    states: int
    bytes_written: int
    seconds: float
    source_dp: int
    optimizer: str
    share_index: int = 0
    share_count: int = 1
    skipped: bool = False
    """True when the output was already complete and nothing was done."""
    summary: str = field(default="", compare=False)


def default_output(ck: ResolvedCheckpoint) -> Path:
    return ck.tag_dir.parent / F.universal_tag(ck.tag)


def plan_checkpoint(meta: CheckpointMeta) -> ConversionPlan:
    """The plan of a DP-only checkpoint (a mixture-of-experts one's expert groups over expert-DP, under global
    expert names), or the merged per-coordinate plans of a TP/PP one.

    ZeRO-3 (per-parameter partitions, :func:`~megatron_ucp.plan.conversion.build_plan`'s ``per_parameter``) keeps
    vocabulary parameters whole, marked :data:`~megatron_ucp.format.dsformat.VOCAB_ROWS_WHOLE`: stock's
    stage-3 universal loader partitions the ``param`` tensor it finds as the live parameter, padded rows
    included, and a trimmed one would land shifted."""
    rules = meta.model.patterns(meta.tp)
    stage3 = meta.files.partitioned_weights
    names = {spec.name for c in meta.coordinates for group in c.model.param_groups for spec in group}
    try:
        if not meta.model_parallel:
            recorded = meta.tp_layouts(sorted(names)) if meta.tp_layouts_known() else None
            if meta.experts is not None:
                experts = meta.experts
                return build_expert_plan(
                    meta.model.param_groups,
                    meta.layouts,
                    experts.expert_groups,
                    experts.ep or 1,
                    experts.experts,
                    rules,
                    tp_layouts=recorded,
                )
            return build_plan(meta.model.param_groups, meta.layouts, rules, tp_layouts=recorded, per_parameter=stage3)
        layouts = meta.tp_layouts(sorted(names))
        coordinates = [
            CoordinateInput(
                pp=c.pp,
                tp=c.tp,
                param_groups=tuple(tuple(g) for g in c.model.param_groups),
                ranks=c.layouts,
                first_file=c.first_file,
            )
            for c in meta.coordinates
        ]
        return build_model_parallel_plan(coordinates, meta.tp, meta.pp, layouts, rules, per_parameter=stage3)
    except PlanError as exc:
        raise CheckpointFormatError(f"{meta.files.tag_dir}: {exc}", subject=meta.files.tag_dir) from exc


def _group_steps(meta: CheckpointMeta, plan: ConversionPlan, cache: RankFileCache) -> tuple[Any, ...]:
    """The optimizer step of each group (rank 0's object); every rank must agree (they step together)."""
    first = cache.get(0)
    steps = []
    for g in plan.groups:
        value = first.step(g.index)
        for r in range(1, len(meta.steps)):
            if meta.steps[r][g.index] != meta.steps[0][g.index]:
                raise CheckpointFormatError(
                    f"{meta.files.rank_files[r]}: optimizer step {meta.steps[r][g.index]} of "
                    f"param group {g.index} differs from rank 0's {meta.steps[0][g.index]}",
                    subject=meta.files.rank_files[r],
                )
        steps.append(value)
    return tuple(steps)


def _latest_applies(ck: ResolvedCheckpoint, output: Path, options: ConvertOptions) -> bool:
    if options.update_latest is False:
        return False
    return ck.root is not None and output.parent.resolve() == ck.root.resolve()


def _repair_interrupted(ck: ResolvedCheckpoint, output: Path, options: ConvertOptions) -> list[str]:
    """What an interrupted earlier run left next to a complete output, undone; one line each.

    A ``--force`` run killed mid-way leaves its dead staging folder (the size of a conversion); a
    run killed between the commit rename and ``latest_universal`` leaves no pointer. Both are
    repaired by the next ``convert`` of the tag, without reconverting.
    """
    done = []
    info = inspect_staging(output)
    if info is not None and not info.is_live(options.stale_after):
        shutil.rmtree(info.path, ignore_errors=True)
        if not info.path.exists():
            done.append(f"removed {info.path.name}, left by an interrupted earlier run")
    if _latest_applies(ck, output, options) and not (ck.root / F.LATEST_UNIVERSAL).exists():
        write_latest_universal(ck.root, output.name)
        done.append(f"{F.LATEST_UNIVERSAL} was missing and now names it")
    for line in done:
        log.info("%s: %s", output, line)
    return done


def check_torch_loadable(files: CheckpointFiles) -> None:
    """Damage ``torch.load`` rejects in a file copied as it is is an error before any work, not a
    "complete" folder that cannot load: our structural check here (headers only, the clearest
    messages), torch's own reader over every file of the output before the commit
    (:func:`_refuse_what_torch_refuses`). Rank
    files are only read by this converter (tolerantly, correctly): the reader warns about their
    damage (a native DeepSpeed load of this tag would fail) as it reads their headers anyway."""
    for path in files_copied_as_they_are(files):
        problems = structure_problems(path)
        if problems:
            raise CheckpointFormatError(
                f"{path}: damaged ({problems[0]}"
                + (f"; {len(problems) - 1} more" if len(problems) > 1 else "")
                + "): torch.load, which DeepSpeed's loader uses, rejects it; the universal "
                "folder would carry it",
                subject=path,
            )


@dataclass(frozen=True)
class _Source:
    """What :func:`convert` learns before reading any rank file's metadata, each fact read once: the
    tag, its files (the folder listed once), their identity, the output and its state."""

    ck: ResolvedCheckpoint
    files: CheckpointFiles
    identity: dict
    output: Path
    state: str
    stale: Optional[str]


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert one tag (or this share of it), a straight pipeline: the source's facts, the output's
    check, the plan, then this share written and, by the last share, committed."""
    t0 = time.perf_counter()
    source = _read_source(options)
    force = _check_output(source, options)
    if force is None:
        return _already_complete(source, options)
    check_torch_loadable(source.files)
    # torch's own reader only for copied files not in torch.save's form, started now to overlap the work
    reader_check = TorchReaderCheck(start=any(unproven(p) for p in files_copied_as_they_are(source.files)))
    try:
        meta, plan, cache = _plan(source)
        check_save_identity(meta, cache)
        return _write_and_commit(source, meta, plan, cache, options, force, t0, reader_check)
    finally:
        reader_check.cancel()


def _read_source(options: ConvertOptions) -> _Source:
    """Resolve the tag, refuse an output that would overwrite it or a ``latest_universal`` that is
    not a file, list the tag folder, and take the output's state (stale when made from other files)."""
    ck = resolve_checkpoint(options.source, options.tag)
    output = Path(options.output) if options.output is not None else default_output(ck)
    check_output_placement(output, [ck.tag_dir])  # --force replaces the output: never a source
    if output.exists() and not output.is_dir():
        raise UcpError(f"{output}: exists and is not a folder; choose another --output", subject=output)
    pointer = ck.root / F.LATEST_UNIVERSAL if ck.root is not None else None
    pointer_kind = special_kind(pointer) if pointer is not None and _latest_applies(ck, output, options) else None
    if pointer_kind is not None:
        raise UcpError(
            f"{pointer}: is {pointer_kind}, not a tag file; remove it (or pass --no-latest) before converting",
            subject=pointer,
        )
    files = find_checkpoint_files(ck.tag_dir)
    identity = source_identity(files.identity_files())  # before reading: what this converts
    state = universal_state(output)
    stale = stale_reason(output, ck.tag_dir, current=identity) if state == COMPLETE else None
    return _Source(ck, files, identity, output, STALE if stale is not None else state, stale)


def _check_output(source: _Source, options: ConvertOptions) -> Optional[bool]:
    """Whether the output is to be replaced (``force``), or None when another share already completed
    it; raises when it exists and may not be replaced, or cannot be written."""
    output, state = source.output, source.state
    force = options.force or (state == STALE and options.replace_stale)
    if state == STALE and not force:
        raise OutputExistsError(
            f"{output}: exists but is stale: {source.stale}; pass --force to reconvert it", subject=output
        )
    if state != "absent" and not force:
        if state == COMPLETE and options.share_count > 1:
            return None
        repaired = _repair_interrupted(source.ck, output, options) if state == COMPLETE else []
        done = "; " + "; ".join(repaired) if repaired else ""
        if state == COMPLETE:
            raise AlreadyConvertedError(
                f"{output}: already a complete conversion of {source.ck.tag_dir.name}{done}; nothing to do "
                "(--force reconverts it)",
                subject=output,
            )
        raise OutputExistsError(f"{output}: already exists ({state}{done}); pass --force to replace it", subject=output)
    if not output.parent.is_dir():
        raise UcpError(f"{output.parent}: output's parent folder does not exist", subject=output.parent)
    if not os.access(output.parent, os.W_OK):
        raise UcpError(f"{output.parent}: not writable", subject=output.parent)
    return force


def _already_complete(source: _Source, options: ConvertOptions) -> ConvertResult:
    return ConvertResult(
        output=source.output,
        tag=source.ck.tag,
        committed=False,
        params=0,
        states=0,
        bytes_written=0,
        seconds=0.0,
        source_dp=0,
        optimizer="",
        share_index=options.share_index,
        share_count=options.share_count,
        skipped=True,
        summary=f"{source.output} is already complete",
    )


def _plan(source: _Source) -> tuple[CheckpointMeta, ConversionPlan, RankFileCache]:
    """Every rank file opened (mapped, metadata unpickled) once: the metadata pass, the step check, the
    writers and the common state all use the same cached objects."""
    files = source.files
    cache = RankFileCache(list(files.rank_files))
    meta = read_checkpoint(
        source.ck.tag_dir, rank_files=[cache.get(r) for r in range(len(files.rank_files))], files=files
    )
    return meta, plan_checkpoint(meta), cache


def _write_and_commit(
    source: _Source,
    meta: CheckpointMeta,
    plan: ConversionPlan,
    cache: RankFileCache,
    options: ConvertOptions,
    force: bool,
    t0: float,
    reader_check: TorchReaderCheck,
) -> ConvertResult:
    """This share's parameters written into the staging folder; the last share writes the common files,
    checks the folder and commits it."""
    ck, files, output, identity = source.ck, source.files, source.output, source.identity
    steps = _group_steps(meta, plan, cache)
    mine = share_of(plan, options.share_index, options.share_count)
    try:
        staging = Staging(
            output,
            plan.fingerprint(),
            options.share_index,
            options.share_count,
            options.attempt_id,
            options.stale_after,
        ).open()
    except OSError as exc:
        raise UcpError(
            f"{exc.filename or output.parent}: cannot create the staging folder: {exc.strerror}", subject=output
        ) from exc
    log.info(
        "converting %s (%s, %s, DeepSpeed %s): %d params, share %d/%d -> %s",
        ck.tag_dir,
        meta.describe(),
        meta.kind,
        meta.ds_version,
        len(mine),
        options.share_index + 1,
        options.share_count,
        output,
    )
    try:
        read, finite = PartitionSums(meta, cache), FiniteCheck(cache.paths)  # checks made as the writers read
        written, sums = _write_params(mine, plan, steps, meta, staging, options, cache, (read.add, finite.add))
        staging.mark_share_done(
            {
                "share": options.share_index,
                "params": len(mine),
                "bytes": written,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "checksums": sums,
                "partition_sums": read.to_record(),
                "non_finite": finite.to_record(),
            }
        )
        committed = staging.claim_commit()
        if committed:
            commit_conversion(ck, files, identity, meta, plan, cache, staging, options, force, t0, reader_check)
    except OSError as exc:
        _abandon(staging, options, exc)
        raise UcpError(f"{exc.filename or staging.path}: {exc.strerror or exc}", subject=exc.filename) from exc
    except BaseException as exc:
        _abandon(staging, options, exc)
        raise
    finally:
        staging.close()

    seconds = time.perf_counter() - t0
    n_states = sum(len(plan.groups[p.group].states) for p in mine)
    summary = (
        f"{'converted' if committed else 'wrote share of'} {ck.tag} ({meta.describe()}, {meta.kind}, DeepSpeed "
        f"{meta.ds_version}): {len(mine)} params, {n_states} state tensors, {human_bytes(written)} in "
        f"{seconds:.2f}s ({human_bytes(written / max(seconds, 1e-9))}/s) -> {output}"
        + ("" if committed else f" [share {options.share_index + 1}/{options.share_count}; commit by the last]")
    )
    log.debug(summary)
    return ConvertResult(
        output=output,
        tag=ck.tag,
        committed=committed,
        params=len(mine),
        states=n_states,
        bytes_written=written,
        seconds=seconds,
        source_dp=meta.dp,
        optimizer=meta.kind,
        share_index=options.share_index,
        share_count=options.share_count,
        summary=summary,
    )


def _tell_all(observers: Sequence[ReadObserver]) -> ReadObserver:
    def tell(*read: Any) -> None:
        for observe in observers:
            observe(*read)

    return tell


def _abandon(staging: Staging, options: ConvertOptions, exc: BaseException) -> None:
    """A single converter removes its staging folder; a share leaves a failure note for the others."""
    if options.share_count == 1:
        staging.discard()
    else:
        staging.mark_share_failed(described(exc))
        staging.close()


def _write_params(
    mine: Sequence[ParamPlan],
    plan: ConversionPlan,
    steps: tuple,
    meta: CheckpointMeta,
    staging: Staging,
    options: ConvertOptions,
    cache: RankFileCache,
    observers: tuple[ReadObserver, ...],
) -> tuple[int, dict]:
    """Write this share's parameters with ``options.workers`` threads over contiguous, byte-balanced chunks;
    return the bytes written and the state files' checksums (:attr:`Writer.sums`); the ``observers`` are told
    each fragment as it passes (the save check's sums, the finite check).

    Threads, not processes: the work is system calls (write, madvise, fsync) and zlib's CRC, all of
    which release the GIL, so threads overlap as well as processes would, without starting
    interpreters (seconds on a small machine). Memory: each thread holds the pages of the
    parameter it is writing, nothing more (see :class:`Writer`). A single converter (one share)
    also copies the model-states file(s) beside the writers, so that copy (~15% of the bytes of a
    checkpoint, fsynced with the rest) does not wait for the commit.
    """
    per_group = {g.index: len(g.states) for g in plan.groups}
    total = sum(p.out_numel * per_group[p.group] * 4 for p in mine)
    workers = max(1, min(options.workers, len(mine)))
    parts = 1 if workers == 1 else workers * 4
    zero_dir = str(staging.path / F.UNIVERSAL_ZERO_DIR)
    chunks = [
        Chunk(params=tuple(ps), groups=plan.groups, steps=steps, zero_dir=zero_dir)
        for ps in split_by_bytes(mine, parts, per_group)
        if ps
    ]
    writer = Writer(cache, fast=not torch_save_forced(), on_read=_tell_all(observers))
    prefetch = [meta.files.model_states] if options.share_count == 1 else []  # the committer copies it
    prefetch += [meta.files.rank_files[r] for r in sorted({i.rank for p in mine for i in p.items})]
    threading.Thread(target=osio.read_ahead, args=(prefetch,), name="ucp-readahead", daemon=True).start()
    if not writer.fast:
        log.info("writing with torch.save (MEGATRON_UCP_TORCH_SAVE=1)")
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"convert {meta.files.tag_dir.name}",
        disable=not options.progress,
        leave=False,
    )
    written = 0
    done = 0
    lock = threading.Lock()

    def advance(nbytes: int) -> None:
        nonlocal done
        with lock:
            bar.update(nbytes)
            done += nbytes
            if options.on_progress is not None:
                options.on_progress(done, total)

    copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-model-copy")
    model_copy = copier.submit(copy_model_files, meta, staging) if options.share_count == 1 else None
    try:
        if workers == 1:
            for chunk in chunks:
                written += write_chunk(chunk, writer, on_param=advance)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ucp-writer") as pool:
                futures = [pool.submit(write_chunk, chunk, writer, advance) for chunk in chunks]
                try:
                    for fut in as_completed(futures):
                        written += fut.result()
                except BaseException:
                    writer.stop.set()
                    for fut in futures:
                        fut.cancel()
                    raise
        if model_copy is not None:
            writer.add_pending(model_copy.result())
        writer.make_durable()
    finally:
        copier.shutdown(wait=True)  # never leave it writing into a staging folder being discarded
        bar.close()
    return written, dict(writer.sums)
