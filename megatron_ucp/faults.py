"""The one seam for fault injection: named points where a test can make a process pause.

Production code calls :func:`pause_point` at a few places where a kill is most instructive (the
background converter after its first parameter, so that a test can SIGKILL it mid-way). It does
nothing unless ``MEGATRON_UCP_TEST_PAUSE`` is set to ``TAG:SECONDS:NODE[,...]``, which only the
tests do (the converter runs in its own process, so an environment variable is the way in).
Each pause happens once per process and point. :func:`die_point` likewise makes one rank exit just
before a collective of a load (``MEGATRON_UCP_TEST_DIE``), so that a test sees what the others do.
"""

from __future__ import annotations

import logging
import os
import time

PAUSE_ENV = "MEGATRON_UCP_TEST_PAUSE"
DIE_ENV = "MEGATRON_UCP_TEST_DIE"
"""``POINT:RANK``: the process of that global rank exits (code 17) at that point (tests only)."""

log = logging.getLogger(__name__)
_done: set[tuple[str, str, int]] = set()


def pause_seconds(tag: str, node: int, env: "os._Environ[str] | dict[str, str] | None" = None) -> float:
    """Seconds to pause for this tag on this node (0: none)."""
    seconds = 0.0
    for entry in (os.environ if env is None else env).get(PAUSE_ENV, "").split(","):
        spec = entry.split(":")
        if len(spec) == 3 and spec[0] == tag and spec[2] == str(node):
            seconds = float(spec[1])
    return seconds


def pause_point(point: str, tag: str, node: int) -> None:
    """Pause here if the tests asked for it (once per process, point, tag and node)."""
    key = (point, tag, node)
    if key in _done:
        return
    seconds = pause_seconds(tag, node)
    _done.add(key)
    if seconds > 0:
        log.warning("fault injection (%s): pausing %.0fs at %s", PAUSE_ENV, seconds, point)
        time.sleep(seconds)


def die_point(point: str) -> None:
    """Exit this process here if the tests asked for it (a rank dying in the middle of a collective)."""
    spec = os.environ.get(DIE_ENV, "")
    if spec and spec == f"{point}:{os.environ.get('RANK', '0')}":
        log.warning("fault injection (%s): rank %s exits at %s", DIE_ENV, os.environ.get("RANK"), point)
        os._exit(17)
