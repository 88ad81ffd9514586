"""What a mixture-of-experts save says about its experts, from its file names and partition counts. Pure.

DeepSpeed-MoE saves each expert's weights as ``layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt`` (``e``
the global expert index, written by expert-data-parallel rank 0; ``l`` counts MoE layers only) and
partitions the expert param groups over the expert-data-parallel group (``partition_count`` DP / EP in
every rank file) instead of the DP group; the model states record the experts per MoE layer
(``num_experts``). Those facts name a checkpoint for what it is, with its EP, and find what is wrong with
one before anything is copied: a missing expert file, an expert count the files and the model disagree on,
an EP that does not divide the experts, expert-DP partitions that do not add up to DP. (What converts
expert groups starts from here: docs/EXTENDING.md, "An expert-parallel axis".)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.reshard import DENSE, Placement

EXPERT_FILE_RE = re.compile(r"^layer_(?P<layer>\d+)_expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")


@dataclass(frozen=True)
class ExpertFacts:
    files: frozenset[tuple[int, int, int]]
    """(MoE layer, global expert, model-parallel rank) of every expert file."""
    model_parallel: int
    dp: int
    partition_counts: tuple[int, ...]
    """The first rank file's ``partition_count`` per param group."""
    model_experts: Optional[int] = None
    """Experts per MoE layer as the model states record them (``num_experts``), when they do."""

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _, _ in self.files}))

    @property
    def experts(self) -> int:
        """Experts per MoE layer: the model's record, else the highest file index + 1."""
        if self.model_experts is not None:
            return self.model_experts
        return 1 + max((expert for _, expert, _ in self.files), default=-1)

    @property
    def expert_groups(self) -> tuple[int, ...]:
        """Param groups partitioned over a group other than DP."""
        return tuple(g for g, count in enumerate(self.partition_counts) if count != self.dp)

    @property
    def expert_dp(self) -> Optional[int]:
        """The expert groups' partition count (the expert-data-parallel size), when they share one."""
        counts = {self.partition_counts[g] for g in self.expert_groups}
        return counts.pop() if len(counts) == 1 else None

    @property
    def ep(self) -> Optional[int]:
        """The expert-parallel size DP / expert-DP, when it divides (1 when no group is partitioned apart: the
        experts are partitioned over DP with the dense groups)."""
        if not self.expert_groups:
            return 1
        if not self.expert_dp or self.dp % self.expert_dp:
            return None
        return self.dp // self.expert_dp

    def problems(self) -> list[tuple[str, str]]:
        """``(file name or '', what is wrong)`` for a save whose experts do not add up; empty when they do."""
        counts = sorted({self.partition_counts[g] for g in self.expert_groups})
        if len(counts) > 1:
            return [("", f"expert param groups partitioned over different sizes {counts} at DP={self.dp}")]
        if self.expert_groups and self.ep is None:
            return [
                (
                    "",
                    f"expert param groups partitioned over {counts[0]} ranks, which does not divide DP={self.dp}: "
                    "the expert-data-parallel partitions do not add up",
                )
            ]
        found: list[tuple[str, str]] = []
        highest = max((expert for _, expert, _ in self.files), default=-1)
        if self.model_experts is not None and highest >= self.model_experts:
            found.append(
                (
                    f"layer_*_expert_{highest}_mp_rank_*_model_states.pt",
                    f"the files hold expert {highest} but the model records {self.model_experts} experts per MoE layer",
                )
            )
        layout = ParallelLayout(tp=self.model_parallel, dp=self.dp, ep=self.ep or 1)  # only the mp numbering counts
        try:
            layout.local_experts(self.experts)
        except PlanError as exc:
            found.append(("", str(exc)))
        for layer in self.layers:
            for expert in range(self.experts):
                for mp in range(self.model_parallel):
                    if (layer, expert, mp) not in self.files:
                        name = layout.expert_file(layer, expert, mp)
                        found.append((name, f"{name} is missing (expert {expert} of MoE layer {layer})"))
        return found

    def describe(self) -> str:
        files = (
            f"{self.experts} experts in each of {len(self.layers)} MoE layer(s)" if self.layers else "no expert files"
        )
        if not self.expert_groups:
            return f"mixture of experts ({files}; partitioned over DP={self.dp} with the dense groups: EP=1)"
        groups = ", ".join(map(str, self.expert_groups))
        where = (
            f"partitioned over expert-data-parallel size {self.expert_dp}" if self.expert_dp else "partitioned apart"
        )
        ep = f"EP={self.ep}" if self.ep else "EP unknown"
        return f"mixture of experts ({files}; param group(s) {groups} {where} at DP={self.dp}: {ep})"


def expert_facts(
    names: Iterable[str],
    partition_counts: Sequence[int],
    dp: int,
    model_parallel: int = 1,
    model_experts: Optional[Sequence[int] | int] = None,
) -> Optional[ExpertFacts]:
    """The experts of a stage-1/2 tag folder, or None when it has neither expert files nor expert groups.

    ``model_experts``: the model states' ``num_experts`` (a count per MoE layer, or one count)."""
    files = frozenset(
        (int(m.group("layer")), int(m.group("expert")), int(m.group("mp")))
        for m in (EXPERT_FILE_RE.match(n) for n in names)
        if m
    )
    counts = tuple(int(c) for c in partition_counts)
    if not files and all(c == dp for c in counts):
        return None
    recorded = recorded_experts(model_experts)
    return ExpertFacts(
        files=files,
        model_parallel=model_parallel,
        dp=dp,
        partition_counts=counts,
        model_experts=recorded,
    )


def recorded_experts(num_experts: object) -> Optional[int]:
    """Experts per MoE layer from the model states' ``num_experts`` (a count per MoE layer, or one count)."""
    counts = num_experts if isinstance(num_experts, (list, tuple)) else [num_experts]
    counts = [int(n) for n in counts if isinstance(n, int)]
    return max(counts) if counts else None


def recorded_expert_parallel(states: object) -> Optional[int]:
    """The EP a model-states dict of an MoE save records (Megatron's ``args.moe_expert_parallel_size``, where
    ``num_experts`` says it is one); None for any other save or when it records none."""
    if not isinstance(states, Mapping) or recorded_experts(states.get("num_experts")) is None:
        return None
    ep = getattr(states.get("args"), "moe_expert_parallel_size", None)
    return ep if isinstance(ep, int) and ep > 0 else None


def expert_layout_change(saved_counts: Sequence[int], live_counts: Sequence[int]) -> Optional[str]:
    """What changed when a job resumes a save at the same DP with its expert groups partitioned otherwise (an EP
    change), or None. At the same DP stock DeepSpeed loads each rank's own saved partition into whatever experts
    the rank now holds: silently another expert's masters and states. (A DP change it refuses by itself.)"""
    saved, live = [int(c) for c in saved_counts], [int(c) for c in live_counts]
    if len(saved) != len(live) or saved == live or not saved:
        return None
    dp = max(saved)
    if max(live) != dp:
        return None  # a DP change: stock DeepSpeed refuses it loudly
    changed = [g for g, (s, c) in enumerate(zip(saved, live)) if s != c]
    was, now = saved[changed[0]], live[changed[0]]
    return (
        f"the expert param groups ({', '.join(map(str, changed))}) were saved partitioned over {was} ranks "
        f"(EP={dp // was} at DP={dp}) and this job partitions them over {now} (EP={dp // now}): stock DeepSpeed "
        "would load each rank's saved partition of other experts into the experts it holds now, silently"
    )


EXPERT_NAME_RE = re.compile(r"(\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\.)")
"""A DeepSpeed-MoE expert's index inside a parameter name (local in the optimizer, global in the expert files)."""


def global_expert_name(name: str, expert_parallel_rank: int, local_experts: int) -> str:
    """The name a rank's optimizer uses for its local expert ``k``, with the global index ``r * E/EP + k``
    the expert files use (DeepSpeed's ``_save_moe_checkpoint`` renames the same way)."""
    match = EXPERT_NAME_RE.search(name)
    if match is None:
        raise PlanError(f"{name}: not an expert parameter (no '.deepspeed_moe.experts.deepspeed_experts.<k>.')")
    local = int(match.group(2))
    if not 0 <= local < local_experts:
        raise PlanError(f"{name}: local expert {local} but a rank holds {local_experts}")
    return f"{name[: match.start(2)]}{expert_parallel_rank * local_experts + local}{name[match.end(2) :]}"


def expert_group_files(layout: ParallelLayout) -> dict[int, list[int]]:
    """Per expert-parallel rank, the DP ranks whose rank files hold its expert groups' partitions, in partition
    order (DP rank ``d`` holds partition ``d // EP`` of expert-parallel rank ``d % EP``'s groups)."""
    files: dict[int, list[int]] = {r: [] for r in range(layout.ep)}
    for d in sorted(range(layout.dp), key=layout.expert_data_parallel_rank):
        files[layout.expert_parallel_rank(d)].append(d)
    return files


def global_expert_names(names: Iterable[str], expert_parallel_rank: int) -> dict[str, str]:
    """Local -> global name of every expert parameter among one rank's ``names`` (the others are left out),
    the rank holding expert-parallel rank ``expert_parallel_rank``'s experts. Its local experts per MoE layer
    are counted from the names themselves (``0 .. E/EP - 1`` under each layer's prefix): what a live model
    holds, whatever EP the checkpoint was saved at."""
    names = list(names)
    held: dict[str, set[int]] = {}
    for name in names:
        match = EXPERT_NAME_RE.search(name)
        if match:
            held.setdefault(name[: match.start(2)], set()).add(int(match.group(2)))
    for prefix, local in held.items():
        if local != set(range(len(local))):
            raise PlanError(f"{prefix}<k>: this rank holds local experts {sorted(local)}, not 0..{len(local) - 1}")
    out = {}
    for name in names:
        match = EXPERT_NAME_RE.search(name)
        if match:
            out[name] = global_expert_name(name, expert_parallel_rank, len(held[name[: match.start(2)]]))
    return out


def saved_placement(counts: Sequence[int], dp: int) -> Placement:
    """Which groups a save partitioned over fewer ranks than DP (its experts, over expert-DP), from one rank file's
    ``partition_count`` per group. A file none of whose groups is over DP is taken as dense: the per-file checks name
    it (a rank file of another save). Raises :class:`PlanError` when the expert groups make no one EP size."""
    experts = expert_facts((), counts, dp)
    if experts is None or len(experts.expert_groups) == len(counts):
        return DENSE
    if experts.ep is None:  # expert groups over different sizes, or over one that does not divide DP
        raise PlanError(experts.problems()[0][1])
    return Placement.of(experts.ep, experts.expert_groups)
