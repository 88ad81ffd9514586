"""A restart from the nodes' memory saves (``--ucp-memory-save-interval``), at the new node count.

Collective, before the durable ``latest`` is read (:func:`restore`): each surviving node's leader reads the records
of what its folder holds (:func:`~megatron_ucp.integration.node_memory.read_holdings`); the first rank takes the
newest committed generation newer than the durable ``latest`` of which every old node's files have a sound copy on
some survivor (:func:`~megatron_ucp.plan.memory_saves.choose`) and says why each newer one is passed over; the
copies of that one are read whole and checked against their crc32, and the choice made again while one is damaged
(a damaged copy gives way to its replica). The chosen generation is assembled on every node as a checkpoint root of
its own (the tag folder, its file list, ``latest``, Megatron's tracker): each file a node's ranks read is sent by a
survivor that holds it, over the job's process group, and checked against its crc32 on arrival; nothing is read
from the parallel file system. The load then reads that root, at the new world size,
through the same routes as any load (the native reshard for a DP change). Any failure on the way: the durable tag,
loudly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp import faults
from megatron_ucp.background.store import MEMORY_RESTARTS_LOG, append_line
from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio
from megatron_ucp.format.paths import read_tag_file
from megatron_ucp.format.save_files import describe, file_list_path, file_list_text
from megatron_ucp.integration.collectives import JOB, comm, is_first
from megatron_ucp.integration.live_job import LoadCall
from megatron_ucp.integration.node_memory import (
    RESTORED,
    Nodes,
    Records,
    generation,
    job_nodes,
    local_folder,
    node_files,
    read_holdings,
    read_progress,
    remove,
    root_origin,
    verify,
)
from megatron_ucp.integration.node_sends import Send, send_files
from megatron_ucp.integration.resume.native.binding import engine_save_files
from megatron_ucp.plan.experts import EXPERT_FILE_RE
from megatron_ucp.plan.memory_saves import Choice, Holding, choose, transfer_rounds
from megatron_ucp.plan.tags import tag_step

log = logging.getLogger(__name__)


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
    mine: tuple[list[Holding], Records, Optional[int]] = ([], {}, None)
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
    durable, origin, choice, holdings = _choose_verified(
        folder, holdings, records, Path(load_dir), nodes.of_rank[me], leader
    )
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
    step, save_id = int(choice.step), choice.save_id
    holdings = choice.holdings(holdings, origin)
    old_nodes = {h.node for h in holdings}
    chosen = {n: records[(step, n, save_id)] for n in old_nodes}
    tag = str(chosen[min(old_nodes)]["tag"])
    of_file = {name: (n, int(v[0]), int(v[1])) for n, r in chosen.items() for name, v in r["files"].items()}
    root = folder / RESTORED
    assembly = Assembly(nodes, me, generation(folder, step), root, tag, choice, of_file)
    assembly.weights_from_masters = any(bool(r.get("weights_from_masters")) for r in chosen.values())
    if leader:
        remove(root)
    JOB.count(0)  # the folder is new on every node before anything is brought into it
    assembly.lazy = _lazy(call, of_file)
    failure = assembly.bring(_first_needs(call, nodes, of_file, assembly.lazy))
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
    own_sound = {name for h in holdings if not h.replica for name in h.sound}  # the chosen save's holdings
    from_replicas = sorted({f"node {of_file[name][0]}" for name in choice.sources if name not in own_sound})
    summary = (
        f"restarting from the memory save of iteration {step} ({tag}, saved by {len(old_nodes)} node(s)) on "
        f"{nodes.count} node(s), newer than the durable {durable or 'checkpoint (none)'}"
        + (f" by {step - tag_step(durable)} iteration(s)" if durable and tag_step(durable) is not None else "")
        + (f"; replicas used for {', '.join(from_replicas[:4])}" if from_replicas else "")
        + (f"; passed over: {'; '.join(choice.passed_over)}" if choice.passed_over else "")
        + ("; its weights to be rebuilt from the masters" if assembly.weights_from_masters else "")
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


_STATE = {"asked": False}


def reset() -> None:
    """A new installation asks again at its first load."""
    _STATE["asked"] = False


def first_load() -> bool:
    """True at the process's first load (whatever it names): the only one a restart from memory may serve; a later
    load within the run (a rollback) loads the checkpoint root as it is."""
    first, _STATE["asked"] = not _STATE["asked"], True
    return first


def _choose_verified(
    folder: Path, holdings: list[Holding], records: Records, load_dir: Path, here: str, leader: bool
) -> tuple[Optional[str], Optional[str], Choice, list[Holding]]:
    """Collective: the choice (first rank: the durable ``latest``, the root's identity), its copies then read whole on
    the nodes that hold them (each node's leader) and the choice made again while a copy it takes turns out damaged:
    only the generation a restart may take is read, never every file of every generation. Returns the holdings with
    what was found damaged."""
    checked: set[tuple[int, int, str]] = set()
    while True:

        def decide() -> tuple[Optional[str], Optional[str], Choice]:
            durable = _durable_tag(load_dir)
            origin = root_origin(load_dir)
            return durable, origin, choose(holdings, tag_step(durable) if durable else None, origin)

        durable, origin, choice = JOB.decided(decide, "choosing a memory save to restart from")
        if choice.step is None:
            return durable, origin, choice, holdings
        verified: list[Holding] = []
        if leader:
            for h in choice.holdings(holdings, origin):
                key = (h.step, h.node, h.save_id)
                if h.holder == here and key not in checked:
                    try:
                        verified.append(verify(folder, h, records[key]))
                    except Exception as exc:  # of any type: every file of that copy taken as damaged, said
                        log.warning("megatron-ucp: restart: %s: %s", folder, exc)
                        verified.append(dataclasses.replace(h, damaged=h.files))
        news = [h for box in JOB.gather_objects(verified) for h in box]
        checked |= {(h.step, h.node, h.save_id) for h in news}
        damaged = {(h.holder, h.step, h.node, h.save_id): h for h in news if h.damaged}
        if not damaged:
            return durable, origin, choice, holdings
        holdings = [damaged.get((h.holder, h.step, h.node, h.save_id), h) for h in holdings]


def _lazy(call: LoadCall, of_file: dict[str, tuple[int, int, int]]) -> bool:
    """Rank files brought when the binding asks for them: a job of one DP group, no experts, and not DeepSpeed's
    elastic checkpoint form (whose own load reads every rank file on every rank)."""
    experts = any(EXPERT_FILE_RE.match(name) or name.startswith("expp_rank_") for name in of_file)
    one_group = call.job.dp_size == comm().get_world_size()
    return one_group and not experts and not surface.elastic_checkpoint(call.job.optimizer)


def _first_needs(
    call: LoadCall, nodes: Nodes, of_file: dict[str, tuple[int, int, int]], lazy: bool
) -> dict[str, set[str]]:
    """Collective: what each node gets before the load: every file every rank reads whole (model states, layer and
    expert files), and of the rank files, those of its ranks' model-parallel coordinates, or (``lazy``) only each
    rank's own (what DeepSpeed's own load reads at the saved DP size); the binding asks for the rest."""
    rank_file, _ = engine_save_files(call.job, call.load_dir, "")
    own = Path(rank_file(call.job.dp_rank)).name
    mp = F.OPTIM_FILE_RE.match(own)
    wanted = JOB.gather_objects((nodes.of_rank[comm().get_rank()], own, mp["mp"] if mp else None))
    needs: dict[str, set[str]] = {name: set() for name in nodes.names}
    for node, name, coordinate in wanted:
        for file in of_file:
            match = F.OPTIM_FILE_RE.match(file)
            if match is None:
                needs[node].add(file)
            elif file == name or (not lazy and match["mp"] == coordinate):
                needs[node].add(file)
    return needs


def record(load_dir: os.PathLike | str, said: str, step: Optional[int]) -> None:
    """The restart's decision in the checkpoint root's store, for ``status`` (first rank)."""
    append_line(Path(load_dir), MEMORY_RESTARTS_LOG, {"at": time.time(), "iteration": step, "said": said}, "restart")


def _durable_tag(load_dir: Path) -> Optional[str]:
    """The tag the durable ``latest`` names (None: none, or unreadable: the durable load's own fallback says why)."""
    try:
        return read_tag_file(load_dir / F.LATEST)
    except CheckpointFormatError:
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
    rounds: int = 0
    """Rounds of sends of the most spread one of its exchanges (a file many nodes lack is relayed)."""
    received: int = 0
    """Bytes sent between nodes so far (the same on every rank)."""
    weights_from_masters: bool = False
    """Its files leave the optimized weights to the masters: the load rebuilds them (or is refused)."""

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
        sent: dict[str, int] = {}  # per node, sends so far: spread over its ranks (so is what each node receives)
        got: dict[str, int] = {}
        try:
            rounds = transfer_rounds({node: sorted(names) for node, names in wanted.items()}, self.choice.sources)
        except KeyError as exc:  # the same plan on every rank: nobody sends, every rank says it
            return failure or f"{self.tag}: {exc.args[0]}"
        for node, names in wanted.items():
            self.present[node] |= names
        self.rounds = max(self.rounds, len(rounds))
        for planned in rounds:  # each round's files in place (checked) before the next relays them
            sends: list[Send] = []
            for t in planned:
                old, size, crc = self.of_file[t.name]
                src_ranks = self.nodes.ranks(self.nodes.named(t.source))
                dst_ranks = self.nodes.ranks(self.nodes.named(t.destination))
                i, j = sent.get(t.source, 0), got.get(t.destination, 0)
                sent[t.source], got[t.destination] = i + 1, j + 1
                write = self.root / self.tag / t.name
                read = write if t.relay else node_files(self.gen, old, self.tag) / t.name
                sends.append(
                    Send(src_ranks[i % len(src_ranks)], dst_ranks[j % len(dst_ranks)], str(read), str(write), size, crc)
                )
                self.received += size
            failure = send_files(sends) or failure
        return failure

    def fetch(self, paths: Sequence[Path]) -> None:
        """Collective: the rank files each rank's binding reads, present on its node (raises on every rank when one
        cannot be brought: the memory save is then refused, and the durable checkpoint loaded)."""
        if not self.lazy:
            return  # every file is here already
        mine = sorted({p.name for p in paths if Path(p).parent == self.root / self.tag and p.name in self.of_file})
        needs: dict[str, set[str]] = {}
        for node, names in JOB.gather_objects((self.here, mine)):
            needs.setdefault(node, set()).update(names)
        try:
            faults.fault_point(f"memory restart {self.tag}: fetch")
            injected = None
        except Exception as exc:  # the tests' fault: this rank's failure, the exchange still run
            injected = f"{type(exc).__name__}: {exc}"
        failure = self.bring(needs) or injected
        JOB.together(
            CheckpointFormatError(failure) if failure else None,
            f"bringing the memory save's rank files to the nodes that read them ({self.tag})",
            subject=self.root,
        )

    def clear(self) -> None:
        """The assembled folder removed on each node once the load is over (never raised)."""
        if self.me == self.nodes.leader(self.nodes.index(self.me)):
            remove(self.root)

    def names_elsewhere(self, folder: Path) -> list[str]:
        return sorted(self.of_file) if self.lazy and Path(folder) == self.root / self.tag else []


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
    osio.write_durably(root / F.MEGATRON_TRACKER, str(step))
    osio.write_durably(root / F.LATEST, tag)
