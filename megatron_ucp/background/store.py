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
from typing import Any, Optional, Sequence

from megatron_ucp.background import queue as B
from megatron_ucp.convert.universal import COMPLETE, inspect_staging, source_identity, universal_state
from megatron_ucp.deepspeed.reader import find_checkpoint_files
from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio

log = logging.getLogger(__name__)


UCP_DIR = ".ucp"


QUEUE_FILE = "queue.json"


LOCK_FILE = "queue.lock"


EVENTS_LOG = "events.log"


RUNNERS_DIR = "runners"


PROGRESS_DIR = "progress"


VERDICTS_DIR = "verdicts"
"""``verdicts/<tag>.json``: whether a native tag was found sound, by whom, and for which files."""


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
                raise LockBusy(
                    f"{self.path}: held by another process for more than {self.timeout:.0f}s", subject=self.path
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _maybe_break(self) -> None:
        try:
            st = self.path.stat()
            holder = self.path.read_text().split()
        except (OSError, ValueError):
            return
        age = time.time() - st.st_mtime
        dead = (
            len(holder) >= 2
            and holder[0] == socket.gethostname()
            and holder[1].isdigit()
            and not osio.pid_alive(int(holder[1]))
        )
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
            self.path.unlink(missing_ok=True)


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


@dataclass(frozen=True)
class Verdict:
    """What the last full read of a native tag found: sound (every file this save's, every recorded checksum
    matching, every master and optimizer state finite) or the problems, each naming its file."""

    tag: str
    sound: bool
    problems: tuple[str, ...]
    checked_by: str
    """``background conversion`` or ``megatron-ucp verify``."""
    source_files: dict
    """The tag's files as they were read (:func:`megatron_ucp.convert.universal.source_identity`): a verdict
    on files rewritten since (a re-save of the tag) does not apply to them."""
    at: float

    def applies_to(self, current: dict) -> bool:
        return self.source_files == current

    def describe(self) -> str:
        if self.sound:
            return f"sound (checked by {self.checked_by})"
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"{self.problems[0] if self.problems else '?'}{more} (checked by {self.checked_by})"


VERDICT_PROBLEMS_KEPT = 20


def record_verdict(root: Path, tag: str, problems: Sequence[str], checked_by: str, source_files: dict) -> Verdict:
    """Write the tag's verdict into the store (replaced atomically) and log it; a store that cannot be
    written is said in the log, never raised (the verdict's caller is a converter or a check)."""
    verdict = Verdict(tag, not problems, tuple(problems[:VERDICT_PROBLEMS_KEPT]), checked_by, source_files, time.time())
    folder = ucp_dir(root) / VERDICTS_DIR
    record = {
        "tag": tag,
        "sound": verdict.sound,
        "problems": list(verdict.problems),
        "problem_count": len(problems),
        "checked_by": checked_by,
        "source_files": source_files,
        "at": verdict.at,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        quick_json(folder / f"{tag}.json", record)
    except OSError as exc:
        log.error("%s: cannot record the verdict on %s: %s", folder, tag, exc)
    (log.info if verdict.sound else log.error)("%s: %s", tag, verdict.describe())
    return verdict


def read_verdict(root: Path, tag: str) -> Optional[Verdict]:
    """The tag's recorded verdict; None when there is none or it cannot be read (said in the log)."""
    path = ucp_dir(root) / VERDICTS_DIR / f"{tag}.json"
    try:
        raw = json.loads(path.read_text())
        return Verdict(
            str(raw["tag"]),
            bool(raw["sound"]),
            tuple(str(x) for x in raw["problems"]),
            str(raw["checked_by"]),
            dict(raw["source_files"]),
            float(raw["at"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: unreadable verdict, ignored (%s)", path, exc)
        return None


def record_refusal(root: Path, tag: str, exc: BaseException, checked_by: str) -> Optional[Verdict]:
    """A conversion refused for what it found in the tag's own files (another save's file, a checksum that does not
    match, a file that is not one checkpoint's): the tag is unsound, and the store says so, so that ``status`` and the
    next restart's fallback know it without reading the tag again. Any other failure (the output, the disk, an
    interruption) says nothing of the tag: None, nothing recorded."""
    tag_dir = Path(root) / tag
    subject = getattr(exc, "subject", None)
    if not isinstance(exc, CheckpointFormatError) or subject is None or tag_dir not in Path(subject).parents:
        return None
    return record_verdict(root, tag, [str(exc)], checked_by, tag_identity(tag_dir))


def tag_identity(tag_dir: Path) -> dict:
    """The tag's files as they are now (names, sizes, modification times: what a verdict applies to); {} when
    they cannot be listed."""
    try:
        return source_identity(find_checkpoint_files(tag_dir).identity_files())
    except (OSError, UcpError):
        return {}


def verdict_is_current(root: Path, tag: str) -> bool:
    """The tag has a verdict on its files as they are now (nothing to verify again)."""
    verdict = read_verdict(root, tag)
    return verdict is not None and verdict.applies_to(tag_identity(root / tag))


FALLBACKS_LOG = "fallbacks.jsonl"
"""One JSON line per restart that fell back to an older tag (:mod:`megatron_ucp.integration.resume.fallback`)."""
SAVES_LOG = "async-saves.jsonl"
"""One JSON line per asynchronous save's outcome (:mod:`megatron_ucp.integration.save.async_save`): committed, or
failed with why."""


def _append_line(root: Path, name: str, entry: dict, what: str) -> None:
    """One JSON line appended to a log of the store; a store that cannot be written is said in the log."""
    try:
        ucp_dir(root).mkdir(exist_ok=True)
        with open(ucp_dir(root) / name, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError as exc:
        log.error("megatron-ucp: cannot record %s in %s: %s", what, ucp_dir(root), exc)


def _read_lines(root: Path, name: str) -> list[dict]:
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
    _append_line(root, FALLBACKS_LOG, entry, "the fallback")


def read_fallbacks(root: Path) -> list[dict]:
    """The restarts that fell back, oldest first."""
    return _read_lines(root, FALLBACKS_LOG)


def record_save_outcome(root: Path, tag: str, failure: Optional[str] = None) -> None:
    """An asynchronous save of ``tag`` committed (``failure`` None) or failed, never becoming ``latest``."""
    _append_line(root, SAVES_LOG, {"tag": tag, "at": time.time(), "failure": failure}, f"the save of {tag}")


def failed_saves(root: Path) -> list[dict]:
    """The tags whose last asynchronous save failed (a later save of the tag that committed clears it)."""
    last = {entry.get("tag"): entry for entry in _read_lines(root, SAVES_LOG)}
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

    def argv(self) -> list[str]:
        out = [
            "--workers",
            str(self.workers),
            "--threads",
            str(self.threads),
            "--stale-after",
            str(self.stale_after),
            "--nice",
            str(self.nice),
            "--job-id",
            self.job_id,
        ]
        if self.keep_last is not None:
            out += ["--keep-last", str(self.keep_last)]
        if self.export_hf:
            out += ["--export-hf"]
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
