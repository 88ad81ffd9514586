"""A memory save (``--ucp-memory-save-interval``): every few iterations each rank's save goes to its node's memory,
and one replica of each node's files to the next node on the ring, so that the loss of any one node loses no file.

:func:`save_to_memory` is collective. Each rank's files are written by DeepSpeed's own ``save_checkpoint`` (the same
files and save record a save writes; every write watched as a durable save's are) into the node's folder
(:mod:`~megatron_ucp.integration.node_memory`), not committed as a durable save is: ``latest``, Megatron's tracker in
the checkpoint root and the background conversion are untouched. Then every file's crc32 is gathered, each node's
files are sent to its ring partner over the job's own process group (and checked there), each node records what it
holds, and, once every node has, writes the generation's commit marker and drops its older generations: at most two
generations per node, the newest committed one staying until the next commits. A memory save that fails anywhere
(a write, a send, a record: an exception of any type) is removed on every node, said on every rank, and training
goes on; the previous generation stays.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp import faults
from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.format import osio
from megatron_ucp.integration.collectives import JOB, Failure, comm, is_first
from megatron_ucp.integration.node_memory import (
    COMMITTED,
    RESTORED,
    FileSum,
    Nodes,
    crc_of,
    generation,
    generations,
    human_size,
    job_nodes,
    local_folder,
    node_files,
    remove,
    root_origin,
    write_record,
)
from megatron_ucp.integration.node_sends import Send, send_files
from megatron_ucp.integration.save.commit import WriteWatch, reason_of, watched_writes
from megatron_ucp.plan.memory_saves import generations_to_drop, partner, replica_of

log = logging.getLogger(__name__)


@dataclass
class _Target:
    """The memory save in progress on this rank: the folder its files go to, what the hooked save wrote."""

    save_dir: Path
    tag: Optional[str] = None
    save_id: str = ""
    watch: WriteWatch = field(default_factory=WriteWatch)
    refused: Optional[str] = None
    """Why the hooks leave this job's saves to stock DeepSpeed (then no memory save is taken)."""


_REFUSED = "memory saves need a job the hooks handle"
_STATE = {"disabled": False}
"""A job the hooks leave to stock DeepSpeed takes no memory save (said once, at the first)."""
_MARGIN = 1.1
"""Free room a node's folder needs before a memory save, over what its newest generation holds (the next one is
written before the newest is dropped)."""


def wanted(config: UcpConfig) -> bool:
    return config.memory_save_interval is not None


def install(patches: Any, config: UcpConfig) -> None:
    """Nothing replaced: a memory save goes through the save hook (:func:`target`); a new installation starts
    with memory saves allowed again."""
    _STATE["disabled"] = False


def on_uninstall() -> None:
    _STATE["disabled"] = False


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


_TARGET: contextvars.ContextVar[Optional[_Target]] = contextvars.ContextVar("memory_save_target", default=None)


def target() -> Optional[_Target]:
    """The memory save this rank is inside, if any (the save hook then writes through :func:`write`)."""
    return _TARGET.get()


def write(engine: Any, original: Callable[..., Any], args: tuple, kwargs: dict, save_id: str) -> Any:
    """DeepSpeed's ``save_checkpoint`` into the memory save's folder, ``latest`` off, every write watched."""
    into = _TARGET.get()
    assert into is not None
    if surface.decoupled_checkpoint_engine(engine) or surface.node_local_storage(engine):
        into.refused = "a decoupled checkpoint engine or node-local storage writes the files after the save returns"
        return None
    bound = inspect.signature(original).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    tag = bound.arguments["tag"]
    into.tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    bound.arguments.update(save_dir=str(into.save_dir), tag=into.tag, save_latest=False)
    into.save_id = save_id
    into.watch = WriteWatch(f"the memory save {into.tag}")
    with watched_writes(engine, into.watch.wrap):
        return original(*bound.args, **bound.kwargs)


@contextlib.contextmanager
def _saving_into(save_dir: Path) -> Iterator[_Target]:
    token = _TARGET.set(_Target(save_dir))
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
    ``args.save`` pointed there). True when committed on every node; False when it failed (said; nothing kept)."""
    if _STATE["disabled"]:
        return False
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
    if not _all_well(failure, gen, leader, step, "preparing"):
        return False
    with _saving_into(gen / f"node{node}") as into:
        try:
            save(str(into.save_dir))
            error = into.watch.outcome()
            if into.refused is not None:
                failure = f"{_REFUSED}: {into.refused}; no more memory saves in this run"
            elif into.tag is None:
                failure = "the save never reached DeepSpeed's save_checkpoint"
            elif error is not None:
                failure = str(error)
        except Exception as exc:  # of any type: this rank's failure, said on every rank
            failure = f"the save raised {reason_of(exc)}"
    sums: list[FileSum] = []
    if failure is None:
        try:
            tag_dir = into.save_dir / str(into.tag)
            sums = [FileSum(os.path.relpath(p, tag_dir), me, os.path.getsize(p), crc_of(p)) for p in into.watch.written]
        except OSError as exc:
            failure = f"summing the files written: {exc}"
    if not _all_well(failure, gen, leader, step, "writing"):
        return False
    gathered = JOB.gather_objects((into.tag, sums))
    tags = {t for t, _ in gathered}
    every = [s for _, box in gathered for s in box]
    tag = str(into.tag)

    def record(of: Optional[int], replica: bool) -> Optional[str]:
        """A node leader's record of one old node's files here (its own, or the replica it keeps)."""
        if not leader or of is None:
            return None
        try:
            faults.fault_point(f"memory {step}: record")
            files = [s for s in every if nodes.index(s.rank) == of]
            write_record(gen, of, nodes.count, tag, into.save_id, files, replica=replica, origin=str(origin))
        except Exception as exc:  # of any type: this rank's failure, said on every rank
            return f"recording {gen}: {reason_of(exc)}"
        return None

    # the node's own copy recorded first (a restart sees it, uncommitted, if the job dies while replicating)
    failure = None if len(tags) == 1 else f"the ranks saved different tags: {sorted(map(str, tags))}"
    failure = failure or record(node, replica=False)
    if not _all_well(failure, gen, leader, step, "recording"):
        return False
    try:
        faults.fault_point(f"memory {step}: replicate")
    except Exception as exc:  # of any type: this rank's failure, and every rank still meets in the sends
        failure = f"replicating: {reason_of(exc)}"
    failure = send_files(_replica_sends(nodes, every, gen, tag)) or failure
    failure = failure or record(replica_of(node, nodes.count), replica=True)
    if not _all_well(failure, gen, leader, step, "replicating"):
        return False
    if leader:
        _commit(gen, folder, step, nodes, into.save_id)
    JOB.count(0)  # every node's marker written before training goes on
    faults.die_point(f"memory {step}: committed")
    if is_first():
        per_node = max(sum(s.size for s in every if nodes.index(s.rank) == n) for n in range(nodes.count))
        log.info(
            "megatron-ucp: memory save of iteration %d (%s): %d file(s) on %d node(s), up to %s per node%s, in %.2f s",
            step,
            tag,
            len(every),
            nodes.count,
            human_size(per_node),
            ", each replicated on the next node" if nodes.count > 1 else " (one node: no replica)",
            time.monotonic() - started,
        )
    return True


def _replica_sends(nodes: Nodes, every: list[FileSum], gen: Path, tag: str) -> list[Send]:
    """Each file to a rank of its node's ring partner (ranks paired by their place in their node, so that the
    sends spread over the partner's ranks). The paths are this rank's: read where it sends, written where it
    receives (each side's folder is its own)."""
    sends = []
    for s in every:
        node = nodes.index(s.rank)
        to = partner(node, nodes.count)
        if to is None:
            continue
        theirs = nodes.ranks(to)
        destination = theirs[nodes.ranks(node).index(s.rank) % len(theirs)]
        path = str(node_files(gen, node, tag) / s.name)
        sends.append(Send(s.rank, destination, path, path, s.size, s.crc))
    return sends


def _all_well(failure: Optional[str], gen: Path, leader: bool, step: int, doing: str) -> bool:
    """Collective: True when no rank failed; else the generation removed on every node and the failures said."""
    failures = [f for f in JOB.gather_objects(failure) if f is not None]
    if not failures:
        return True
    if any(f.startswith(_REFUSED) for f in failures):  # the same on every rank: no memory save of this job, ever
        _STATE["disabled"] = True
    if leader:
        remove(gen)
    if is_first():
        log.error(
            "megatron-ucp: the memory save of iteration %d failed %s (%s); it is removed, the previous generation "
            "stays, training goes on",
            step,
            doing,
            "; ".join(failures[:4]) + (f"; and {len(failures) - 4} more" if len(failures) > 4 else ""),
        )
    return False


def _commit(gen: Path, folder: Path, step: int, nodes: Nodes, save_id: str) -> None:
    """A node leader's part of the commit: the marker, then its older generations dropped (said, never raised: the
    generation is whole on every node already)."""
    try:
        faults.fault_point(f"memory {step}: commit")
        osio.write_durably(gen / COMMITTED, json.dumps({"iteration": step, "nodes": nodes.count, "save_id": save_id}))
    except Exception as exc:
        log.error("megatron-ucp: cannot mark the memory save %s committed: %s", gen, reason_of(exc))
        return
    try:
        held = generations(folder)
        for old in generations_to_drop(sorted(held), step):
            remove(held[old])
    except OSError as exc:
        log.warning("megatron-ucp: cannot list %s to drop its older memory saves: %s", folder, exc)
