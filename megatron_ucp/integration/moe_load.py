"""A mixture-of-experts job the hooks leave to stock DeepSpeed, refused where stock would load the wrong experts.

At TP = PP = 1 the hooks handle expert groups (:mod:`megatron_ucp.integration.elastic_load`: a DP or EP change
goes through the universal folder). A job they leave to stock (:mod:`megatron_ucp.integration.handled`: experts
at TP or PP > 1, or at ZeRO-3) loads as stock DeepSpeed loads it. At another DP size stock refuses by itself
(``ZeRORuntimeException``). At the same DP size with another EP it does not: every rank loads its own saved
partition, which held other experts (DP rank ``d`` holds experts of expert-parallel rank ``d % EP``), and training
goes on with experts' masters and states exchanged. That one case is refused here, before anything is loaded,
with what changed and what to do (``MEGATRON_UCP_STRICT=0``: one warning and stock's load, for a user who knows
what they resume).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.torch_files import load_raw
from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import read_tag_file
from megatron_ucp.integration.collectives import Failure, count_across, decide_on_first
from megatron_ucp.integration.handled import warn_once
from megatron_ucp.plan.experts import expert_layout_change


def refuse_an_expert_layout_change(engine: Any, load_dir: str, tag: Optional[str], config: UcpConfig) -> None:
    """Collective: the first rank compares its saved partition counts with the live groups; every rank raises
    the same error (strict) or goes on to stock's load."""
    # every rank takes the same way: at PP > 1 only the stages holding MoE layers know of them
    if not count_across(int(bool(getattr(engine, "has_moe_layers", False)))):
        return
    verdict = decide_on_first(lambda: _change(engine, Path(load_dir), tag))
    if verdict is None or isinstance(verdict, Failure):  # nothing changed, or unreadable: stock's load says it
        return
    if config.strict:
        raise UnsupportedError(
            f"{verdict}. megatron-ucp does not reshard expert groups at TP or PP > 1 yet: resume at the EP size "
            "of the save, "
            "or set MEGATRON_UCP_STRICT=0 to load as stock DeepSpeed does",
            subject=load_dir,
        )
    warn_once(verdict, "MEGATRON_UCP_STRICT=0: loading as stock DeepSpeed does")


def _change(engine: Any, root: Path, tag: Optional[str]) -> Optional[str]:
    tag = tag or read_tag_file(root / F.LATEST)
    if tag is None or not (root / tag).is_dir():
        return None
    files = sorted((root / tag).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    if not files:
        return None
    saved = load_raw(files[0], random_access=True)  # the pickle only
    counts = saved.get(F.OPTIMIZER_STATE_DICT, {}).get(F.PARTITION_COUNT) if isinstance(saved, dict) else None
    if not isinstance(counts, (list, tuple)):
        return None
    change = expert_layout_change(counts, surface.group_dp_sizes(engine.optimizer))
    return None if change is None else f"{files[0]}: {change}"
