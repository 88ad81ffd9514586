"""Which pipeline stage holds which layer of a DeepSpeed ``PipelineModule`` (pure).

``GPTModelPipe`` partitions its layer list with ``partition_method="type:transformer"``: every
``ParallelTransformerLayerPipe`` weighs 1, everything else (the bf16 cast, the embedding, the final
norm, the head) 0, and the stages are the contiguous split that minimises the spread between the
heaviest and the lightest stage (the linear partition problem, solved by dynamic programming).
Where several splits tie, DeepSpeed 0.16-0.19 keep the one whose last cut is furthest right; so
does :func:`balanced_cuts` (the system tests hold it to ``deepspeed.runtime.utils.partition_balanced``
for every layer count and stage count a llama model takes). A stage's layers decide its file names
(``layer_XX-model_YY-model_states.pt``) and its parameters' names, so the synthetic writer needs
exactly DeepSpeed's split, not merely a balanced one.
"""

from __future__ import annotations

import math
from typing import Sequence

from megatron_ucp.errors import PlanError


def uniform_cuts(items: int, parts: int) -> list[int]:
    """Cut points for ``items`` equal-weight items in ``parts`` (the first parts take the remainder)."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    size, extra = divmod(items, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def balanced_cuts(weights: Sequence[int], parts: int) -> list[int]:
    """Cut points ``[0, c1, ..., len(weights)]``: stage ``s`` holds items ``cuts[s]:cuts[s + 1]``.

    Minimises (heaviest stage - lightest stage) over contiguous splits into non-empty stages; ties
    go to the split found with the larger last cut, scanning cuts from left to right.
    """
    if parts < 1:
        raise PlanError(f"a pipeline needs at least one stage, got {parts}")
    n = len(weights)
    if n <= parts:
        return uniform_cuts(n, parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    # [j][i]: the best split of the first i items into j stages: its cost, heaviest and lightest stage, last cut
    heaviest = [[inf] * (n + 1) for _ in range(parts + 1)]
    lightest = [[inf] * (n + 1) for _ in range(parts + 1)]
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    heaviest[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                segment = prefix[i] - prefix[k]
                top, bottom = max(heaviest[j - 1][k], segment), min(lightest[j - 1][k], segment)
                if cost[j][i] >= top - bottom:  # '>=': among equal costs the last k scanned wins
                    cost[j][i], heaviest[j][i], lightest[j][i], cut[j][i] = top - bottom, top, bottom, k
    cuts = [n]
    for j in range(parts, 0, -1):
        cuts.append(cut[j][cuts[-1]])
    return cuts[::-1]
