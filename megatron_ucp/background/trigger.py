"""The training side of asynchronous conversion: after a save, queue the tag and make sure this
node has a live converter (:func:`trigger`); at exit, wait for it (:func:`wait_for_converter`).

The converter is a separate process (``python -m megatron_ucp.background.converter``) in its own
session, with the launchers' per-process variables removed from its environment
(:func:`converter_env`), so that it is never taken for a rank of the training job.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp import launchenv
from megatron_ucp.background import queue as B
from megatron_ucp.background.store import (
    POLL_S,
    STALE_AFTER_S,
    ConverterSettings,
    QueueLock,
    advance_locked,
    read_queue,
    read_registrations,
    register,
    twin_path,
    ucp_dir,
    write_queue,
)
from megatron_ucp.background.verdicts import verdict_is_current
from megatron_ucp.convert.universal import COMPLETE, universal_state

log = logging.getLogger(__name__)

_children: dict[tuple[str, int], subprocess.Popen] = {}
"""This process's converters, reaped when they exit (a killed one would stay a zombie)."""

_LAUNCH_ENV_DROP = launchenv.PER_PROCESS


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclass(frozen=True)
class TriggerResult:
    tag: str
    active: Optional[str]
    pending: Optional[str]
    spawned: Optional[int]
    """pid of the converter started by this call, if any."""
    events: tuple[B.Event, ...]
    """Events of this call and, with ``report=True``, every event not reported before."""
    seconds: float


def _reap() -> None:
    for key, proc in list(_children.items()):
        if proc.poll() is not None:
            del _children[key]


def trigger(
    root: Path,
    tag: str,
    node: int,
    nodes: int,
    settings: ConverterSettings,
    report: bool = False,
    lock_timeout: float = 5.0,
    kind: str = B.CONVERT,
) -> TriggerResult:
    """Queue ``tag`` of ``root`` for conversion (``kind`` :data:`~megatron_ucp.background.queue.VERIFY`: for
    verification only, by node 0 alone: ``nodes`` 1) and make sure node ``node``'s converter runs.

    Every node's launcher calls it after the same save (idempotent). Takes the queue lock for a few
    filesystem operations and may start one process; never waits for a conversion.
    """
    t0 = time.perf_counter()
    root = Path(root).resolve()
    now = time.time()
    _reap()
    spawned = None
    with QueueLock(root, timeout=lock_timeout):
        state = before = read_queue(root)
        complete = _done(root, tag, kind)
        state, events = B.request(state, tag, nodes, now, already_complete=complete, kind=kind)
        state, job, more = advance_locked(root, state, settings, now, redo_dead=True)
        events += more
        reg = read_registrations(root).get(node)
        if (state.active is not None or state.pending is not None) and not (reg and reg.alive(settings.stale_after)):
            proc = spawn_converter(root, node, nodes, settings)
            register(root, node, proc.pid, "starting")
            _children[(str(root), node)] = proc
            spawned = proc.pid
        reported: tuple[B.Event, ...] = tuple(events)
        if report:
            reported = state.unreported()
            state = state.mark_reported()
        if state != before:  # the other nodes' identical requests change nothing: no rewrite, no fsync
            write_queue(root, state, events)
    return TriggerResult(
        tag=tag,
        active=state.active.tag if state.active else None,
        pending=state.pending.tag if state.pending else None,
        spawned=spawned,
        events=reported,
        seconds=time.perf_counter() - t0,
    )


def converter_env(settings: ConverterSettings, base: Optional[dict] = None) -> dict[str, str]:
    """The converter's environment: no distributed launcher variables, bounded threads, CPU only."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _LAUNCH_ENV_DROP}
    for key in _THREAD_ENV:
        env[key] = str(settings.threads)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    # The folder holding the megatron_ucp package (a checkout run without installing): never the package
    # folder itself, whose subpackages would then shadow top-level names (its ``deepspeed`` DeepSpeed's).
    package_parent = str(Path(__file__).resolve().parents[2])
    paths = [package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_parent]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def spawn_converter(root: Path, node: int, nodes: int, settings: ConverterSettings) -> subprocess.Popen:
    """Start node ``node``'s converter, detached: its own session (the training job's signals and
    terminal do not reach it), stdin closed, output appended to ``.ucp/runner.node<i>.log``."""
    folder = ucp_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [
        settings.python,
        "-m",
        "megatron_ucp.background.converter",
        "--root",
        str(root),
        "--node",
        str(node),
        "--nodes",
        str(nodes),
        *settings.argv(),
    ]
    with open(folder / f"runner.node{node}.log", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=converter_env(settings),
            cwd=str(root),
            start_new_session=True,
            close_fds=True,
        )
    log.debug("started converter pid %d for node %d of %s", proc.pid, node, root)
    return proc


def wait_for_converter(
    root: Path, node: int, timeout: float, stale_after: float = STALE_AFTER_S, say_every: float = 30.0
) -> bool:
    """Wait (at most ``timeout`` s) until node ``node``'s converter exited. True when it did."""
    root = Path(root).resolve()
    deadline = time.monotonic() + timeout
    said = time.monotonic()
    while True:
        _reap()
        proc = _children.get((str(root), node))
        reg = read_registrations(root).get(node)
        running = (proc is not None and proc.poll() is None) or (reg is not None and reg.alive(stale_after))
        if not running:
            return True
        if time.monotonic() >= deadline:
            return False
        if time.monotonic() - said >= say_every:
            state = read_queue(root)
            log.warning(
                "megatron-ucp: waiting for the background conversion of %s (pending: %s)",
                state.active.tag if state.active else "-",
                state.pending.tag if state.pending else "-",
            )
            said = time.monotonic()
        time.sleep(min(POLL_S, max(0.05, deadline - time.monotonic())))


def _done(root: Path, tag: str, kind: str) -> bool:
    """A conversion: the twin is complete (not stale either); a verification: a verdict on the files as they are."""
    if kind == B.VERIFY:
        return verdict_is_current(root, tag)
    return universal_state(twin_path(root, tag), root / tag) == COMPLETE


def unfinished(root: Path, tags: Sequence[str], kind: str = B.CONVERT) -> list[str]:
    """Those of ``tags`` (queued by this process for ``kind`` jobs) still without a complete twin (a current
    verdict), except the ones skipped for a newer save or removed by retention (nothing is owed for them) and
    the verifications that failed (their event says why)."""
    state = read_queue(root)
    out = []
    job = B.event_job(kind)
    for tag in tags:
        if _done(root, tag, kind):
            continue
        last = state.last_event(tag, job)
        if last is not None and last.kind in (B.EventKind.SKIPPED, B.EventKind.REMOVED):
            continue
        if job is not None and last is not None and last.kind in B.SETTLING:
            continue
        out.append(tag)
    return out
