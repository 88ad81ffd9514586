"""Files sent between ranks over a process group of the whole job (the memory saves' replicas, over their own gloo
group; a restart's files brought to the nodes that read them, over the job's): chunks through the group's device (the
accelerator's, or the host for a gloo group), a bounded window in flight, every
file checked against its crc32 on arrival, and every failure on a rank kept while the exchange runs to its end on
every rank.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_ucp.integration.collectives import JOB, Collective, comm

_CHUNK = 64 << 20
"""Bytes per message of a file sent between nodes."""


@dataclass(frozen=True)
class Send:
    """One file sent from one rank to another: where it is read, where it is written, what it must sum to."""

    source: int
    destination: int
    read: str
    write: str
    size: int
    crc: int


_WINDOW = 4
"""Chunks a rank has in flight at once (its staging memory: this many times :data:`_CHUNK`, on the host and on the
accelerator), whatever the number and size of the files it sends and receives."""


@dataclass
class _End:
    """This rank's end of one send: the open file (None once it failed here: zeros are sent, or what arrives is
    dropped, so that the peer is never left waiting) and, when receiving, the crc32 of what arrived so far."""

    send: Send
    sending: bool
    fd: Optional[int] = None
    crc: int = 0
    failed: Optional[str] = None


def send_files(sends: Sequence[Send], over: Collective = JOB) -> Optional[str]:
    """Collective (every rank with the same ``sends``, in the same order): each file read on its source rank and
    written on its destination rank (a temporary name, its crc32 compared on arrival, then renamed), in chunks through
    the group's device, all pairs at once, at most :data:`_WINDOW` chunks in flight per rank. Each rank takes its
    chunks in one global order (chunk index, then the send's place in ``sends``) and waits for a window before the
    next: the earliest chunk not yet moved always has both ends posted, so no rank waits forever. A failure here (a
    file that cannot be read or written, or arrives damaged) is kept and the exchange goes on to its end. Returns this
    rank's first failure. ``over``: the process group the sends go through (every rank of the job is in it)."""
    dist = comm()
    me = dist.get_rank()
    mine = [s for s in sends if me in (s.source, s.destination) and s.source != s.destination]
    width = min(_CHUNK, max((s.size for s in mine), default=0))
    dev = over.tensor_device()
    try:  # the window's buffers, on the host and the device, before any rank posts anything
        host = [np.empty(width, dtype=np.uint8) for _ in range(_WINDOW)]
        staged = [torch.from_numpy(h).to(dev) for h in host]  # the host buffers themselves where the device is
        short = None
    except Exception as exc:  # of any type (no memory on the device): every rank learns it, nobody posts
        host, staged, short = [], [], f"staging {_WINDOW} chunks of {width} bytes for the sends: {exc}"
    if over.count(1 if short else 0):  # also a barrier: what a rank received before this call is in place
        return short or "another rank could not stage its sends"
    ends = [_open(s, s.source == me) for s in mine]  # after the barrier: a relay reads what arrived in the last call
    ops = sorted(
        ((start // _CHUNK, i, start) for i, e in enumerate(ends) for start in range(0, e.send.size, _CHUNK)),
        key=lambda op: (op[0], op[1]),
    )
    for w in range(0, len(ops), _WINDOW):
        window = ops[w : w + _WINDOW]
        works, landing = [], []
        for slot, (_, i, start) in enumerate(window):
            e = ends[i]
            n = min(_CHUNK, e.send.size - start)
            buffer, chunk = host[slot][:n], staged[slot][:n]
            if e.sending:
                _read_into(e, buffer, start)
                if chunk.data_ptr() != buffer.ctypes.data:
                    chunk.copy_(torch.from_numpy(buffer))
                works.append(dist.isend(chunk, e.send.destination, group=over.group))
            else:
                works.append(dist.irecv(chunk, e.send.source, group=over.group))
                landing.append((e, buffer, start, chunk))
        for work in works:
            work.wait()
        for e, buffer, start, chunk in landing:
            if chunk.data_ptr() != buffer.ctypes.data:
                np.copyto(buffer, chunk.cpu().numpy())
            _write_from(e, buffer, start)
    return _close(ends)


def _open(send: Send, sending: bool) -> _End:
    end = _End(send, sending)
    path = send.read if sending else send.write + ".partial"
    try:
        if sending:
            end.fd = os.open(path, os.O_RDONLY)
            if os.fstat(end.fd).st_size != send.size:
                raise OSError(f"{os.fstat(end.fd).st_size} bytes, {send.size} recorded")
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            end.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            if send.size:
                os.posix_fallocate(end.fd, 0, send.size)  # no room: said now, not a SIGBUS or a short file later
    except Exception as exc:  # of any type: this end fails, the exchange goes on
        end.failed = f"{path}: cannot {'read' if sending else 'write'} it: {exc}"
        if end.fd is not None:
            os.close(end.fd)
            end.fd = None
    return end


def _read_into(end: _End, buffer: np.ndarray, start: int) -> None:
    if end.fd is not None:
        try:
            if os.preadv(end.fd, [memoryview(buffer)], start) == len(buffer):
                return
            raise OSError("the file ended early")
        except Exception as exc:
            end.failed = end.failed or f"{end.send.read}: reading it: {exc}"
            os.close(end.fd)
            end.fd = None
    buffer[:] = 0  # the peer still gets its bytes; the failure is said


def _write_from(end: _End, buffer: np.ndarray, start: int) -> None:
    end.crc = zlib.crc32(buffer, end.crc)  # chunks of one send arrive in order
    if end.fd is None:
        return
    try:
        if os.pwritev(end.fd, [memoryview(buffer)], start) != len(buffer):
            raise OSError("short write")
    except Exception as exc:
        end.failed = end.failed or f"{end.send.write}: writing it: {exc}"
        os.close(end.fd)
        end.fd = None


def _close(ends: list[_End]) -> Optional[str]:
    """Every file closed; each received one renamed into place when whole and of its recorded crc32, else removed."""
    failure: Optional[str] = None
    for e in ends:
        if e.fd is not None:
            try:
                os.close(e.fd)
            except OSError as exc:  # kept: the exchange's end is reached on every rank
                e.failed = e.failed or f"{e.send.read if e.sending else e.send.write}: closing it: {exc}"
        if e.sending:
            failure = failure or e.failed
            continue
        partial = Path(e.send.write + ".partial")
        if e.failed is None and e.crc != e.send.crc:
            e.failed = f"{e.send.write}: arrived from rank {e.send.source} with another crc32 than recorded"
        try:
            if e.failed is None:
                os.replace(partial, e.send.write)
            else:
                partial.unlink(missing_ok=True)
        except OSError as exc:
            e.failed = e.failed or f"{e.send.write}: {exc}"
        failure = failure or e.failed
    return failure
