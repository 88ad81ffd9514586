"""The two loads straight from the native rank files, every ZeRO stage: a DP change (the reshard) and a
same-DP restart.

Both bind every old rank file to its position and its save before DeepSpeed's own load touches the
engine (:func:`megatron_ucp.integration.resume.native.binding.bind_save`), then let DeepSpeed load what it
loads, then finish: the reshard copies each rank's new partitions out of the old files, the same-DP
restart checks what DeepSpeed loaded.

With ``module_read = distributed`` (the default) neither reads the module's weights: DeepSpeed's
model-states loader reads the pickle only and its module load takes only what has no master, read
once across the DP group (:mod:`megatron_ucp.integration.resume.module_read`); the weights are rebuilt from
the loaded masters with one all-gather. A restart at the saved DP size must give exactly what
DeepSpeed's own load gives, the saved weights: it rebuilds only when it has proven, on every rank,
that the masters round to them (the save's recorded checksums, or each rank's 1/DP slice of the saved
weights, read), else it reads the module in full, as DeepSpeed does, with one warning. A reshard
always ends with the weights the masters round to (what the universal route gives), reading the 1/DP
slice only to check, for a save without the hooks' record, that the files belong together.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_ucp.config import UcpConfig
from megatron_ucp.errors import StockFormError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import is_first
from megatron_ucp.integration.handled import warn_once
from megatron_ucp.integration.live_job import LiveJob
from megatron_ucp.integration.resume.engine_load import (
    ClientStates,
    CopiedFrom,
    LoadOutcome,
    loaded_path,
    model_states_for,
    one_model_states_file_per_rank,
    replacing_optimizer_load,
)
from megatron_ucp.integration.resume.module_read import (
    SavedWeights,
    how_module_is_read,
    layer_hook,
    module_from_masters,
    rebuild,
    rebuild_from_masters,
    refresh_lp_params,
    weight_sources,
)
from megatron_ucp.integration.resume.native.binding import BoundSave, bind_save, engine_save_files
from megatron_ucp.integration.resume.native.reshard import (
    SavedSlice,
    load_native_partitions,
    loaded_weights,
    verify_loaded,
)
from megatron_ucp.plan.accounting import AccountingReport
from megatron_ucp.plan.resume import Route

log = logging.getLogger(__name__)

REBUILT = "module weights rebuilt from the masters (one all-gather; of the module, only what has no master read)"


def _module_reads(job: LiveJob, model_states: Path, distributed: bool) -> Any:
    return module_from_masters(job, model_states) if distributed else contextlib.nullcontext()


def _layers(job: LiveJob, model_states: Path, distributed: bool) -> Any:
    """A pipeline model's layer files, read the same way (distributed), else None."""
    return layer_hook(job, model_states.parent) if distributed and job.pipeline else None


def _saved_slices(job: LiveJob, bound: BoundSave, model_states: Path) -> SavedSlice:
    """This rank's real range of the saved weights per group, read from the model-states file (or the
    pipeline model's layer files) on first use (1/DP of the weights)."""
    weights = SavedWeights(bound.facts.layout.shapes, weight_sources(job, model_states))
    starts, reals = bound.new.starts(bound.rank), bound.new.true_lengths(bound.rank)
    dtypes = [parts[0].dtype for parts in job.lp_partitions()]
    cache: dict[int, torch.Tensor] = {}

    def saved(g: int) -> torch.Tensor:
        if g not in cache:
            cache[g] = torch.empty(reals[g], dtype=dtypes[g])
            weights.read(g, starts[g], cache[g])
        return cache[g]

    saved.close = weights.close  # type: ignore[attr-defined]
    saved.bytes_read = lambda: weights.bytes_read  # type: ignore[attr-defined]
    return saved


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def reshard_load(
    job: LiveJob,
    original: Callable[..., Any],
    load_dir: str,
    tag: str,
    dp_from: int,
    kwargs: dict,
    config: UcpConfig,
    seen_states: Optional[dict] = None,
) -> LoadOutcome:
    """Route RESHARD, every stage, up to the report: files bound, DeepSpeed's load of everything but the
    optimizer states (and, distributed, but the optimized weights), the partitions from the old rank files
    (:func:`~megatron_ucp.integration.resume.native.reshard.load_native_partitions`), the weights the masters round to.
    ZeRO-1/2 load the partitions after DeepSpeed's load (``load_optimizer_states`` off); ZeRO-3 in place of its
    optimizer load, which restores the module from the masters. The caller finishes (training state, summary)."""
    engine = job.engine
    rank_file, model_states = engine_save_files(job, load_dir, tag)
    per_parameter = job.per_parameter
    how = how_module_is_read(job, config, kwargs, Route.RESHARD)
    distributed = how.distributed
    first_read = seen_states if is_first() else None
    try:
        bound = bind_save(job, model_states, rank_file, first_read, requantize=config.requantize_8bit)
    except StockFormError as exc:  # a form of the files the hooks do not read, before anything was loaded
        return _deepspeeds_own_load(job, original, load_dir, tag, kwargs, exc)
    reports: list[AccountingReport] = []
    origins = CopiedFrom(bound.reads, rank_file)

    def partitions(_original: Any, _engine: Any, _dir: str, _tag: str, _load_optimizer_states: bool) -> bool:
        reports.append(load_native_partitions(job, bound, strict=config.strict))
        return True

    try:
        with (
            one_model_states_file_per_rank(
                engine,
                always=True,
                lazy=how.lazy,
                layer_hook=_layers(job, model_states, distributed),
                path=model_states_for(job, Path(load_dir) / tag) if per_parameter else None,
            ) as read,
            _module_reads(job, model_states, distributed),
            replacing_optimizer_load(partitions) if per_parameter else contextlib.nullcontext(),
        ):
            result = original(engine, load_dir, tag, **(kwargs if per_parameter else {**kwargs, **_NO_STATES}))
    except BaseException:
        bound.close()
        raise
    load_path = loaded_path(result)
    if load_path is None or per_parameter:
        bound.close()
    if load_path is None:
        return LoadOutcome(result)  # DeepSpeed said why (no such tag)
    if per_parameter:
        if not reports:
            raise UcpError(
                f"DeepSpeed's load of {Path(load_dir) / tag} did not reach its optimizer load: the partitions were "
                "not restored",
                subject=Path(load_dir) / tag,
            )
        return LoadOutcome(result, load_path, reports[0], dp_from, states=read.of(load_path), origins=origins)
    saved = _saved_slices(job, bound, model_states) if distributed else None
    try:
        report = load_native_partitions(job, bound, strict=config.strict, saved=saved)
    finally:
        getattr(saved, "close", lambda: None)()
    if distributed:
        rebuild(job)  # the weights the masters round to, as the universal route gives
        optimizer_bytes = sum(src.reader.bytes_read for src in bound.sources.values() if src.reader is not None)
        module = (
            f"{REBUILT}; rank {bound.rank} read {_mb(optimizer_bytes)} of the old rank files and "
            f"{_mb(saved.bytes_read())} of the saved weights"
        )
    else:
        refreshed = refresh_lp_params(job)
        module = f"module read in full ({how.why_full})" + (
            "; its weights were not the masters rounded to nearest: refreshed from the masters, as a universal "
            "load does"
            if refreshed
            else ""
        )
    report = report.with_more(extras=[module])
    return LoadOutcome(result, load_path, report, dp_from, states=read.of(load_path), origins=origins)


_NO_STATES = {"load_optimizer_states": False}


def _deepspeeds_own_load(
    job: LiveJob, original: Callable[..., Any], load_dir: str, tag: str, kwargs: dict, why: StockFormError
) -> LoadOutcome:
    """A save in a form the hooks do not read (the same error on every rank: the first rank's read, shared): loaded
    as stock DeepSpeed loads it, with one warning (it may refuse what it cannot load, as without the hooks)."""
    warn_once(str(why), "loaded by DeepSpeed's own load, as without megatron-ucp")
    return LoadOutcome(original(job.engine, load_dir, tag, **kwargs), stock=True)


def same_dp_load(
    job: LiveJob,
    original: Callable[..., Any],
    load_dir: str,
    tag: Optional[str],
    kwargs: dict,
    config: UcpConfig,
    seen_states: Optional[dict] = None,
) -> LoadOutcome:
    """Route NATIVE at the saved DP size, every ZeRO stage: the old rank files bound before DeepSpeed's own
    load (each rank its own file, named when it is another position's or another save's), then DeepSpeed's
    load as it is (ZeRO-1/2 distributed: without the optimized weights), then what it loaded checked
    (:func:`~megatron_ucp.integration.resume.native.reshard.verify_loaded`) and, at ZeRO-1/2, the weights rebuilt or
    read (ZeRO-3's own load restores them from the masters)."""
    engine = job.engine
    if tag is None:
        return LoadOutcome(original(engine, load_dir, tag, **kwargs))
    rank_file, model_states = engine_save_files(job, load_dir, tag)
    try:
        bound = bind_save(job, model_states, rank_file, seen_states if is_first() else None, same_dp=True)
    except StockFormError as exc:  # a form of the files the hooks do not read, before anything was loaded
        return _deepspeeds_own_load(job, original, load_dir, tag, kwargs, exc)
    flat = not job.per_parameter
    how = how_module_is_read(job, config, kwargs, Route.NATIVE)
    distributed = bound is not None and how.distributed
    try:
        with (
            one_model_states_file_per_rank(
                engine, always=True, lazy=how.lazy, layer_hook=_layers(job, model_states, distributed)
            )
            if distributed
            else contextlib.nullcontext(ClientStates()) as read,
            _module_reads(job, model_states, distributed),
        ):
            result = original(engine, load_dir, tag, **kwargs)
    except BaseException:
        if bound is not None:
            bound.close()
        raise
    if bound is None or loaded_path(result) is None:
        if bound is not None:
            bound.close()
        return LoadOutcome(result)
    t0 = time.perf_counter()
    saved = _saved_slices(job, bound, model_states) if distributed else None
    try:
        weights = (saved or loaded_weights(job, bound)) if flat else None
        what = verify_loaded(job, bound, config.strict, weights)
        if distributed:
            exact = rebuild_from_masters(job, bound.new.true_lengths(bound.rank), saved)
            what += "; " + (
                "module weights rebuilt from the masters (one all-gather), proven equal to the saved ones "
                f"(rank {bound.rank} read {_mb(saved.bytes_read())} of them, its 1/DP)"
                if exact
                else _read_in_full(engine, read, model_states, kwargs)
            )
        elif flat:
            what += f"; module read in full ({how.why_full})"
    finally:
        getattr(saved, "close", lambda: None)()
    if is_first():
        log.info(
            "megatron-ucp: %s loaded at DP %d: %s (%.3fs before DeepSpeed's load, %.3fs after)",
            tag,
            bound.dp_to,
            what,
            bound.seconds,
            time.perf_counter() - t0,
        )
    return LoadOutcome(result)


def _read_in_full(engine: Any, read: ClientStates, model_states: Path, kwargs: dict) -> str:
    """The saved weights are not the masters rounded to nearest somewhere: DeepSpeed's own module load,
    every rank the whole module (collective decision: every rank is here)."""
    if is_first():
        log.warning(
            "megatron-ucp: %s: the saved weights are not the fp32 masters rounded to nearest; reading the module "
            "in full on every rank, as DeepSpeed does",
            model_states,
        )
    engine.load_module_state_dict(
        checkpoint={**(read.states or {}), F.MODULE: read.module}, strict=kwargs.get("load_module_strict", True)
    )
    return "module read in full: its saved weights are not the masters rounded to nearest"
