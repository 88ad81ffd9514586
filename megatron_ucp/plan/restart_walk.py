"""What a restart's fallback does with the candidates it walks, predicted from what is known before any load. Pure.

The restart (``integration/resume/fallback.py``) walks the tag ``latest`` names, then the older tags, newest first.
A tag whose damage is known before a load (a recorded verdict on its files as they are, its save's file list, a
missing folder, a missing universal twin under ``--universal-checkpoint``) is skipped without a load; any other is
loaded, and its load decides. A load refused for the tag's own damage makes that its verdict and does not count;
one refused for what may be the job's fault (a changed optimizer or model) counts, and after :data:`MAX_LOADS` of
those the restart gives up: each try at 768 ranks costs a full load. ``status --check`` walks the same candidates
with :func:`walk` and says the outcome; the restart holds to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MAX_LOADS = 3
"""Loads refused for what may be the job's fault before a restart gives up: such a problem (a changed optimizer)
fails every tag alike."""


@dataclass(frozen=True)
class Candidate:
    """One tag as the walk meets it, from what is known without reading its weights."""

    tag: str
    problems: tuple[str, ...] = ()
    """Its damage, known before a load: the walk skips it."""
    sound: bool = False
    """Read whole and found sound, its files unchanged since: its load passes (unless the job differs)."""
    refused: Optional[str] = None
    """The last restart, which resumed from no tag, had its load refuse these very files for what may be the job's
    fault: the same job refuses them again (a load counted against the cap)."""


@dataclass(frozen=True)
class Walk:
    """The walk's outcome. ``tries``: the tags a restart loads in turn, each taken when its files are sound (every one
    but the last not read yet); ``certain``: the last of them was found sound, so the restart resumes from one of
    ``tries`` (it cannot fail for the tags' files); with no ``tries``, it resumes from none."""

    tries: tuple[str, ...]
    certain: bool
    skipped: tuple[str, ...]
    """``tag: why`` of each tag passed over before the first of ``tries`` (or all of them)."""
    capped: bool = False
    """The walk stopped at the load cap (:data:`MAX_LOADS` refusals the job may be at fault for)."""

    @property
    def tag(self) -> Optional[str]:
        """The tag the restart loads first; None when it loads none."""
        return self.tries[0] if self.tries else None


def walk(candidates: Sequence[Candidate], max_loads: int = MAX_LOADS) -> Walk:
    """The restart's walk over ``candidates`` (in its order), as far as it can be known without a load."""
    skipped: list[str] = []
    tries: list[str] = []
    loads = 0
    for c in candidates:
        if c.problems:
            if not tries:
                more = f" (+{len(c.problems) - 1} more)" if c.problems[1:] else ""
                skipped.append(f"{c.tag}: {one_line(c.problems[0])}{more}")
            continue
        if loads == max_loads:
            if not tries:
                skipped.append(f"{c.tag}: not tried: {max_loads} loads were refused before it")
            return Walk(tuple(tries), False, tuple(skipped), capped=True)
        if c.refused is not None:
            loads += 1
            if not tries:
                skipped.append(f"{c.tag}: the last restart's load refused it: {one_line(c.refused)}")
            continue
        tries.append(c.tag)
        if c.sound:
            return Walk(tuple(tries), True, tuple(skipped))
        # not read yet: its load decides; refused for its own damage, it does not count, and the walk goes on
    return Walk(tuple(tries), False, tuple(skipped))


def one_line(problem: str, limit: int = 400) -> str:
    """A problem on one line (a load's refusal spans several), cut at ``limit`` characters."""
    text = " ".join(problem.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
