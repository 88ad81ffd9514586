"""A training launch relaunched on the nodes left after a node failure, decided (pure).

Within one allocation a node that dies takes the whole launch down with it; the job can go on on the rest at the new
node count (the elastic resume reshards the checkpoint to it). After a failed launch, the nodes that no longer answer
are dropped and the launch is repeated on the others, at most a given number of times; a launch that failed with every
node up is not a node failure, and is not repeated (the same error would end it again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


def hosts_of(lines: Iterable[str]) -> list[str]:
    """The hosts of a host file (PBS_NODEFILE, a hostfile): one per node, in order, comments and blank lines left
    out, a host listed once per slot counted once; ``host slots=N`` (DeepSpeed's hostfile) is the host."""
    hosts: list[str] = []
    for line in lines:
        word = _host(line)
        if word is not None and word not in hosts:
            hosts.append(word)
    return hosts


def lines_for(lines: Sequence[str], hosts: Iterable[str]) -> list[str]:
    """The lines of a host file that name one of ``hosts``, as they are (slots, a host once per rank): the host file
    of a launch on those nodes, in the form the original had."""
    kept = set(hosts)
    return [line for line in lines if _host(line) in kept]


def _host(line: str) -> Optional[str]:
    words = line.split("#", 1)[0].split()
    return words[0] if words else None


@dataclass(frozen=True)
class Next:
    """What follows a failed launch: ``hosts`` to relaunch on (None: stop, with ``code``), and why, in words."""

    hosts: Optional[tuple[str, ...]]
    why: str
    code: int = 0


def before_first(hosts: Sequence[str], down: Sequence[str], probe_broken: bool, min_nodes: int = 1) -> Next:
    """The nodes the first launch starts on, given the nodes that did not answer the probe before it (``down``):
    those left, when enough are (a launch that includes a lost node fails, or hangs until its timeout). ``hosts``
    None: the probe cannot tell a lost node here (it cannot run, or fails on every node): one launch, no loop."""
    lost = [h for h in hosts if h in set(down)]
    left = tuple(h for h in hosts if h not in set(down))
    if probe_broken or not left:
        return Next(None, "it cannot tell a lost node here; launching once on every node, no relaunch")
    if lost and len(left) >= max(1, min_nodes):
        return Next(
            left,
            f"{len(lost)} of {len(hosts)} node(s) down before the first launch ({', '.join(lost)}): "
            f"launching on the {len(left)} left",
        )
    return Next(
        tuple(hosts),
        f"{len(lost)} of {len(hosts)} node(s) down before the first launch; too few left: "
        "launching on every node as given"
        if lost
        else "",
    )


def after_failure(
    hosts: Sequence[str], down: Sequence[str], code: int, restarts_done: int, max_restarts: int, min_nodes: int = 1
) -> Next:
    """The decision after a launch on ``hosts`` ended with exit ``code`` (non-zero) and the probe found ``down``.
    Every node down at once is taken for a probe that does not work (likelier than every node lost): not relaunched."""
    lost = [h for h in hosts if h in set(down)]
    left = tuple(h for h in hosts if h not in set(down))
    if lost and not left:
        return Next(
            None,
            f"the probe fails on all {len(hosts)} node(s) at once: more likely the probe than the nodes; "
            "not relaunched",
            code,
        )
    if not lost:
        return Next(
            None,
            f"the launch failed (exit {code}) with all {len(hosts)} node(s) up: not a node failure, "
            "not relaunched (the same error would end it again)",
            code,
        )
    said = f"{len(lost)} of {len(hosts)} node(s) down ({', '.join(lost)})"
    if restarts_done >= max_restarts:
        return Next(None, f"{said}; {max_restarts} relaunch(es) already made: stopping", code)
    if len(left) < max(1, min_nodes):
        return Next(None, f"{said}; {len(left)} left, fewer than the {max(1, min_nodes)} needed: stopping", code)
    return Next(left, f"{said}: relaunching on the {len(left)} left (relaunch {restarts_done + 1} of {max_restarts})")


def last_loop(records: Sequence[dict]) -> tuple[dict, ...]:
    """The launches of the newest relaunch loop that launched more than once, each its start and end records merged
    (records as ``megatron-ucp relaunch`` writes them, oldest first); () when the newest loop launched once."""
    loops = [r.get("loop") for r in records if r.get("loop") is not None]
    if not loops:
        return ()
    launches: dict[int, dict] = {}
    for r in records:
        if r.get("loop") == loops[-1]:
            launches.setdefault(int(r.get("launch", 0)), {}).update(r)
    return tuple(launches[n] for n in sorted(launches)) if len(launches) > 1 else ()


def loop_summary(loop: Sequence[dict]) -> str:
    """One line of what a relaunch loop did: each launch's nodes, how it ended, and the nodes it lost."""
    parts = []
    for r in loop:
        if "exit" not in r:
            ended = "running, or its loop was killed"
        else:
            ended = "ended well" if r["exit"] == 0 else f"exit {r['exit']}"
        down = f", down: {', '.join(r['down'])}" if r.get("down") else ""
        parts.append(f"launch {r.get('launch')} on {len(r.get('hosts') or [])} node(s) {ended}{down}")
    return "; ".join(parts)
