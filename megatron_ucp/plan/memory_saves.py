"""Memory saves across nodes, planned (pure): whose replica each node keeps, which generation a restart on the
surviving nodes can resume from, and which survivor sends which old file to which new node.

A memory save writes each node's files of one generation (its ranks' files of a save, named as in the tag folder) to
its own local folder and one replica of them to its ring partner's (:func:`partner`), and is committed across the
job: a node's commit marker on a generation proves that every rank wrote and replicated its files. After a failure,
the survivors' folders say what is left (:class:`Holding`); :func:`choose` takes the newest committed generation of
which every old node's files are held by some survivor, and says for each newer one which nodes' copies are gone;
:func:`transfers` plans who sends what so that each new node holds every file its ranks read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence


def partner(node: int, nodes: int) -> Optional[int]:
    """The node that keeps node ``node``'s replica: the next one on the ring; None with one node (no replica)."""
    if not 0 <= node < nodes:
        raise ValueError(f"node {node} outside {nodes} nodes")
    return (node + 1) % nodes if nodes > 1 else None


def replica_of(node: int, nodes: int) -> Optional[int]:
    """The node whose replica node ``node`` keeps (the previous one on the ring); None with one node."""
    if not 0 <= node < nodes:
        raise ValueError(f"node {node} outside {nodes} nodes")
    return (node - 1) % nodes if nodes > 1 else None


@dataclass(frozen=True)
class Holding:
    """What one surviving node's local folder holds of one generation: one old node's files, its own or a replica."""

    holder: str
    """The survivor that holds them (its host)."""
    step: int
    """The generation: the iteration the memory save was taken at."""
    node: int
    """The old node whose files these are."""
    nodes: int
    """How many nodes the job that saved them had."""
    files: frozenset[str]
    replica: bool = False
    committed: bool = False
    """The job's commit marker is on it: every rank of the old job wrote and replicated its files."""
    damaged: frozenset[str] = frozenset()
    """Those of ``files`` whose bytes no longer match the sums recorded at the save (or that are gone)."""
    origin: str = ""
    """The checkpoint root's memory-save identity the save carried."""
    save_id: str = ""
    """The save's identity (the same in every file of one save)."""

    @property
    def sound(self) -> frozenset[str]:
        return self.files - self.damaged


@dataclass(frozen=True)
class Choice:
    """What a restart resumes from: ``step`` (None: no generation newer than the durable save is whole) and the save it
    is (``save_id``), each file's holders (own copy first, then the replica) and, for each newer generation passed
    over, why."""

    step: Optional[int]
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    passed_over: tuple[str, ...] = ()
    save_id: str = ""

    def holdings(self, holdings: Sequence[Holding], origin: Optional[str]) -> list[Holding]:
        """Of ``holdings``, those of the chosen save."""
        return [h for h in holdings if (h.step, h.origin, h.save_id) == (self.step, origin, self.save_id)]


def choose(holdings: Sequence[Holding], durable_step: Optional[int] = None, origin: Optional[str] = None) -> Choice:
    """The newest committed generation newer than ``durable_step`` whose every old node's files some survivor holds,
    of the checkpoint root whose memory-save identity is ``origin`` (None: the root has none, so no generation is
    its). At one iteration, each save held there is judged on its own (a node back from an earlier run of the root
    may hold another); one of another root, saved by jobs of different node counts, or without a commit marker
    anywhere, is passed over, said why; so is one missing a node's files (its own copy and its replica both gone) or
    whose every copy of a file is damaged."""
    steps = sorted({h.step for h in holdings}, reverse=True)
    why: list[str] = []
    for step in steps:
        if durable_step is not None and step <= durable_step:
            break
        mine = [h for h in holdings if h.step == step and origin is not None and h.origin == origin]
        if not mine:  # what another root's saves left (a local dir shared, a root made anew) is never this one's
            why.append(f"iteration {step}: saved for another checkpoint root (or an earlier run of this one)")
            continue
        saves = sorted(
            {h.save_id for h in mine}, key=lambda i: (not any(h.committed for h in mine if h.save_id == i), i)
        )
        for save_id in saves:
            sources, problem = _whole(step, [h for h in mine if h.save_id == save_id])
            if problem is None:
                return Choice(step, sources, tuple(why), save_id)
            why.append(problem + (" (one of the saves held at that iteration)" if len(saves) > 1 else ""))
    return Choice(None, {}, tuple(why))


def _whole(step: int, mine: Sequence[Holding]) -> tuple[dict[str, tuple[str, ...]], Optional[str]]:
    """One save's holdings at one iteration: each file's sound holders, or why they are not a whole generation."""
    counts = {h.nodes for h in mine}
    if len(counts) > 1:
        return {}, f"iteration {step}: held as saved by jobs of {sorted(counts)} nodes (folders of two runs?)"
    if not any(h.committed for h in mine):
        return {}, f"iteration {step}: not committed (the job stopped while saving it)"
    nodes = counts.pop()
    held = {h.node for h in mine}
    missing = [n for n in range(nodes) if n not in held]
    if missing:
        shown = ", ".join(f"node {n} (its copy and its replica on node {partner(n, nodes)})" for n in missing)
        return {}, f"iteration {step}: no survivor holds the files of {shown}"
    sources: dict[str, list[str]] = {}
    for h in sorted(mine, key=lambda h: (h.replica, h.holder)):
        for name in sorted(h.files):
            holders = sources.setdefault(name, [])
            if name in h.sound:
                holders.append(h.holder)
    unsound = sorted(name for name, holders in sources.items() if not holders)
    if unsound:
        where = sorted({h.holder for h in mine if set(unsound) & h.damaged})
        more = f" and {len(unsound) - 3} more" if len(unsound) > 3 else ""
        return {}, f"iteration {step}: every copy of {', '.join(unsound[:3])}{more} is damaged (on {', '.join(where)})"
    return {name: tuple(hs) for name, hs in sources.items()}, None


@dataclass(frozen=True)
class Transfer:
    """One file sent from a survivor that holds it to a new node that does not."""

    name: str
    source: str
    destination: str
    relay: bool = False
    """The source sends the copy it received in an earlier round (not a copy of the save it holds)."""


def transfers(needs: Mapping[str, Sequence[str]], sources: Mapping[str, Sequence[str]]) -> list[Transfer]:
    """Who sends what: for each new node (``needs``: node -> the files its ranks read), each file it does not hold
    itself, from the holder with the fewest sends so far (own copies before replicas on a tie). Raises
    :class:`KeyError` naming a file no survivor holds."""
    sends: Counter[str] = Counter()
    planned: list[Transfer] = []
    for destination in sorted(needs):
        for name in sorted(set(needs[destination])):
            holders = sources.get(name)
            if not holders:
                raise KeyError(f"{name}: no survivor holds it")
            if destination in holders:
                continue
            source = min(holders, key=lambda h: (sends[h], holders.index(h)))
            sends[source] += 1
            planned.append(Transfer(name, source, destination))
    return planned


SPREAD_ABOVE = 2
"""A file more new nodes need than this (the model states, which every rank reads) is spread in rounds: each node that
has it sends it to one more, so that the nodes holding it double each round instead of two holders sending it to all."""


def transfer_rounds(
    needs: Mapping[str, Sequence[str]], sources: Mapping[str, Sequence[str]], spread_above: int = SPREAD_ABOVE
) -> list[list[Transfer]]:
    """Who sends what, in rounds (each round's sends at once, the next after it): a file few nodes lack as
    :func:`transfers` plans it, in the first round; a file more than ``spread_above`` nodes lack, from every node that
    has it by then (its holders, then those that received it: ``relay``), one new node each per round. Raises
    :class:`KeyError` naming a file no survivor holds."""
    lacking: dict[str, list[str]] = {}
    for destination in sorted(needs):
        for name in sorted(set(needs[destination])):
            if not sources.get(name):
                raise KeyError(f"{name}: no survivor holds it")
            if destination not in sources[name]:
                lacking.setdefault(name, []).append(destination)
    spread = {name for name, nodes in lacking.items() if len(nodes) > spread_above}
    rounds: list[list[Transfer]] = [transfers({d: [n for n in needs[d] if n not in spread] for d in needs}, sources)]
    for name in sorted(spread):
        holders, waiting, r = list(sources[name]), list(lacking[name]), 0
        while waiting:
            if r == len(rounds):
                rounds.append([])
            served = waiting[: len(holders)]
            waiting = waiting[len(holders) :]
            rounds[r] += [Transfer(name, h, d, relay=h not in sources[name]) for h, d in zip(holders, served)]
            holders += served
            r += 1
    return [r for r in rounds if r]


def generations_to_drop(committed: Sequence[int], newest_committed: int) -> list[int]:
    """The generations a node removes once ``newest_committed`` is committed: every older one (at most two stay on a
    node: the newest committed one, and the one being written)."""
    return sorted(step for step in committed if step < newest_committed)
