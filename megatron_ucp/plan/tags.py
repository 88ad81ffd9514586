"""Which tag is newer: by the step number in its name, else by modification time.

One rule for every place that orders checkpoints: the background queue and retention, ``status``'s
rows, and the ``latest_universal`` policy (a conversion of an older tag never moves the pointer
back). Pure.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

__all__ = ["tag_step", "newer", "chronological", "should_update_latest"]

_STEP_RE = re.compile(r"(\d+)(?!.*\d)")


def tag_step(tag: str) -> Optional[int]:
    """The last number in a tag (global_step1200 -> 1200), None when it has none."""
    m = _STEP_RE.search(tag[: -len("_universal")] if tag.endswith("_universal") else tag)
    return int(m.group(1)) if m else None


def iterations_lost(latest: Optional[str], loaded: str, latest_here: bool = True) -> str:
    """What resuming from ``loaded`` instead of ``latest`` loses, in words (``latest`` None: it names no tag;
    ``latest_here`` False: no such tag is here, so its step number says nothing of what was trained)."""
    if latest is None:
        return f"what was saved after {loaded}, if anything"
    if not latest_here:
        return f"what was saved after {loaded}, if anything: {latest} is not here"
    new, old = tag_step(latest), tag_step(loaded)
    return f"{new - old} iterations" if new is not None and old is not None else "the iterations between them"


def newer(a: tuple[str, float], b: tuple[str, float]) -> bool:
    """Is ``a`` = (tag, mtime) newer than ``b``? By step number when both have one, else by mtime."""
    sa, sb = tag_step(a[0]), tag_step(b[0])
    if sa is not None and sb is not None and sa != sb:
        return sa > sb
    return a[1] > b[1]


def chronological(items: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
    """Oldest first; by step number when every tag has one, else by mtime (tag as tie-break)."""
    items = list(items)
    if items and all(tag_step(t) is not None for t, _ in items):
        return sorted(items, key=lambda it: (tag_step(it[0]), it[1], it[0]))
    return sorted(items, key=lambda it: (it[1], it[0]))


def should_update_latest(new: tuple[str, float], current: Optional[tuple[str, float]]) -> bool:
    """Move ``latest_universal`` to ``new`` unless it names a complete folder that is newer."""
    return current is None or not newer(current, new)
