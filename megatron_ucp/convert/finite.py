"""NaN and Inf in a save's fp32 masters and optimizer states, found as the fragments are read.

A NaN or Inf that reached a save (a diverged step, a bad node's memory) makes a bad checkpoint even when every
checksum matches: a restart from it trains on NaN. :class:`FiniteCheck` is told each fragment a conversion or
``megatron-ucp verify`` reads anyway (the plan's items: real elements only, never padding, which ZeRO-3 leaves
uninitialized) and counts what is not finite, per parameter, state and rank file. NumPy only (the converter
does not import torch); the shares of a multi-node conversion hand their findings to the one that commits.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from megatron_ucp.plan.conversion import CopyItem, ParamPlan

_FLOATS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


CHUNK = 1 << 20
"""Elements judged at a time: the temporaries stay a few MiB whatever the parameter's size."""


def non_finite_counts(fragment: Any) -> tuple[int, int]:
    """(NaN, Inf) in one fragment of a floating-point state; (0, 0) for any other dtype."""
    name = fragment.dtype.name
    if name == "bfloat16":
        raw = np.frombuffer(fragment.bytes_view(), dtype="<u2")
    elif name in _FLOATS:
        raw = np.frombuffer(fragment.bytes_view(), dtype=_FLOATS[name])
    else:
        return 0, 0
    nan = inf = 0
    for start in range(0, raw.size, CHUNK):
        values = raw[start : start + CHUNK]
        if name == "bfloat16":  # the high half of a float32
            values = (values.astype(np.uint32) << 16).view(np.float32)
        finite = np.isfinite(values)
        if finite.all():
            continue
        bad = int(np.count_nonzero(np.isnan(values)))
        nan += bad
        inf += int(values.size - np.count_nonzero(finite)) - bad
    return nan, inf


class FiniteCheck:
    """Counts of non-finite elements per (rank file, parameter, state), from what the readers were told."""

    def __init__(self, paths: Sequence[Any]):
        self.paths = list(paths)
        self.elements = 0
        self._bad: dict[tuple[int, str, str], list[int]] = {}
        self._lock = threading.Lock()

    def add(self, p: ParamPlan, state: str, items: Sequence[CopyItem], fragments: Sequence[Any]) -> None:
        found = [(item.rank, non_finite_counts(fragment)) for item, fragment in zip(items, fragments)]
        with self._lock:
            self.elements += sum(item.length for item in items)
            for rank, (nan, inf) in found:
                if nan or inf:
                    counts = self._bad.setdefault((rank, p.name, state), [0, 0])
                    counts[0] += nan
                    counts[1] += inf

    def problems(self) -> list[str]:
        """One line per rank file, parameter and state holding a NaN or Inf, naming all three."""
        return [
            f"{self.paths[rank]}: {nan} NaN and {inf} Inf in {state!r} of parameter {name!r}"
            for (rank, name, state), (nan, inf) in sorted(self._bad.items())
        ]

    def to_record(self) -> list[list]:
        """For a share's record (JSON)."""
        return [[rank, name, state, nan, inf] for (rank, name, state), (nan, inf) in sorted(self._bad.items())]

    def merge(self, records: Iterable[Optional[list]]) -> "FiniteCheck":
        """Another share's findings (:meth:`to_record`) added to these."""
        for record in records:
            for rank, name, state, nan, inf in record or []:
                counts = self._bad.setdefault((int(rank), str(name), str(state)), [0, 0])
                counts[0] += int(nan)
                counts[1] += int(inf)
        return self
