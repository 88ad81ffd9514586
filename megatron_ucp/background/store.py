"""The files the trigger and the converters share under ``<root>/.ucp/``.

``queue.json`` (the queue's state, replaced atomically under ``queue.lock``), ``events.log`` (one
line per event), ``runners/node<N>.json`` (each node's converter: pid, phase, heartbeat by
mtime), ``progress/`` and the per-attempt logs. Every reader tolerates a damaged or missing file
(a fresh queue, no registration) and says so; what the facts mean is decided in
:mod:`megatron_ucp.background.queue`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

from megatron_ucp.background import queue as B
from megatron_ucp.convert.universal import COMPLETE, inspect_staging, universal_state
from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio

log = logging.getLogger(__name__)


UCP_DIR = F.UCP_DIR


QUEUE_FILE = "queue.json"


LOCK_FILE = "queue.lock"


EVENTS_LOG = "events.log"


RUNNERS_DIR = "runners"


PROGRESS_DIR = "progress"


LOCK_STALE_S = 30.0
"""A lock file older than this (or held by a dead local process) is broken: holds last milliseconds."""


STALE_AFTER_S = 60.0
"""A converter heartbeat older than this is dead."""


def ucp_dir(root: Path) -> Path:
    return Path(root) / UCP_DIR


class LockBusy(UcpError):
    """The queue lock could not be taken in time."""


class QueueLock:
    """Exclusive lock on a root's queue: ``O_CREAT|O_EXCL`` on the shared filesystem (works across
    nodes on NFS and Lustre, where ``flock`` may not). A holder that died is detected (same host:
    its pid is gone; any host: the file is older than :data:`LOCK_STALE_S`) and the lock broken.

    Breaking is the one step that removes another process's lock, so it is done by one process at a time and on what
    it sees then: a breaker first takes the break claim (``queue.lock.breaking``, ``O_EXCL`` too), judges the lock
    again under it, and removes it only if it is still the stale holder's it judged. Two processes that judged the
    same dead holder at once cannot both remove a lock: the second finds the lock the first one's successor took
    (a live holder) and leaves it. A breaker dies inside its claim only in a window of milliseconds; a claim older than
    :data:`LOCK_STALE_S` is then removed, after the same check of whose it is. A holder releases only its own lock."""

    def __init__(self, root: Path, timeout: float = 10.0):
        self.path = ucp_dir(root) / LOCK_FILE
        self.timeout = timeout
        self._held = False
        self._token = ""

    def __enter__(self) -> "QueueLock":
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._token = f"{socket.gethostname()} {os.getpid()} {time.time():.3f} {os.urandom(6).hex()}\n"
        while True:
            if _create_exclusively(self.path, self._token):
                self._held = True
                return self
            self._maybe_break()
            if time.monotonic() > deadline:
                raise LockBusy(
                    f"{self.path}: held by another process for more than {self.timeout:.0f}s", subject=self.path
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _maybe_break(self) -> None:
        seen = _stale_holder(self.path)
        if seen is None:
            return
        claim = self.path.with_name(LOCK_FILE + BREAKING)
        mine = f"{socket.gethostname()} {os.getpid()} {time.time():.3f} {os.urandom(6).hex()}\n"
        if not _create_exclusively(claim, mine):
            _break_abandoned_claim(claim)
            return
        try:
            if _stale_holder(self.path) == seen:  # still the holder judged dead: nobody took the lock since
                self.path.unlink(missing_ok=True)
                log.warning("%s: broke a stale lock (holder %s)", self.path, seen.strip())
        finally:
            with contextlib.suppress(OSError):
                if claim.read_text() == mine:  # ours still (never another breaker's)
                    claim.unlink()

    def __exit__(self, *exc: Any) -> None:
        if self._held:
            self._held = False
            try:
                holder = self.path.read_text()
            except OSError:
                holder = ""
            if holder == self._token:
                self.path.unlink(missing_ok=True)
            else:  # broken as stale while held (held past LOCK_STALE_S): the lock is another's now
                log.error("%s: this process's lock was broken as stale while held; left to its new holder", self.path)


BREAKING = ".breaking"
"""The claim of the one process breaking a stale queue lock (:class:`QueueLock`)."""


def _create_exclusively(path: Path, text: str) -> bool:
    """``path`` created with ``text`` (``O_EXCL``); False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return True


def _stale_holder(path: Path) -> Optional[str]:
    """The lock file's content when its holder is dead (same host: its pid is gone) or it is older than
    :data:`LOCK_STALE_S`; None while it is held by a live holder (or is gone, or cannot be read yet)."""
    try:
        st = path.stat()
        text = path.read_text()
    except (OSError, ValueError):
        return None
    holder = text.split()
    if len(holder) < 3:  # being written by its creator (or damaged: then its age breaks it)
        return text if time.time() - st.st_mtime > LOCK_STALE_S else None
    dead = holder[0] == socket.gethostname() and holder[1].isdigit() and not osio.pid_alive(int(holder[1]))
    return text if dead or time.time() - st.st_mtime > LOCK_STALE_S else None


def _break_abandoned_claim(claim: Path) -> None:
    """A break claim whose breaker died inside it (judged as a lock is: its pid gone on this host, or older than
    :data:`LOCK_STALE_S`) removed: renamed to a name of this process's, then removed only if it is the claim judged
    abandoned (else put back where it was)."""
    seen = _stale_holder(claim)
    if seen is None:
        return
    taken = claim.with_name(f"{claim.name}.{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(claim, taken)
    except OSError:
        return
    if taken.read_text() == seen:
        taken.unlink(missing_ok=True)
        log.warning("%s: removed an abandoned claim to break the lock (%s)", claim, seen.strip())
        return
    with contextlib.suppress(OSError):  # a live breaker's claim: back, unless another took its place
        os.link(taken, claim)
    taken.unlink(missing_ok=True)


def read_queue(root: Path) -> B.QueueState:
    """The queue as last written (rename makes reads consistent without the lock)."""
    try:
        return B.QueueState.from_json(json.loads((ucp_dir(root) / QUEUE_FILE).read_text()))
    except FileNotFoundError:
        return B.QueueState()
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); starting an empty queue", ucp_dir(root) / QUEUE_FILE, exc)
        return B.QueueState()


def write_queue(root: Path, state: B.QueueState, events: Sequence[B.Event]) -> None:
    """Replace the queue file by rename. Not fsynced (that costs a save tens of milliseconds on a
    busy disk): the queue is advisory, the manifests are the truth, and an unreadable queue after
    a crash reads as an empty one."""
    quick_json(ucp_dir(root) / QUEUE_FILE, state.to_json())
    if events:
        with open(ucp_dir(root) / EVENTS_LOG, "a") as fh:
            for e in events:
                fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(e.time))} {e.line()}\n")


def quick_json(path: Path, data: dict) -> None:
    """Replace a small state file by rename, without fsync (queue, progress, registrations)."""
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


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
        if self.host == socket.gethostname() and not osio.pid_alive(self.pid):
            return False
        return self.age < stale_after


def registration_path(root: Path, node: int) -> Path:
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
            out[node] = Registration(
                node,
                str(data["host"]),
                int(data["pid"]),
                str(data.get("phase", "")),
                data.get("attempt"),
                age,
                float(data.get("since", 0.0)),
            )
        except (OSError, ValueError, KeyError):
            continue
    return out


def register(root: Path, node: int, pid: int, phase: str, attempt: Optional[str] = None) -> None:
    path = registration_path(root, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    quick_json(
        path,
        {
            "node": node,
            "host": socket.gethostname(),
            "pid": pid,
            "phase": phase,
            "attempt": attempt,
            "since": time.time(),
        },
    )


def unregister(root: Path, node: int, pid: int) -> None:
    reg = read_registrations(root).get(node)
    if reg is not None and reg.pid == pid and reg.host == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            registration_path(root, node).unlink()


def twin_path(root: Path, tag: str) -> Path:
    return Path(root) / F.universal_tag(tag)


def job_facts(root: Path, job: B.Job, regs: dict[int, Registration], stale_after: float) -> B.JobFacts:
    """Converters count as alive for the job while ``starting`` (about to join whatever is active)
    or ``converting`` it; a converter ``waiting`` for the others does not keep a job alive."""
    verify = job.kind == B.VERIFY  # no folder of its own: settled by its event, alive by its converter
    output = twin_path(root, job.tag)
    info = None if verify else inspect_staging(output)
    runners = any(
        r.alive(stale_after) and (r.phase == "starting" or (r.phase == "converting" and r.attempt == job.attempt))
        for r in regs.values()
    )
    joined = [
        r
        for r in regs.values()
        if r.attempt == job.attempt or (r.phase == "starting" and r.since >= (job.activated or 0.0))
    ]
    return B.JobFacts(
        universal_complete=not verify and universal_state(output, root / job.tag) == COMPLETE,
        staging_live=info is not None and info.is_live(stale_after),
        runners_live=runners,
        shares_failed=info.failed if info is not None and info.attempt_id == job.attempt else (),
        runners_gone=bool(joined) and not any(r.alive(stale_after) for r in joined),
    )


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


def clean_dead_staging(
    root: Path, state: B.QueueState, stale_after: float, now: float
) -> tuple[B.QueueState, list[B.Event]]:
    """Remove staging folders whose converters are gone: they never look finished, but they use disk."""
    events = []
    for path in sorted(Path(root).glob(f".*{F.UNIVERSAL_SUFFIX}{F.STAGING_SUFFIX}")):
        output = path.parent / path.name[1 : -len(F.STAGING_SUFFIX)]
        if not staging_dead(output, stale_after, now):
            continue
        try:
            osio.remove_out_of_sight(path)
        except OSError:
            continue
        tag = output.name[: -len(F.UNIVERSAL_SUFFIX)]
        state, event = state.add(tag, B.EventKind.CLEANED, f"removed the dead staging folder {path.name}", now)
        events.append(event)
    return state, events


def record_event(root: Path, tag: str, kind: B.EventKind, message: str, **extra: Any) -> B.Event:
    with QueueLock(root, timeout=60.0):
        state, event = read_queue(root).add(tag, kind, message, time.time(), **extra)
        write_queue(root, state, [event])
    (log.info if kind in (B.EventKind.COMPLETE, B.EventKind.REMOVED, B.EventKind.CLEANED) else log.error)(
        "%s", event.line()
    )
    return event


FALLBACKS_LOG = "fallbacks.jsonl"
"""One JSON line per restart that fell back to an older tag (:mod:`megatron_ucp.integration.resume.fallback`)."""
RELAUNCHES_LOG = "relaunches.jsonl"
"""One JSON line per launch of ``megatron-ucp relaunch`` (its nodes, how it ended, the nodes found down)."""
MEMORY_RESTARTS_LOG = "memory-restarts.jsonl"
"""One JSON line per restart that found memory saves on its nodes: what it resumed from, or why not."""
SAVES_LOG = "async-saves.jsonl"
"""One JSON line per asynchronous save's outcome: committed, or failed with why."""


def append_line(root: Path, name: str, entry: dict, what: str) -> None:
    """One JSON line appended to a log of the store; a store that cannot be written is said in the log."""
    try:
        ucp_dir(root).mkdir(exist_ok=True)
        with open(ucp_dir(root) / name, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError as exc:
        log.error("megatron-ucp: cannot record %s in %s: %s", what, ucp_dir(root), exc)


def read_lines(root: Path, name: str) -> list[dict]:
    """A log of the store, oldest first; unreadable lines skipped."""
    try:
        lines = (ucp_dir(root) / name).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def record_fallback(root: Path, entry: dict) -> None:
    """Append a restart's fallback to the store."""
    append_line(root, FALLBACKS_LOG, entry, "the fallback")


def read_fallbacks(root: Path) -> list[dict]:
    """The restarts that fell back, oldest first."""
    return read_lines(root, FALLBACKS_LOG)


REFUSED_RESTART = "refused-restart.json"
"""The last restart that could resume from no tag (:mod:`megatron_ucp.integration.resume.fallback`): each tag it
tried with its problem and its files as they were; removed by the next restart that loads a tag."""


def record_refused_restart(root: Path, entry: dict) -> None:
    """A restart refused every tag: ``status`` says that a restart as it is fails again while nothing changed (a
    recorded verdict would outlive a job at fault, and the next restart's fallback would skip sound tags)."""
    try:
        ucp_dir(root).mkdir(exist_ok=True)
        quick_json(ucp_dir(root) / REFUSED_RESTART, entry)
    except OSError as exc:
        log.error("megatron-ucp: cannot record the refused restart in %s: %s", ucp_dir(root), exc)


def read_refused_restart(root: Path) -> Optional[dict]:
    try:
        entry = json.loads((ucp_dir(root) / REFUSED_RESTART).read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def clear_refused_restart(root: Path) -> None:
    """A restart loaded a tag: the last refusal no longer says what a restart does."""
    with contextlib.suppress(FileNotFoundError):
        (ucp_dir(root) / REFUSED_RESTART).unlink()


def record_save_outcome(root: Path, tag: str, failure: Optional[str] = None) -> None:
    """An asynchronous save of ``tag`` committed (``failure`` None) or failed, never becoming ``latest``."""
    append_line(root, SAVES_LOG, {"tag": tag, "at": time.time(), "failure": failure}, f"the save of {tag}")


def failed_saves(root: Path) -> list[dict]:
    """The tags whose last asynchronous save failed (a later save of the tag that committed clears it)."""
    last = {entry.get("tag"): entry for entry in read_lines(root, SAVES_LOG)}
    return [entry for entry in last.values() if entry.get("failure")]


NICE_INCREMENT = 10
POLL_S = 1.0


@dataclass(frozen=True)
class ConverterSettings:
    workers: int = 1
    threads: int = 1
    keep_last: Optional[int] = None
    export_hf: bool = False
    stale_after: float = STALE_AFTER_S
    nice: int = NICE_INCREMENT
    job_id: str = "local"
    python: str = field(default_factory=lambda: sys.executable)

    OPTIONS: ClassVar[tuple[tuple[str, type], ...]] = tuple(
        zip(
            ("workers", "threads", "keep_last", "export_hf", "stale_after", "nice", "job_id"),
            (int, int, int, bool, float, int, str),
            strict=True,
        )
    )
    """The settings a converter process takes on its command line, in one place (``python`` is what starts it)."""

    def argv(self) -> list[str]:
        out: list[str] = []
        for name, kind in self.OPTIONS:
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if kind is bool:
                out += [flag] if value else []
            elif value is not None:
                out += [flag, str(value)]
        return out

    @staticmethod
    def job_id_from_env(env: Optional[dict] = None) -> str:
        env = os.environ if env is None else env
        for key in ("PBS_JOBID", "SLURM_JOB_ID", "LSB_JOBID", "FLUX_JOB_ID", "TORCHELASTIC_RUN_ID"):
            if env.get(key):
                return str(env[key])
        return f"{socket.gethostname()}-{os.getpid()}"


def advance_locked(
    root: Path, state: B.QueueState, settings: ConverterSettings, now: float, redo_dead: bool
) -> tuple[B.QueueState, Optional[B.Job], list[B.Event]]:
    """Judge the active job, settle it, activate the next; on activation clear dead staging first."""
    outcome = None
    if state.active is not None:
        outcome = B.judge(
            state, state.active, job_facts(root, state.active, read_registrations(root), settings.stale_after), now
        )
    before = state.active.attempt if state.active is not None else None
    state, job, events = B.advance(
        state, outcome, now, lambda j: B.attempt_id(j.tag, settings.job_id, j.tries, now), redo_dead=redo_dead
    )
    if job is not None and job.attempt != before:
        state, cleaned = clean_dead_staging(root, state, settings.stale_after, now)
        events += cleaned
        log.info("activated conversion of %s (attempt %s, %d share(s))", job.tag, job.attempt, job.share_count)
    return state, job, events
