"""A memory save from its copy to its commit: what the save hook filled in (:class:`Target`), the save handed to the
writer (:class:`Pending`), and the commit the memory saves' writer thread runs once this rank's files are written
(:func:`committing`), collective over the memory saves' own process group: every rank's crc32 gathered, each node's
own files recorded, sent to its ring partner (checked there) and recorded there, the commit marker written on every
node, then each node's older generations dropped. A failure anywhere (an exception of any type in a step of this
rank) is agreed and the generation removed on every node; an exception out of the commit (a peer gone) leaves it
uncommitted (a node that broke off may hold the only replica a restart needs) and is kept for the next memory save's
agreement (:mod:`~megatron_ucp.integration.save.memory_save`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_ucp import faults
from megatron_ucp.format import osio
from megatron_ucp.integration.collectives import Collective, comm, is_first
from megatron_ucp.integration.node_memory import (
    COMMITTED,
    FileSum,
    Nodes,
    generations,
    human_size,
    node_files,
    remove,
    write_record,
)
from megatron_ucp.integration.node_sends import Send, send_files
from megatron_ucp.integration.save.async_save import InFlight
from megatron_ucp.integration.save.commit import reason_of
from megatron_ucp.plan.memory_saves import generations_to_drop, partner, replica_of

log = logging.getLogger(__name__)


@dataclass
class Target:
    """The memory save in progress on this rank: the folder its files go to, what the hooked save wrote."""

    save_dir: Path
    tag: Optional[str] = None
    save_id: str = ""
    refused: Optional[str] = None
    """Why the hooks leave this job's saves to stock DeepSpeed (then no memory save is taken)."""
    flight: Optional[InFlight] = None
    """The files handed to the writer; their crc32 in ``sums`` as they are written."""
    sums: list[FileSum] = field(default_factory=list)
    weights_from_masters: bool = False
    """Its files leave the optimized weights to the masters (:mod:`.memory_weights`; the same on every rank)."""


@dataclass
class Pending:
    """A memory save copied and handed to the writer, committed by it (:func:`_commit`)."""

    step: int
    gen: Path
    folder: Path
    nodes: Nodes
    leader: bool
    origin: str
    into: Target
    started: float
    copied: float
    broken: bool = False
    """Its commit broke off (an exception out of it)."""


def committing(pending: Pending, over: Collective) -> None:
    """The writer thread's commit of ``pending``, once this rank's files are done; an exception out of it (a peer
    gone) is said, and the next memory save's agreement stops them."""
    try:
        _commit(pending, over)
    except BaseException as exc:
        pending.broken = True  # its files stay: a node that broke off may hold the only replica a restart needs
        log.error(
            "megatron-ucp: the commit of the memory save of iteration %d broke off (%s); it stays uncommitted here, "
            "the previous generation stays",
            pending.step,
            reason_of(exc),
        )


def _commit(pending: Pending, over: Collective) -> bool:
    """Collective over the memory saves' group (every rank's writer thread): one memory save's commit, once this
    rank's files are written. True when committed on every node; False when it failed anywhere (said; removed on
    every node)."""
    step, gen, nodes, leader, into = pending.step, pending.gen, pending.nodes, pending.leader, pending.into
    node = nodes.index(comm().get_rank())
    written = time.monotonic()
    error = into.flight.watch.outcome() if into.flight is not None else None
    failure = None if error is None else str(error)
    if not all_well(over, failure, gen, leader, step, "writing"):
        return False
    gathered = over.gather_objects((into.tag, into.sums))
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
            write_record(
                gen,
                of,
                nodes.count,
                tag,
                into.save_id,
                files,
                replica=replica,
                origin=pending.origin,
                weights_from_masters=into.weights_from_masters,
            )
        except Exception as exc:  # of any type: this rank's failure, said on every rank
            return f"recording {gen}: {reason_of(exc)}"
        return None

    # the node's own copy recorded first (a restart sees it, uncommitted, if the job dies while replicating)
    failure = None if len(tags) == 1 else f"the ranks saved different tags: {sorted(map(str, tags))}"
    failure = failure or record(node, replica=False)
    if not all_well(over, failure, gen, leader, step, "recording"):
        return False
    try:
        faults.fault_point(f"memory {step}: replicate")
    except Exception as exc:  # of any type: this rank's failure, and every rank still meets in the sends
        failure = f"replicating: {reason_of(exc)}"
    failure = send_files(_replica_sends(nodes, every, gen, tag), over) or failure
    failure = failure or record(replica_of(node, nodes.count), replica=True)
    if not all_well(over, failure, gen, leader, step, "replicating"):
        return False
    if leader:
        _mark_committed(gen, step, nodes, into.save_id)
    over.count(0)  # every node's marker written before any node drops its older generations
    if leader:
        _drop_older(pending.folder, step)
    faults.die_point(f"memory {step}: committed")
    if is_first():  # after the last collective: nothing here can leave a peer waiting
        per_node = max(sum(s.size for s in every if nodes.index(s.rank) == n) for n in range(nodes.count))
        log.info(
            "megatron-ucp: memory save of iteration %d (%s): %d file(s) on %d node(s), up to %s per node%s; "
            "copied in %.2f s, committed in the background %.2f s later (the replica and records: %.2f s)",
            step,
            tag,
            len(every),
            nodes.count,
            human_size(per_node),
            ", each replicated on the next node" if nodes.count > 1 else " (one node: no replica)",
            pending.copied - pending.started,
            time.monotonic() - pending.copied,
            time.monotonic() - written,
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


def failures_of(over: Collective, failure: Optional[str], gen: Path, leader: bool, step: int, doing: str) -> list[str]:
    """Collective over ``over``: every rank's failure (none: all went well); when any, the generation removed on every
    node and the failures said."""
    failures = [f for f in over.gather_objects(failure) if f is not None]
    if not failures:
        return []
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
    return failures


def all_well(over: Collective, failure: Optional[str], gen: Path, leader: bool, step: int, doing: str) -> bool:
    """:func:`failures_of`: True when there are none."""
    return not failures_of(over, failure, gen, leader, step, doing)


def _mark_committed(gen: Path, step: int, nodes: Nodes, save_id: str) -> None:
    """A node leader's commit marker (said, never raised: the generation is whole on every node already)."""
    try:
        faults.fault_point(f"memory {step}: commit")
        osio.write_durably(gen / COMMITTED, json.dumps({"iteration": step, "nodes": nodes.count, "save_id": save_id}))
    except Exception as exc:  # of any type
        log.error("megatron-ucp: cannot mark the memory save %s committed: %s", gen, reason_of(exc))


def _drop_older(folder: Path, step: int) -> None:
    """A node leader's older generations dropped, once every node marked the new one (said, never raised)."""
    try:
        held = generations(folder)
        for old in generations_to_drop(sorted(held), step):
            remove(held[old])
    except Exception as exc:  # of any type
        log.warning("megatron-ucp: cannot drop the older memory saves of %s: %s", folder, reason_of(exc))
