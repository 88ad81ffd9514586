"""The two loads straight from the native rank files, every ZeRO stage: a DP change (:func:`reshard_load`) and a
same-DP restart (:func:`same_dp_load`). Both bind the old files (:mod:`.binding`) before DeepSpeed's own load, let it
load what it loads, then copy (:mod:`.reshard`) or check what it loaded. With ``module_read = distributed`` neither
reads the module's weights in full: they are rebuilt from the loaded masters, at the saved DP size only once proven
equal to the saved ones (:mod:`~megatron_ucp.integration.resume.module_read`)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ucp.errors import StockFormError, UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration import node_memory
from megatron_ucp.integration.collectives import is_first
from megatron_ucp.integration.handled import warn_once
from megatron_ucp.integration.live_job import LiveJob, LoadCall
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
from megatron_ucp.integration.resume.native.reshard import load_native_partitions, loaded_weights, verify_loaded
from megatron_ucp.plan.accounting import AccountingReport
from megatron_ucp.plan.resume import Route

log = logging.getLogger(__name__)

REBUILT = "module weights rebuilt from the masters (one all-gather; of the module, only what has no master read)"
NO_WEIGHTS = "the memory save left them to the masters"
_NO_STATES = {"load_optimizer_states": False}


def _module_reads(job: LiveJob, model_states: Path, distributed: bool) -> Any:
    return module_from_masters(job, model_states) if distributed else contextlib.nullcontext()


def _layers(job: LiveJob, model_states: Path, distributed: bool) -> Any:
    """A pipeline model's layer files, read the same way (distributed), else None."""
    return layer_hook(job, model_states.parent) if distributed and job.pipeline else None


@dataclass
class SavedSlices:
    """This rank's real range of the saved weights per group, read from the model-states file (or the pipeline
    model's layer files) on first use: 1/DP of the weights."""

    weights: SavedWeights
    starts: list[int]
    reals: list[int]
    dtypes: list[torch.dtype]
    cache: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, job: LiveJob, bound: BoundSave, model_states: Path) -> "SavedSlices":
        weights = SavedWeights(bound.facts.layout.shapes, weight_sources(job, model_states))
        dtypes = [parts[0].dtype for parts in job.lp_partitions()]
        return cls(weights, bound.new.starts(bound.rank), bound.new.true_lengths(bound.rank), dtypes)

    def __call__(self, g: int) -> torch.Tensor:
        if g not in self.cache:
            self.cache[g] = torch.empty(self.reals[g], dtype=self.dtypes[g])
            self.weights.read(g, self.starts[g], self.cache[g])
        return self.cache[g]

    def read(self) -> str:
        return f"{self.weights.bytes_read / 1e6:.1f} MB"

    def close(self) -> None:
        self.weights.close()


def reshard_load(call: LoadCall, tag: str, dp_from: int, seen_states: Optional[dict] = None) -> LoadOutcome:
    """Route RESHARD, every stage, up to the report: files bound, DeepSpeed's load of everything but the optimizer
    states (and, distributed, but the optimized weights), the partitions copied from the old rank files, the weights
    the masters round to. ZeRO-1/2 copy after DeepSpeed's load; ZeRO-3 in place of its optimizer load, which restores
    the module from the masters. The caller finishes."""
    job, config = call.job, call.config
    rank_file, model_states = engine_save_files(job, call.load_dir, tag)
    per_parameter = job.per_parameter
    how = how_module_is_read(call, Route.RESHARD)
    distributed = how.distributed
    try:
        first_read = seen_states if is_first() else None
        bound = bind_save(job, model_states, rank_file, first_read, requantize=config.requantize_8bit)
    except StockFormError as exc:  # a form of the files the hooks do not read, before anything was loaded
        return _deepspeeds_own_load(call, tag, exc, [rank_file(r) for r in range(dp_from)])
    reports: list[AccountingReport] = []
    origins = CopiedFrom(bound.reads, rank_file)

    def partitions(_original: Any, _engine: Any, _dir: str, _tag: str, _load_optimizer_states: bool) -> bool:
        reports.append(load_native_partitions(job, bound, strict=config.strict))
        return True

    try:
        with (
            one_model_states_file_per_rank(
                job.engine,
                always=True,
                lazy=how.lazy,
                layer_hook=_layers(job, model_states, distributed),
                path=model_states_for(job, Path(call.load_dir) / tag) if per_parameter else None,
            ) as read,
            _module_reads(job, model_states, distributed),
            replacing_optimizer_load(partitions) if per_parameter else contextlib.nullcontext(),
        ):
            result = call.deepspeed(tag, **({} if per_parameter else _NO_STATES))
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
                f"DeepSpeed's load of {Path(call.load_dir) / tag} did not reach its optimizer load: the partitions "
                "were not restored",
                subject=Path(call.load_dir) / tag,
            )
        return LoadOutcome(result, load_path, reports[0], dp_from, states=read.of(load_path), origins=origins)
    masters_only = node_memory.weights_from_masters()
    saved = SavedSlices.of(job, bound, model_states) if distributed and not masters_only else None
    try:
        report = load_native_partitions(job, bound, strict=config.strict, saved=saved, weights=not masters_only)
    finally:
        if saved is not None:
            saved.close()
    if distributed:
        rebuild(job)  # the weights the masters round to, as the universal route gives
        optimizer_bytes = sum(src.reader.bytes_read for src in bound.sources.values() if src.reader is not None)
        module = f"{REBUILT}; rank {bound.rank} read {optimizer_bytes / 1e6:.1f} MB of the old rank files and " + (
            f"{saved.read()} of the saved weights" if saved is not None else f"none of the weights ({NO_WEIGHTS})"
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


def _deepspeeds_own_load(call: LoadCall, tag: str, why: StockFormError, rank_files: list[Path]) -> LoadOutcome:
    """A save in a form the hooks do not read (the same error on every rank): loaded as stock DeepSpeed loads it,
    with one warning (it may refuse what it cannot load, as without the hooks). ``rank_files``: what its load may read
    (a memory save's are brought to this node first)."""
    refuse_weights_left_out(call, "DeepSpeed's own load reads them from its files")
    node_memory.fetch(rank_files)
    warn_once(str(why), "loaded by DeepSpeed's own load, as without megatron-ucp")
    return LoadOutcome(call.deepspeed(tag), stock=True)


def refuse_weights_left_out(call: LoadCall, why: str) -> None:
    """A memory save that left the weights to the masters, loaded where they would be read from its files: refused on
    every rank alike, before anything is loaded (the restart then loads the durable checkpoint)."""
    if node_memory.weights_from_masters():
        raise UnsupportedError(
            f"{call.load_dir}: this memory save left the model's weights to the fp32 masters, and {why}",
            subject=call.load_dir,
        )


def same_dp_load(call: LoadCall, tag: str, seen_states: Optional[dict] = None) -> LoadOutcome:
    """Route NATIVE at the saved DP size, every ZeRO stage: the old rank files bound before DeepSpeed's own load
    (each rank its own file, named when it is another position's or another save's), DeepSpeed's load as it is
    (ZeRO-1/2 distributed: without the optimized weights), then what it loaded checked and, at ZeRO-1/2, the weights
    rebuilt or read (ZeRO-3's own load restores them from the masters)."""
    job, config = call.job, call.config
    rank_file, model_states = engine_save_files(job, call.load_dir, tag)
    how = how_module_is_read(call, Route.NATIVE)  # a refusal before anything is bound or brought
    try:
        bound = bind_save(job, model_states, rank_file, seen_states if is_first() else None, same_dp=True)
    except StockFormError as exc:  # a form of the files the hooks do not read, before anything was loaded
        return _deepspeeds_own_load(call, tag, exc, [rank_file(r) for r in range(job.dp_size)])
    flat = not job.per_parameter
    masters_only = node_memory.weights_from_masters()  # then distributed: how_module_is_read refused otherwise
    distributed = how.distributed and (bound is not None or masters_only)
    try:
        with (
            one_model_states_file_per_rank(
                job.engine, always=True, lazy=how.lazy, layer_hook=_layers(job, model_states, distributed)
            )
            if distributed
            else contextlib.nullcontext(ClientStates()) as read,
            _module_reads(job, model_states, distributed),
        ):
            result = call.deepspeed(tag)
    except BaseException:
        if bound is not None:
            bound.close()
        raise
    if bound is None or loaded_path(result) is None:
        if bound is not None:
            bound.close()
        elif masters_only and loaded_path(result) is not None:  # unbound: DeepSpeed's own load of the masters
            rebuild(job)
            if is_first():
                log.info("megatron-ucp: %s: module weights rebuilt from the masters (%s)", tag, NO_WEIGHTS)
        return LoadOutcome(result)
    t0 = time.perf_counter()
    saved = SavedSlices.of(job, bound, model_states) if distributed and not masters_only else None
    try:
        weights = (saved or loaded_weights(job, bound)) if flat and not masters_only else None
        what = verify_loaded(job, bound, config.strict, weights)
        if distributed and masters_only:
            rebuild(job)
            what += f"; module weights rebuilt from the masters (one all-gather; {NO_WEIGHTS})"
        elif saved is not None:
            exact = rebuild_from_masters(job, bound.new.true_lengths(bound.rank), saved)
            what += "; " + (
                "module weights rebuilt from the masters (one all-gather), proven equal to the saved ones "
                f"(rank {bound.rank} read {saved.read()} of them, its 1/DP)"
                if exact
                else _read_in_full(call, read, model_states)
            )
        elif flat:
            what += f"; module read in full ({how.why_full})"
    finally:
        if saved is not None:
            saved.close()
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


def _read_in_full(call: LoadCall, read: ClientStates, model_states: Path) -> str:
    """The saved weights are not the masters rounded to nearest somewhere: DeepSpeed's own module load, every rank the
    whole module (collective decision: every rank is here)."""
    if is_first():
        log.warning(
            "megatron-ucp: %s: the saved weights are not the fp32 masters rounded to nearest; reading the module "
            "in full on every rank, as DeepSpeed does",
            model_states,
        )
    call.job.engine.load_module_state_dict(
        checkpoint={**(read.states or {}), F.MODULE: read.module}, strict=call.kwargs.get("load_module_strict", True)
    )
    return "module read in full: its saved weights are not the masters rounded to nearest"
