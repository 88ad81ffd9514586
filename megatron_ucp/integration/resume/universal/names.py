"""The live model's parameter names as a universal folder keeps them: the other GPT model class's names mapped
(:func:`saved_names`), and a mixture-of-experts rank's local expert indices as the folder's global ones
(:func:`live_expert_names`), each checked, so that a topology this tool does not know stops the load by name.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from megatron_ucp.errors import CheckpointFormatError, PlanError, UnsupportedError
from megatron_ucp.integration.collectives import Collective, comm, is_first
from megatron_ucp.plan.experts import global_expert_names
from megatron_ucp.plan.names import is_pipeline_names, name_map
from megatron_ucp.plan.parallel_layout import ParallelLayout

log = logging.getLogger(__name__)


def saved_names(names: dict[Any, str], listing: dict[str, tuple[str, ...]], group: Any) -> Optional[dict[str, str]]:
    """Live name -> saved folder name when the checkpoint was saved by the other GPT model class
    (``GPTModel`` <-> ``GPTModelPipe``, :mod:`megatron_ucp.plan.names`); None when names match.
    Collective over ``group``: the pipeline model's names are only complete across its stages. ``names``:
    live parameter -> name (the optimizer's or the engine's map)."""
    local = set(names.values())
    calls = Collective(group)
    if not calls.count(0 if local <= set(listing) else 1):
        return None
    live = calls.names(local)
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


def live_expert_names(
    names: dict[Any, str], groups: list[list[Any]], group_dp_groups: list[Any], dp_group: Any
) -> dict[Any, str]:
    """Live parameter -> global name, for the expert parameters this rank holds (empty without expert groups).
    ``names``: live parameter -> the optimizer's (local) name; ``groups``: each param group's live parameters,
    partitioned over its process group of ``group_dp_groups``."""
    dist = comm()
    sizes = [int(dist.get_world_size(group=pg)) for pg in group_dp_groups]
    if len(set(sizes)) == 1:
        return {}
    dp, d = dist.get_world_size(group=dp_group), dist.get_rank(group=dp_group)
    out: dict[Any, str] = {}
    for g, (size, group, lps) in enumerate(zip(sizes, group_dp_groups, groups)):
        if size == dp:
            continue
        try:
            layout = ParallelLayout(dp=dp, ep=dp // size)
            place = dist.get_rank(group=group)
            if dp % size or place != layout.expert_data_parallel_rank(d):
                raise PlanError(
                    f"DP rank {d} of {dp} is rank {place} of param group {g}'s {size} ranks; DeepSpeed-MoE's layout "
                    f"puts it at {layout.expert_data_parallel_rank(d)}"
                )
            local = [names[lp] for lp in lps]
            mapping = global_expert_names(local, layout.expert_parallel_rank(d))
        except PlanError as exc:
            raise UnsupportedError(f"mixture-of-experts param group {g}: {exc}") from exc
        strays = [name for name in local if name not in mapping]
        if strays:
            raise UnsupportedError(
                f"param group {g} is partitioned over {size} of {dp} ranks (an expert group) but holds "
                f"{strays[0]!r}, which is not an expert parameter"
            )
        out.update({lp: mapping[name] for lp, name in zip(lps, local)})
    return out
