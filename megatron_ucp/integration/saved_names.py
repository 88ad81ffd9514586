"""The checkpoint's parameter names against the live model's, when the other GPT model class saved it."""

from __future__ import annotations

import logging
from typing import Any, Optional

from megatron_ucp.errors import CheckpointFormatError, PlanError
from megatron_ucp.integration.collectives import count_across, gather_names, is_first
from megatron_ucp.plan.names import is_pipeline_names, name_map

log = logging.getLogger(__name__)


def saved_names(names: dict[Any, str], listing: dict[str, tuple[str, ...]], group: Any) -> Optional[dict[str, str]]:
    """Live name -> saved folder name when the checkpoint was saved by the other GPT model class
    (``GPTModel`` <-> ``GPTModelPipe``, :mod:`megatron_ucp.plan.names`); None when names match.
    Collective over ``group``: the pipeline model's names are only complete across its stages. ``names``:
    live parameter -> name (the optimizer's or the engine's map)."""
    local = set(names.values())
    if not count_across(0 if local <= set(listing) else 1, group):
        return None
    live = gather_names(local, group)
    try:
        mapping = name_map(live, listing)
    except PlanError as exc:
        raise CheckpointFormatError(
            f"the checkpoint's parameter names do not match the model's, and no name map applies: {exc}",
            subject=str(exc),
        ) from exc
    if mapping is not None and is_first(group):
        kinds = ("GPTModelPipe", "GPTModel") if is_pipeline_names(listing) else ("GPTModel", "GPTModelPipe")
        log.info(
            "megatron-ucp: the checkpoint was saved by %s, the model is %s: %d parameter names mapped (e.g. %s <- %s)",
            *kinds,
            len(mapping),
            *next(iter(sorted(mapping.items()))),
        )
    return mapping
