"""Pure decisions of the background (asynchronous) conversion: queue, liveness, nodes, retention.

No I/O here: :mod:`megatron_ucp.background.converter` gathers facts from the checkpoint filesystem,
calls these functions under the root's queue lock, and writes back what they return. Keeping
the decisions pure lets the tests walk through every interleaving (saves faster than
conversions, a converter killed, a node that never starts) in milliseconds, without processes.

The model: one queue per checkpoint root, with at most one ``active`` job (the tag being
converted, by one converter per node, each on its share) and at most one ``pending`` job (the
newest tag saved while the active one ran). A newer request replaces the pending one, which is
reported as skipped: the newest pending tag wins. Whoever comes first after the active job
settled (complete, failed, or dead) activates the pending one, under the lock, so every node's
converter works on the same tag with the same attempt id.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

from megatron_ucp.errors import UcpError
from megatron_ucp.plan.tags import chronological

QUEUE_FORMAT = "megatron-ucp/async-queue"
QUEUE_VERSION = 1
MAX_EVENTS = 200
"""Events kept in the queue file (older ones remain in the events log)."""
MAX_TRIES = 3
"""A job whose converters die this many times is given up (reported failed), not redone again."""
STARTUP_GRACE_S = 10.0
"""A just-activated job counts as alive this long even before any converter shows a heartbeat."""


class EventKind(str, enum.Enum):
    COMPLETE = "complete"
    """Committed, verified, ``latest_universal`` considered."""
    FAILED = "failed"
    """A converter raised; its log says why."""
    REJECTED = "rejected"
    """Committed but failed the read-back verification; moved aside, ``latest_universal`` untouched."""
    SKIPPED = "skipped"
    """A pending tag replaced by a newer one before its conversion started."""
    INTERRUPTED = "interrupted"
    """Every converter of the job died (killed, node lost) before it committed."""
    REMOVED = "removed"
    """Retention (``keep_last``) deleted a universal folder."""
    CLEANED = "cleaned"
    """A dead staging folder was removed."""


SETTLING = (EventKind.COMPLETE, EventKind.FAILED, EventKind.REJECTED)
"""Events that settle the job they name (by attempt)."""

CONVERT = "convert"
"""A job that writes the tag's universal twin (its read also judges the tag: a verdict)."""
VERIFY = "verify"
"""A job that only judges the tag (every file read once, its verdict recorded): a job saving without
background conversion. Its events say ``job: verify``; the universal column of ``status`` ignores them."""


EXPORT_HF = "export-hf"
"""The events of a converted tag's Hugging Face export (made by the committer after the conversion; no job of its
own in the queue)."""


def event_job(kind: str) -> Optional[str]:
    """What the events of a ``kind`` job carry as ``job``: None for a conversion (as before there were other jobs)."""
    return None if kind == CONVERT else kind


@dataclass(frozen=True)
class Job:
    tag: str
    share_count: int
    requested: float
    attempt: Optional[str] = None
    """Set when the job becomes active; every node's converter passes it to ``convert``."""
    activated: Optional[float] = None
    tries: int = 0
    kind: str = CONVERT
    """:data:`CONVERT` or :data:`VERIFY`."""

    def __post_init__(self) -> None:
        if self.share_count < 1:
            raise UcpError(f"job {self.tag}: share_count must be >= 1, got {self.share_count}", subject=self)

    @property
    def event_job(self) -> Optional[str]:
        return event_job(self.kind)

    def to_json(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "share_count": self.share_count,
            "requested": self.requested,
            "attempt": self.attempt,
            "activated": self.activated,
            "tries": self.tries,
            "kind": self.kind,
        }

    @classmethod
    def from_json(cls, data: Optional[dict]) -> Optional["Job"]:
        if not data:
            return None
        return cls(
            tag=str(data["tag"]),
            share_count=int(data.get("share_count", 1)),
            requested=float(data.get("requested", 0.0)),
            attempt=data.get("attempt"),
            activated=data.get("activated"),
            tries=int(data.get("tries", 0)),
            kind=str(data.get("kind", CONVERT)),
        )


@dataclass(frozen=True)
class Event:
    seq: int
    time: float
    tag: str
    kind: EventKind
    message: str
    attempt: Optional[str] = None
    log: Optional[str] = None
    seconds: Optional[float] = None
    job: Optional[str] = None
    """None: a conversion's event; :data:`VERIFY`: a verification's."""

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "seq": self.seq,
            "time": self.time,
            "tag": self.tag,
            "kind": self.kind.value,
            "message": self.message,
            "attempt": self.attempt,
            "log": self.log,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: dict) -> Optional["Event"]:
        try:
            kind = EventKind(data["kind"])
        except (KeyError, ValueError):
            return None  # a newer megatron-ucp's event kind: ignored, never fatal
        return cls(
            seq=int(data["seq"]),
            time=float(data.get("time", 0.0)),
            tag=str(data.get("tag", "")),
            kind=kind,
            message=str(data.get("message", "")),
            attempt=data.get("attempt"),
            log=data.get("log"),
            seconds=data.get("seconds"),
            job=data.get("job"),
        )

    def line(self) -> str:
        extra = f" (log: {self.log})" if self.log else ""
        job = f" ({self.job})" if self.job else ""
        return f"{self.tag}: {self.kind.value}{job}: {self.message}{extra}"


@dataclass(frozen=True)
class QueueState:
    active: Optional[Job] = None
    pending: Optional[Job] = None
    events: tuple[Event, ...] = ()
    next_seq: int = 1
    reported_seq: int = 0
    """Events up to this seq were reported in the training log."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": QUEUE_FORMAT,
            "version": QUEUE_VERSION,
            "active": self.active.to_json() if self.active else None,
            "pending": self.pending.to_json() if self.pending else None,
            "events": [e.to_json() for e in self.events],
            "next_seq": self.next_seq,
            "reported_seq": self.reported_seq,
        }

    @classmethod
    def from_json(cls, data: Optional[dict]) -> "QueueState":
        """Tolerant: unknown fields are ignored; a foreign or empty file gives an empty queue."""
        if not isinstance(data, dict) or data.get("format") != QUEUE_FORMAT:
            return cls()
        events = tuple(e for e in (Event.from_json(d) for d in data.get("events") or ()) if e is not None)
        return cls(
            active=Job.from_json(data.get("active")),
            pending=Job.from_json(data.get("pending")),
            events=events,
            next_seq=int(data.get("next_seq", 1)),
            reported_seq=int(data.get("reported_seq", 0)),
        )

    def add(self, tag: str, kind: EventKind, message: str, now: float, **extra: Any) -> tuple["QueueState", Event]:
        event = Event(seq=self.next_seq, time=now, tag=tag, kind=kind, message=message, **extra)
        events = (self.events + (event,))[-MAX_EVENTS:]
        return replace(self, events=events, next_seq=self.next_seq + 1), event

    def settled_by(self, attempt: Optional[str]) -> Optional[Event]:
        """The event that settled this attempt (complete / failed / rejected), if any."""
        if attempt is None:
            return None
        for event in reversed(self.events):
            if event.attempt == attempt and event.kind in SETTLING:
                return event
        return None

    def unreported(self) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.seq > self.reported_seq)

    def mark_reported(self) -> "QueueState":
        return replace(self, reported_seq=self.next_seq - 1)

    def last_event(self, tag: str, job: Optional[str] = None) -> Optional[Event]:
        """The tag's newest event of that job kind (None: conversions)."""
        for event in reversed(self.events):
            if event.tag == tag and event.job == job:
                return event
        return None


# ------------------------------------------------------------------------------------------------
# liveness of the active job
# ------------------------------------------------------------------------------------------------


class Outcome(str, enum.Enum):
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"
    DEAD = "dead"


@dataclass(frozen=True)
class JobFacts:
    """What the filesystem says about one job (gathered by the I/O layer)."""

    universal_complete: bool
    staging_live: bool
    """A converter of this output refreshed its heartbeat recently (ours or another tool's)."""
    runners_live: bool
    """A node's background converter that is starting, or working on this attempt, is alive."""
    shares_failed: tuple[str, ...] = ()
    runners_gone: bool = False
    """Every converter that joined this job since its activation is known dead (its process is gone):
    the startup grace is for converters not yet seen, not for ones already seen to die."""


def judge(state: QueueState, job: Job, facts: JobFacts, now: float, grace: float = STARTUP_GRACE_S) -> Outcome:
    """Has ``job`` (the active one) settled? Recorded events first, then liveness, then the folders.

    Liveness comes before the folders: a committed folder whose committer is still verifying it
    (or a failed share while another still writes) is not settled yet, so the event that settles
    it is the committer's own, and no next conversion overlaps it.
    """
    event = state.settled_by(job.attempt)
    if event is not None:
        return Outcome.COMPLETE if event.kind is EventKind.COMPLETE else Outcome.FAILED
    if facts.staging_live or facts.runners_live:
        return Outcome.RUNNING
    if facts.universal_complete:
        return Outcome.COMPLETE
    if facts.shares_failed:
        return Outcome.FAILED
    if job.activated is not None and now - job.activated < grace and not facts.runners_gone:
        return Outcome.RUNNING
    return Outcome.DEAD


# ------------------------------------------------------------------------------------------------
# queue transitions
# ------------------------------------------------------------------------------------------------


def request(
    state: QueueState, tag: str, share_count: int, now: float, already_complete: bool = False, kind: str = CONVERT
) -> tuple[QueueState, list[Event]]:
    """A save of ``tag`` finished: make it the pending job (the newest wins; a replaced one is skipped).
    ``kind``: :data:`CONVERT` or :data:`VERIFY` (one node's job: ``share_count`` 1).

    Idempotent: every node's trigger requests the same tag after the same save.
    """
    if already_complete:
        return state, []
    active, pending = state.active, state.pending
    if active is not None and active.tag == tag and state.settled_by(active.attempt) is None:
        return state, []
    if pending is not None and pending.tag == tag:
        return state, []
    events: list[Event] = []
    if pending is not None:
        state, event = state.add(
            pending.tag,
            EventKind.SKIPPED,
            f"not {'verified' if pending.kind == VERIFY else 'converted'}: {tag} was saved before its "
            f"{pending.kind} job could start (saves come faster than that; the newest wins)",
            now,
            job=pending.event_job,
        )
        events.append(event)
    return replace(state, pending=Job(tag=tag, share_count=share_count, requested=now, kind=kind)), events


def advance(
    state: QueueState,
    outcome: Optional[Outcome],
    now: float,
    make_attempt: Callable[[Job], str],
    redo_dead: bool = True,
) -> tuple[QueueState, Optional[Job], list[Event]]:
    """Settle the active job if ``outcome`` says so and activate the next one; returns the job to work on.

    ``outcome`` is :func:`judge`'s verdict on ``state.active`` (None when there is none). A running
    job is returned as is (converters join it). A dead job is reported interrupted; it is redone
    (new attempt) only when nothing newer is pending, when ``redo_dead`` (a trigger, which starts
    every node's converter; not a surviving converter, which would redo it alone and wait for the
    dead node again), and at most :data:`MAX_TRIES` times.
    """
    events: list[Event] = []
    active = state.active
    if active is not None and outcome is Outcome.RUNNING:
        return state, active, events
    redo: Optional[Job] = None
    if active is not None:
        said: Optional[tuple[EventKind, str]] = None
        if outcome is Outcome.DEAD:
            give_up = active.tries >= MAX_TRIES
            if state.pending is not None:
                what = f"superseded by {state.pending.tag}"
            elif give_up:
                what = f"given up after {active.tries} attempts"
            elif not redo_dead:
                what = f"the next save or `megatron-ucp {active.kind}` redoes it"
            else:
                what = "converting it again" if active.kind == CONVERT else "verifying it again"
                redo = active
            said = (
                EventKind.INTERRUPTED,
                f"every converter of attempt {active.attempt} stopped before it committed; {what}",
            )
        elif state.settled_by(active.attempt) is None and outcome is Outcome.COMPLETE:
            said = (EventKind.COMPLETE, "committed (by another converter)")
        elif state.settled_by(active.attempt) is None and outcome is Outcome.FAILED:
            said = (EventKind.FAILED, "a share of the conversion failed")
        if said is not None:
            state, event = state.add(active.tag, *said, now, attempt=active.attempt, job=active.event_job)
            events.append(event)
        state = replace(state, active=None)
    nxt = state.pending if state.pending is not None else redo
    if nxt is None:
        return state, None, events
    job = replace(nxt, tries=nxt.tries + 1 if nxt is redo else 1, activated=now)
    job = replace(job, attempt=make_attempt(job))
    return replace(state, active=job, pending=None if nxt is state.pending else state.pending), job, events


def attempt_id(tag: str, job_id: str, tries: int, now: float) -> str:
    """The id every node's converter of one try passes to ``convert`` (they join one staging folder).

    Made once, by whoever activates the job under the lock, and read by the others from the queue
    file; the activation time keeps a later re-save of the same tag from joining an old attempt.
    """
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "_", job_id)[:64] or "job"
    return f"async-{tag}-{clean}-t{tries}-{int(now * 1000)}"


# ------------------------------------------------------------------------------------------------
# nodes
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeAssignment:
    node: int
    nodes: int
    launcher: bool
    """This process starts its node's converter (the node's first process)."""
    note: str = ""


def node_assignment(
    rank: int,
    world: int,
    local_rank: Optional[int] = None,
    local_world: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
) -> NodeAssignment:
    """Which node this rank is on, how many nodes there are, and whether it launches the converter.

    ``ranks_per_node`` (config) wins; else ``LOCAL_WORLD_SIZE``/``LOCAL_RANK``. Ranks are assumed
    placed in contiguous blocks per node (mpiexec, torchrun); when the numbers do not fit that
    (uneven nodes, a local rank that disagrees with the block), one converter on rank 0 does it all.
    """
    if not 0 <= rank < world:
        raise UcpError(f"rank {rank} outside a world of {world}", subject=rank)
    per = ranks_per_node if ranks_per_node is not None else local_world
    if per is None or per < 1:
        return NodeAssignment(0, 1, rank == 0, "node size unknown: one converter (rank 0)")
    if world % per:
        return NodeAssignment(
            0, 1, rank == 0, f"world {world} is not a multiple of {per} ranks per node: one converter (rank 0)"
        )
    local = local_rank if ranks_per_node is None and local_rank is not None else rank % per
    if local != rank % per:
        return NodeAssignment(
            0, 1, rank == 0, f"LOCAL_RANK {local} does not match rank {rank} in blocks of {per}: one converter (rank 0)"
        )
    return NodeAssignment(rank // per, world // per, local == 0)


# ------------------------------------------------------------------------------------------------
# tag order, latest_universal, retention
# ------------------------------------------------------------------------------------------------


def select_for_removal(
    folders: Sequence[tuple[str, float]], keep_last: Optional[int], protected: Iterable[str]
) -> list[str]:
    """Which complete universal folders retention deletes: all but the newest ``keep_last``.

    ``folders`` are (name, mtime) of complete megatron-ucp universal folders only (never native
    checkpoints, never foreign folders). The newest ``keep_last`` are kept, and ``protected`` names
    (``latest_universal``'s target, the active job's output) are kept in addition.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise UcpError(f"keep_last must be >= 1, got {keep_last}", subject=keep_last)
    ordered = chronological(folders)
    keep = set(protected) | {name for name, _ in ordered[-keep_last:]}
    return [name for name, _ in ordered if name not in keep]


def log_name(tag: str, share_index: int, share_count: int, kind: str = CONVERT) -> str:
    """Per-tag converter log under ``<root>/.ucp/``: one per node when the work is split."""
    return f"{kind}-{tag}.log" if share_count == 1 else f"{kind}-{tag}.node{share_index}.log"


def progress_fraction(done: Sequence[int], total: Sequence[int]) -> Optional[float]:
    t = sum(total)
    return None if t <= 0 else min(1.0, sum(done) / t)


def fmt_seconds(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.1f}min"
