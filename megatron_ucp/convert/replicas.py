"""Compare the copies of replicated parameters that a model-parallel checkpoint holds more than once.

A TP-replicated parameter (layer norms, with biases: row-parallel biases) is stored by every TP rank,
and a tied parameter by two pipeline stages. They should be bit-equal; when they are not (a missed
all-reduce, non-deterministic kernels), stock ``ds_to_universal`` stops on an assertion. The
converter keeps TP rank 0's copy, as stock does, and reports each drifted state with numbers: how
many elements differ and by how much at most, so the user can judge. Reads the copies' bytes
(small parameters) through the plan's items; NumPy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_ucp.convert.writer import RankFileCache, ReadObserver, state_fragments
from megatron_ucp.plan.conversion import ConversionPlan, ParamPlan

_FLOAT_OF_SIZE = {2: np.float16, 4: np.float32, 8: np.float64}


@dataclass(frozen=True)
class ReplicaDrift:
    param: str
    state: str
    copy: int
    """Which copy (1 = the first replica) differs from the one kept."""
    differing: int
    numel: int
    max_abs_diff: float

    def describe(self) -> str:
        return (
            f"{self.param} state {self.state!r}: copy {self.copy} differs from the kept copy (TP rank 0) in "
            f"{self.differing} of {self.numel} elements, max |diff| {self.max_abs_diff:.3g}; kept TP rank 0's"
        )

    def to_record(self) -> dict:
        return {
            "param": self.param,
            "state": self.state,
            "copy": self.copy,
            "differing": self.differing,
            "numel": self.numel,
            "max_abs_diff": self.max_abs_diff,
        }


def _values(
    p: ParamPlan, state: str, items, cache: RankFileCache, on_read: Optional[ReadObserver] = None
) -> np.ndarray:
    ordered = sorted(items, key=lambda i: i.dst_offset)
    parts = state_fragments(p, state, cache, ordered)
    if on_read is not None:
        on_read(p, state, ordered, parts)
    raw = b"".join(bytes(t.bytes_view()) for t in parts)
    itemsize = parts[0].dtype.itemsize if parts else 4
    kind = parts[0].dtype.name if parts else "float32"
    if kind == "bfloat16":  # widen to float32 by its high half
        halves = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return halves.view(np.float32)
    return np.frombuffer(raw, dtype=_FLOAT_OF_SIZE.get(itemsize, np.float32))


def compare_replicas(
    plan: ConversionPlan, cache: RankFileCache, on_read: Optional[ReadObserver] = None
) -> list[ReplicaDrift]:
    """Every replica of every replicated parameter, state by state, against the kept copy; ``on_read`` is
    told each replica's fragments (the kept copy's are the writers' to report)."""
    out = []
    for p in plan.params:
        if not p.replicas:
            continue
        for state in plan.groups[p.group].states:
            kept = _values(p, state, p.items, cache)
            for copy, items in enumerate(p.replicas, start=1):
                other = _values(p, state, items, cache, on_read)
                if other.tobytes() == kept.tobytes():
                    continue
                diff = np.abs(other.astype(np.float64) - kept.astype(np.float64))
                out.append(
                    ReplicaDrift(
                        p.name,
                        state,
                        copy,
                        int(np.count_nonzero(other != kept)),
                        int(kept.size),
                        float(np.nanmax(diff)) if diff.size else 0.0,
                    )
                )
    return out
