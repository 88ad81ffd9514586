"""Memory saves' node-local folders: which node each rank is on, where its folder is, what one generation holds, and
the files sent between nodes over the job's own process group.

A node is the ranks that share a host (``socket.gethostname()``); ``MEGATRON_UCP_NODE_NAMES`` (one name per global
rank, comma-separated) overrides it, so that tests run several "nodes" on one machine. A node's folder is
``--ucp-local-dir`` (``{node}`` in it is replaced by the node's name), by default a folder under ``/dev/shm`` named
after the checkpoint root. One generation (a memory save at iteration N) is ``iter_<N>/`` there::

    iter_0000013/
      node1/global_step13/...   node 1's files (its ranks' files of the save, named as in the tag folder)
      node1.json                what they are: old node, node count, the save, each file's size and crc32
      node0/global_step13/...   node 0's replica (this node is node 0's ring partner)
      node0.json
      COMMITTED                 written once every node of the job wrote and replicated its files

Shared by the save (:mod:`~megatron_ucp.integration.save.memory_save`) and the restart
(:mod:`~megatron_ucp.integration.resume.from_memory`), which never import each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Protocol, Sequence

import numpy as np
import torch

from megatron_ucp.config import UcpConfig
from megatron_ucp.format import osio
from megatron_ucp.integration.collectives import JOB, comm, device
from megatron_ucp.plan.memory_saves import Holding

log = logging.getLogger(__name__)

NODE_NAMES_ENV = "MEGATRON_UCP_NODE_NAMES"
COMMITTED = "COMMITTED"
_GENERATION = re.compile(r"^iter_(\d+)$")
_RECORD = re.compile(r"^node(\d+)\.json$")
_CHUNK = 64 << 20
"""Bytes per message of a file sent between nodes (the accelerator's memory holds one per transfer at a time)."""


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: each global rank's node name, the nodes in order of their first rank."""

    of_rank: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.of_rank))

    @property
    def count(self) -> int:
        return len(self.names)

    def index(self, rank: int) -> int:
        return self.names.index(self.of_rank[rank])

    def ranks(self, node: int) -> list[int]:
        return [r for r, name in enumerate(self.of_rank) if name == self.names[node]]

    def leader(self, node: int) -> int:
        return self.ranks(node)[0]


def node_name(rank: int) -> str:
    """This rank's node: ``MEGATRON_UCP_NODE_NAMES``'s entry for it, else the host's name."""
    given = os.environ.get(NODE_NAMES_ENV, "").strip()
    if given:
        names = [n.strip() for n in given.split(",")]
        if rank >= len(names) or not names[rank]:
            raise ValueError(f"{NODE_NAMES_ENV}={given!r} names no node for global rank {rank}")
        return names[rank]
    return socket.gethostname()


def job_nodes() -> Nodes:
    """Collective: every rank's node, on every rank."""
    return Nodes(tuple(JOB.gather_objects(node_name(comm().get_rank()))))


def local_folder(config: UcpConfig, root: os.PathLike | str, node: str) -> Path:
    """The node-local folder of the checkpoint root ``root`` on node ``node``."""
    if config.local_dir:
        return Path(config.local_dir.replace("{node}", node))
    absolute = os.path.abspath(str(root))
    digest = hashlib.sha256(absolute.encode()).hexdigest()[:10]
    return Path("/dev/shm") / "megatron-ucp" / f"{Path(absolute).name or 'root'}-{digest}"


def generation(folder: Path, step: int) -> Path:
    return folder / f"iter_{step:07d}"


def node_files(gen: Path, node: int, tag: str) -> Path:
    """Where one old node's files of a generation lie (its own copy or its replica)."""
    return gen / f"node{node}" / tag


def generations(folder: Path) -> dict[int, Path]:
    """The generations a node's folder holds, by iteration."""
    found: dict[int, Path] = {}
    if folder.is_dir():
        for entry in folder.iterdir():
            match = _GENERATION.match(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = entry
    return found


def committed(gen: Path) -> bool:
    return (gen / COMMITTED).is_file()


@dataclass(frozen=True)
class FileSum:
    """One file of a memory save: its name in the tag folder, the rank that wrote it, its size and crc32."""

    name: str
    rank: int
    size: int
    crc: int


def human_size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def crc_of(path: os.PathLike | str) -> int:
    """The crc32 of a file's bytes."""
    crc = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(_CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def write_record(gen: Path, node: int, nodes: int, tag: str, save_id: str, files: Sequence[FileSum], replica: bool):
    """The record of one old node's files in a generation (what a restart checks them against)."""
    record = {
        "node": node,
        "nodes": nodes,
        "tag": tag,
        "save_id": save_id,
        "replica": replica,
        "files": {f.name: [f.size, f.crc] for f in files},
    }
    osio.write_durably(gen / f"node{node}.json", json.dumps(record, indent=1, sort_keys=True))


def read_holdings(folder: Path, holder: str, verify: bool = True) -> tuple[list[Holding], dict[tuple[int, int], dict]]:
    """What a node's folder holds, generation by generation: one :class:`Holding` per record (``verify``: every file
    read and its crc32 compared with the record's: a damaged or missing file is named in ``damaged``), and each
    record by (iteration, old node). A record that cannot be read is said and left out."""
    holdings: list[Holding] = []
    records: dict[tuple[int, int], dict] = {}
    for step, gen in sorted(generations(folder).items()):
        for entry in sorted(gen.iterdir()):
            match = _RECORD.match(entry.name)
            if not match:
                continue
            try:
                record = json.loads(entry.read_text())
                files = {str(k): (int(v[0]), int(v[1])) for k, v in record["files"].items()}
                node, nodes, tag = int(record["node"]), int(record["nodes"]), str(record["tag"])
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("megatron-ucp: memory save record %s cannot be read (%s); left out", entry, exc)
                continue
            damaged = set()
            if verify:
                where = node_files(gen, node, tag)
                for name, (size, crc) in files.items():
                    path = where / name
                    if not path.is_file() or path.stat().st_size != size or crc_of(path) != crc:
                        damaged.add(name)
                if damaged:
                    log.warning(
                        "megatron-ucp: memory save of iteration %d on %s: %s of node %d do not match their sums",
                        step,
                        holder,
                        ", ".join(sorted(damaged)),
                        node,
                    )
            records[(step, node)] = record
            holdings.append(
                Holding(
                    holder,
                    step,
                    node,
                    nodes,
                    frozenset(files),
                    replica=bool(record.get("replica")),
                    committed=committed(gen),
                    damaged=frozenset(damaged),
                )
            )
    return holdings, records


PROGRESS = "progress"


def note_progress(folder: Path, rank: int, iteration: int) -> None:
    """The iteration this rank is about to train (its node's folder; a restart says how many iterations after the
    memory save it resumes from were lost). Memory only, never raised: a note, not a save."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{PROGRESS}.{rank}"
        tmp.write_text(str(iteration))
        os.replace(tmp, folder / PROGRESS)
    except OSError:
        pass


def read_progress(folder: Path) -> Optional[int]:
    try:
        return int((folder / PROGRESS).read_text())
    except (OSError, ValueError):
        return None


def remove(path: Path) -> None:
    """A generation (or a half-written one) gone; said, never raised."""
    try:
        shutil.rmtree(path, ignore_errors=False)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("megatron-ucp: cannot remove %s: %s", path, exc)


@dataclass(frozen=True)
class Send:
    """One file sent from one rank to another: where it is read, where it is written, what it must sum to."""

    source: int
    destination: int
    read: str
    write: str
    size: int
    crc: int


def send_files(sends: Sequence[Send]) -> Optional[str]:
    """Collective: every send carried out over the job's process group, each file in chunks through the
    accelerator's device, all pairs at once; each received file written to a temporary name, its crc32 compared,
    then renamed. Returns this rank's first failure (a file that cannot be read, written, or arrived damaged)."""
    dist = comm()
    me = dist.get_rank()
    mine = [s for s in sends if me in (s.source, s.destination)]
    failure: Optional[str] = None
    opened: dict[int, np.memmap] = {}
    try:
        for i, s in enumerate(mine):
            path = s.read if s.source == me else s.write + ".partial"
            if s.size == 0:
                if s.destination == me:
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    Path(path).write_bytes(b"")
                continue
            if s.destination == me:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            try:
                opened[i] = np.memmap(path, dtype=np.uint8, mode="c" if s.source == me else "w+", shape=(s.size,))
            except (OSError, ValueError) as exc:
                failure = failure or f"{path}: cannot open: {exc}"
                opened[i] = np.zeros(s.size, dtype=np.uint8)  # still sent/received: the peer is not left waiting
        dev = device()
        longest = max((s.size for s in mine), default=0)
        for start in range(0, longest, _CHUNK):
            works, landing = [], []
            for i, s in enumerate(mine):
                if s.size <= start:
                    continue
                end = min(s.size, start + _CHUNK)
                if s.source == me:
                    chunk = torch.from_numpy(np.asarray(opened[i][start:end])).to(dev)
                    works.append(dist.isend(chunk, s.destination))
                    landing.append(chunk)
                else:
                    chunk = torch.empty(end - start, dtype=torch.uint8, device=dev)
                    works.append(dist.irecv(chunk, s.source))
                    landing.append((i, start, chunk))
            for work in works:
                work.wait()
            for item in landing:
                if isinstance(item, tuple):
                    i, at, chunk = item
                    opened[i][at : at + chunk.numel()] = chunk.cpu().numpy()
        for i, s in enumerate(mine):
            if s.destination != me:
                continue
            if i in opened and isinstance(opened[i], np.memmap):
                opened[i].flush()
            partial = Path(s.write + ".partial")
            if failure is None and partial.exists() and crc_of(partial) != s.crc:
                failure = f"{s.write}: arrived from rank {s.source} with another crc32 than recorded"
            if failure is None and partial.exists():
                os.replace(partial, s.write)
            else:
                partial.unlink(missing_ok=True)
    except Exception as exc:  # of any type: this rank's failure, said on every rank by the caller
        failure = failure or f"sending memory save files: {type(exc).__name__}: {exc}"
    finally:
        opened.clear()
    return failure


class Restoring(Protocol):
    """A restart from memory in progress: which files of its folder are held on other nodes, and the collective that
    brings some here."""

    def held_elsewhere(self, path: Path) -> bool: ...

    def fetch(self, paths: Sequence[Path]) -> None: ...


_RESTORING: contextvars.ContextVar[Optional[Restoring]] = contextvars.ContextVar("memory_restart", default=None)


@contextlib.contextmanager
def restoring(assembly: Restoring) -> Iterator[None]:
    """Around the load of a memory save's folder: the binding asks for the rank files it reads (:func:`fetch`)."""
    token = _RESTORING.set(assembly)
    try:
        yield
    finally:
        _RESTORING.reset(token)


def fetch(paths: Sequence[Path]) -> None:
    """Collective (every rank of the job, in the same order): each rank's ``paths`` present on its node. Nothing to do
    outside a restart from memory, where every file is in the folder already."""
    assembly = _RESTORING.get()
    if assembly is not None:
        assembly.fetch(paths)


def held_elsewhere(path: Path) -> bool:
    """``path`` is a file of the memory save being loaded that another node holds (not missing: brought here by
    :func:`fetch` when a rank of this node reads it)."""
    assembly = _RESTORING.get()
    return assembly is not None and assembly.held_elsewhere(path)
