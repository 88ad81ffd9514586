"""A memory save (``--ucp-memory-save-interval``): every few iterations each rank's save goes to its node's memory,
and one replica of each node's files to the next node on the ring, so that the loss of any one node loses no file.

:func:`save_to_memory` is collective and returns once every rank's state is copied into host memory, as an
asynchronous save does: DeepSpeed's own ``save_checkpoint`` (the same files and save record a save writes) runs with
each file copied into the memory saves' own host buffer (:func:`~megatron_ucp.integration.save.async_save.
copy_to_host`), and their own writer thread (:mod:`~megatron_ucp.integration.save.writer`) writes the files into the
node's folder (:mod:`~megatron_ucp.integration.node_memory`) and takes each one's crc32, beside training. Nothing is
committed as a durable save is: ``latest``, Megatron's tracker in the checkpoint root and the background conversion
are untouched.

The writer thread then commits it, beside training, over the memory saves' own process group (gloo, every rank; so
that it never meets the collectives training issues meanwhile; :mod:`~megatron_ucp.integration.save.memory_commit`):
each node's files recorded, replicated on its ring partner and recorded there, the commit marker written on every
node, then the older generations dropped: at most two generations per node, the newest committed one staying until
the next commits. The next memory save, a durable save, a load, the job leaving its process group through DeepSpeed
and the process's exit wait for that commit first. A memory save that fails anywhere (the copy, a write, a send, a
record: an exception of any type) is removed on every node, said on every rank, and training goes on; the previous
generation stays. A commit that breaks off (a peer gone) is said, its generation left uncommitted, and the next memory
save stops them for the run on every rank. A job that dies before the commit leaves the generation uncommitted: a
restart passes it over.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import functools
import inspect
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import UcpError
from megatron_ucp.integration.collectives import JOB, Collective, Failure, comm, is_first, let_go_at_exit
from megatron_ucp.integration.node_memory import (
    RESTORED,
    FileSum,
    crc_of,
    generation,
    generations,
    human_size,
    job_nodes,
    local_folder,
    remove,
    root_origin,
)
from megatron_ucp.integration.save import async_save, memory_weights
from megatron_ucp.integration.save.commit import OpenSave, WriteWatch, reason_of
from megatron_ucp.integration.save.host_copy import HostBuffers
from megatron_ucp.integration.save.memory_commit import Pending, Target, all_well, committing, failures_of
from megatron_ucp.integration.save.writer import Writer

log = logging.getLogger(__name__)


_REFUSED = "memory saves need a job the hooks handle"
_STATE: dict[str, Any] = {}
"""``disabled``: no more memory saves in this run (a job the hooks leave to stock DeepSpeed; a commit that broke off;
said once); ``broken``: a commit of this run broke off on this rank (kept for the next memory save's agreement);
``pending``: the memory save handed to the writer, its commit not yet seen done by this thread; ``slot``,
``writer``, ``over``: the memory saves' host buffer, writer thread and process group (their own: a memory save never
waits for a durable save's slot or files, and its commit never meets training's collectives); ``exit_wait``: how long
the process's exit waits for the last commit; ``config``: the hooks' settings (what a restart will read)."""
_MARGIN = 1.1
"""Free room a node's folder needs before a memory save, over what its newest generation holds (the next one is
written before the newest is dropped)."""
_GROUP_TIMEOUT_S = 3600
"""How long a collective of the memory saves' group waits for a rank: longer than the slowest writer takes (node 0's
first rank writes and sums the model states), so that only a peer gone ends a commit."""


def wanted(config: UcpConfig) -> bool:
    return config.memory_save_interval is not None


def install(patches: Any, config: UcpConfig) -> None:
    """A memory save goes through the save hook (:func:`target`); its commit runs in the memory saves' writer thread.
    The next memory save, a durable save (the save hook), a load, the job leaving its process group through DeepSpeed,
    and the process's exit wait for it first (:func:`wait`)."""
    _reset()
    _STATE.update(
        writer=Writer("megatron-ucp-memory-writer"), exit_wait=float(config.converter_exit_wait), config=config
    )
    surface.replace(patches, surface.ENGINE, "load_checkpoint", _waiting_first, stack=True)
    surface.replace(patches, surface.TORCH_BACKEND, "destroy_process_group", _leaving_after_the_commit, stack=True)
    atexit.register(_at_exit)
    async_save.watch_for_crash()


def on_uninstall() -> None:
    """The memory save in flight waited for as at the exit (unless the hooks go while an exception propagates), the
    writer stopped."""
    atexit.unregister(_at_exit)
    if not _dying():
        _at_exit()
    if _STATE["writer"] is not None:
        _STATE["writer"].stop()
    _reset()
    async_save.stop_watching_for_crash()


def _dying() -> bool:
    """The job is dying: an exception propagates through the uninstall (a ``finally``; a clean ``sys.exit`` is not
    one), or the runner said so (:func:`~megatron_ucp.integration.save.async_save.note_crash`). The peers may never
    meet this rank again."""
    exc = sys.exc_info()[1]
    return async_save.crashed() or (exc is not None and not (isinstance(exc, SystemExit) and exc.code in (None, 0)))


def _at_exit() -> None:
    """The process ends: the last memory save's commit waited for, up to ``converter_exit_wait`` seconds (every rank
    ends alike and its writer thread meets the others' by itself; 0: not waited for, the save may stay uncommitted);
    not when the process dies of an exception (its peers may never meet it)."""
    if _STATE["pending"] is not None and not async_save.crashed():
        wait(_STATE["exit_wait"])
        let_go_at_exit()


def _reset() -> None:
    _STATE.update(
        disabled=False, broken=False, pending=None, slot=None, writer=None, over=None, exit_wait=0.0, config=None
    )


_reset()  # the keys of :data:`_STATE`, as before any installation


def _waiting_first(original: Callable[..., Any]) -> Callable[..., Any]:
    """The memory save in flight committed before a load reads anything (a folder a restart reads): this rank waits
    for its writer thread."""

    @functools.wraps(original)
    def waiting(*args: Any, **kwargs: Any) -> Any:
        wait()
        return original(*args, **kwargs)

    return waiting


def _leaving_after_the_commit(original: Callable[..., Any]) -> Callable[..., Any]:
    """The job leaves its process group: the memory save in flight committed first (up to ``converter_exit_wait``
    seconds, as at the exit), and the memory saves' group forgotten with it (a new process group gets its own)."""

    @functools.wraps(original)
    def destroy_process_group(self: Any, group: Any = None, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        whole = group is None or group is dist.GroupMember.WORLD
        if whole and _STATE["pending"] is not None:
            wait(_STATE["exit_wait"])
        result = original(self, group, *args, **kwargs)
        if whole:
            _STATE.update(over=None, broken=False, pending=None)
        return result

    return destroy_process_group


def wait(timeout: Optional[float] = None) -> bool:
    """This rank's writer done with the memory save in flight, its commit included (no collective of this thread: the
    writer threads meet in their own group), or ``timeout`` seconds passed. True when a commit of this run broke off
    (an exception out of it: the ranks' writers may no longer be in step; kept until the next memory save's agreement
    reads it, whoever waits first) or did not end in time."""
    pending: Optional[Pending] = _STATE["pending"]
    if pending is not None:
        flight, writer = pending.into.flight, _STATE["writer"]
        if flight is not None and writer is not None:
            if timeout is None:
                writer.wait(flight)
            elif not flight.done.wait(timeout):
                log.warning(
                    "megatron-ucp: the memory save of iteration %d did not commit in %.0f s", pending.step, timeout
                )
                return True
        _STATE["pending"] = None
        _STATE["broken"] = _STATE["broken"] or pending.broken
    return bool(_STATE["broken"])


def _memory_group() -> Optional[str]:
    """The memory saves' own process group (collective, at the first memory save): every rank, gloo (host tensors,
    whatever the job's backend). Their commit runs in the writer thread, so it never shares a group with the
    collectives training issues meanwhile. Returns why it cannot be had (every rank learns it), never raises."""
    if _STATE["over"] is not None:
        return None
    dist = comm()
    failure = None if dist.is_gloo_available() else "this torch has no gloo backend"
    if JOB.count(1 if failure else 0):
        return failure or "another rank has no gloo backend"
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT_S))
    except Exception as exc:  # of any type: said on every rank, no memory saves
        failure = f"making their gloo process group: {reason_of(exc)}"
    if JOB.count(1 if failure else 0):
        return failure or "another rank could not make the memory saves' gloo process group"
    _STATE["over"] = Collective(group, host=True)
    return None


def _prepare(folder: Path, own: Path, step: int) -> Optional[str]:
    """A node leader's part before the writes: generations of this iteration or newer (an earlier run's, stale) gone,
    the node's folder made, and room for another generation like the newest. Returns the failure, never raises."""
    try:
        held = generations(folder)
        for old in [g for s, g in held.items() if s >= step] + [folder / RESTORED]:  # stale, or a restart's leftover
            remove(old)
            if old.exists():
                return f"{old}: cannot be removed"
        own.mkdir(parents=True, exist_ok=True)
        newest = max((s for s in held if s < step), default=None)
        last = _bytes(held[newest]) if newest is not None else 0
        free = shutil.disk_usage(folder).free
        if free < _MARGIN * last:
            return f"{folder}: {human_size(free)} free, the last memory save holds {human_size(last)}"
    except Exception as exc:  # of any type
        return f"{folder}: {reason_of(exc)}"
    return None


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


_TARGET: contextvars.ContextVar[Optional[Target]] = contextvars.ContextVar("memory_save_target", default=None)


def target() -> Optional[Target]:
    """The memory save this rank is inside, if any (the save hook then writes through :func:`write`)."""
    return _TARGET.get()


def write(engine: Any, original: Callable[..., Any], args: tuple, kwargs: dict, save_id: str) -> Any:
    """DeepSpeed's ``save_checkpoint`` into the memory save's folder, ``latest`` off: every file copied into the
    memory saves' host buffer and handed to their writer (the files and their crc32 written beside training)."""
    into = _TARGET.get()
    assert into is not None
    if surface.decoupled_checkpoint_engine(engine) or surface.node_local_storage(engine):
        into.refused = "a decoupled checkpoint engine or node-local storage writes the files after the save returns"
        return None
    bound = inspect.signature(original).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    tag = bound.arguments["tag"]
    into.tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if into.flight is not None:  # a second engine save in one memory save: the first one's files would go unwritten
        raise UcpError("a memory save takes one save_checkpoint of one engine; this save() called it again")
    bound.arguments.update(save_dir=str(into.save_dir), tag=into.tag, save_latest=False)
    into.save_id = save_id
    rank = comm().get_rank()
    tag_dir = into.save_dir / into.tag
    sums: list[FileSum] = []
    flight = async_save.InFlight(
        OpenSave(into.save_dir, into.tag, False, None, save_id),
        None,
        save_id=save_id,
        rank=rank,
        watch=WriteWatch(f"the memory save {into.tag}", rank),
        engine=engine,
        after_write=lambda path: sums.append(
            FileSum(os.path.relpath(path, tag_dir), rank, os.path.getsize(path), crc_of(path))
        ),
    )
    into.sums = sums
    shape = memory_weights.decided(engine, tag_dir, _STATE["config"])  # collective: every rank is in this save
    into.weights_from_masters = shape is not None
    result, _ = async_save.copy_to_host(engine, lambda: original(*bound.args, **bound.kwargs), flight, _slot(), shape)
    into.flight = flight  # handed to the writer once every rank has its copy (save_to_memory)
    return result


def _slot() -> HostBuffers:
    """The memory saves' host buffer (one: a memory save is committed before the next is copied), made at the
    first."""
    if _STATE["slot"] is None:
        _STATE["slot"] = HostBuffers(pin=async_save.pinning())
    return _STATE["slot"]  # type: ignore[return-value]


@contextlib.contextmanager
def _saving_into(save_dir: Path) -> Iterator[Target]:
    token = _TARGET.set(Target(save_dir))
    try:
        yield _TARGET.get()  # type: ignore[misc]
    finally:
        _TARGET.reset(token)


def save_to_memory(
    config: UcpConfig,
    root: os.PathLike | str,
    step: int,
    save: Callable[[str], Any],
) -> bool:
    """Collective: one memory save at iteration ``step`` of the job whose durable saves go to ``root``. ``save(dir)``
    is the job's own save into ``dir`` (the engine's ``save_checkpoint``, or Megatron's ``save_checkpoint`` with
    ``args.save`` pointed there). Returns once every rank's state is copied into host memory (True): the writer
    thread writes the files and commits the save beside training (:func:`_commit`); False when the copy failed
    (said; nothing kept)."""
    if _STATE["disabled"] or _STATE["writer"] is None:  # stopped for this run, or the hooks no longer installed
        return False
    waited = time.monotonic()
    broken = wait()
    waited = time.monotonic() - waited
    if JOB.count(1 if broken else 0):  # a commit broke off somewhere: the writers may be out of step
        return _stop("a memory save's commit broke off (said above on the ranks where it did)")
    if waited > 0.05 and is_first():
        log.warning("megatron-ucp: this memory save waited %.2f s for the previous one's commit", waited)
    unavailable = _memory_group()
    if unavailable is not None:
        return _stop(unavailable)
    over: Collective = _STATE["over"]
    started = time.monotonic()
    nodes = job_nodes()
    me = comm().get_rank()
    node = nodes.index(me)
    folder = local_folder(config, root, nodes.of_rank[me])
    gen = generation(folder, step)
    leader = me == nodes.leader(node)
    origin = JOB.decide(lambda: root_origin(root, create=True))  # the root's identity, carried by every record
    failure: Optional[str] = origin.message if isinstance(origin, Failure) else None
    if leader and failure is None:
        failure = _prepare(folder, gen / f"node{node}", step)
    if not all_well(JOB, failure, gen, leader, step, "preparing"):
        return False
    with _saving_into(gen / f"node{node}") as into:
        try:
            save(str(into.save_dir))
            if into.refused is not None:
                failure = f"{_REFUSED}: {into.refused}; no more memory saves in this run"
            elif into.tag is None or into.flight is None:
                failure = "the save never reached DeepSpeed's save_checkpoint"
        except Exception as exc:  # of any type: this rank's failure, said on every rank
            failure = f"the save raised {reason_of(exc)}"
    failures = failures_of(JOB, failure, gen, leader, step, "copying")
    if any(f.startswith(_REFUSED) for f in failures):  # the same on every rank: no memory save of this job, ever
        _STATE["disabled"] = True
    if failures:
        return False
    pending = Pending(step, gen, folder, nodes, leader, str(origin), into, started, time.monotonic())
    into.flight.then = lambda: committing(pending, over)  # type: ignore[union-attr]
    _STATE["writer"].put(into.flight)
    _STATE["pending"] = pending
    return True


def _stop(why: str) -> bool:
    """No more memory saves in this run (every rank, said once); their host buffer let go. Returns False."""
    _STATE.update(disabled=True, slot=None)
    if is_first():
        log.error("megatron-ucp: %s: no more memory saves in this run", why)
    return False
