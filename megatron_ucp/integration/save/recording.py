"""Save-time hook: every rank's optimizer file records its true unpadded lengths.

Wraps ``state_dict`` of ``BF16_Optimizer`` and ``DeepSpeedZeroOptimizer`` so that the dict each
rank saves carries, next to ``group_paddings``, ``group_true_lengths`` and ``zero_partition_info``
(DP size, rank, alignment, group numels, partition sizes): what a converter needs to check the
file on its own, and ``zero_partition_checksums``: a checksum of the real elements of every flat
partition it saves (fp32 and each optimizer state), taken on the tensors in memory, against which
a native reshard checks what it copied. BF16_Optimizer's ``group_paddings`` (last-rank-only in stock DeepSpeed,
wrong once
the padding exceeds a partition) is replaced by the per-rank value, so that stock
``ds_to_universal`` converts plugin-saved checkpoints too. The optimizer's own attributes are not
touched; only the returned dict differs. ``patches/`` carries the same change as an upstream diff.

Every save also gets an identity (:data:`~megatron_ucp.format.dsformat.UCP_SAVE_RECORD`): at the start
of ``save_checkpoint`` the first rank draws a random ``save_id`` and broadcasts it (one small
collective per save; ``save_checkpoint`` is collective already), and every rank's optimizer file and
every model-states file of the save carry it, with the optimizer file's DP rank and size. A load then
binds each file to its place and to its save (:mod:`megatron_ucp.plan.rank_binding`).

A mixture-of-experts job's expert groups are partitioned over the expert-data-parallel group: their true
lengths follow that group's geometry and its ranks (``group_dp_sizes``/``group_dp_ranks`` in the record).
A job whose optimizer the hooks cannot record (:func:`megatron_ucp.integration.handled.unhandled_reason`:
a layout without an :class:`OptimizerLayout`, experts at TP or PP > 1) saves exactly as stock DeepSpeed
does, with one warning: the hooks never make a save fail.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import uuid
from typing import Any, Callable, Optional

from megatron_ucp import faults
from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.deepspeed.surface import OptimizerLayout
from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import JOB, comm
from megatron_ucp.integration.handled import STOCK, unhandled_reason, warn_once
from megatron_ucp.integration.live_job import tp_layout_record
from megatron_ucp.integration.save import async_save, memory_save
from megatron_ucp.integration.save.commit import committed_save
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.save_record import (
    partition_checksums,
    partition_record,
    save_identity,
    stage3_partition_checksums,
    stage3_partition_record,
)
from megatron_ucp.plan.tensor_parallel import TP_LAYOUT_KEY

log = logging.getLogger(__name__)

_SAVE_ID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("megatron_ucp_save_id", default=None)
"""The identity of the save in progress (set by ``save_checkpoint`` for its duration)."""
_STOCK_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_ucp_stock_save", default=False)
"""A save the hooks leave to stock DeepSpeed (said once, at its start): its state dicts stay stock."""


def wanted(config: UcpConfig) -> bool:
    return config.record_true_lengths


def _dp_of(optimizer: Any) -> tuple[list[int], list[int]]:
    import torch.distributed as dist

    groups = surface.group_dp_groups(optimizer)
    return [dist.get_world_size(group=pg) for pg in groups], [dist.get_rank(group=pg) for pg in groups]


def _base_states(optimizer: Any, flats: list[Any]) -> list[dict[str, Any]]:
    return [dict(surface.base_optimizer(optimizer).state.get(flat, {})) for flat in flats]


def _checksums(flats: list[Any], states: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any]:
    return partition_checksums(flats, states, record)[F.ZERO_PARTITION_CHECKSUMS]


def _stage3_checksums(flats: list[Any], states: list[dict[str, Any]], groups: Stage3Groups, rank: int) -> dict:
    return stage3_partition_checksums(flats, states, groups, rank)[F.ZERO_PARTITION_CHECKSUMS]


def _record(layout: OptimizerLayout) -> Callable[[Any], dict[str, Any]]:
    """What one optimizer class adds to the dict it saves, read where its layout keeps it."""

    def record_of(optimizer: Any) -> dict[str, Any]:
        numels, padded = layout.padded_numels(optimizer)
        sizes, ranks = _dp_of(optimizer)
        record = partition_record(
            numels,
            padded,
            [f.numel() for f in layout.flats(optimizer)],
            sizes,
            ranks,
            surface.alignment_factor(optimizer),
        )
        recorded = list(getattr(optimizer, layout.recorded_paddings, []) if layout.recorded_paddings else [])
        if recorded and recorded != record[F.GROUP_PADDINGS]:
            log.warning(
                "%s group_paddings %s differ from the geometry's %s; saving the latter",
                layout.class_name,
                recorded,
                record[F.GROUP_PADDINGS],
            )
        flats = layout.masters(optimizer)
        out = {
            **record,
            F.ZERO_PARTITION_CHECKSUMS: async_save.when_written(
                _checksums, flats, _base_states(optimizer, flats), record
            ),
        }
        save_id = _SAVE_ID.get()
        if save_id is not None:  # the DP group's place (a mixture-of-experts job's expert groups are smaller)
            group = surface.dp_group(optimizer)
            out.update(save_identity(save_id, comm().get_world_size(group=group), comm().get_rank(group=group)))
        return out

    return record_of


def _record_stage3(layout: OptimizerLayout) -> Callable[[Any], dict[str, Any]]:
    """What a ZeRO-3 optimizer adds to the dict it saves: each sub-group's and each parameter's true length
    on this rank, the layout they follow from, and the checksum of every partition's real runs."""

    def record_of(optimizer: Any) -> dict[str, Any]:
        import torch.distributed as dist

        group = surface.dp_group(optimizer)
        dp, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        sub_groups, owners = stage3_runtime.stage3_sub_groups(optimizer)
        groups = Stage3Groups(tuple(tuple(g) for g in sub_groups), tuple(owners), dp)
        flats = layout.masters(optimizer)
        sizes, held = groups.partition_sizes(), [int(f.numel()) for f in flats]
        if held != sizes:
            raise UnsupportedError(
                f"{layout.class_name}: fp32 partitions of {held} elements, the per-parameter "
                f"geometry gives {sizes} at DP={dp}; this DeepSpeed partitions differently from what megatron-ucp "
                "understands"
            )
        out = {
            **stage3_partition_record(groups, rank),
            F.ZERO_PARTITION_CHECKSUMS: async_save.when_written(
                _stage3_checksums, flats, _base_states(optimizer, flats), groups, rank
            ),
        }
        save_id = _SAVE_ID.get()
        if save_id is not None:
            out.update(save_identity(save_id, dp, rank))
        return out

    return record_of


def _wrap(record: Any) -> Any:
    def make(original: Any) -> Any:
        @functools.wraps(original)
        def state_dict(self: Any, *args: Any, **kwargs: Any) -> dict:
            sd = original(self, *args, **kwargs)
            if _STOCK_SAVE.get():
                return sd
            try:
                extra = record(self)
            except AttributeError as exc:  # DeepSpeed internals changed under a tested release: say so, save
                warn_once(f"{type(self).__name__} lacks an attribute the save record relies on ({exc})", STOCK)
                return sd
            except UnsupportedError as exc:  # a layout the record cannot describe: the stock dict
                warn_once(str(exc), STOCK)
                return sd
            sd.update(extra)
            return sd

        return state_dict

    return make


def _record_tp_layout(original: Any) -> Any:
    """The model states also carry each parameter's TP layout (:func:`tp_layout_record`), so that a
    TP=1 checkpoint is converted with the right ``cat_dim`` and reshards correctly to TP > 1."""

    @functools.wraps(original)
    def _save_checkpoint(
        self: Any, save_dir: Any, tag: Any, client_state: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        faults.fault_point(f"save {tag}: model states")  # inside DeepSpeed's save, before its model states
        state = dict(client_state or {})
        save_id = _SAVE_ID.get()
        if save_id is not None:
            state.update(save_identity(save_id))
        names = getattr(self, "param_names", None)
        if TP_LAYOUT_KEY not in state and isinstance(names, dict):
            record = tp_layout_record((names[p], p) for p in self.module.parameters() if p in names)
            if record is not None:
                state[TP_LAYOUT_KEY] = record
        return original(self, save_dir, tag, state, *args, **kwargs)

    return _save_checkpoint


def _identify_save(original: Any) -> Any:
    """Around DeepSpeed's save: every rank agrees on one new save identity, and the save becomes ``latest``
    only when every rank wrote its files (:func:`~megatron_ucp.integration.save.commit.committed_save`); a job
    the hooks do not handle saves as stock does, with one warning."""

    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        reason = unhandled_reason(self)
        if reason is not None:
            if memory_save.target() is not None:  # no memory save of a job left to stock DeepSpeed: nothing written
                memory_save.target().refused = reason  # type: ignore[union-attr]
                return None
            warn_once(reason, STOCK)
            stock = _STOCK_SAVE.set(True)
            try:
                return original(self, *args, **kwargs)
            finally:
                _STOCK_SAVE.reset(stock)
        if memory_save.target() is None:  # a durable save follows the memory save in flight (committed first)
            memory_save.wait()
        token = _SAVE_ID.set(_new_save_id())
        try:
            if memory_save.target() is not None:
                return memory_save.write(self, original, args, kwargs, _SAVE_ID.get() or "")
            if async_save.enabled() and async_save.supported(self):
                return async_save.async_save(self, original, args, kwargs, _SAVE_ID.get())
            return committed_save(self, original, args, kwargs, _SAVE_ID.get() or "")
        finally:
            _SAVE_ID.reset(token)

    return save_checkpoint


def _new_save_id() -> str:
    """A random identity drawn by the first rank and broadcast to every rank of the job."""
    dist = comm()
    if not (dist.is_available() and dist.is_initialized()):
        return uuid.uuid4().hex
    return JOB.broadcast(uuid.uuid4().hex if dist.get_rank() == 0 else None)


def install(patches: Any, config: UcpConfig) -> None:
    """Every optimizer layout's ``state_dict`` records, the engine's ``_save_checkpoint`` adds the TP layout
    and the save's identity, ``save_checkpoint`` agrees on that identity (the install checked the surface)."""
    surface.replace(patches, surface.ENGINE, "save_checkpoint", _identify_save)
    surface.replace(patches, surface.ENGINE, "_save_checkpoint", _record_tp_layout)
    surface.replace(patches, surface.ENGINE, "_save_moe_checkpoint", _record_tp_layout)  # a mixture-of-experts save
    for layout in surface.OPTIMIZER_LAYOUTS:
        record = _record_stage3(layout) if layout.per_parameter else _record(layout)
        surface.replace(patches, layout.owner, "state_dict", _wrap(record))
