"""A save becomes ``latest`` only when every rank wrote its files, and a save that does not commit changes nothing.

DeepSpeed's ``save_checkpoint`` (0.16 to 0.19) writes ``latest`` on the first rank after that rank's own writes,
then every rank meets in a barrier. A rank whose ``torch.save`` fails (a full or failing file system) raises
alone: ``latest`` names its incomplete tag anyway, and the other ranks wait in the barrier until the collective
timeout, with nothing saying which rank or file.

Around a hooked save (:func:`committed_save`), every write through the engine's checkpoint engine (the only way
DeepSpeed writes a save's files: model states, rank files, layer and expert files) is watched. A failed write (an
exception of any type) is kept (file, error) and the rank writes nothing more of this save, but goes on through
DeepSpeed's save as if it had written, so that every rank reaches the same collectives in the same order. When
DeepSpeed's save returns, one small all-reduce tells every rank whether any failed, or left a file it was asked to
write unwritten: then every rank raises one :class:`~megatron_ucp.errors.SaveFailedError` naming each failed rank's
file and error (within seconds, not at the collective timeout), and ``latest`` still names the previous tag, as does
Megatron's ``latest_checkpointed_iteration.txt``, which Megatron writes only after this returns. A decoupled
checkpoint engine (0.17+, committed after the save returns) and node-local storage are left to DeepSpeed.

The commit (:func:`commit_on_first`, the first rank, its outcome shared with every rank: an I/O error there fails
the save on every rank, never on the first alone) checks that the folder holds exactly the files the ranks wrote,
then writes, each to a temporary file ``fsync``'d before anything is renamed: the save's file list
(:mod:`megatron_ucp.format.save_files`: every file's size and zip-directory digest, which a load and ``verify``
check), then the pointers, Megatron's tracker (an asynchronous save's) and ``latest`` last, each renamed into place
and the rename made durable: a reader, also after a power loss, finds the previous value or the new one. Between
the list and the pointers the commit records itself in the store
(:func:`~megatron_ucp.background.set_aside.mark_committed`): a process killed there has its pointers written by the
next start, so that ``latest`` and the tracker agree again.

A save of a tag that already holds one first moves the earlier save aside (:mod:`megatron_ucp.background.set_aside`):
the commit marks it committed before it renames its pointers, then removes it; a save that does not commit, also when
DeepSpeed's own save raises, puts it back; what a killed process left is settled at the next start. A failed save
changes nothing, and the earlier save is never deleted before its replacement commits.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from megatron_ucp import faults
from megatron_ucp.background.set_aside import (
    CHECKPOINT_FILE_ENDINGS,
    Pointer,
    SetAside,
    end_commit,
    mark_committed,
    recover,
    set_aside,
    write_pointer,
)
from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import SaveFailedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio
from megatron_ucp.format.save_files import SavedFile, describe, file_list_path, file_list_text
from megatron_ucp.integration.collectives import JOB, Failure, comm, is_first
from megatron_ucp.integration.save import megatron_tracker

log = logging.getLogger(__name__)


class WriteWatch:
    """The first write of this rank that failed (the rest of the save is then not written), the files it was asked
    to write and those it wrote."""

    def __init__(self, tag: str = "the save", rank: Optional[int] = None) -> None:
        self.tag = tag
        self.rank = rank
        """This rank's (given where the writes may outlive the process group), else asked when said."""
        self.failure: Optional[SaveFailedError] = None
        self.asked: list[str] = []
        self.files: list[SavedFile] = []

    @property
    def written(self) -> list[str]:
        return [f.path for f in self.files]

    def expect(self, path: Any) -> None:
        """A file the save asked this rank to write (it must be written for the save to commit)."""
        self.asked.append(os.path.abspath(str(path)))

    def write(self, write: Callable[[], Any], path: Any) -> Any:
        """``write()`` (one file of the save, at ``path``) unless an earlier one failed; a failure of any type is kept
        and said."""
        if os.path.abspath(str(path)) not in self.asked:
            self.expect(path)
        if self.failure is not None:
            return None
        try:
            done = write()
            self.files.append(describe(path))
            return done
        except Exception as exc:
            self.fail(path, exc)
            return None

    def fail(self, path: Any, exc: BaseException) -> None:
        """Keep (and say) a failure of this rank's save, unless one is kept already."""
        if self.failure is not None:
            return
        self.failure = SaveFailedError(f"{path}: write failed: {reason_of(exc)}", subject=path)
        log.error(
            "megatron-ucp: %s (global rank %s); %s will not become latest",
            self.failure,
            self.rank if self.rank is not None else comm().get_rank(),
            self.tag,
        )

    def outcome(self) -> Optional[SaveFailedError]:
        """The failure of this rank's part of the save: the first failed write, else a file it was asked to write
        and did not."""
        if self.failure is None:
            unwritten = [p for p in self.asked if p not in set(self.written)]
            if unwritten:
                self.fail(unwritten[0], RuntimeError(f"never written ({len(unwritten)} file(s) of this rank)"))
        return self.failure

    def wrap(self, save: Callable[..., Any]) -> Callable[..., Any]:
        def watched_save(state_dict: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            def write() -> Any:
                faults.fault_point(f"write {self.tag}/{os.path.basename(str(path))}")
                return save(state_dict, path, *args, **kwargs)

            return self.write(write, path)

        return watched_save


def reason_of(exc: BaseException) -> str:
    """The error in words: an OS error by its reason (torch's writer wraps it: ``[enforce fail at ...] ...
    strerror: No space left``), any other by its type and message."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    found = re.search(r"strerror: (.+)$", text)
    if found:
        return found.group(1)
    return text if isinstance(exc, (OSError, RuntimeError)) and text else f"{type(exc).__name__}: {text}"


@contextlib.contextmanager
def watched_writes(engine: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """For one save, the engine's checkpoint engine writes through ``wrap(its save)`` (an instance attribute,
    removed after)."""
    ce = engine.checkpoint_engine
    had = "save" in vars(ce)
    before = vars(ce).get("save")
    ce.save = wrap(ce.save)
    try:
        yield
    finally:
        if had:
            ce.save = before
        else:
            del ce.save


@dataclass(frozen=True)
class OpenSave:
    """A hooked save between its start and its commit: where it goes, and the earlier save of its tag set aside."""

    save_dir: Path
    tag: str
    save_latest: bool
    aside: Optional[SetAside]
    save_id: str = ""

    @property
    def folder(self) -> Path:
        return self.save_dir / self.tag


def open_save(
    engine: Any,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    save_id: str = "",
    before: Callable[[Path, str], None] = lambda save_dir, tag: None,
) -> tuple[Any, OpenSave]:
    """DeepSpeed's ``save_checkpoint`` arguments bound (``save_latest`` off: written at the commit), and the save
    opened: ``before(save_dir, tag)``, then (collective: the first rank acts, every rank learns) what an interrupted
    save left settled (:func:`recover`) and an earlier save of its tag moved aside."""
    bound = inspect.signature(original).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    save_dir, tag, save_latest = bound.arguments["save_dir"], bound.arguments["tag"], bound.arguments["save_latest"]
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    bound.arguments["save_latest"] = False  # written at the commit, once every rank wrote its files
    before(Path(save_dir), tag)

    def on_first() -> Optional[SetAside]:
        recover(Path(save_dir))
        return set_aside(Path(save_dir), tag, save_id)

    aside = JOB.decide(on_first)
    if isinstance(aside, Failure):
        if is_first():
            log.warning(
                "megatron-ucp: cannot move the earlier save of %s aside (%s); saving over it", tag, aside.message
            )
        aside = None
    return bound, OpenSave(Path(save_dir), tag, bool(save_latest), aside, save_id)


def close_save(save: OpenSave, watch: WriteWatch, tracker: Optional[Pointer] = None) -> None:
    """Collective: the save committed (:func:`commit_on_first`, the first rank, whose outcome every rank learns)
    when every rank wrote every file it was asked to; else the earlier save put back and one
    :class:`SaveFailedError` raised on every rank, naming each failed rank's file."""
    failure = watch.outcome()
    if JOB.count(1 if failure is not None else 0):
        if is_first():
            put_back(save.aside)
        JOB.raise_gathered(
            failure,
            f"saving {save.tag} in {save.save_dir} (`latest` still names the previous tag; nothing was marked as "
            "saved)",
            subject=save.folder,
        )
    files = gather_files(watch.files)
    outcome = JOB.decide(lambda: commit_on_first(save, files, tracker))
    if isinstance(outcome, Failure):
        why = outcome.message.removeprefix(f"{outcome.kind}: ")
        raise SaveFailedError(f"saving {save.tag} in {save.save_dir}: {why}", subject=save.folder)


def gather_files(files: Sequence[SavedFile]) -> list[SavedFile]:
    """Every rank's files of the save, on every rank."""
    return [f for box in JOB.gather_objects(list(files)) for f in box]


def commit_on_first(save: OpenSave, files: Sequence[SavedFile], tracker: Optional[Pointer] = None, wait: bool = False):
    """The first rank's part of a commit every rank's writes agreed on (the module docstring): the folder checked to
    hold exactly ``files``, the file list, then the pointers (``tracker``: Megatron's, then ``latest``), then the
    earlier save of the tag removed (``wait``: before this returns, as when the process ends next). Raises
    :class:`SaveFailedError` with the earlier save put back and nothing pointing at this one."""
    every = {f.path for f in files}
    strays = _not_written(save.folder, every)
    missing = sorted(p for p in every if not os.path.isfile(p))
    if strays or missing:
        put_back(save.aside)
        why = (
            f"the folder holds checkpoint files this save did not write, which a load would refuse "
            f"({', '.join(strays[:4])})"
            if strays
            else f"files its ranks wrote are not there ({', '.join(missing[:4])})"
        )
        raise SaveFailedError(f"{why}; `latest` still names the previous tag", subject=save.folder)
    pointers = ([tracker] if tracker is not None else []) + (
        [Pointer(save.save_dir / F.LATEST, save.tag)] if save.save_latest else []
    )
    listing = file_list_path(save.save_dir, save.tag)
    before = {p.path: _read(p.path) for p in pointers}
    prepared: list[tuple[Path, Path]] = []
    placed: list[Path] = []
    record: Optional[Path] = None
    try:
        faults.fault_point(f"commit {save.tag}: file list")
        listing.parent.mkdir(parents=True, exist_ok=True)
        prepared.append((osio.prepare(listing, file_list_text(save.folder, save.save_id, files)), listing))
        for pointer in pointers:
            faults.fault_point(f"commit {save.tag}: {pointer.path.name}")
            prepared.append((osio.prepare(pointer.path, pointer.value), pointer.path))
        # decided: from here a killed process's next start completes the commit (and never puts the earlier back)
        record = mark_committed(save.save_dir, save.tag, save.save_id, pointers, save.aside)
        for tmp, path in prepared:
            faults.fault_point(f"commit {save.tag}: place {path.name}")
            osio.place(tmp, path)
            placed.append(path)
    except BaseException as exc:
        for tmp, _ in prepared:
            tmp.unlink(missing_ok=True)
        _undo(placed, before, listing, record)
        put_back(save.aside)
        if not isinstance(exc, Exception):
            raise
        raise SaveFailedError(
            f"its commit failed: {reason_of(exc)}; `latest` still names the previous tag", subject=save.folder
        ) from exc
    remover = save.aside.drop() if save.aside is not None else None
    if save.aside is None or remover is not None:  # else the record stays: the next start removes the earlier save
        end_commit(record)
    if wait and remover is not None:
        remover.join()


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def _undo(placed: list[Path], before: dict[Path, Optional[str]], listing: Path, record: Optional[Path]) -> None:
    """A commit cut short by an error: what it placed given back (best effort: the pointers their earlier values, the
    file list removed, the commit's record taken back)."""
    for path in placed:
        with contextlib.suppress(OSError):
            if path == listing:
                path.unlink(missing_ok=True)
            elif before.get(path) is None:
                path.unlink(missing_ok=True)
            else:
                write_pointer(path, before[path] or "")
    if record is not None:
        end_commit(record)


def committed_save(engine: Any, original: Callable[..., Any], args: tuple, kwargs: dict, save_id: str = "") -> Any:
    """``original(engine, *args, **kwargs)`` (DeepSpeed's ``save_checkpoint``), made ``latest`` only when
    every rank wrote its files (the module docstring)."""
    if surface.decoupled_checkpoint_engine(engine) or surface.node_local_storage(engine):
        return original(engine, *args, **kwargs)
    bound, save = open_save(engine, original, args, kwargs, save_id)
    tracker = megatron_tracker.for_synchronous_save(save.save_dir, bound.arguments.get("client_state"))
    watch = WriteWatch(save.tag)
    with put_back_if_raised(save):
        with watched_writes(engine, watch.wrap):
            result = original(*bound.args, **bound.kwargs)
        close_save(save, watch, tracker)
    return result


@contextlib.contextmanager
def put_back_if_raised(save: OpenSave) -> Iterator[None]:
    """Around a save from its set-aside to its commit: an exception from DeepSpeed's own save (not one this module
    raised, which put back already) leaves the earlier save where it was set aside, for the next start to put back
    (:func:`~megatron_ucp.background.set_aside.recover`): other ranks may still be writing into the tag's folder,
    which a put-back now would hand them (their files over the earlier save's)."""
    try:
        yield
    except SaveFailedError:
        raise
    except BaseException:
        if is_first() and save.aside is not None:
            save.aside.close()
            log.error(
                "megatron-ucp: the save of %s raised before it committed: `latest` names the previous save; the "
                "earlier save of %s waits in %s, and the next start puts it back",
                save.tag,
                save.tag,
                save.aside.folder,
            )
        raise


def put_back(aside: Optional[SetAside]) -> None:
    """A failed save (the first rank's part): the earlier save of its tag, if one was moved aside, back in place."""
    if aside is None or not aside.folder.is_dir():
        return
    try:
        aside.put_back()
    except Exception as exc:  # of any type: said, never raised on the first rank alone
        log.error(
            "megatron-ucp: cannot put the earlier save of %s back from %s: %s; the next start does",
            aside.tag,
            aside.folder,
            exc,
        )


def _not_written(folder: Path, written: set[str]) -> list[str]:
    """The tag folder's rank and model-states files that no rank of this save wrote (another save's)."""
    return sorted(
        entry.name
        for entry in os.scandir(folder)
        if entry.name.endswith(CHECKPOINT_FILE_ENDINGS) and os.path.abspath(entry.path) not in written
    )
