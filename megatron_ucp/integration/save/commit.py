"""A save becomes ``latest`` only when every rank wrote its files.

DeepSpeed's ``save_checkpoint`` (0.16 to 0.19) writes ``latest`` on the first rank after that rank's own writes,
then every rank meets in a barrier. A rank whose ``torch.save`` fails (a full or failing file system) raises
alone: ``latest`` names its incomplete tag anyway, and the other ranks wait in the barrier until the collective
timeout, with nothing saying which rank or file.

Around a hooked save (:func:`committed_save`), every write through the engine's checkpoint engine (the only way
DeepSpeed writes a save's files: model states, rank files, layer and expert files) is watched. A failed write is
kept (file, OS error) and the rank writes nothing more of this save, but goes on through DeepSpeed's save as if
it had written, so that every rank reaches the same collectives in the same order. When DeepSpeed's save
returns, one small all-reduce tells every rank whether any failed: then every rank raises one
:class:`~megatron_ucp.errors.SaveFailedError` naming each failed rank's file and error (within seconds, not at
the collective timeout), and ``latest`` still names the previous tag, as does Megatron's
``latest_checkpointed_iteration.txt``, which Megatron writes only after this returns. Otherwise the first rank
writes ``latest`` (through a temporary file and a rename) as DeepSpeed would have, once the folder is known to hold
only this save's files (an earlier save of the same tag is moved aside first and removed once this one commits:
below). A decoupled checkpoint engine
(0.17+, committed after the save returns) and node-local storage are left to DeepSpeed.

A save into a tag folder that already exists leaves one save there, never two mixed.

DeepSpeed writes a save's files into ``<save_dir>/<tag>/`` over whatever is there. A save of a tag that exists
with more rank files (a restart that fell back past a damaged tag and saves it again at a smaller DP size, a rerun
from an earlier iteration, another TP or PP size) leaves the earlier save's extra files beside the new ones: every
later load refuses the folder ("files of another save in the folder?"), falls back past it and saves it again,
losing the same iterations at every restart.

Before a hooked save writes (:func:`set_aside`, the first rank; every rank waits for it), an existing folder of the
tag is moved aside whole, with the universal twin, Hugging Face export and verdict made of it (and ``latest_universal``
when it names that twin), into ``<save_dir>/.ucp/replaced/<tag>.<time>.<pid>.<unique>/``, by renames (instant on one
file system). When the new save commits, that folder is removed (:meth:`SetAside.drop`, in the background: the earlier
save was replaced by the user's own save); when the save fails, the partial new folder is moved there in its turn and
the earlier save put back (:meth:`SetAside.put_back`): a failed save changes nothing, and the earlier save is never
deleted before its replacement commits.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.background.store import ucp_dir
from megatron_ucp.background.verdicts import VERDICTS_DIR
from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import CheckpointFormatError, SaveFailedError
from megatron_ucp.export.hf_source import hf_name
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import read_tag_file
from megatron_ucp.integration.collectives import (
    Failure,
    comm,
    count_across,
    decide_on_first,
    gather_names,
    is_first,
    raise_gathered,
)

log = logging.getLogger(__name__)

REPLACED_DIR = "replaced"
"""Under the store (``<save_dir>/.ucp/``): earlier saves of a tag being saved again, until the new one commits."""
CHECKPOINT_FILE_ENDINGS = ("optim_states.pt", "model_states.pt")
"""The files of a save that a load binds (every layout's rank files and model states)."""


def _companions(save_dir: Path, tag: str) -> dict[str, Path]:
    """What belongs to the tag's save: its folder, its universal twin, its export, its verdict, and
    ``latest_universal`` when it names that twin (name -> path)."""
    return {
        tag: save_dir / tag,
        F.universal_tag(tag): save_dir / F.universal_tag(tag),
        hf_name(tag): save_dir / hf_name(tag),
        f"verdict-{tag}.json": ucp_dir(save_dir) / VERDICTS_DIR / f"{tag}.json",
        F.LATEST_UNIVERSAL: save_dir / F.LATEST_UNIVERSAL,
    }


def _belongs(name: str, path: Path, tag: str) -> bool:
    """Whether ``path`` (one of :func:`_companions`) is there and is the tag's: ``latest_universal`` only while it
    names the tag's twin (moved aside with it, a pointer to a folder no longer there would send a universal load to
    nothing; a load without it converts the new save first)."""
    if name != F.LATEST_UNIVERSAL:
        return path.exists()
    try:
        return path.is_file() and read_tag_file(path) == F.universal_tag(tag)
    except CheckpointFormatError:  # not a pointer this save can judge: left where it is
        return False


@dataclass(frozen=True)
class SetAside:
    """An earlier save of the tag being saved, moved aside (``folder``), and what was in it."""

    save_dir: Path
    tag: str
    folder: Path
    moved: tuple[str, ...]

    def drop(self) -> threading.Thread:
        """The new save committed: the earlier one is removed beside training (a large save takes a while to
        delete on a parallel file system; the save does not wait for it, the process's exit does)."""
        log.info("megatron-ucp: %s committed; removing the earlier save of it (%s)", self.tag, self.folder)
        remover = threading.Thread(target=shutil.rmtree, args=(self.folder,), kwargs={"ignore_errors": True})
        remover.start()
        return remover

    def put_back(self) -> None:
        """The new save failed: its partial files moved aside in turn (``<folder>/failed-save``), the earlier save
        back where it was."""
        places = _companions(self.save_dir, self.tag)
        if places[self.tag].exists():
            os.replace(places[self.tag], self.folder / "failed-save")
        for name in self.moved:
            os.replace(self.folder / name, places[name])
        log.error(
            "megatron-ucp: the save of %s failed: the earlier save of it is back in %s; the failed save's files are in "
            "%s",
            self.tag,
            self.save_dir / self.tag,
            self.folder / "failed-save",
        )


def holds_a_save(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint file (a rank file or model states) of some save."""
    try:
        return any(entry.is_file() and entry.name.endswith(CHECKPOINT_FILE_ENDINGS) for entry in os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return False


def set_aside(save_dir: Path, tag: str) -> Optional[SetAside]:
    """The tag's existing save moved aside before it is saved again (first rank); None when there is none."""
    existing = _companions(save_dir, tag)
    if not holds_a_save(existing[tag]):
        return None
    (ucp_dir(save_dir) / REPLACED_DIR).mkdir(parents=True, exist_ok=True)
    stamp = f"{tag}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}."  # unique: a tag may be set aside twice a second
    folder = Path(tempfile.mkdtemp(prefix=stamp, dir=ucp_dir(save_dir) / REPLACED_DIR))
    moved = []
    for name, path in existing.items():
        if _belongs(name, path, tag):
            os.replace(path, folder / name)
            moved.append(name)
    log.warning(
        "megatron-ucp: %s already holds a save of %s; this save replaces it: the earlier save (%s) is kept in %s "
        "until this one commits, then removed",
        save_dir,
        tag,
        ", ".join(moved),
        folder,
    )
    return SetAside(save_dir, tag, folder, tuple(moved))


class WriteWatch:
    """The first write of this rank that failed (the rest of the save is then not written), and the files it
    wrote."""

    def __init__(self, tag: str = "the save", rank: Optional[int] = None) -> None:
        self.tag = tag
        self.rank = rank
        """This rank's (given where the writes may outlive the process group), else asked when said."""
        self.failure: Optional[SaveFailedError] = None
        self.written: list[str] = []

    def write(self, write: Callable[[], Any], path: Any) -> Any:
        """``write()`` (one file of the save, at ``path``) unless an earlier one failed; a failure is kept and said."""
        if self.failure is not None:
            return None
        try:
            done = write()
            self.written.append(os.path.abspath(str(path)))
            return done
        except (OSError, RuntimeError) as exc:
            self.failure = SaveFailedError(f"{path}: write failed: {reason_of(exc)}", subject=path)
            log.error(
                "megatron-ucp: %s (global rank %s); %s will not become latest",
                self.failure,
                self.rank if self.rank is not None else comm().get_rank(),
                self.tag,
            )
            return None

    def wrap(self, save: Callable[..., Any]) -> Callable[..., Any]:
        def watched_save(state_dict: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            return self.write(lambda: save(state_dict, path, *args, **kwargs), path)

        return watched_save


def reason_of(exc: BaseException) -> str:
    """The OS error in words: torch's writer wraps it (``[enforce fail at ...] ... strerror: No space left``)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    found = re.search(r"strerror: (.+)$", text)
    return found.group(1) if found else text


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

    @property
    def folder(self) -> Path:
        return self.save_dir / self.tag


def open_save(
    engine: Any,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    before: Callable[[Path, str], None] = lambda save_dir, tag: None,
) -> tuple[Any, OpenSave]:
    """DeepSpeed's ``save_checkpoint`` arguments bound (``save_latest`` off: written at the commit), and the save
    opened: ``before(save_dir, tag)``, then an earlier save of its tag moved aside (collective: the first rank moves,
    every rank learns)."""
    bound = inspect.signature(original).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    save_dir, tag, save_latest = bound.arguments["save_dir"], bound.arguments["tag"], bound.arguments["save_latest"]
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    bound.arguments["save_latest"] = False  # written at the commit, once every rank wrote its files
    before(Path(save_dir), tag)
    aside = decide_on_first(lambda: set_aside(Path(save_dir), tag))
    if isinstance(aside, Failure):
        if is_first():
            log.warning(
                "megatron-ucp: cannot move the earlier save of %s aside (%s); saving over it", tag, aside.message
            )
        aside = None
    return bound, OpenSave(Path(save_dir), tag, bool(save_latest), aside)


def close_save(
    save: OpenSave, failure: Optional[SaveFailedError], written: list[str], then: Callable[[], None] = lambda: None
) -> None:
    """Collective: the save committed (``latest`` names it, then ``then()`` on the first rank, the earlier save of
    its tag removed) when every rank wrote its files and the folder holds no other save's; else the earlier save
    put back and one :class:`SaveFailedError` raised on every rank, naming each failed rank's file."""
    if count_across(1 if failure is not None else 0):
        if is_first():
            put_back(save.aside)
        raise_gathered(
            failure,
            f"saving {save.tag} in {save.save_dir} (`latest` still names the previous tag; nothing was marked as "
            "saved)",
            subject=save.folder,
        )
    every = gather_names(written)
    strays = decide_on_first(lambda: _not_written(save.folder, every))
    if strays or isinstance(strays, Failure):
        if is_first():
            put_back(save.aside)
        raise SaveFailedError(
            f"saving {save.tag} in {save.save_dir}: the folder holds checkpoint files this save did not write, which a "
            f"load would refuse ({strays.message if isinstance(strays, Failure) else ', '.join(strays[:4])}); "
            "`latest` still names the previous tag",
            subject=save.folder,
        )
    if is_first():
        commit_on_first(save, then)


def commit_on_first(save: OpenSave, then: Callable[[], None] = lambda: None, wait: bool = False) -> None:
    """The first rank's part of a commit every rank agreed on: ``latest`` names the save, then ``then()``, then the
    earlier save of its tag is removed (``wait``: before this returns, as when the process ends next)."""
    if save.save_latest:
        write_pointer(save.save_dir / F.LATEST, save.tag)
    then()
    if save.aside is not None:
        remover = save.aside.drop()
        if wait:
            remover.join()


def committed_save(engine: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``original(engine, *args, **kwargs)`` (DeepSpeed's ``save_checkpoint``), made ``latest`` only when
    every rank wrote its files (the module docstring)."""
    if surface.decoupled_checkpoint_engine(engine) or surface.node_local_storage(engine):
        return original(engine, *args, **kwargs)
    bound, save = open_save(engine, original, args, kwargs)
    watch = WriteWatch()
    with watched_writes(engine, watch.wrap):
        result = original(*bound.args, **bound.kwargs)
    close_save(save, watch.failure, watch.written)
    return result


def put_back(aside: Optional[SetAside]) -> None:
    """A failed save (the first rank's part): the earlier save of its tag, if one was moved aside, back in place."""
    if aside is None:
        return
    try:
        aside.put_back()
    except OSError as exc:
        log.error("megatron-ucp: cannot put the earlier save of %s back from %s: %s", aside.tag, aside.folder, exc)


def _not_written(folder: Path, written: set[str]) -> list[str]:
    """The tag folder's rank and model-states files that no rank of this save wrote (another save's)."""
    return sorted(
        entry.name
        for entry in os.scandir(folder)
        if entry.name.endswith(CHECKPOINT_FILE_ENDINGS) and os.path.abspath(entry.path) not in written
    )


def write_pointer(path: Path, value: str) -> None:
    """A pointer file (``latest``, Megatron's tracker) replaced by rename: a reader sees the previous value or this
    one, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(value)
    os.replace(tmp, path)
