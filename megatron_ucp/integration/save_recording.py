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
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.surface import OptimizerLayout
from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.live_layout import tp_layout_record
from megatron_ucp.plan.save_record import partition_checksums, partition_record
from megatron_ucp.plan.tensor_parallel import TP_LAYOUT_KEY

log = logging.getLogger(__name__)


def wanted(config: UcpConfig) -> bool:
    return config.record_true_lengths


def _dp_of(optimizer: Any) -> tuple[list[int], list[int]]:
    import torch.distributed as dist

    groups = surface.group_dp_groups(optimizer)
    return [dist.get_world_size(group=pg) for pg in groups], [dist.get_rank(group=pg) for pg in groups]


def _base_states(optimizer: Any, flats: list[Any]) -> list[dict[str, Any]]:
    return [dict(surface.base_optimizer(optimizer).state.get(flat, {})) for flat in flats]


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
        return {**record, **partition_checksums(flats, _base_states(optimizer, flats), record)}

    return record_of


def _wrap(record: Any) -> Any:
    def make(original: Any) -> Any:
        @functools.wraps(original)
        def state_dict(self: Any, *args: Any, **kwargs: Any) -> dict:
            sd = original(self, *args, **kwargs)
            try:
                sd.update(record(self))
            except AttributeError as exc:
                raise UnsupportedError(
                    f"megatron-ucp save hook: {type(self).__name__} lacks an attribute it relies "
                    f"on ({exc}); DeepSpeed internals changed"
                ) from exc
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
        state = dict(client_state or {})
        names = getattr(self, "param_names", None)
        if TP_LAYOUT_KEY not in state and isinstance(names, dict):
            record = tp_layout_record((names[p], p) for p in self.module.parameters() if p in names)
            if record is not None:
                state[TP_LAYOUT_KEY] = record
        return original(self, save_dir, tag, state, *args, **kwargs)

    return _save_checkpoint


def install(patches: Any, config: UcpConfig) -> None:
    """Every optimizer layout's ``state_dict`` records, the engine's ``_save_checkpoint`` adds the TP layout
    (the install checked the surface)."""
    surface.replace(patches, surface.ENGINE, "_save_checkpoint", _record_tp_layout)
    for layout in surface.OPTIMIZER_LAYOUTS:
        surface.replace(patches, layout.owner, "state_dict", _wrap(_record(layout)))
