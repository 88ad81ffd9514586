"""The preload server: ``python -m tests.support.preload.server SOCKET MODULE...``, in the environment of the jobs it
will fork.

It imports what every rank imports (``MODULE...``), checks that it is still one thread (a fork copies only the
calling thread: a lock held by another would stay held in the child), freezes the imported objects out of the
garbage collector's reach (so the ranks share those pages, copy-on-write) and listens on ``SOCKET``; it exists once
the imports are done. Each connection is one job (``client.py`` says what it sends), forked into an agent
(``agent.py``). It leaves when its parent, the test session, is gone.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import socket
import struct
import sys
from pathlib import Path

TORCH_AND_DEEPSPEED = (
    "torch",
    "torch._dynamo",
    "deepspeed",
    # 0.19.8's ZeRO optimizer check imports Muon, whose module calls torch.compile (torch's compiler: ~2 s per rank)
    "deepspeed.runtime.zero.muon.muon_optimizer",
)
"""What every rank of every job imports before it does anything; a launch adds its own (``pool.launch_command``),
each imported where installed. Never ``mpi4py.MPI``: its import initialises MPI, which a fork must not copy."""
CANNOT_FORK = 3
"""The server's exit status when its imports left a second thread: the launch falls back to fresh interpreters."""
HEADER = struct.Struct("!Q")


def preload(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"preload server: {threads} threads after the imports; a fork would copy one of them", file=sys.stderr)
        sys.exit(CANNOT_FORK)
    gc.collect()
    gc.freeze()


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One job's request: its length and the client's stdin, stdout and stderr, then the JSON itself."""
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    if len(head) != HEADER.size or len(fds) != 3:
        raise ConnectionError(f"a request without its header or its 3 descriptors ({len(head)} bytes, {fds})")
    (size,) = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client left mid-request")
        body += chunk
    return json.loads(body), fds


def serve(path: Path, modules: list[str]) -> None:
    from . import agent

    parent = os.getppid()
    preload(modules)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    while os.getppid() == parent:
        for _ in agent.finished_children():  # the agents of jobs that ended
            pass
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = receive(conn)
        except (ConnectionError, ValueError, OSError) as exc:
            print(f"preload server: a request refused: {exc}", file=sys.stderr, flush=True)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            agent.run(conn, request, fds)
        conn.close()
        for fd in fds:
            os.close(fd)
    listener.close()
    path.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), sys.argv[2:])
