"""Earlier saves of a tag set aside while the tag is saved again, and what a killed process left so settled.

A save into a tag folder that already exists leaves one save there, never two mixed. DeepSpeed writes a save's files
into ``<save_dir>/<tag>/`` over whatever is there: a save of a tag that exists with more rank files (a restart that
fell back past a damaged tag and saves it again at a smaller DP size, a rerun from an earlier iteration, another TP
or PP size) would leave the earlier save's extra files beside the new ones, and every later load would refuse the
folder. So before a hooked save writes (:func:`set_aside`, the first rank), an existing folder of the tag is moved
aside whole, with the universal twin, Hugging Face export, verdict and file list made of it (and ``latest_universal``
when it names that twin), into ``<save_dir>/.ucp/replaced/<tag>.<time>.<pid>.<unique>/``, by renames (instant on
one file system), after a record of what is set aside and for which save (:data:`ASIDE_RECORD`).

The save's commit (:mod:`megatron_ucp.integration.save.commit`) records itself (:func:`mark_committed`: the pointers
it writes and the set-aside folder it replaces, in ``.ucp/commits/<tag>.json``) before it renames its pointers, then
removes that folder (:meth:`SetAside.drop`: renamed out of sight, deleted in the background) and its record; a save
that does not commit gets the earlier save back (:meth:`SetAside.put_back`). A process killed in between leaves the
record or the folder: the next start of a save or a load (:func:`recover`, the first rank) finishes what was
interrupted: a recorded commit completed (its pointers written where they are older: ``latest`` and Megatron's
tracker agree again) and the folder it replaced removed; an unrecorded set-aside's earlier save put back, unless the
tag has since been saved by another save (then the earlier one is no longer needed). ``megatron-ucp status`` names
what is set aside and what becomes of it (:func:`leftovers`). The earlier save is never deleted before its
replacement commits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp import faults
from megatron_ucp.background.store import ucp_dir
from megatron_ucp.background.verdicts import VERDICTS_DIR
from megatron_ucp.deepspeed.model_states import model_states_path, recorded_save_id
from megatron_ucp.errors import CheckpointFormatError, UcpError, described
from megatron_ucp.export.hf_source import hf_name
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio
from megatron_ucp.format.paths import read_tag_file
from megatron_ucp.format.save_files import file_list_path
from megatron_ucp.plan.tags import tag_step

log = logging.getLogger(__name__)

REPLACED_DIR = "replaced"
"""Under the store (``<save_dir>/.ucp/``): earlier saves of a tag being saved again, until the new one commits."""
ASIDE_RECORD = "aside.json"
"""In a set-aside folder, written before anything is moved into it: the tag, the save replacing it, what was moved."""
COMMITS_DIR = "commits"
"""Under the store: a commit between its decision and its pointers' renames (``<tag>.json``: the pointers, the
set-aside folder it replaces)."""
REMOVING = ".removing"
"""A set-aside folder no longer needed, renamed so before it is deleted (a deletion cut short is never taken for a
set-aside save)."""
FAILED_SAVE = "failed-save"
CHECKPOINT_FILE_ENDINGS = ("optim_states.pt", "model_states.pt")
"""The files of a save that a load binds (every layout's rank files and model states)."""
_OPEN: set[Path] = set()
"""This process's set-aside folders whose save has not closed yet (:func:`recover` leaves them)."""
_RECOVERED: set[str] = set()
"""The save folders whose leftovers this process settled (once: only a process that ended leaves them)."""
HEARTBEAT_S = 5.0
"""How often a process touches the records of its open set-asides (:func:`_heartbeat`)."""
LIVE_S = 30.0
"""A set-aside or commit record touched this recently may belong to a live save on another host: left alone."""
_heart: dict[str, Optional[threading.Thread]] = {"thread": None}
_ASIDE_NAME = re.compile(r"^(?P<tag>.+)\.\d{8}-\d{6}\.\d+\.[^.]+$")


def _companions(save_dir: Path, tag: str) -> dict[str, Path]:
    """What belongs to the tag's save: its folder, its universal twin, its export, its verdict, its file list, and
    ``latest_universal`` when it names that twin (name -> path)."""
    return {
        tag: save_dir / tag,
        F.universal_tag(tag): save_dir / F.universal_tag(tag),
        hf_name(tag): save_dir / hf_name(tag),
        f"verdict-{tag}.json": ucp_dir(save_dir) / VERDICTS_DIR / f"{tag}.json",
        f"files-{tag}.json": file_list_path(save_dir, tag),
        F.LATEST_UNIVERSAL: save_dir / F.LATEST_UNIVERSAL,
    }


def _belongs(name: str, path: Path, tag: str) -> bool:
    """Whether ``path`` (one of :func:`_companions`) is there and is the tag's: ``latest_universal`` only while it
    names the tag's twin (moved aside with it, a pointer left naming a folder no longer there would send a universal
    load to nothing; a load without it converts the new save first)."""
    if name != F.LATEST_UNIVERSAL:
        return os.path.lexists(path)
    try:
        return path.is_file() and read_tag_file(path) == F.universal_tag(tag)
    except CheckpointFormatError:  # not a pointer this save can judge: left where it is
        return False


@dataclass(frozen=True)
class Pointer:
    """A small file a commit writes: ``latest``, Megatron's tracker."""

    path: Path
    value: str


def write_pointer(path: Path, value: str) -> None:
    """A pointer file (``latest``, Megatron's tracker) replaced durably by rename: a reader sees the previous value or
    this one, never a partial one, also after a power loss."""
    osio.write_durably(path, value)


def _owner() -> dict:
    """Who writes a record: the host and process (a record of a live process is left alone by another's recovery)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _live(record: Path, entry: dict) -> bool:
    """Whether the process that wrote ``record`` may still be saving: touched within :data:`LIVE_S`, unless it is
    on this host and gone (then it is surely dead; a live save on another host touches its records every
    :data:`HEARTBEAT_S`)."""
    try:
        fresh = time.time() - record.stat().st_mtime < LIVE_S
    except OSError:
        return False
    pid = entry.get("pid")
    if entry.get("host") == socket.gethostname() and isinstance(pid, int):
        return fresh and pid != os.getpid() and osio.pid_alive(pid)
    return fresh


def _heartbeat() -> None:
    """While this process has set-aside folders open, their records touched every :data:`HEARTBEAT_S` (a daemon
    thread, started at the first set-aside): another host's recovery sees the save is live."""
    while True:
        time.sleep(HEARTBEAT_S)
        for folder in list(_OPEN):
            with contextlib.suppress(OSError):
                os.utime(folder / ASIDE_RECORD)


def mark_committed(
    save_dir: Path, tag: str, save_id: str, pointers: Sequence[Pointer], aside: Optional["SetAside"]
) -> Path:
    """The save commits: from here on its set-aside save is not put back, and a process killed before its file list
    and pointers are written has the pointers written by the next start (:func:`recover`). Returns the record
    (:func:`end_commit`). Paths are recorded absolute: the next start may run from another folder."""
    faults.fault_point(f"commit {tag}: mark")
    record = ucp_dir(save_dir) / COMMITS_DIR / f"{tag}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    entry = {"tag": tag, "save_id": save_id, "aside": aside.folder.name if aside is not None else None, **_owner()}
    entry["pointers"] = [[os.path.abspath(p.path), p.value] for p in pointers]
    osio.write_durably(record, json.dumps(entry))
    _SAVED_HERE.add(os.path.join(os.path.abspath(save_dir), tag))
    return record


def end_commit(record: Path) -> None:
    """A commit whose pointers are written: its record removed (a record left is completed again: harmless)."""
    with contextlib.suppress(OSError):
        record.unlink(missing_ok=True)


def _commits(save_dir: Path) -> list[tuple[Path, dict]]:
    """The commit records in the store (an unreadable one: an empty entry, removed by :func:`recover`)."""
    out = []
    for path in sorted((ucp_dir(save_dir) / COMMITS_DIR).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            entry = {}
        out.append((path, entry if isinstance(entry, dict) else {}))
    return out


@dataclass(frozen=True)
class SetAside:
    """An earlier save of the tag being saved, moved aside (``folder``), and what was in it."""

    save_dir: Path
    tag: str
    folder: Path
    moved: tuple[str, ...]
    save_id: str = ""
    """The save that replaces it."""

    def close(self) -> None:
        """This process is done with it (its save will not commit here): the next start settles it."""
        _OPEN.discard(self.folder)

    def drop(self) -> Optional[threading.Thread]:
        """The new save committed: the earlier one is removed beside training (a large save takes a while to
        delete on a parallel file system; the save does not wait for it, the process's exit does)."""
        _OPEN.discard(self.folder)
        log.info("megatron-ucp: %s committed; removing the earlier save of it (%s)", self.tag, self.folder)
        return _remove(self.folder)

    def put_back(self) -> Optional[threading.Thread]:
        """The new save failed: what it made of the tag (its partial folder, a file list) moved aside in turn, the
        earlier save back where it was, then the set-aside folder removed (the thread removing it). Repeatable: a
        put-back cut short is finished by the next (:func:`recover`)."""
        faults.fault_point(f"put back {self.tag}")
        places = _companions(self.save_dir, self.tag)
        failed = self.folder / f"{FAILED_SAVE}-{time.time_ns()}"
        for name, place in places.items():  # the new save's, where the earlier save's go back (or had none)
            theirs = name in self.moved and os.path.lexists(self.folder / name)
            if name == F.LATEST_UNIVERSAL or not os.path.lexists(place) or not (theirs or name not in self.moved):
                continue
            failed.mkdir(exist_ok=True)
            os.replace(place, failed / name)
        for name in self.moved:
            if os.path.lexists(self.folder / name):
                os.replace(self.folder / name, places[name])
        _OPEN.discard(self.folder)
        log.error(
            "megatron-ucp: the save of %s did not commit: the earlier save of it is back in %s",
            self.tag,
            self.save_dir / self.tag,
        )
        return _remove(self.folder)


def _remove(folder: Path) -> Optional[threading.Thread]:
    """A set-aside folder renamed out of sight (:data:`REMOVING`), then deleted in the background."""
    removing = folder if folder.name.endswith(REMOVING) else folder.with_name(folder.name + REMOVING)
    try:
        if removing != folder:
            os.rename(folder, removing)
    except OSError as exc:
        log.error("megatron-ucp: cannot remove %s (%s); the next start removes it", folder, exc)
        return None
    remover = threading.Thread(target=shutil.rmtree, args=(removing,), kwargs={"ignore_errors": True})
    remover.start()
    return remover


def holds_a_save(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint file (a rank file or model states) of some save."""
    try:
        return any(entry.is_file() and entry.name.endswith(CHECKPOINT_FILE_ENDINGS) for entry in os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return False


def set_aside(save_dir: Path, tag: str, save_id: str = "") -> Optional[SetAside]:
    """The tag's existing save moved aside before it is saved again by ``save_id`` (first rank); None when there is
    none. A move that fails puts back what was moved and raises."""
    existing = _companions(save_dir, tag)
    # this process committed a save of the tag before: Megatron's save of its last iteration at the end of training
    again = os.path.join(os.path.abspath(save_dir), tag) in _SAVED_HERE
    if not holds_a_save(existing[tag]):
        return None
    (ucp_dir(save_dir) / REPLACED_DIR).mkdir(parents=True, exist_ok=True)
    stamp = f"{tag}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}."  # unique: a tag may be set aside twice a second
    folder = Path(tempfile.mkdtemp(prefix=stamp, dir=ucp_dir(save_dir) / REPLACED_DIR))
    names = [name for name, path in existing.items() if _belongs(name, path, tag)]
    aside = SetAside(save_dir, tag, folder, tuple(names), save_id)
    record = {"tag": tag, "save_id": save_id, "moved": names, **_owner()}
    osio.write_durably(folder / ASIDE_RECORD, json.dumps(record))
    _OPEN.add(folder)
    if _heart["thread"] is None:
        _heart["thread"] = threading.Thread(target=_heartbeat, name="megatron-ucp-set-aside", daemon=True)
        _heart["thread"].start()
    try:
        faults.fault_point(f"set aside {tag}")
        for name in names:
            os.replace(existing[name], folder / name)
            faults.fault_point(f"set aside {tag}: {name}")
        osio.fsync_path(folder)
    except BaseException:
        with contextlib.suppress(Exception):
            aside.put_back()
        raise
    if again:
        log.info("megatron-ucp: %s saved again by this run (Megatron saves its last iteration at the end too)", tag)
        return aside
    log.warning(
        "megatron-ucp: %s already holds a save of %s; this save replaces it: the earlier save (%s) is kept in %s "
        "until this one commits, then removed",
        save_dir,
        tag,
        ", ".join(names),
        folder,
    )
    return aside


_SAVED_HERE: set[str] = set()
"""``<save_dir>/<tag>`` of each save this process committed."""


def recover(save_dir: Path) -> list[str]:
    """What earlier processes left set aside in ``save_dir`` settled (first rank, once per process; the module
    docstring), each step said in the log; returns those lines. What may belong to a live save (:func:`_live`) is
    left alone, and looked at again at this process's next save or load."""
    key = os.path.abspath(save_dir)
    if key in _RECOVERED:
        return []
    done: list[str] = []
    committed: set[str] = set()
    live = False
    for record, entry in _commits(Path(save_dir)):
        committed.add(str(entry.get("aside")))  # never put back, even when its pointers cannot be written now
        if _live(record, entry):
            live = True
            continue
        try:
            for path, value in entry.get("pointers") or ():
                _complete(Pointer(Path(path), str(value)))
        except (OSError, TypeError, ValueError) as exc:
            done.append(f"{record}: cannot complete the commit it records ({described(exc)}); the next start tries")
            continue
        done.append(f"{entry.get('tag')}: its commit was cut short; its pointers are written")
        if not entry.get("aside") or _drop_named(Path(save_dir), str(entry["aside"])):
            end_commit(record)
    folder = ucp_dir(save_dir) / REPLACED_DIR
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        if entry in _OPEN or not entry.is_dir() or entry.name in committed:
            continue
        try:
            line = _settle(Path(save_dir), entry)
        except (OSError, UcpError) as exc:
            line = f"{entry}: cannot settle what an interrupted save left there ({described(exc)}); left as it is"
        if line == LIVE:
            live = True
        elif line:
            done.append(line)
    for line in done:
        log.warning("megatron-ucp: %s", line)
    if not live:
        _RECOVERED.add(key)
    return done


LIVE = "live"


def _drop_named(save_dir: Path, name: str) -> bool:
    """The set-aside folder ``name`` (a committed save's) removed; whether it is gone (or being removed)."""
    folder = ucp_dir(save_dir) / REPLACED_DIR / name
    if not folder.exists():
        return True
    return _remove(folder) is not None


def found_aside(save_dir: Path, folder: Path) -> Optional[SetAside]:
    """The set-aside folder as its record describes it; None without a record (a folder an earlier release set
    aside, or one cut short before its record)."""
    try:
        record = json.loads((folder / ASIDE_RECORD).read_text())
        return SetAside(save_dir, str(record["tag"]), folder, tuple(record["moved"]), str(record.get("save_id") or ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _settle(save_dir: Path, folder: Path) -> Optional[str]:
    """One set-aside folder of no commit: what becomes of it (None: nothing to say; :data:`LIVE`: left alone)."""
    if folder.name.endswith(REMOVING):
        _remove(folder)
        return None
    aside = found_aside(save_dir, folder)
    if aside is None:
        if any(p.name.startswith(FAILED_SAVE) for p in folder.iterdir()) or not any(folder.iterdir()):
            _remove(folder)  # an earlier release's put-back (its failed save kept), or a folder cut short: empty
            return None
        return None  # an earlier release's, whose save's outcome is unknown: named by status, left to the user
    if _live(folder / ASIDE_RECORD, _record_of(folder)):
        return LIVE
    if not any(name != ASIDE_RECORD for name in os.listdir(folder)):  # cut short before it moved anything
        _remove(folder)
        return None
    now = _current_save(save_dir / aside.tag)
    if now is not None and now != aside.save_id:
        aside.drop()
        return f"{aside.tag}: saved again since an interrupted save set its earlier save aside; that one was removed"
    aside.put_back()
    return f"{aside.tag}: a save of it was interrupted before it committed; the earlier save of it is back"


def _record_of(folder: Path) -> dict:
    try:
        entry = json.loads((folder / ASIDE_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return entry if isinstance(entry, dict) else {}


def _current_save(tag_dir: Path) -> Optional[str]:
    """Which save the tag folder's model states are of: None when there are none (or they cannot be read: cut short,
    as by the interrupted save), "" for a save without the hooks' record."""
    if model_states_path(tag_dir) is None:
        return None
    try:
        return recorded_save_id(tag_dir) or ""
    except (OSError, UcpError):
        return None


def _complete(pointer: Pointer) -> None:
    """A committed save's pointer written, unless it already names that save or a later one."""
    try:
        current = pointer.path.read_text().strip() if pointer.path.is_file() else ""
    except OSError:
        current = ""
    ours, theirs = _order(pointer.value), _order(current)
    if current == pointer.value or (ours is not None and theirs is not None and theirs > ours):
        return
    write_pointer(pointer.path, pointer.value)


def _order(value: str) -> Optional[int]:
    return int(value) if value.isdigit() else tag_step(value)


def leftovers(save_dir: Path) -> list[tuple[str, Path, str]]:
    """What is set aside in ``save_dir`` now (read only, for ``status``): (tag, folder, what becomes of it)."""
    folder = ucp_dir(save_dir) / REPLACED_DIR
    commits = _commits(Path(save_dir))
    committed = {entry.get("aside") for _, entry in commits}
    out = [
        (str(entry.get("tag")), record, "a commit cut short; the next start writes its pointers (latest, the tracker)")
        for record, entry in commits
    ]
    try:
        entries = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return out
    for entry in entries:
        if entry.name.endswith(REMOVING):
            out.append((entry.name[: -len(REMOVING)].split(".", 1)[0], entry, "being removed (no longer needed)"))
            continue
        aside = found_aside(Path(save_dir), entry)
        if aside is None:
            named = _ASIDE_NAME.match(entry.name)
            tag = named["tag"] if named else entry.name
            out.append((tag, entry, "an earlier save of it set aside by an earlier release; check it, then remove it"))
        elif entry.name in committed:
            out.append((aside.tag, entry, "its replacing save committed; the next start removes the earlier save"))
        elif _live(entry / ASIDE_RECORD, _record_of(entry)):
            owner = _record_of(entry)
            out.append(
                (aside.tag, entry, f"a save of it in progress (host {owner.get('host')}, pid {owner.get('pid')})")
            )
        else:
            out.append(
                (aside.tag, entry, "a save of it did not commit; the next start of a save or load puts this back")
            )
    return out
