"""What a mixture-of-experts save says about its experts, from its file names and partition counts. Pure.

DeepSpeed-MoE saves each expert's weights as ``layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt`` (``e``
the global expert index, written by expert-data-parallel rank 0) and partitions the expert param groups
over the expert-data-parallel group (``partition_count`` DP / EP in every rank file) instead of the DP
group. Reading those facts is what lets a refusal name the checkpoint for what it is (and what a
converter of expert groups starts from: docs/EXTENDING.md, "An expert-parallel axis").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

EXPERT_FILE_RE = re.compile(r"^layer_(?P<layer>\d+)_expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")


@dataclass(frozen=True)
class ExpertFacts:
    layers: tuple[int, ...]
    """The MoE layers' indices (DeepSpeed counts MoE layers only)."""
    experts: int
    """Experts per MoE layer (global count: the expert files' indices)."""
    dp: int
    expert_groups: tuple[int, ...]
    """Param groups partitioned over a group other than DP."""
    expert_dp: Optional[int]
    """Their partition count (the expert-data-parallel size), when one."""

    @property
    def ep(self) -> Optional[int]:
        """The expert-parallel size DP / expert-DP, when it divides."""
        if not self.expert_dp or self.dp % self.expert_dp:
            return None
        return self.dp // self.expert_dp

    def describe(self) -> str:
        files = (
            f"{self.experts} experts in each of {len(self.layers)} MoE layer(s)" if self.layers else "no expert files"
        )
        groups = ", ".join(map(str, self.expert_groups))
        where = (
            f"partitioned over expert-data-parallel size {self.expert_dp}" if self.expert_dp else "partitioned apart"
        )
        ep = f"EP={self.ep}" if self.ep else "EP unknown"
        return f"mixture of experts ({files}; param group(s) {groups} {where} at DP={self.dp}: {ep})"


def expert_facts(names: Iterable[str], partition_counts: Sequence[int], dp: int) -> Optional[ExpertFacts]:
    """The experts of a stage-1/2 tag folder, or None when it has neither expert files nor expert groups."""
    found = [m for m in (EXPERT_FILE_RE.match(n) for n in names) if m]
    groups = tuple(g for g, count in enumerate(partition_counts) if int(count) != dp)
    if not found and not groups:
        return None
    layers = sorted({int(m.group("layer")) for m in found})
    experts = len({int(m.group("expert")) for m in found})
    counts = {int(partition_counts[g]) for g in groups}
    return ExpertFacts(
        layers=tuple(layers),
        experts=experts,
        dp=dp,
        expert_groups=groups,
        expert_dp=counts.pop() if len(counts) == 1 else None,
    )
