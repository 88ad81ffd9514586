"""An asynchronous save (``--ucp-async-save``): ``save_checkpoint`` returns once this rank's state is in host memory;
the files are written beside training and the save is committed across the job when every rank's are durable.

Inside a hooked save (:func:`async_save`) every file DeepSpeed saves through its checkpoint engine is copied into
reusable host buffers (:mod:`megatron_ucp.integration.save.host_copy`) instead of written; when DeepSpeed's save
returns, this process's writer thread writes them with the checkpoint engine's own ``save`` (the same files a
synchronous save writes) to a temporary name, ``fsync``s them and renames them into place. ``latest`` is not
written by DeepSpeed (``save_latest`` off), and Megatron's ``latest_checkpointed_iteration.txt``, which Megatron
writes as soon as the save returns, is redirected aside for that one write
(:mod:`megatron_ucp.integration.save.megatron_tracker`): both name the save only at its commit.

The commit is agreed where training already meets, never from a background thread: at each optimizer step
(``_take_model_step``, where DeepSpeed's own decoupled engine commits) while a save is in flight, and at the next
save, one small all-reduce asks whether every rank's writer finished; when all did, the commit of
:func:`~megatron_ucp.integration.save.commit.close_save` runs (a write that failed anywhere: the earlier save put
back and the failure said on every rank, naming the file; training goes on), then the background conversion of
the save is queued. A load commits the saves in flight before it reads anything, and so does a job leaving its
process group (DeepSpeed's ``destroy_process_group``: a worker that ends without exit handlers). At the end of the
run, when the ranks no longer meet (a script may have left its process group), each rank records its outcome in the
store and the first rank commits from those records (:func:`at_end_of_run`).

At most ``saves_in_flight`` saves are written at once: a save that finds as many still writing waits for them, and
says how long. A file whose copy cannot be taken (no host memory, or anything else the copy raises) is written
before the save returns instead, with one warning. An exception of any type in the writer fails that save (named on
every rank at its commit) and the writer goes on with the next; a file the save was asked to write and that is not
written fails it too. A job that dies of an exception does not wait at its exit for the ranks it can no longer
meet: its saves in flight stay uncommitted, ``latest`` names the previous one, and the next start puts back what
they set aside (:func:`~megatron_ucp.background.set_aside.recover`).

Size: one save's life, from its copy to its commit at a step or at the end of the run, shares one state (the saves
in flight, the host slots, the writer); split, each part would reach into the others'. The writer thread itself is
:mod:`~megatron_ucp.integration.save.writer` (the memory saves have one too).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp import faults
from megatron_ucp.background.store import record_save_outcome, ucp_dir
from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import SaveFailedError
from megatron_ucp.format.save_files import SavedFile
from megatron_ucp.integration.collectives import JOB, comm, device, is_first
from megatron_ucp.integration.save import megatron_tracker
from megatron_ucp.integration.save.commit import (
    OpenSave,
    WriteWatch,
    close_save,
    commit_on_first,
    open_save,
    put_back,
    put_back_if_raised,
    reason_of,
    watched_writes,
    write_pointer,
)
from megatron_ucp.integration.save.host_copy import HostBuffers, HostCopy, HostMemoryShort, WhenWritten, written_form
from megatron_ucp.integration.save.writer import Writer, write

log = logging.getLogger(__name__)

OUTCOMES_DIR = "async-saves"
"""Under the store (``<save_dir>/.ucp/``): one folder per save committed at the end of the run (``<tag>.<save id>``),
with each rank's outcome and the first rank's verdict."""
VERDICT_FILE = "verdict.json"


@dataclass
class InFlight:
    """One save of this rank, from its return to its commit."""

    save: OpenSave
    iteration: Optional[int]
    """Megatron's iteration (its client state's), for its tracker at the commit; None: not Megatron's save."""
    files: list[tuple[Callable[..., Any], Any, str]] = field(default_factory=list)
    """(the checkpoint engine's save, the host copy of a state dict, its path), in DeepSpeed's order."""
    save_id: str = ""
    """The save's identity (the same on every rank): its records at the end of the run are its own."""
    rank: int = 0
    world: int = 1
    """This process's place in the job at the save (the end of the run may come after the process group is gone)."""
    watch: WriteWatch = field(default_factory=WriteWatch)
    """Which files this rank was asked to write and wrote, and its first failed write."""
    tracker: Optional[Path] = None
    """Where Megatron's tracker write after this save went (:mod:`~megatron_ucp.integration.save.megatron_tracker`)."""
    done: threading.Event = field(default_factory=threading.Event)
    returned: float = 0.0
    engine: Any = None
    """The engine that saved: its configuration decides what follows the commit (the background conversion), whichever
    engine's step, load or exit commits it."""
    after_write: Optional[Callable[[str], None]] = None
    """Called by the writer on each file written (a memory save's checksums, off the training thread)."""
    then: Optional[Callable[[], None]] = None
    """Called by the writer once the files are done, written or not (a memory save's commit)."""


@dataclass
class _State:
    config: Optional[UcpConfig] = None
    in_flight: collections.deque = field(default_factory=collections.deque)
    slots: list[HostBuffers] = field(default_factory=list)
    saves: int = 0
    writer: Writer = field(default_factory=lambda: Writer("megatron-ucp-writer"))
    failed: list[str] = field(default_factory=list)
    short_warned: bool = False
    unsupported_warned: bool = False
    reported: bool = False
    last_copied: int = 0
    redirected: Optional[str] = None
    """Why Megatron's tracker is not redirected ("" once it is; None: not tried yet)."""


_state = _State()
_crash: dict[str, Any] = {"crashed": False, "excepthook": None}
"""Whether this process is dying of an uncaught exception (its exit then waits for nobody)."""
_COPYING: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_ucp_async_copying", default=False)
"""True inside the save of :func:`async_save`: what its state dicts compute from their tensors may wait for the
writer (:func:`when_written`)."""
_AFTER_COMMIT: list[Callable[[Any, str, str, Optional[tuple[int, int]]], None]] = []
"""What runs on every rank once a save commits (``(engine, save_dir, tag, place)``: the background conversion's
trigger; ``place``, the rank and world size at the save, is given at the end of the run, where the process group may
be gone)."""


def wanted(config: UcpConfig) -> bool:
    return config.async_save


def install(patches: Any, config: UcpConfig) -> None:
    """Asynchronous saves for this process: the save hook routes here (:func:`enabled`); each optimizer step
    commits what every rank finished writing; the end of the run commits the rest."""
    _state.config = config
    _state.slots = [HostBuffers(pin=pinning()) for _ in range(config.saves_in_flight)]
    surface.replace(patches, surface.ENGINE, "_take_model_step", _committing_step)
    surface.replace(patches, surface.ENGINE, "load_checkpoint", _loading_after_the_saves, stack=True)
    surface.replace(patches, surface.TORCH_BACKEND, "destroy_process_group", _committing_before_leaving)
    atexit.register(_at_exit)
    watch_for_crash()


def on_uninstall() -> None:
    atexit.unregister(_at_exit)
    finish_in_flight()
    reset()
    stop_watching_for_crash()


def watch_for_crash() -> None:
    """Remember when training dies of an uncaught exception (once per process): the exit handlers then wait for
    nobody (:func:`crashed`)."""
    if _crash["excepthook"] is None:
        _crash["excepthook"] = sys.excepthook
        sys.excepthook = _excepthook


def stop_watching_for_crash() -> None:
    """The interpreter's exception hook back (the hooks uninstalled)."""
    if _crash["excepthook"] is not None and sys.excepthook is _excepthook:
        sys.excepthook = _crash["excepthook"]
    _crash["excepthook"] = None


def _excepthook(kind: type, value: BaseException, tb: Any) -> None:
    _crash["crashed"] = True
    (_crash["excepthook"] or sys.__excepthook__)(kind, value, tb)


def note_crash() -> None:
    """The job is ending by an exception (or a failing exit status), said by whoever knows before the interpreter's
    hook runs (the runner, whose uninstall comes first): its exit handlers wait for nobody."""
    _crash["crashed"] = True


def forget_crash() -> None:
    """A crash noted by :func:`note_crash` forgotten once the hooks are gone (a later run in this process starts
    clean)."""
    _crash["crashed"] = False


def crashed() -> bool:
    """The process is dying of an uncaught exception: its ranks will not meet again."""
    return bool(_crash["crashed"])


def after_commit(callback: Callable[[Any, str, str, Optional[tuple[int, int]]], None]) -> None:
    """``callback(engine, save_dir, tag, place)`` on every rank once an asynchronous save commits."""
    _AFTER_COMMIT[:] = [callback]


def _committing_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _take_model_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _state.in_flight:
            settle(self, block=False)
        return original(self, *args, **kwargs)

    return _take_model_step


def _loading_after_the_saves(original: Callable[..., Any]) -> Callable[..., Any]:
    """A load reads what the saves before it wrote: the saves in flight are written and committed first (collective:
    every rank loads), so that a job may load what it just saved (an evaluation, a rollback after a loss spike)."""

    @functools.wraps(original)
    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _state.in_flight:
            if is_first():
                log.info("megatron-ucp: this load waits for %d save(s) in flight to commit", len(_state.in_flight))
            while _state.in_flight:
                settle(None, block=True)  # each save's own engine decides what follows its commit
        return original(self, *args, **kwargs)

    return load_checkpoint


def wait_for_saves() -> None:
    """Collective (every rank): each asynchronous save of this process written and committed before it returns, for
    a script that reads a save's files itself right after ``save_checkpoint`` (the engine's own load waits by
    itself). Raises :class:`~megatron_ucp.errors.SaveFailedError` naming the saves that failed meanwhile (each
    already said on every rank; ``latest`` names the save before them)."""
    failed_before = len(_state.failed)
    while _state.in_flight:
        settle(None, block=True)
    failed = _state.failed[failed_before:]
    if failed:
        raise SaveFailedError("%d asynchronous save(s) failed: %s" % (len(failed), "; ".join(failed)))


def _committing_before_leaving(original: Callable[..., Any]) -> Callable[..., Any]:
    """The job leaves its process group (every rank: the end of a training loop, of a test's worker): the saves in
    flight are committed first, while the ranks still meet. A process that ends without exit handlers (a launcher's
    or a pool's worker) would never commit them otherwise."""

    @functools.wraps(original)
    def destroy_process_group(self: Any, group: Any = None, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if _state.in_flight and (group is None or group is dist.GroupMember.WORLD) and dist.is_initialized():
            try:
                _commit_before_leaving()
            except Exception as exc:  # said; the job leaves its group as it asked
                log.error("megatron-ucp: committing the saves in flight before leaving the process group: %s", exc)
        return original(self, group, *args, **kwargs)

    return destroy_process_group


def _commit_before_leaving() -> None:
    """Each rank's writer given up to ``converter_exit_wait`` seconds, then one agreement: every rank's files written
    (commit them now, together) or not (leave them to the end of the run's records, which need no collective). A
    stalled file system never holds the job's exit forever, and no rank leaves while another still commits."""
    wait = float(_state.config.converter_exit_wait) if _state.config is not None else 0.0
    deadline = time.monotonic() + wait
    for flight in list(_state.in_flight):
        flight.done.wait(max(0.0, deadline - time.monotonic()))
    unfinished = JOB.count(sum(not flight.done.is_set() for flight in _state.in_flight))
    if unfinished:
        log.warning(
            "megatron-ucp: leaving the process group with %d file write(s) unfinished after %.0fs: the saves in "
            "flight are left to the end of the run (committed there if every rank finishes, else not latest)",
            unfinished,
            wait,
        )
        return
    while _state.in_flight:
        settle(None, block=True)


def pinning() -> Optional[Callable[[Any], Any]]:
    """How host buffers are pinned where the state lives on an accelerator (page-locked: copies at the link's speed,
    overlapped), through the accelerator's own ``pin_memory``; None on the CPU."""
    import torch

    return None if torch.empty(0, device=device()).is_cpu else surface.accelerator().pin_memory


def enabled() -> bool:
    return _state.config is not None and _state.config.async_save


def supported(engine: Any) -> bool:
    """Whether this engine's saves can be asynchronous: not with a decoupled checkpoint engine (it writes after the
    save itself) nor with node-local storage, which keep DeepSpeed's own save, with one warning."""
    if surface.decoupled_checkpoint_engine(engine) or surface.node_local_storage(engine):
        if not _state.unsupported_warned:
            _state.unsupported_warned = True
            log.warning(
                "megatron-ucp: --ucp-async-save: a decoupled checkpoint engine or node-local storage saves its own "
                "way: DeepSpeed's save as it is"
            )
        return False
    return True


# ------------------------------------------------------------------------------------------------
# the save: copied into host memory, handed to the writer
# ------------------------------------------------------------------------------------------------


def async_save(engine: Any, original: Callable[..., Any], args: tuple, kwargs: dict, save_id: str) -> Any:
    """DeepSpeed's ``save_checkpoint``, returning once this rank's files are copied into host memory."""
    if _state.redirected is None:
        _state.redirected = megatron_tracker.redirect() or ""
        if _state.redirected:
            log.debug("megatron-ucp: Megatron's tracker not redirected: %s", _state.redirected)
    bound, save = open_save(
        engine, original, args, kwargs, save_id, lambda folder, tag: _make_room(engine, folder / tag)
    )
    rank = comm().get_rank()
    flight = InFlight(
        save,
        megatron_tracker.iteration_of(bound.arguments.get("client_state")),
        save_id=save_id,
        rank=rank,
        world=comm().get_world_size(),
        watch=WriteWatch(save.tag, rank),
        engine=engine,
    )
    slot = _state.slots[_state.saves % len(_state.slots)]
    _state.saves += 1
    t0 = time.perf_counter()
    with put_back_if_raised(save):
        result, host = copy_to_host(engine, lambda: original(*bound.args, **bound.kwargs), flight, slot)
    flight.returned = time.monotonic()
    _state.last_copied = host.copied_bytes
    if flight.iteration is not None and not _state.redirected:  # Megatron writes its tracker next: aside
        flight.tracker = megatron_tracker.aside_next_write(save.save_dir, save.tag)
    _state.in_flight.append(flight)
    _state.writer.put(flight)
    if is_first():
        log.info(
            "megatron-ucp: %s copied into host memory in %.3fs (%.1f MB on this rank); written in the background, "
            "committed when every rank's files are durable",
            save.tag,
            time.perf_counter() - t0,
            host.copied_bytes / 1e6,
        )
    return result


def copy_to_host(
    engine: Any,
    call: Callable[[], Any],
    flight: InFlight,
    slot: HostBuffers,
    shape: Optional[Callable[[Any, str], Any]] = None,
) -> tuple[Any, HostCopy]:
    """``call()`` (DeepSpeed's ``save_checkpoint``) with every file it saves copied into ``slot`` for ``flight``
    instead of written (the writer writes them): its result, once the copies are taken. ``shape(state_dict, path)``:
    what of each state dict is written (a memory save's leaves the weights to the masters)."""
    host = HostCopy(slot)
    copying = _COPYING.set(True)
    try:
        with watched_writes(engine, lambda ce_save: _capture(ce_save, flight, host, shape)):
            result = call()
            host.finish(surface.accelerator().synchronize)
    finally:
        _COPYING.reset(copying)
    return result, host


def when_written(compute: Callable[..., Any], *args: Any) -> Any:
    """``compute(*args)`` now, or, inside an asynchronous save, when the file is written: from the host copies of the
    tensors in ``args``, by the writer thread (the save record's checksums: not part of the stall)."""
    return WhenWritten(compute, args) if _COPYING.get() else compute(*args)


def _capture(
    ce_save: Callable[..., Any], flight: InFlight, host: HostCopy, shape: Optional[Callable[[Any, str], Any]] = None
) -> Callable[..., Any]:
    def save(state_dict: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        flight.watch.expect(path)
        try:
            faults.fault_point(f"copy {flight.save.tag}/{Path(str(path)).name}")
            copied = host.of(shape(state_dict, str(path)) if shape is not None else state_dict)
        except Exception as exc:  # no host memory, or a copy that cannot be taken: this file written now
            if not _state.short_warned:
                _state.short_warned = True
                why = str(exc) if isinstance(exc, HostMemoryShort) else f"its copy failed ({reason_of(exc)})"
                log.warning("megatron-ucp: %s: %s: written before the save returns", path, why)
            write(flight, lambda target: ce_save(written_form(state_dict), target, *args, **kwargs), str(path))
            return None
        flight.files.append((lambda s, target: ce_save(s, target, *args, **kwargs), copied, str(path)))
        return None

    return save


# ------------------------------------------------------------------------------------------------
# the commit: agreed at the step boundary and at the next save
# ------------------------------------------------------------------------------------------------


def _make_room(engine: Any, folder: Path) -> None:
    """Before a save into ``folder``: the saves in flight beyond the limit, and one into the same folder, written (this
    rank waits for its writer, saying how long) and committed; the rest asked once."""
    limit = _state.config.saves_in_flight if _state.config is not None else 1

    def full() -> bool:
        return len(_state.in_flight) >= limit or any(f.save.folder == folder for f in _state.in_flight)

    t0 = time.perf_counter()
    was_full = full()
    while full():
        settle(engine, block=True)
    if was_full and time.perf_counter() - t0 > 0.01 and is_first():  # the wait for every rank's writer
        log.warning(
            "megatron-ucp: this save waited %.2fs for the previous one's files (%d save(s) may be written at once)",
            time.perf_counter() - t0,
            limit,
        )
    settle(engine, block=False)


def settle(engine: Any, block: bool = False) -> None:
    """Collective (every rank, in step): commit, oldest first, each save in flight that every rank finished writing.
    ``block``: the oldest is waited for (this rank's writer, then the others') and committed first."""
    must = block
    while _state.in_flight:
        oldest: InFlight = _state.in_flight[0]
        if must:
            _state.writer.wait(oldest)
        if JOB.count(0 if oldest.done.is_set() else 1):  # the same sum on every rank: every rank goes the same way
            if not must:
                return
            time.sleep(0.05)  # another rank still writes: ask again
            continue
        must = False
        _state.in_flight.popleft()
        _commit(engine, oldest)


def _commit(engine: Any, flight: InFlight) -> None:
    save = flight.save
    try:
        close_save(save, flight.watch, megatron_tracker.at_commit(save.save_dir, flight.tracker, flight.iteration))
    except SaveFailedError as exc:
        log.error("megatron-ucp: %s; training goes on (the save is lost, the previous one stays latest)", exc)
        _failed(flight, str(exc))
        return
    if is_first():
        record_save_outcome(save.save_dir, save.tag)
        log.info(
            "megatron-ucp: %s committed: every rank's files durable (%.2fs after the save returned)",
            save.tag,
            time.monotonic() - flight.returned,
        )
    for callback in _AFTER_COMMIT:
        callback(flight.engine if flight.engine is not None else engine, str(save.save_dir), save.tag, None)


# ------------------------------------------------------------------------------------------------
# the end of the run: outcomes through the store, the first rank commits
# ------------------------------------------------------------------------------------------------


def at_end_of_run(wait: float) -> None:
    """Every save still in flight written (this rank's writer) and its outcome recorded in the store (the files it
    wrote, or why not); the first rank commits from every rank's record and records the verdict, which the others
    wait for (each up to ``wait`` seconds): no collective, the ranks may have left their process group. A process dying
    of an exception (:func:`crashed`) waits for nobody: its record says so, and the first rank commits nothing."""
    dying = crashed()
    while _state.in_flight:
        flight: InFlight = _state.in_flight.popleft()
        if dying:  # its writer may still write into the folder: nobody puts the earlier save back over it now
            flight.watch.fail(flight.save.folder, RuntimeError(f"global rank {flight.rank} died of an exception"))
        elif not flight.done.is_set():
            log.warning("megatron-ucp: waiting for this rank's files of %s to be written", flight.save.tag)
            _state.writer.wait(flight)
        folder = ucp_dir(flight.save.save_dir) / OUTCOMES_DIR / f"{flight.save.tag}.{flight.save_id}"
        folder.mkdir(parents=True, exist_ok=True)
        failure = flight.watch.outcome()
        files = [list(dataclasses.astuple(f)) for f in flight.watch.files]
        record = {"failure": None if failure is None else str(failure), "files": files, "dying": dying}
        write_pointer(folder / f"rank-{flight.rank}.json", json.dumps(record))
        if flight.rank == 0:
            ranks = [folder / f"rank-{r}.json" for r in range(flight.world)]
            why = _commit_from_records(flight, ranks, 0.0 if dying else wait, dying)
            write_pointer(folder / VERDICT_FILE, json.dumps({"failure": why}))
        else:
            found = _records([folder / VERDICT_FILE], time.monotonic() + (0.0 if dying else wait))
            why = found[0]["failure"] if found else "the first rank did not say whether it committed"
            if why is not None:
                log.error("megatron-ucp: %s was not committed at the end of the run: %s", flight.save.tag, why)
                _state.failed.append(f"saving {flight.save.tag} in {flight.save.save_dir}: {why}")
        if why is None:  # the process group may be gone: each rank's place as it saved
            for callback in _AFTER_COMMIT:
                callback(None, str(flight.save.save_dir), flight.save.tag, (flight.rank, flight.world))


def _records(paths: list[Path], deadline: float) -> list[dict]:
    """The JSON records at ``paths``, waiting until ``deadline`` for all of them; those found."""
    found: dict[Path, dict] = {}
    while True:
        for path in paths:
            if path not in found:
                with contextlib.suppress(OSError, ValueError):
                    found[path] = json.loads(path.read_text())
        if len(found) == len(paths) or time.monotonic() >= deadline:
            return list(found.values())
        time.sleep(0.2)


def _commit_from_records(flight: InFlight, records: list[Path], wait: float, dying: bool = False) -> Optional[str]:
    """The first rank's commit at the end of the run, from every rank's record; returns why not (None: committed).
    The earlier save of the tag is put back only when every rank said it is done writing (a rank that did not say,
    or died of an exception, this one included, may still write into the folder: then the next start puts it
    back)."""
    save = flight.save
    found = _records(records, time.monotonic() + wait)
    failures = [record["failure"] for record in found if record.get("failure")]
    silent = len(records) - len(found) + sum(1 for record in found if record.get("dying")) + int(dying)
    why = "; ".join(failures[:4]) or (f"{silent} rank(s) did not say they finished writing" if silent else None)
    if why is None:
        files = [SavedFile(*entry) for record in found for entry in record.get("files") or ()]
        tracker = megatron_tracker.at_commit(save.save_dir, flight.tracker, flight.iteration)
        try:  # the process ends next: the earlier save removed before it does
            commit_on_first(save, files, tracker, wait=True)
        except SaveFailedError as exc:
            why = str(exc)
    if why is not None:
        log.error(
            "megatron-ucp: %s was not committed at the end of the run (%s); `latest` names the previous save",
            save.tag,
            why,
        )
        _failed(flight, f"saving {save.tag} in {save.save_dir}: {why}")
        if not silent:
            put_back(save.aside)
        elif save.aside is not None:
            save.aside.close()
        return why
    record_save_outcome(save.save_dir, save.tag)
    log.info("megatron-ucp: %s committed at the end of the run (every rank's files durable)", save.tag)
    return None


def last_copied_bytes() -> int:
    """The bytes this rank's last asynchronous save copied into host memory (what the copy floor is measured on)."""
    return _state.last_copied


def _failed(flight: InFlight, message: str) -> None:
    """A save that did not commit: kept for the end of the run's report, and (first rank) for ``status``."""
    _state.failed.append(message)
    if flight.rank == 0:
        record_save_outcome(flight.save.save_dir, flight.save.tag, message)


def finish_in_flight() -> None:
    """The end of the run (the runner, the exit handler, the uninstall): what is still in flight written and
    committed (:func:`at_end_of_run`)."""
    config = _state.config
    if config is not None and _state.in_flight:
        at_end_of_run(float(config.converter_exit_wait))
    if _state.failed and not _state.reported:
        _state.reported = True
        log.error(
            "megatron-ucp: %d asynchronous save(s) of this run failed and did not become latest:\n  %s",
            len(_state.failed),
            "\n  ".join(_state.failed),
        )


def _at_exit() -> None:
    finish_in_flight()


def reset() -> None:
    """This process's asynchronous saves forgotten (the writer told to stop once its queue is empty), Megatron's
    tracker name given back."""
    global _state
    megatron_tracker.restore()
    _state.writer.stop()
    _state = _State()
