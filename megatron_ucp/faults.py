"""The one seam for fault injection: named points where a test can make a process pause, fail or die.

Production code calls these at the places where a fault is most instructive. Each does nothing unless its
environment variable is set, which only the tests do (the ranks and the converter run in their own processes, so
an environment variable is the way in):

* :func:`pause_point` (``MEGATRON_UCP_TEST_PAUSE=TAG:SECONDS:NODE[,...]``): the background converter pauses after
  its first parameter, so that a test can SIGKILL it mid-way. Once per process, point, tag and node.
* :func:`die_point` (``MEGATRON_UCP_TEST_DIE=POINT:RANK``): the process of that global rank exits (code 17) there,
  e.g. just before a collective of a load, so that a test sees what the others do.
* :func:`fault_point` (``MEGATRON_UCP_TEST_FAULT=POINT:RANK:WHAT[,...]``): at every step of a save (its copy, each
  file's write, fsync and rename, the set-aside, each write of the commit, the put-back), the process of that
  global rank (``*``: every rank) raises ``OSError``, ``ValueError`` or ``MemoryError``, exits (``exit``: code
  17, as a crash), is killed (``kill``: SIGKILL, nothing runs after it) or waits (``pause<seconds>``: a slow
  write). ``POINT`` is a shell pattern over the point's name (``write global_step4/*optim_states.pt``); each entry
  fires once per process.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import signal
import time

PAUSE_ENV = "MEGATRON_UCP_TEST_PAUSE"
DIE_ENV = "MEGATRON_UCP_TEST_DIE"
"""``POINT:RANK``: the process of that global rank exits (code 17) at that point (tests only)."""
FAULT_ENV = "MEGATRON_UCP_TEST_FAULT"
"""``POINT:RANK:WHAT[,...]``: the fault :func:`fault_point` injects (tests only)."""
FAULTS = {"OSError": OSError, "ValueError": ValueError, "MemoryError": MemoryError}

log = logging.getLogger(__name__)
_done: set[tuple[str, str, int]] = set()
_fired: set[str] = set()


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


def fault_point(point: str) -> None:
    """Fail here as the tests asked (:data:`FAULT_ENV`), once per process and entry; else nothing."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    rank = os.environ.get("RANK", "0")
    for entry in spec.split(","):
        pattern, _, rest = entry.rpartition(":")
        pattern, _, who = pattern.rpartition(":")
        if entry in _fired or not fnmatch.fnmatchcase(point, pattern) or who not in ("*", rank):
            continue
        _fired.add(entry)
        log.warning("fault injection (%s): rank %s: %s at %s", FAULT_ENV, rank, rest, point)
        if rest == "exit":
            os._exit(17)
        if rest == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if rest.startswith("pause"):
            time.sleep(float(rest[len("pause") :]))
            continue
        kind = FAULTS.get(rest)
        if kind is None:
            raise ValueError(f"{FAULT_ENV}: unknown fault {rest!r} (known: exit, kill, pauseN, {', '.join(FAULTS)})")
        raise kind(f"injected {rest} at {point}")
