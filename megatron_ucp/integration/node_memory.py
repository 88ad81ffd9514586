"""Memory saves' node-local folders: which node each rank is on, where its folder is, what one generation holds, and
what a restart from them brings to the load (:class:`Restoring`). The files themselves travel through
:mod:`~megatron_ucp.integration.node_sends`.

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
import dataclasses
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

from megatron_ucp.config import UcpConfig
from megatron_ucp.format import osio
from megatron_ucp.integration.collectives import JOB, comm
from megatron_ucp.plan.memory_saves import Holding

log = logging.getLogger(__name__)

NODE_NAMES_ENV = "MEGATRON_UCP_NODE_NAMES"
COMMITTED = "COMMITTED"
RESTORED = "restored"
"""In a node's folder: where a restart assembles the generation it resumes from (removed after the load)."""
_GENERATION = re.compile(r"^iter_(\d+)$")
_RECORD = re.compile(r"^node(\d+)\.json$")
_CHUNK = 64 << 20
"""Bytes read at a time when a file's crc32 is computed."""


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: each global rank's node name, the nodes in order of their first rank (indexed once: the job
    asks them for every file of every save)."""

    of_rank: tuple[str, ...]

    def __post_init__(self) -> None:
        names = tuple(dict.fromkeys(self.of_rank))
        where = {name: i for i, name in enumerate(names)}
        members: list[list[int]] = [[] for _ in names]
        for rank, name in enumerate(self.of_rank):
            members[where[name]].append(rank)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_node_of", tuple(where[name] for name in self.of_rank))
        object.__setattr__(self, "_members", tuple(tuple(m) for m in members))

    @property
    def names(self) -> tuple[str, ...]:
        return self._names  # type: ignore[attr-defined]

    @property
    def count(self) -> int:
        return len(self.names)

    def index(self, rank: int) -> int:
        return self._node_of[rank]  # type: ignore[attr-defined]

    def ranks(self, node: int) -> tuple[int, ...]:
        return self._members[node]  # type: ignore[attr-defined]

    def leader(self, node: int) -> int:
        return self.ranks(node)[0]

    def named(self, name: str) -> int:
        """The index of the node of that name."""
        return self._where[name]  # type: ignore[attr-defined]


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
    """The node-local folder of the checkpoint root ``root`` on node ``node``: ``<local dir>/<root's name>-<hash of its
    path>``, so that two jobs (two roots) sharing a local dir never touch each other's generations."""
    absolute = os.path.realpath(str(root))  # the save's --save and the restart's --load may differ in spelling
    digest = hashlib.sha256(absolute.encode()).hexdigest()[:10]
    base = Path(config.local_dir.replace("{node}", node)) if config.local_dir else _default_base()
    return base / f"{Path(absolute).name or 'root'}-{digest}"


def _default_base() -> Path:
    return Path("/dev/shm") / f"megatron-ucp-{os.getuid()}"


ORIGIN = "memory-origin"
"""In the checkpoint root's store: the identity every memory save of this root carries (made at its first one); a
restart takes only generations that carry it (not another root's, or an earlier run's of a root made anew)."""


def root_origin(root: os.PathLike | str, create: bool = False) -> Optional[str]:
    """The root's memory-save identity (first rank; ``create``: made when missing). None: the root has none."""
    path = Path(root) / ".ucp" / ORIGIN
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        if not create:
            return None
    except OSError:
        return None
    import uuid

    path.parent.mkdir(parents=True, exist_ok=True)
    osio.write_durably(path, uuid.uuid4().hex)
    return path.read_text().strip()


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


def write_record(
    gen: Path,
    node: int,
    nodes: int,
    tag: str,
    save_id: str,
    files: Sequence[FileSum],
    replica: bool,
    origin: str,
    weights_from_masters: bool = False,
):
    """The record of one old node's files in a generation (what a restart checks them against, and whether they leave
    the optimized weights to the masters)."""
    record = {
        "weights_from_masters": weights_from_masters,
        "origin": origin,
        "node": node,
        "nodes": nodes,
        "tag": tag,
        "save_id": save_id,
        "replica": replica,
        "files": {f.name: [f.size, f.crc] for f in files},
    }
    osio.write_durably(gen / f"node{node}.json", json.dumps(record, indent=1, sort_keys=True))


Records = dict[tuple[int, int, str], dict]
"""Each record read, by (iteration, old node, save identity)."""


def read_holdings(folder: Path, holder: str) -> tuple[list[Holding], Records]:
    """What a node's folder holds, generation by generation: one :class:`Holding` per record (committed when the
    generation's marker names the same save), nothing read but the records (:func:`verify` reads the files). A
    record that cannot be read is said and left out."""
    holdings: list[Holding] = []
    records: Records = {}
    for step, gen in sorted(generations(folder).items()):
        marker = committed_save(gen)
        for entry in sorted(gen.iterdir()):
            if not _RECORD.match(entry.name):
                continue
            try:
                record = json.loads(entry.read_text())
                files = frozenset(str(k) for k in record["files"])
                node, nodes, save_id = int(record["node"]), int(record["nodes"]), str(record.get("save_id", ""))
                if not str(record["tag"]):
                    raise ValueError("no tag")
            except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                log.warning("megatron-ucp: memory save record %s cannot be read (%s); left out", entry, exc)
                continue
            records[(step, node, save_id)] = record
            holdings.append(
                Holding(
                    holder,
                    step,
                    node,
                    nodes,
                    files,
                    replica=bool(record.get("replica")),
                    committed=marker is not None and marker == save_id,
                    origin=str(record.get("origin", "")),
                    save_id=save_id,
                )
            )
    return holdings, records


def committed_save(gen: Path) -> Optional[str]:
    """The save a generation's commit marker names (None: not committed, or the marker unreadable)."""
    try:
        return str(json.loads((gen / COMMITTED).read_text())["save_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify(folder: Path, holding: Holding, record: dict) -> Holding:
    """``holding`` (this node's) with every file read and its crc32 compared with the record's: a damaged or missing
    file named in ``damaged`` (said)."""
    where = node_files(generation(folder, holding.step), holding.node, str(record["tag"]))
    damaged = set()
    for name, (size, crc) in record["files"].items():
        path = where / name
        try:
            if not path.is_file() or path.stat().st_size != int(size) or crc_of(path) != int(crc):
                damaged.add(name)
        except OSError:
            damaged.add(name)
    if damaged:
        log.warning(
            "megatron-ucp: memory save of iteration %d on %s: %s of node %d do not match their sums",
            holding.step,
            holding.holder,
            ", ".join(sorted(damaged)),
            holding.node,
        )
    return dataclasses.replace(holding, damaged=frozenset(damaged))


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
    except Exception as exc:  # of any type: said, never raised (a collective may follow)
        log.warning("megatron-ucp: cannot remove %s: %s", path, exc)


class Restoring(Protocol):
    """A restart from memory in progress: which files of its folder are held on other nodes, and the collective that
    brings some here."""

    def fetch(self, paths: Sequence[Path]) -> None: ...

    def names_elsewhere(self, folder: Path) -> list[str]: ...

    @property
    def weights_from_masters(self) -> bool: ...


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


def names_elsewhere(folder: Path) -> list[str]:
    """The names of the files of ``folder`` (a memory save's tag folder being loaded) that other nodes hold (not
    missing: brought here by :func:`fetch` when a rank of this node reads one), for the checks that look for a tag's
    rank files; [] outside a restart from memory."""
    assembly = _RESTORING.get()
    return assembly.names_elsewhere(folder) if assembly is not None else []


def weights_from_masters() -> bool:
    """True while a memory save whose files leave the model's optimized weights to the masters is loaded (its record
    says so): the load rebuilds them from the masters, or is refused (:mod:`~megatron_ucp.integration.save.
    memory_weights`)."""
    assembly = _RESTORING.get()
    return assembly is not None and assembly.weights_from_masters
