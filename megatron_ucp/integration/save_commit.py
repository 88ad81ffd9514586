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
:mod:`megatron_ucp.integration.tag_replace`). A decoupled checkpoint engine
(0.17+, committed after the save returns) and node-local storage are left to DeepSpeed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import SaveFailedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import (
    Failure,
    comm,
    count_across,
    decide_on_first,
    gather_names,
    is_first,
    raise_gathered,
)
from megatron_ucp.integration.tag_replace import CHECKPOINT_FILE_ENDINGS, SetAside, set_aside

log = logging.getLogger(__name__)


class WriteWatch:
    """The first write of this rank that failed (the rest of the save is then not written), and the files it
    wrote."""

    def __init__(self) -> None:
        self.failure: Optional[SaveFailedError] = None
        self.written: list[str] = []

    def wrap(self, save: Callable[..., Any]) -> Callable[..., Any]:
        def watched_save(state_dict: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            if self.failure is not None:
                return None
            try:
                done = save(state_dict, path, *args, **kwargs)
                self.written.append(os.path.abspath(str(path)))
                return done
            except (OSError, RuntimeError) as exc:
                self.failure = SaveFailedError(f"{path}: write failed: {_reason(exc)}", subject=path)
                log.error(
                    "megatron-ucp: %s (global rank %s); the save will not become latest",
                    self.failure,
                    comm().get_rank(),
                )
                return None

        return watched_save


def _reason(exc: BaseException) -> str:
    """The OS error in words: torch's writer wraps it (``[enforce fail at ...] ... strerror: No space left``)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    found = re.search(r"strerror: (.+)$", text)
    return found.group(1) if found else text


@contextlib.contextmanager
def _watched(engine: Any, watch: WriteWatch) -> Iterator[None]:
    """The engine's checkpoint engine writes through ``watch`` for one save (an instance attribute, removed
    after)."""
    ce = engine.checkpoint_engine
    had = "save" in vars(ce)
    before = vars(ce).get("save")
    ce.save = watch.wrap(ce.save)
    try:
        yield
    finally:
        if had:
            ce.save = before
        else:
            del ce.save


def committed_save(engine: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``original(engine, *args, **kwargs)`` (DeepSpeed's ``save_checkpoint``), made ``latest`` only when
    every rank wrote its files (the module docstring)."""
    if surface.decoupled_checkpoint_engine(engine) or surface.node_local_storage(engine):
        return original(engine, *args, **kwargs)
    bound = inspect.signature(original).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    save_dir, tag, save_latest = bound.arguments["save_dir"], bound.arguments["tag"], bound.arguments["save_latest"]
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    bound.arguments["save_latest"] = False  # written below, once every rank wrote its files
    aside = decide_on_first(lambda: set_aside(Path(save_dir), tag))
    if isinstance(aside, Failure):
        if is_first():
            log.warning(
                "megatron-ucp: cannot move the earlier save of %s aside (%s); saving over it", tag, aside.message
            )
        aside = None
    watch = WriteWatch()
    with _watched(engine, watch):
        result = original(*bound.args, **bound.kwargs)
    if count_across(1 if watch.failure is not None else 0):
        _put_back(aside)
        raise_gathered(
            watch.failure,
            f"saving {tag} in {save_dir} (`latest` still names the previous tag; nothing was marked as saved)",
            subject=Path(save_dir) / tag,
        )
    folder = Path(save_dir) / tag
    written = gather_names(watch.written)
    strays = decide_on_first(lambda: _not_written(folder, written))
    if strays or isinstance(strays, Failure):
        _put_back(aside)
        raise SaveFailedError(
            f"saving {tag} in {save_dir}: the folder holds checkpoint files this save did not write, which a load "
            f"would refuse ({strays.message if isinstance(strays, Failure) else ', '.join(strays[:4])}); `latest` "
            "still names the previous tag",
            subject=folder,
        )
    if save_latest and is_first():
        _write_latest(Path(save_dir), tag)
    if aside is not None and is_first():
        aside.drop()
    return result


def _put_back(aside: Optional[SetAside]) -> None:
    """A failed save: the earlier save of its tag, if one was moved aside, back in place (the first rank)."""
    if aside is None or not is_first():
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


def _write_latest(save_dir: Path, tag: str) -> None:
    """``latest`` replaced by rename: a reader sees the previous tag or this one, never a partial name."""
    path = save_dir / F.LATEST
    tmp = path.with_name(f".{F.LATEST}.tmp-{os.getpid()}")
    tmp.write_text(tag)
    os.replace(tmp, path)
