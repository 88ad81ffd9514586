"""What a checkpoint root holds, tag by tag: native checkpoint, universal twin, conversion state.

Read-only. Facts come from the folders (manifest = complete, staging sibling = unfinished), the background queue
under ``<root>/.ucp/`` (active / pending jobs, recent events, converter heartbeats, progress files) and the model
states (DP size). :func:`classify` turns the facts of one tag into its universal state without I/O, so the
precedence is tested on its own: complete > foreign > in progress > pending > failed > interrupted > skipped >
removed > absent.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from megatron_ucp.background import queue as B
from megatron_ucp.background import restart_judge, verdicts
from megatron_ucp.background.pointer_problems import dangling_universal_pointer
from megatron_ucp.background.set_aside import leftovers
from megatron_ucp.background.store import (
    MEMORY_RESTARTS_LOG,
    PROGRESS_DIR,
    RELAUNCHES_LOG,
    failed_saves,
    job_facts,
    read_fallbacks,
    read_lines,
    read_queue,
    read_refused_restart,
    read_registrations,
    ucp_dir,
)
from megatron_ucp.background.verdicts import identity_digest, read_verdict, tag_identity
from megatron_ucp.convert.universal import inspect_staging, read_manifest, universal_state
from megatron_ucp.deepspeed.folder import is_native_tag
from megatron_ucp.deepspeed.reader import recorded_sizes
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.export.hf_export import EXPORT_MARKER
from megatron_ucp.export.hf_source import hf_name
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import read_tag_file
from megatron_ucp.plan.relaunch import last_loop
from megatron_ucp.plan.resume import TwinState
from megatron_ucp.plan.tags import chronological

__all__ = [
    "UniversalStatus",
    "TagFacts",
    "TagStatus",
    "RootStatus",
    "ResumeAnswer",
    "classify",
    "root_status",
]

log = logging.getLogger(__name__)


class UniversalStatus(str, enum.Enum):
    """What ``status`` reports: the folder's own state (:class:`~megatron_ucp.plan.resume.TwinState`, same values)
    or, when there is no finished folder, what the background queue says about it."""

    COMPLETE = TwinState.COMPLETE.value
    STALE = TwinState.STALE.value
    FOREIGN = TwinState.FOREIGN.value
    IN_PROGRESS = "in progress"
    PENDING = "pending"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    SKIPPED = "skipped"
    REMOVED = "removed"
    ABSENT = TwinState.ABSENT.value
    UNREADABLE = "unreadable"
    """The tag's entry cannot be examined (a symlink loop, no permission): the row says why."""


@dataclass(frozen=True)
class TagFacts:
    """Everything :func:`classify` needs about one tag (gathered by :func:`root_status`)."""

    tag: str
    folder: str
    """``complete`` / ``foreign`` / ``absent`` (:func:`megatron_ucp.convert.universal.universal_state`)."""
    staging: bool = False
    staging_live: bool = False
    active: Optional[str] = None
    """The queue's verdict when this tag is the active job: ``running`` / ``dead`` / ... (Outcome)."""
    pending: bool = False
    last_event: Optional[B.Event] = None
    progress: Optional[float] = None
    shares: Optional[tuple[int, int]] = None
    """(shares done, share count) of the staging folder."""
    root: str = "ROOT"


def classify(f: TagFacts) -> tuple[UniversalStatus, str]:
    """The tag's universal state and a one-line detail (progress, log path, what to do)."""
    convert_hint = f"`megatron-ucp convert {f.root} --tag {f.tag}` converts it"
    if f.folder == TwinState.COMPLETE:
        return UniversalStatus.COMPLETE, ""
    if f.folder == TwinState.STALE:
        return UniversalStatus.STALE, (
            f"the native files of {f.tag} changed since it was converted (re-saved, or damaged): "
            f"`megatron-ucp verify {f.root} --tag {f.tag}` reads them; once they are sound, "
            f"`megatron-ucp convert {f.root} --tag {f.tag} --force` converts them again"
        )
    if f.folder == TwinState.FOREIGN:
        return UniversalStatus.FOREIGN, "exists without a megatron-ucp manifest (stock converter, or copied)"
    ev = f.last_event
    if f.staging_live or f.active == B.Outcome.RUNNING.value:
        parts = []
        if f.progress is not None:  # bytes written run a little ahead of the estimate: 100% only when committed
            parts.append(f"{min(f.progress, 0.99):.0%}")
        if f.shares is not None and f.shares[1] > 1:
            parts.append(f"{f.shares[0]}/{f.shares[1]} shares done")
        return UniversalStatus.IN_PROGRESS, ", ".join(parts) or "starting"
    if f.pending:
        return UniversalStatus.PENDING, "queued behind the active conversion"
    if ev is not None and ev.kind in (B.EventKind.FAILED, B.EventKind.REJECTED):
        return UniversalStatus.FAILED, ev.message + (f"; log: {ev.log}" if ev.log else "")
    if (
        f.staging
        or f.active is not None
        or (ev is not None and ev.kind in (B.EventKind.INTERRUPTED, B.EventKind.CLEANED))
    ):
        why = "its converter stopped before committing (killed, or the job ended)"
        return UniversalStatus.INTERRUPTED, f"{why}; {convert_hint}"
    if ev is not None and ev.kind is B.EventKind.SKIPPED:
        return UniversalStatus.SKIPPED, f"a newer save was queued first; {convert_hint}"
    if ev is not None and ev.kind is B.EventKind.REMOVED:
        return UniversalStatus.REMOVED, ev.message
    return UniversalStatus.ABSENT, ""


@dataclass(frozen=True)
class TagStatus:
    tag: str
    native: bool
    universal: UniversalStatus
    detail: str
    dp: Optional[int] = None
    native_bytes: Optional[int] = None
    universal_bytes: Optional[int] = None
    seconds: Optional[float] = None
    """Conversion time recorded in the manifest."""
    latest: bool = False
    latest_universal: bool = False
    ep: Optional[int] = None
    """A mixture-of-experts save's expert-parallel size."""
    verified: Optional[str] = None
    """The native tag's recorded verdict: ``sound``, ``unsound`` or ``outdated`` (its files were rewritten since);
    None when nothing read it whole yet."""
    verdict: Optional[str] = None
    """What the verdict says (the first problem, who checked)."""
    hf_export: Optional[str] = None
    """The tag's Hugging Face export: ``complete`` (``<tag>_hf`` finished), else its last background event's kind
    (``failed``, ``skipped``, ``interrupted``, ``removed``); None when nothing exported it."""
    hf_detail: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["universal"] = self.universal.value
        return d


@dataclass(frozen=True)
class ResumeAnswer:
    """What a restart would load (:meth:`RootStatus.resume_answer`)."""

    tag: Optional[str]
    """The tag it loads first; None: none (it starts from scratch or stops)."""
    said: str
    fallback: bool = False
    tries: tuple[str, ...] = ()
    """The tags it may load, in turn, each when its files are sound (:class:`~megatron_ucp.plan.restart_walk.Walk`)."""
    certain: bool = False
    """The last of ``tries`` was found sound: the restart resumes from one of them."""


@dataclass(frozen=True)
class RootStatus:
    root: Path
    latest: Optional[str]
    latest_universal: Optional[str]
    tags: tuple[TagStatus, ...]
    converters: tuple[str, ...]
    """One line per node's background converter that is alive."""
    problems: tuple[str, ...] = ()
    """What could not be read at the root (a ``latest`` that is a symlink loop, ...), one line each."""
    last_fallback: Optional[dict] = None
    """The last restart that fell back to an older tag (``.ucp/fallbacks.jsonl``), if any."""
    refused_restart: Optional[dict] = None
    """The last restart, when it resumed from no tag and ``latest`` and every tag it tried are as they were then."""
    latest_unreadable: Optional[str] = None
    """Why ``latest`` names no tag (empty after a power loss, garbage): a restart falls back."""
    relaunches: tuple[dict, ...] = ()
    """The launches of the last ``megatron-ucp relaunch`` loop that relaunched (``.ucp/relaunches.jsonl``)."""
    memory_restart: Optional[dict] = None
    """The last restart that found memory saves on its nodes (``.ucp/memory-restarts.jsonl``)."""

    @property
    def latest_converted(self) -> bool:
        """The tag in ``latest`` has a complete universal twin (what a resume at another DP size needs)."""
        return any(t.tag == self.latest and t.universal is UniversalStatus.COMPLETE for t in self.tags)

    @property
    def latest_missing(self) -> bool:
        """``latest`` names a tag that has no native folder here: a restart cannot load it."""
        return self.latest is not None and not any(t.tag == self.latest and t.native for t in self.tags)

    def newest_native(self) -> Optional[str]:
        return next((t.tag for t in reversed(self.tags) if t.native), None)

    def latest_problem(self) -> Optional[str]:
        """Why the tag in ``latest`` cannot be loaded as it is named, in words (None: nothing known against it)."""
        if self.latest is None:
            return self.latest_unreadable or f"{self.root}: no '{F.LATEST}' file: nothing to resume from"
        if self.latest_missing:
            return f"{self.root / F.LATEST} names {self.latest}, which is not a checkpoint under {self.root}"
        row = next(t for t in self.tags if t.tag == self.latest)
        return f"{self.latest}: {row.verdict}" if row.verified == "unsound" else None

    def resume_answer(self) -> "ResumeAnswer":
        """What a restart of this root does (the hooks' fallback on, any DP size: a DP change reads the native
        files), from what is known without reading a rank file, walked as the restart walks it
        (:func:`megatron_ucp.background.restart_judge.predict`)."""
        if self.latest is None and self.latest_unreadable is None:
            newest = self.newest_native()
            if newest is None:
                return ResumeAnswer(None, f"{self.root}: no '{F.LATEST}' file and no checkpoint: nothing to resume")
            return ResumeAnswer(
                None,
                f"{self.root}: no '{F.LATEST}' file: a restart starts from scratch (DeepSpeed and Megatron load what "
                f"it names); {to_repoint(self)}",
            )
        walked, said = restart_judge.predict(self.root, self.latest, self.latest_unreadable)
        fallback = bool(walked.skipped) or self.latest is None
        return ResumeAnswer(walked.tag, said, fallback, tries=walked.tries, certain=walked.certain)

    def to_json(self) -> dict:
        return {
            "root": str(self.root),
            "latest": self.latest,
            "latest_universal": self.latest_universal,
            "latest_converted": self.latest_converted,
            "latest_missing": self.latest_missing,
            "converters": list(self.converters),
            "tags": [t.to_json() for t in self.tags],
            "problems": list(self.problems),
            "last_fallback": self.last_fallback,
            "refused_restart": self.refused_restart,
            "latest_unreadable": self.latest_unreadable,
            "relaunches": list(self.relaunches),
            "memory_restart": self.memory_restart,
        }


def _read_text(path: Path, problems: list[str]) -> Optional[str]:
    """The tag a ``latest``-style file names; a damaged one reported and shown as absent (never a FIFO opened)."""
    try:
        return read_tag_file(path)
    except CheckpointFormatError as exc:
        log.warning("%s", exc)
        problems.append(str(exc))
        return None


def _entry_kind(entry: os.DirEntry) -> str:
    """``dir`` / ``other`` for a root entry, or why it cannot be examined (a symlink loop, ...)."""
    try:
        return "dir" if entry.is_dir() else "other"
    except OSError as exc:
        return "a symlink loop" if exc.errno == errno.ELOOP else f"unreadable: {exc.strerror or exc}"


def _folder_bytes(path: Path) -> int:
    return sum(_size(os.path.join(folder, name)) for folder, _, files in os.walk(path) for name in files)


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _native_dp(tag_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """The DP and EP sizes a native tag was saved at (EP: a mixture-of-experts save's); None when unreadable
    (status describes, it does not fail)."""
    try:
        return recorded_sizes(tag_dir)
    except CheckpointFormatError:
        return None, None


def _progress(root: Path, tag: str, attempt: Optional[str]) -> Optional[float]:
    done, total = [], []
    for path in (ucp_dir(root) / PROGRESS_DIR).glob(f"{tag}.node*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if attempt is None or data.get("attempt") == attempt:
            done.append(int(data.get("done", 0)))
            total.append(int(data.get("total", 0)))
    return B.progress_fraction(done, total)


def root_status(root: os.PathLike | str, sizes: bool = True, dp: bool = True) -> RootStatus:
    """Gather the facts of every tag under ``root`` and classify them."""

    root = Path(root).resolve()
    if not root.is_dir():
        raise CheckpointFormatError(f"{root}: not a directory", subject=root)
    problems: list[str] = []
    latest = _read_text(root / F.LATEST, problems)
    latest_unreadable = problems[-1] if problems else None
    latest_universal = _read_text(root / F.LATEST_UNIVERSAL, problems)
    queue = read_queue(root)
    regs = read_registrations(root)
    now = time.time()

    tags: dict[str, float] = {}
    unreadable: dict[str, str] = {}
    for entry in os.scandir(root):
        kind = _entry_kind(entry)
        if entry.name.startswith(".") or entry.name in (F.LATEST, F.LATEST_UNIVERSAL) or kind == "other":
            continue
        if kind != "dir":  # one bad entry is a row of the table, not the end of status
            unreadable[entry.name] = str(kind)
            continue
        path = Path(entry.path)
        if entry.name.endswith(F.UNIVERSAL_SUFFIX):
            tags.setdefault(entry.name[: -len(F.UNIVERSAL_SUFFIX)], entry.stat().st_mtime)
        elif is_native_tag(path):
            tags[entry.name] = entry.stat().st_mtime
    for job in (queue.active, queue.pending):
        if job is not None:
            tags.setdefault(job.tag, job.requested)

    active_verdict = None
    if queue.active is not None:
        active_verdict = B.judge(queue, queue.active, job_facts(root, queue.active, regs, 60.0), now).value

    rows = []
    for tag, _ in chronological(tags.items()):
        native_dir = root / tag
        twin = root / F.universal_tag(tag)
        folder = universal_state(twin, native_dir)
        info = inspect_staging(twin)
        is_active = queue.active is not None and queue.active.tag == tag and queue.active.kind == B.CONVERT
        facts = TagFacts(
            tag=tag,
            folder=folder,
            staging=info is not None,
            staging_live=bool(info and info.is_live(60.0)),
            active=active_verdict
            if is_active and active_verdict in (B.Outcome.RUNNING.value, B.Outcome.DEAD.value)
            else None,
            pending=queue.pending is not None and queue.pending.tag == tag and queue.pending.kind == B.CONVERT,
            last_event=queue.last_event(tag),
            progress=_progress(root, tag, queue.active.attempt if is_active else None) if info or is_active else None,
            shares=(len(info.shares_done), info.share_count) if info is not None else None,
            root=str(root),
        )
        state, detail = classify(facts)
        try:
            manifest = read_manifest(twin) if folder in ("complete", "stale") else None
        except CheckpointFormatError as exc:  # one damaged folder does not hide the others
            manifest = None
            state, detail = UniversalStatus.FAILED, f"{exc}; `megatron-ucp verify {twin}` checks it"
        dp_size, ep_size = (((manifest or {}).get(k) or {}).get(v) for k, v in (("source", "dp"), ("parallel", "ep")))
        if dp_size is None and dp and native_dir.is_dir():
            dp_size, ep_size = _native_dp(native_dir)
        judged = _verifying(queue, tag) or _verdict(root, tag, native_dir)
        if judged.get("verified") == "unsound" and "`megatron-ucp convert" in detail:  # a conversion would fail
            if state is UniversalStatus.STALE:
                detail = f"the native files of {tag} changed since it was converted"
            kept = detail.split("`megatron-ucp convert")[0].rstrip(" ;:,")
            detail = (f"{kept}; " if kept else "") + "its files are damaged (below): not to convert"
        rows.append(
            TagStatus(
                tag=tag,
                native=native_dir.is_dir() and is_native_tag(native_dir),
                universal=state,
                detail=detail,
                dp=dp_size,
                ep=ep_size,
                native_bytes=_folder_bytes(native_dir) if sizes and native_dir.is_dir() else None,
                universal_bytes=_folder_bytes(twin) if sizes and twin.is_dir() else None,
                seconds=manifest.get("seconds") if manifest else None,
                latest=tag == latest,
                latest_universal=latest_universal == twin.name,
                **judged,
                **_hf_export(root, queue, tag),
            )
        )
    for name, why in sorted(unreadable.items()):
        rows.append(
            TagStatus(
                tag=name,
                native=False,
                universal=UniversalStatus.UNREADABLE,
                detail=f"{root / name}: {why}; remove or replace it",
                latest=name == latest,
                latest_universal=name == latest_universal,
            )
        )
    converters = tuple(
        f"node {r.node}: pid {r.pid} on {r.host}, {r.phase}"
        + (f" ({r.attempt})" if r.attempt else "")
        + f", heartbeat {r.age:.0f}s ago"
        for r in sorted(regs.values(), key=lambda r: r.node)
        if r.alive()
    )
    problems += [
        f"{record.get('tag')}: an asynchronous save of it failed and did not become {F.LATEST}: {record.get('failure')}"
        for record in failed_saves(root)
    ]
    problems += [f"{tag}: {fate} ({folder})" for tag, folder, fate in leftovers(root)]
    problems += dangling_universal_pointer(
        root, latest, latest_universal, [(r.tag, r.native, r.verified, r.verdict) for r in rows]
    )
    newer = [t.tag for t in rows if t.native and latest is not None and verdicts.newer_than(t.tag, latest, root)]
    problems += [f"{tag}: {verdicts.UNCOMMITTED}" for tag in newer if verdicts.uncommitted(root / tag)]
    return RootStatus(
        root=root,
        latest=latest,
        latest_universal=latest_universal,
        tags=tuple(rows),
        converters=converters,
        problems=tuple(problems),
        last_fallback=(read_fallbacks(root) or [None])[-1],
        relaunches=last_loop(read_lines(root, RELAUNCHES_LOG)),
        memory_restart=(read_lines(root, MEMORY_RESTARTS_LOG) or [None])[-1],
        refused_restart=_refused_restart(root, latest),
        latest_unreadable=latest_unreadable,
    )


def _refused_restart(root: Path, latest: Optional[str]) -> Optional[dict]:
    """The store's last refused restart while it still says what a restart does: ``latest`` names the tag it named
    and every tag it tried holds the files it tried (a save, a repaired file or a new ``latest`` ends it)."""
    entry = read_refused_restart(root)
    if entry is None or latest is None or entry.get("latest") != latest:
        return None
    tried = entry.get("failed") or []
    if not tried or any(identity_digest(root / str(f.get("tag"))) != f.get("files") for f in tried):
        return None
    return entry


def _verifying(queue: B.QueueState, tag: str) -> dict:
    """A verify job of the tag that is active or queued (its verdict is on the way)."""
    for job, said in ((queue.active, "verifying"), (queue.pending, "queued")):
        if job is not None and job.tag == tag and job.kind == B.VERIFY:
            return {"verified": said, "verdict": f"background verification {said}"}
    return {}


def _hf_export(root: Path, queue: B.QueueState, tag: str) -> dict:
    """The tag's Hugging Face export: its folder when finished, else what the background said of it last."""
    if (root / hf_name(tag) / EXPORT_MARKER).is_file():
        return {"hf_export": TwinState.COMPLETE.value}
    event = queue.last_event(tag, B.EXPORT_HF)
    if event is None:
        return {}
    return {"hf_export": event.kind.value, "hf_detail": event.line()}


def _verdict(root: Path, tag: str, native_dir: Path) -> dict:
    """The tag's recorded verdict, if it applies to the files there now, and the damage its save's file list shows,
    in the restart's judge's order (an unsound verdict, the list, a sound verdict)."""
    verdict = read_verdict(root, tag)
    current = tag_identity(native_dir) if verdict is not None else {}
    applies = verdict is not None and bool(current) and verdict.applies_to(current)
    damage = () if applies and not verdict.sound else verdicts.listed_damage(native_dir) if native_dir.is_dir() else ()
    if damage:
        return {"verified": "unsound", "verdict": damage[0] + (f" (+{len(damage) - 1} more)" if damage[1:] else "")}
    if applies:
        return {"verified": "sound" if verdict.sound else "unsound", "verdict": verdict.describe()}
    if verdict is None:
        return {}
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(verdict.at))
    return {"verified": "outdated", "verdict": f"its files changed since it was checked ({when})"}


def to_repoint(rs: RootStatus) -> str:
    newest = rs.newest_native()
    if newest is None:
        return "no native tag is here to point it at"
    return f"`echo {newest} > {rs.root / F.LATEST}` points it at the newest tag here"
