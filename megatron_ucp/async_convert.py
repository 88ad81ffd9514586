"""Background conversion after every save: the queue on the checkpoint filesystem and the converter process.

Everything lives under ``<root>/.ucp/`` and is coordinated through the shared checkpoint
filesystem only (no network service)::

    queue.json                 active job, pending job, recent events (QueueState; rewritten by rename)
    queue.lock                 exclusive lock (O_CREAT|O_EXCL), held for milliseconds
    events.log                 one line per event (complete, failed, skipped, interrupted, removed, ...)
    runners/node<i>.json       node i's converter: host, pid, phase, attempt; mtime = heartbeat
    runner.node<i>.log         the converter process's own output (also crashes before logging starts)
    convert-<tag>.log          log of one conversion (convert-<tag>.node<i>.log when split over nodes)
    progress/<tag>.node<i>.json  bytes done / expected of node i's share, for ``megatron-ucp status``

Call order. After ``save_checkpoint`` returned on every rank, each node's launcher calls
:func:`trigger`: under the lock it requests the tag (:func:`megatron_ucp.background.request`),
activates it when nothing runs, and starts the node's converter if none is alive: a detached
``python -m megatron_ucp.async_convert`` (new session, low CPU and I/O priority, bounded threads).
The converter (:func:`run_converter`) loops: under the lock, settle the active job and take the
next (:func:`megatron_ucp.background.advance`); convert its node's share with
:func:`megatron_ucp.convert.convert` (staging sibling, last share commits); the committer
verifies the folder (read-back of every file), moves ``latest_universal`` and applies
``keep_last``; wait until the job settled on every node; repeat until nothing is pending, then
exit. Decisions are the pure functions of :mod:`megatron_ucp.background`; this module only
gathers facts and executes them.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from . import background as B
from . import dsformat as F
from .errors import OutputExistsError, UcpError
from .universal import (COMPLETE, ConversionInProgress, _pid_alive, inspect_staging, latest_universal_target,
                        universal_state, write_latest_universal)

log = logging.getLogger("megatron_ucp.async_convert")  # not __name__: "__main__" in the converter process

UCP_DIR = ".ucp"
QUEUE_FILE = "queue.json"
LOCK_FILE = "queue.lock"
EVENTS_LOG = "events.log"
RUNNERS_DIR = "runners"
PROGRESS_DIR = "progress"
LOCK_STALE_S = 30.0
"""A lock file older than this (or held by a dead local process) is broken: holds last milliseconds."""
STALE_AFTER_S = 60.0
"""A converter heartbeat older than this is dead."""
HEARTBEAT_S = 5.0
POLL_S = 1.0
PROGRESS_EVERY_S = 2.0
NICE_INCREMENT = 10
FAULT_PAUSE_ENV = "MEGATRON_UCP_TEST_PAUSE"
"""Fault injection for tests: ``<tag>:<seconds>:<node>[,...]`` makes that node's converter of that tag
sleep after its first parameter (so a test can kill it mid-way, or order events, deterministically)."""
_LAUNCH_ENV_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
                    "PALS_RANKID", "PALS_LOCAL_RANKID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def ucp_dir(root: Path) -> Path:
    return Path(root) / UCP_DIR


# ================================================================================================
# settings passed from the training process to the converter process
# ================================================================================================

@dataclass(frozen=True)
class ConverterSettings:
    workers: int = 1
    threads: int = 1
    keep_last: Optional[int] = None
    stale_after: float = STALE_AFTER_S
    nice: int = NICE_INCREMENT
    job_id: str = "local"
    python: str = field(default_factory=lambda: sys.executable)

    def argv(self) -> list[str]:
        out = ["--workers", str(self.workers), "--threads", str(self.threads), "--stale-after",
               str(self.stale_after), "--nice", str(self.nice), "--job-id", self.job_id]
        if self.keep_last is not None:
            out += ["--keep-last", str(self.keep_last)]
        return out

    @staticmethod
    def job_id_from_env(env: Optional[dict] = None) -> str:
        env = os.environ if env is None else env
        for key in ("PBS_JOBID", "SLURM_JOB_ID", "LSB_JOBID", "FLUX_JOB_ID", "TORCHELASTIC_RUN_ID"):
            if env.get(key):
                return str(env[key])
        return f"{socket.gethostname()}-{os.getpid()}"


# ================================================================================================
# the lock and the queue file
# ================================================================================================

class LockBusy(UcpError):
    """The queue lock could not be taken in time."""


class QueueLock:
    """Exclusive lock on a root's queue: ``O_CREAT|O_EXCL`` on the shared filesystem (works across
    nodes on NFS and Lustre, where ``flock`` may not). A holder that died is detected (same host:
    its pid is gone; any host: the file is older than :data:`LOCK_STALE_S`) and the lock broken."""

    def __init__(self, root: Path, timeout: float = 10.0):
        self.path = ucp_dir(root) / LOCK_FILE
        self.timeout = timeout
        self._held = False

    def __enter__(self) -> "QueueLock":
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = f"{socket.gethostname()} {os.getpid()} {time.time():.3f}\n".encode()
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._maybe_break()
            else:
                os.write(fd, me)
                os.close(fd)
                self._held = True
                return self
            if time.monotonic() > deadline:
                raise LockBusy(f"{self.path}: held by another process for more than {self.timeout:.0f}s",
                               subject=self.path)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _maybe_break(self) -> None:
        try:
            st = self.path.stat()
            holder = self.path.read_text().split()
        except (OSError, ValueError):
            return
        age = time.time() - st.st_mtime
        dead = len(holder) >= 2 and holder[0] == socket.gethostname() and holder[1].isdigit() \
            and not _pid_alive(int(holder[1]))
        if dead or age > LOCK_STALE_S:
            broken = self.path.with_name(f"{LOCK_FILE}.broken-{os.getpid()}-{time.time_ns()}")
            try:
                os.rename(self.path, broken)
                broken.unlink()
                log.warning("%s: broke a stale lock (holder %s, %.0fs old)", self.path, " ".join(holder[:2]), age)
            except OSError:
                pass

    def __exit__(self, *exc: Any) -> None:
        if self._held:
            self._held = False
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def read_queue(root: Path) -> B.QueueState:
    """The queue as last written (rename makes reads consistent without the lock)."""
    try:
        return B.QueueState.from_json(json.loads((ucp_dir(root) / QUEUE_FILE).read_text()))
    except FileNotFoundError:
        return B.QueueState()
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); starting an empty queue", ucp_dir(root) / QUEUE_FILE, exc)
        return B.QueueState()


def _write_queue(root: Path, state: B.QueueState, events: Sequence[B.Event]) -> None:
    """Replace the queue file by rename. Not fsynced (that costs a save tens of milliseconds on a
    busy disk): the queue is advisory, the manifests are the truth, and an unreadable queue after
    a crash reads as an empty one."""
    _quick_json(ucp_dir(root) / QUEUE_FILE, state.to_json())
    if events:
        with open(ucp_dir(root) / EVENTS_LOG, "a") as fh:
            for e in events:
                fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(e.time))} {e.line()}\n")


def _quick_json(path: Path, data: dict) -> None:
    """Replace a small state file by rename, without fsync (queue, progress, registrations)."""
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# ================================================================================================
# converter registrations (one per node) and facts about a job
# ================================================================================================

@dataclass(frozen=True)
class Registration:
    node: int
    host: str
    pid: int
    phase: str
    """``starting`` (spawned), ``converting`` / ``waiting`` (on ``attempt``), ``idle``."""
    attempt: Optional[str]
    age: float
    """Seconds since the last heartbeat."""
    since: float = 0.0
    """When it entered ``phase``."""

    def alive(self, stale_after: float = STALE_AFTER_S) -> bool:
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return False
        return self.age < stale_after


def _registration_path(root: Path, node: int) -> Path:
    return ucp_dir(root) / RUNNERS_DIR / f"node{node}.json"


def read_registrations(root: Path) -> dict[int, Registration]:
    out = {}
    folder = ucp_dir(root) / RUNNERS_DIR
    now = time.time()
    for path in folder.glob("node*.json") if folder.is_dir() else ():
        try:
            data = json.loads(path.read_text())
            age = now - path.stat().st_mtime
            node = int(data["node"])
            out[node] = Registration(node, str(data["host"]), int(data["pid"]), str(data.get("phase", "")),
                                     data.get("attempt"), age, float(data.get("since", 0.0)))
        except (OSError, ValueError, KeyError):
            continue
    return out


def _register(root: Path, node: int, pid: int, phase: str, attempt: Optional[str] = None) -> None:
    path = _registration_path(root, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    _quick_json(path, {"node": node, "host": socket.gethostname(), "pid": pid, "phase": phase, "attempt": attempt,
                       "since": time.time()})


def _unregister(root: Path, node: int, pid: int) -> None:
    reg = read_registrations(root).get(node)
    if reg is not None and reg.pid == pid and reg.host == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            _registration_path(root, node).unlink()


def twin_path(root: Path, tag: str) -> Path:
    return Path(root) / F.universal_tag(tag)


def job_facts(root: Path, job: B.Job, regs: dict[int, Registration], stale_after: float) -> B.JobFacts:
    """Converters count as alive for the job while ``starting`` (about to join whatever is active)
    or ``converting`` it; a converter ``waiting`` for the others does not keep a job alive."""
    output = twin_path(root, job.tag)
    info = inspect_staging(output)
    runners = any(r.alive(stale_after)
                  and (r.phase == "starting" or (r.phase == "converting" and r.attempt == job.attempt))
                  for r in regs.values())
    joined = [r for r in regs.values()
              if r.attempt == job.attempt or (r.phase == "starting" and r.since >= (job.activated or 0.0))]
    return B.JobFacts(universal_complete=universal_state(output, root / job.tag) == COMPLETE,
                      staging_live=info is not None and info.is_live(stale_after), runners_live=runners,
                      shares_failed=info.failed if info is not None and info.attempt_id == job.attempt else (),
                      runners_gone=bool(joined) and not any(r.alive(stale_after) for r in joined))


def staging_dead(output: Path, stale_after: float, now: Optional[float] = None) -> bool:
    """A staging folder nobody works on: no live heartbeat, and (when no heartbeat file is left at
    all, e.g. between shares) nothing in it touched for ``stale_after`` seconds."""
    info = inspect_staging(output)
    if info is None or info.is_live(stale_after):
        return False
    hb = info.path / "heartbeats"
    if hb.is_dir() and any(hb.iterdir()):
        return True  # heartbeats exist and none is alive: their processes are gone or silent
    now = time.time() if now is None else now
    newest = 0.0
    for p in (info.path, info.path / "shares", info.path / "attempt.json", hb):
        with contextlib.suppress(OSError):
            newest = max(newest, p.stat().st_mtime)
    return now - newest > stale_after


def _clean_dead_staging(root: Path, state: B.QueueState, stale_after: float, now: float
                        ) -> tuple[B.QueueState, list[B.Event]]:
    """Remove staging folders whose converters are gone: they never look finished, but they use disk."""
    events = []
    for path in sorted(Path(root).glob(f".*{F.UNIVERSAL_SUFFIX}{F.STAGING_SUFFIX}")):
        output = path.parent / path.name[1:-len(F.STAGING_SUFFIX)]
        if not staging_dead(output, stale_after, now):
            continue
        trash = path.with_name(f"{path.name}.trash-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(path, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        tag = output.name[:-len(F.UNIVERSAL_SUFFIX)]
        state, event = state.add(tag, B.EventKind.CLEANED, f"removed the dead staging folder {path.name}", now)
        events.append(event)
    return state, events


def _advance_locked(root: Path, state: B.QueueState, settings: ConverterSettings, now: float,
                    redo_dead: bool) -> tuple[B.QueueState, Optional[B.Job], list[B.Event]]:
    """Judge the active job, settle it, activate the next; on activation clear dead staging first."""
    outcome = None
    if state.active is not None:
        outcome = B.judge(state, state.active, job_facts(root, state.active, read_registrations(root),
                                                         settings.stale_after), now)
    before = state.active.attempt if state.active is not None else None
    state, job, events = B.advance(state, outcome, now, lambda j: B.attempt_id(j.tag, settings.job_id, j.tries, now),
                                   redo_dead=redo_dead)
    if job is not None and job.attempt != before:
        state, cleaned = _clean_dead_staging(root, state, settings.stale_after, now)
        events += cleaned
        log.info("activated conversion of %s (attempt %s, %d share(s))", job.tag, job.attempt, job.share_count)
    return state, job, events


# ================================================================================================
# the trigger (training side)
# ================================================================================================

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


_children: dict[tuple[str, int], subprocess.Popen] = {}
"""Converters this process started (reaped at the next trigger, waited for at exit)."""


def _reap() -> None:
    for key, proc in list(_children.items()):
        if proc.poll() is not None:
            del _children[key]


def trigger(root: Path, tag: str, node: int, nodes: int, settings: ConverterSettings, report: bool = False,
            lock_timeout: float = 5.0) -> TriggerResult:
    """Queue ``tag`` of ``root`` for conversion and make sure node ``node``'s converter runs.

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
        complete = universal_state(twin_path(root, tag), root / tag) == COMPLETE  # not stale either
        state, events = B.request(state, tag, nodes, now, already_complete=complete)
        state, job, more = _advance_locked(root, state, settings, now, redo_dead=True)
        events += more
        reg = read_registrations(root).get(node)
        if (state.active is not None or state.pending is not None) and not (reg and reg.alive(settings.stale_after)):
            proc = spawn_converter(root, node, nodes, settings)
            _register(root, node, proc.pid, "starting")
            _children[(str(root), node)] = proc
            spawned = proc.pid
        reported: tuple[B.Event, ...] = tuple(events)
        if report:
            reported = state.unreported()
            state = state.mark_reported()
        if state != before:  # the other nodes' identical requests change nothing: no rewrite, no fsync
            _write_queue(root, state, events)
    return TriggerResult(tag=tag, active=state.active.tag if state.active else None,
                         pending=state.pending.tag if state.pending else None, spawned=spawned,
                         events=reported, seconds=time.perf_counter() - t0)


def converter_env(settings: ConverterSettings, base: Optional[dict] = None) -> dict[str, str]:
    """The converter's environment: no distributed launcher variables, bounded threads, CPU only."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _LAUNCH_ENV_DROP}
    for key in _THREAD_ENV:
        env[key] = str(settings.threads)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    package_parent = str(Path(__file__).resolve().parents[1])
    paths = [package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_parent]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def spawn_converter(root: Path, node: int, nodes: int, settings: ConverterSettings) -> subprocess.Popen:
    """Start node ``node``'s converter, detached: its own session (the training job's signals and
    terminal do not reach it), stdin closed, output appended to ``.ucp/runner.node<i>.log``."""
    folder = ucp_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [settings.python, "-m", "megatron_ucp.async_convert", "--root", str(root), "--node", str(node),
            "--nodes", str(nodes), *settings.argv()]
    with open(folder / f"runner.node{node}.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=converter_env(settings), cwd=str(root), start_new_session=True, close_fds=True)
    log.debug("started converter pid %d for node %d of %s", proc.pid, node, root)
    return proc


def wait_for_converter(root: Path, node: int, timeout: float, stale_after: float = STALE_AFTER_S,
                       say_every: float = 30.0) -> bool:
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
            log.warning("megatron-ucp: waiting for the background conversion of %s (pending: %s)",
                        state.active.tag if state.active else "-", state.pending.tag if state.pending else "-")
            said = time.monotonic()
        time.sleep(min(POLL_S, max(0.05, deadline - time.monotonic())))


def unfinished(root: Path, tags: Sequence[str]) -> list[str]:
    """Those of ``tags`` (queued by this process) still without a complete twin, except the ones
    skipped for a newer save or removed by retention (nothing is owed for them)."""
    state = read_queue(root)
    out = []
    for tag in tags:
        if universal_state(twin_path(root, tag), root / tag) == COMPLETE:
            continue
        last = state.last_event(tag)
        if last is not None and last.kind in (B.EventKind.SKIPPED, B.EventKind.REMOVED):
            continue
        out.append(tag)
    return out


# ================================================================================================
# the converter process
# ================================================================================================

def lower_priority(nice: int) -> str:
    """Lowest best-effort I/O class level and ``nice``: training and data loading come first.

    Called first thing in the converter's main thread, so the threads and processes it starts inherit
    both. Returns what was applied, for the log.
    """
    applied = []
    if nice:
        try:
            applied.append(f"nice {os.nice(nice)}")
        except OSError as exc:
            log.debug("os.nice(%d) failed: %s", nice, exc)
    nr = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(platform.machine())
    if not sys.platform.startswith("linux") or nr is None:
        log.debug("ioprio_set not available on %s/%s; I/O priority unchanged", sys.platform, platform.machine())
        return ", ".join(applied) or "unchanged"
    ioprio_class_be, ioprio_who_process, level = 2, 1, 7
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(nr, ioprio_who_process, 0, (ioprio_class_be << 13) | level) != 0:
            log.debug("ioprio_set failed: errno %d", ctypes.get_errno())
        else:
            applied.append(f"I/O best-effort level {level}")
    except (OSError, AttributeError) as exc:
        log.debug("ioprio_set unavailable: %s", exc)
    return ", ".join(applied) or "unchanged"


class _Heartbeat:
    """Refreshes this converter's registration mtime, so other nodes can tell it is alive."""

    def __init__(self, root: Path, node: int):
        self.path = _registration_path(root, node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucp-runner-heartbeat", daemon=True)

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S * 2)


class _Progress:
    """``on_progress`` for :func:`convert`: a throttled progress file, and the tests' fault pause."""

    def __init__(self, path: Path, attempt: Optional[str], tag: str, node: int):
        self.path = path
        self.attempt = attempt
        self.last = 0.0
        self.pause = 0.0
        for entry in os.environ.get(FAULT_PAUSE_ENV, "").split(","):
            spec = entry.split(":")
            if len(spec) == 3 and spec[0] == tag and spec[2] == str(node):
                self.pause = float(spec[1])

    def __call__(self, done: int, total: int) -> None:
        now = time.time()
        if now - self.last >= PROGRESS_EVERY_S or done >= total:
            self.last = now
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _quick_json(self.path, {"done": done, "total": total, "updated": now, "attempt": self.attempt})
        if self.pause:
            seconds, self.pause = self.pause, 0.0
            log.warning("fault injection (%s): pausing %.0fs after the first parameter", FAULT_PAUSE_ENV, seconds)
            time.sleep(seconds)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def _record(root: Path, tag: str, kind: B.EventKind, message: str, **extra: Any) -> B.Event:
    with QueueLock(root, timeout=60.0):
        state, event = read_queue(root).add(tag, kind, message, time.time(), **extra)
        _write_queue(root, state, [event])
    (log.info if kind in (B.EventKind.COMPLETE, B.EventKind.REMOVED, B.EventKind.CLEANED) else log.error)(
        "%s", event.line())
    return event


class Converter:
    """Node ``node``'s background converter; :meth:`run` until the queue is empty."""

    def __init__(self, root: Path, node: int, nodes: int, settings: ConverterSettings):
        self.root = Path(root).resolve()
        self.node = node
        self.nodes = nodes
        self.settings = settings
        self.pid = os.getpid()

    def run(self) -> int:
        with QueueLock(self.root, timeout=60.0):
            reg = read_registrations(self.root).get(self.node)
            if reg is not None and reg.pid != self.pid and reg.alive(self.settings.stale_after):
                log.info("node %d already has a converter (pid %d on %s); exiting", self.node, reg.pid, reg.host)
                return 0
            _register(self.root, self.node, self.pid, "starting")
        try:
            with _Heartbeat(self.root, self.node):
                while True:
                    with QueueLock(self.root, timeout=60.0):
                        state = read_queue(self.root)
                        state, job, events = _advance_locked(self.root, state, self.settings, time.time(),
                                                             redo_dead=False)
                        _write_queue(self.root, state, events)
                        if job is None:
                            _unregister(self.root, self.node, self.pid)
                            log.info("queue empty; converter of node %d exits", self.node)
                            return 0
                        share = self.node if self.node < job.share_count else None
                        _register(self.root, self.node, self.pid, "converting" if share is not None else "waiting",
                                  job.attempt)
                    for event in events:
                        log.info("%s", event.line())
                    if share is not None:
                        self._convert_share(job, share)
                    _register(self.root, self.node, self.pid, "waiting", job.attempt)
                    self._wait_settled(job)
        finally:
            with contextlib.suppress(Exception):
                _unregister(self.root, self.node, self.pid)

    def _convert_share(self, job: B.Job, share: int) -> None:
        from .convert import ConvertOptions, convert

        output = twin_path(self.root, job.tag)
        info = inspect_staging(output)
        if info is not None and info.attempt_id == job.attempt and share in info.shares_done:
            return  # this node did its share already (an earlier converter of this node exited)
        log_path = ucp_dir(self.root) / B.log_name(job.tag, share, job.share_count)
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        logging.getLogger().addHandler(handler)
        progress = _Progress(ucp_dir(self.root) / PROGRESS_DIR / f"{job.tag}.node{share}.json", job.attempt, job.tag,
                             self.node)
        t0 = time.perf_counter()
        try:
            log.info("converting %s, share %d of %d (attempt %s, %d worker(s))", job.tag, share + 1,
                     job.share_count, job.attempt, self.settings.workers)
            result = convert(ConvertOptions(
                source=self.root / job.tag, output=output, workers=self.settings.workers,
                force=False, replace_stale=True, update_latest=False, share_index=share,
                share_count=job.share_count, attempt_id=job.attempt, progress=False,
                stale_after=self.settings.stale_after, on_progress=progress))
            log.info("%s", result.summary)
            if result.committed:
                self._finish(job, output, log_path, time.perf_counter() - t0)
        except Terminated as exc:  # say so before the process ends (the queue would only see it die)
            _record(self.root, job.tag, B.EventKind.INTERRUPTED,
                    f"converter pid {os.getpid()} on {socket.gethostname()} stopped by {exc}; the next save, "
                    f"resume or `megatron-ucp convert {self.root} --tag {job.tag}` completes it",
                    attempt=job.attempt, log=str(log_path))
            raise
        except ConversionInProgress as exc:
            log.warning("%s; waiting for that converter instead", exc)
        except OutputExistsError as exc:
            if universal_state(output) != COMPLETE:
                _record(self.root, job.tag, B.EventKind.FAILED, str(exc), attempt=job.attempt, log=str(log_path))
        except Exception as exc:  # the conversion failed: loud in the logs, harmless to training
            log.exception("conversion of %s failed", job.tag)
            _record(self.root, job.tag, B.EventKind.FAILED, f"{type(exc).__name__}: {exc}", attempt=job.attempt,
                    log=str(log_path))
        finally:
            progress.remove()
            logging.getLogger().removeHandler(handler)
            handler.close()

    def _finish(self, job: B.Job, output: Path, log_path: Path, seconds: float) -> None:
        """The committer: read-back verification, then ``latest_universal``, then retention."""
        from .verify import verify_universal

        try:
            report = verify_universal(output)
        except Exception as exc:  # unreadable beyond a list of problems
            report = None
            problems = [f"{type(exc).__name__}: {exc}"]
        else:
            problems = report.problems
        if report is None or not report.ok:
            rejected = output.with_name(f".{output.name}.ucp-rejected-{int(time.time())}")
            os.rename(output, rejected)
            _record(self.root, job.tag, B.EventKind.REJECTED,
                    f"read-back verification failed ({len(problems)} problem(s); first: {problems[0]}); "
                    f"moved to {rejected.name}, latest_universal unchanged", attempt=job.attempt, log=str(log_path))
            return
        current = latest_universal_target(self.root)
        manifest_time = (output / F.MANIFEST_FILE).stat().st_mtime
        if B.should_update_latest((output.name, manifest_time), current):
            write_latest_universal(self.root, output.name)
            moved = f"latest_universal -> {output.name}"
        else:
            moved = f"latest_universal left at the newer {current[0] if current else '?'}"
        _record(self.root, job.tag, B.EventKind.COMPLETE,
                f"converted and verified ({report.params} params, {report.state_files} files) in "
                f"{B.fmt_seconds(seconds)}; {moved}", attempt=job.attempt, log=str(log_path), seconds=round(seconds, 3))
        self._retention()

    def _retention(self) -> None:
        keep = self.settings.keep_last
        if keep is None:
            return
        current = latest_universal_target(self.root)
        state = read_queue(self.root)
        protected = {current[0]} if current else set()
        protected |= {F.universal_tag(j.tag) for j in (state.active, state.pending) if j is not None}
        folders = [(p.name, (p / F.MANIFEST_FILE).stat().st_mtime) for p in sorted(self.root.iterdir())
                   if p.name.endswith(F.UNIVERSAL_SUFFIX) and not p.name.startswith(".")
                   and universal_state(p) == COMPLETE]
        for name in B.select_for_removal(folders, keep, protected):
            path = self.root / name
            trash = path.with_name(f".{name}.ucp-trash-{os.getpid()}")
            try:
                os.rename(path, trash)  # first out of sight: a half-deleted folder must not look complete
            except OSError as exc:
                log.warning("retention: could not remove %s: %s", path, exc)
                continue
            shutil.rmtree(trash, ignore_errors=True)
            _record(self.root, name[:-len(F.UNIVERSAL_SUFFIX)], B.EventKind.REMOVED,
                    f"retention (keep_last={keep}) removed {name}")

    def _wait_settled(self, job: B.Job) -> None:
        """Until the job is complete, failed or dead on every node: one conversion at a time per root."""
        while True:
            state = read_queue(self.root)
            if state.active is None or state.active.attempt != job.attempt:
                return  # someone already settled it and moved on
            facts = job_facts(self.root, job, read_registrations(self.root), self.settings.stale_after)
            if B.judge(state, job, facts, time.time()) is not B.Outcome.RUNNING:
                return
            time.sleep(POLL_S)


_LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"


def run_converter(root: Path, node: int, nodes: int, settings: ConverterSettings) -> int:
    priority = lower_priority(settings.nice)
    # No torch here: the converter reads and writes torch files without it (OMP_NUM_THREADS, set by
    # converter_env, bounds torch's threads where a rare fallback imports it).
    log.info("converter of node %d/%d for %s: priority %s, %d worker(s)", node, nodes, root, priority,
             settings.workers)
    return Converter(root, node, nodes, settings).run()


class Terminated(SystemExit):
    """SIGTERM (the job's end, a scheduler's kill): unwinds like ``sys.exit(143)``, recorded on the way."""

    def __init__(self) -> None:
        super().__init__(143)

    def __str__(self) -> str:
        return "SIGTERM"


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ucp.async_convert",
                                description="Background converter of one node (started by the async trigger).")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--stale-after", type=float, default=STALE_AFTER_S)
    p.add_argument("--nice", type=int, default=NICE_INCREMENT)
    p.add_argument("--job-id", default="local")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT, stream=sys.stdout)
    signal.signal(signal.SIGTERM, _terminate)  # run finally blocks: record, unregister, stop heartbeats
    settings = ConverterSettings(workers=args.workers, threads=args.threads, keep_last=args.keep_last,
                                 stale_after=args.stale_after, nice=args.nice, job_id=args.job_id)
    try:
        return run_converter(args.root, args.node, args.nodes, settings)
    except Exception:
        log.exception("background converter of node %d failed", args.node)
        return 1


if __name__ == "__main__":
    sys.exit(main())
