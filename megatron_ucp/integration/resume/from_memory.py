"""A restart from the nodes' memory saves (``--ucp-memory-save-interval``), at the new node count.

Collective, before the durable ``latest`` is read (:func:`restore`): each surviving node's leader reads what its
folder holds, every file checked against its recorded crc32 (:func:`~megatron_ucp.integration.node_memory.
read_holdings`); the first rank takes the newest committed generation newer than the durable ``latest`` of which
every old node's files have a sound copy on some survivor (:func:`~megatron_ucp.plan.memory_saves.choose`: a damaged
copy gives way to its replica) and says why each newer one is passed over. The chosen generation is assembled on
every node as a checkpoint root of its own (the tag folder, its file list, ``latest``, Megatron's tracker): each
file a node lacks is sent by a survivor that holds it, over the job's process group, and checked against its crc32
on arrival; nothing is read from the parallel file system. The load then reads that root, at the new world size,
through the same routes as any load (the native reshard for a DP change). Any failure on the way: the durable tag,
loudly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp.background.store import MEMORY_RESTARTS_LOG, append_line
from megatron_ucp.config import UcpConfig
from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio
from megatron_ucp.format.save_files import describe, file_list_path, file_list_text
from megatron_ucp.integration.collectives import JOB, comm, is_first
from megatron_ucp.integration.live_job import LoadCall
from megatron_ucp.integration.node_memory import (
    Nodes,
    Send,
    generation,
    job_nodes,
    local_folder,
    node_files,
    read_holdings,
    read_progress,
    remove,
    root_origin,
    send_files,
)
from megatron_ucp.plan.experts import EXPERT_FILE_RE
from megatron_ucp.plan.memory_saves import Choice, Holding, choose, transfers
from megatron_ucp.plan.tags import tag_step

log = logging.getLogger(__name__)

RESTORED = "restored"
"""The folder (in a node's memory-save folder) where a restart assembles the generation it resumes from."""
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Restored:
    """What a restart from memory loads: the assembled checkpoint root on this node, and what it came from."""

    load_dir: Path
    step: int
    tag: str
    durable: Optional[str]
    summary: str
    assembly: "Assembly"


def wanted(config: UcpConfig) -> bool:
    return config.memory_save_interval is not None


def restore(call: LoadCall) -> Optional[Restored]:
    """Collective: the newest whole memory save newer than the durable ``latest`` of the call's folder, being
    assembled on every node (None: there is none, or it could not be assembled; said why, on the first rank)."""
    config, load_dir = call.config, call.load_dir
    started = time.monotonic()
    nodes = job_nodes()
    me = comm().get_rank()
    node = nodes.index(me)
    folder = local_folder(config, load_dir, nodes.of_rank[me])
    leader = me == nodes.leader(node)
    mine: tuple[list[Holding], dict, Optional[int]] = ([], {}, None)
    unread: Optional[str] = None
    if leader:
        try:
            mine = (*read_holdings(folder, nodes.of_rank[me]), read_progress(folder))
        except Exception as exc:  # of any type: this node's memory saves are left out, said; nobody waits for it
            unread = f"{folder}: cannot be read ({type(exc).__name__}: {exc}); its memory saves are left out"
    gathered = JOB.gather_objects((*mine, unread))
    holdings = [h for held, _, _, _ in gathered for h in held]
    records = {key: record for _, recs, _, _ in gathered for key, record in recs.items()}
    reached = max((p for _, _, p, _ in gathered if p is not None), default=None)
    if is_first():
        for why in (u for _, _, _, u in gathered if u is not None):
            log.warning("megatron-ucp: restart: %s", why)
    if not holdings:
        return None

    def decide() -> tuple[Optional[str], Choice]:
        durable = _durable_tag(Path(load_dir))
        return durable, choose(holdings, tag_step(durable) if durable else None, root_origin(load_dir))

    durable, choice = JOB.decided(decide, "choosing a memory save to restart from")
    if choice.step is None:
        if is_first():
            newest, durable_step = max(h.step for h in holdings), tag_step(durable) if durable else None
            said = (
                f"the nodes' newest memory save (iteration {newest}) is not newer than the durable {durable}"
                if durable_step is not None and newest <= durable_step
                else f"the nodes hold memory saves up to iteration {newest}, but none newer than the durable "
                f"{durable or 'checkpoint (none)'} is whole"
                + (f" ({'; '.join(choice.passed_over)})" if choice.passed_over else "")
            ) + "; loading the durable checkpoint"
            log.warning("megatron-ucp: restart: %s", said)
            record(load_dir, said, None)
        return None
    step = int(choice.step)
    old_nodes = {h.node for h in holdings if h.step == step}
    tag = str(records[(step, min(old_nodes))]["tag"])
    save_id = str(records[(step, min(old_nodes))].get("save_id", ""))
    of_file = {
        name: (n, *records[(step, n)]["files"][name])
        for (s, n) in records
        if s == step
        for name in records[(s, n)]["files"]
    }
    root = folder / RESTORED
    assembly = Assembly(nodes, me, generation(folder, step), root, tag, choice, of_file)
    failure = None
    if leader:
        remove(root)
    JOB.count(0)  # the folder is new on every node before anything is brought into it
    # what every rank reads whole (model states, layer and expert files) on every node; in a job of one DP group and
    # no experts, the rank files only when a rank's binding asks for them (Assembly.fetch), each on the nodes whose
    # ranks read it; else every file on every node (the bindings of several groups would ask at different times)
    experts = any(EXPERT_FILE_RE.match(name) or name.startswith("expp_rank_") for name in of_file)
    lazy = call.job.dp_size == comm().get_world_size() and not experts
    everywhere = {name for name in of_file if not (lazy and F.OPTIM_FILE_RE.match(name))}
    assembly.lazy = lazy
    failure = assembly.bring({name: set(everywhere) for name in nodes.names})
    failures = [f for f in JOB.gather_objects(failure) if f is not None]
    if not failures:
        if leader:
            try:
                _write_root(root, tag, step, save_id)
            except Exception as exc:  # of any type: said on every rank, the durable tag loaded
                failure = f"{root}: {type(exc).__name__}: {exc}"
        failures = [f for f in JOB.gather_objects(failure) if f is not None]
    if failures:
        if leader:
            remove(root)
        if is_first():
            said = (
                f"the memory save of iteration {step} could not be assembled ({'; '.join(failures[:4])}); loading "
                f"the durable {durable or 'checkpoint'}"
            )
            log.error("megatron-ucp: restart: %s", said)
            record(load_dir, said, None)
        return None
    own_sound = {name for h in holdings if h.step == step and not h.replica for name in h.sound}
    from_replicas = sorted({f"node {of_file[name][0]}" for name in choice.sources if name not in own_sound})
    summary = (
        f"restarting from the memory save of iteration {step} ({tag}, saved by {len(old_nodes)} node(s)) on "
        f"{nodes.count} node(s), newer than the durable {durable or 'checkpoint (none)'}"
        + (f" by {step - tag_step(durable)} iteration(s)" if durable and tag_step(durable) is not None else "")
        + (f"; replicas used for {', '.join(from_replicas[:4])}" if from_replicas else "")
        + (f"; passed over: {'; '.join(choice.passed_over)}" if choice.passed_over else "")
        + f"; its model states on every node in {time.monotonic() - started:.2f} s, "
        + ("each rank file brought to the nodes that read it" if assembly.lazy else "every file on every node")
        + ", from the nodes' memory (nothing read from the checkpoint root); "
        + (
            f"{max(reached - step, 0)} iteration(s) lost (the run had completed iteration {reached})"
            if reached is not None
            else f"what the run did after iteration {step} is lost"
        )
    )
    if is_first():
        record(load_dir, summary, step)
    return Restored(root, step, tag, durable, summary, assembly)


def record(load_dir: os.PathLike | str, said: str, step: Optional[int]) -> None:
    """The restart's decision in the checkpoint root's store, for ``status`` (first rank)."""
    append_line(Path(load_dir), MEMORY_RESTARTS_LOG, {"at": time.time(), "iteration": step, "said": said}, "restart")


def _durable_tag(load_dir: Path) -> Optional[str]:
    try:
        return (load_dir / F.LATEST).read_text().strip() or None
    except OSError:
        return None


@dataclass
class Assembly:
    """A memory save's generation being assembled on every node, as a checkpoint folder (``root``/``tag``): what each
    node has brought into its folder so far (the same on every rank: decided from gathered needs, not from disk), and
    the collective that brings more."""

    nodes: Nodes
    me: int
    gen: Path
    root: Path
    tag: str
    choice: Choice
    of_file: dict[str, tuple[int, int, int]]
    """Each file's old node, size and crc32."""
    present: dict[str, set[str]] = field(default_factory=dict)
    lazy: bool = True
    """Rank files brought when the binding asks (one DP group, no experts), else every file brought up front."""
    received: int = 0
    """Bytes sent between nodes so far (the same on every rank)."""

    @property
    def here(self) -> str:
        return self.nodes.of_rank[self.me]

    def bring(self, needs: dict[str, set[str]]) -> Optional[str]:
        """Collective: each node's needed files into its folder, linked from its own sound copy or sent by a survivor
        that holds one, checked against its crc32 on arrival. Returns this rank's failure."""
        failure: Optional[str] = None
        wanted = {node: set(names) - self.present.setdefault(node, set()) for node, names in needs.items()}
        if self.me == self.nodes.leader(self.nodes.index(self.me)):
            try:
                (self.root / self.tag).mkdir(parents=True, exist_ok=True)
                for name in sorted(wanted.get(self.here, ())):
                    if self.here in self.choice.sources[name]:
                        _link(node_files(self.gen, self.of_file[name][0], self.tag) / name, self.root / self.tag / name)
            except Exception as exc:  # of any type
                failure = f"{self.root}: {type(exc).__name__}: {exc}"
        sends: list[Send] = []
        sent: dict[str, int] = {}  # per node, sends so far: spread over its ranks (so is what each node receives)
        got: dict[str, int] = {}
        for t in transfers({node: sorted(names) for node, names in wanted.items()}, self.choice.sources):
            old, size, crc = self.of_file[t.name]
            src_ranks = self.nodes.ranks(self.nodes.named(t.source))
            dst_ranks = self.nodes.ranks(self.nodes.named(t.destination))
            i, j = sent.get(t.source, 0), got.get(t.destination, 0)
            sent[t.source], got[t.destination] = i + 1, j + 1
            read, write = node_files(self.gen, old, self.tag) / t.name, self.root / self.tag / t.name
            sends.append(
                Send(src_ranks[i % len(src_ranks)], dst_ranks[j % len(dst_ranks)], str(read), str(write), size, crc)
            )
            self.received += size
        for node, names in wanted.items():
            self.present[node] |= names
        return send_files(sends) or failure

    def fetch(self, paths: Sequence[Path]) -> None:
        """Collective: the rank files each rank's binding reads, present on its node (raises on every rank when one
        cannot be brought: the memory save is then refused, and the durable checkpoint loaded)."""
        if not self.lazy:
            return  # every file is here already
        mine = sorted({p.name for p in paths if Path(p).parent == self.root / self.tag and p.name in self.of_file})
        needs: dict[str, set[str]] = {}
        for node, names in JOB.gather_objects((self.here, mine)):
            needs.setdefault(node, set()).update(names)
        JOB.together(
            UcpError(failure) if (failure := self.bring(needs)) else None,
            f"bringing the memory save's rank files to the nodes that read them ({self.tag})",
            subject=self.root,
        )

    def clear(self) -> None:
        """The assembled folder removed on each node once the load is over (never raised)."""
        if self.me == self.nodes.leader(self.nodes.index(self.me)):
            remove(self.root)

    def held_elsewhere(self, path: Path) -> bool:
        return self.lazy and Path(path).parent == self.root / self.tag and Path(path).name in self.of_file


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _write_root(root: Path, tag: str, step: int, save_id: str) -> None:
    """The assembled folder as a checkpoint root: the save's file list, Megatron's tracker, ``latest`` last."""
    folder = root / tag
    files = [describe(p) for p in sorted(folder.rglob("*")) if p.is_file()]
    listing = file_list_path(root, tag)
    listing.parent.mkdir(parents=True, exist_ok=True)
    osio.write_durably(listing, file_list_text(folder, save_id, files))
    osio.write_durably(root / TRACKER, str(step))
    osio.write_durably(root / F.LATEST, tag)
    osio.write_durably(root / F.UCP_DIR / "memory_restart.json", json.dumps({"iteration": step, "tag": tag}))
