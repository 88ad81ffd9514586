"""Start one job on a preload server and stand for it: ``python -S client.py SOCKET NPROC PORT [OPTION...] -- ARGS...``.

``ARGS`` are what would follow ``python`` (``-m MODULE ...`` or ``SCRIPT ...``). Options (agent.py says what they
do): ``--rank-logs DIR``, ``--no-stop-on-failure``. The job gets this process's
environment, working folder, stdin, stdout and stderr; this process exits with the job's status (torchrun's: 0, or 1
when a rank failed). SIGTERM or SIGINT asks the job to stop (its ranks get SIGTERM, then SIGKILL); a killed client
makes the agent kill the ranks. Standard library only, and run with ``-S``: it starts in milliseconds.
"""

import json
import os
import signal
import socket
import struct
import sys

GONE = 70


def request(argv: list[str]) -> tuple[str, dict]:
    path, nproc, port, *rest = argv
    if "--" not in rest or rest.index("--") == len(rest) - 1:
        raise SystemExit("usage: client.py SOCKET NPROC PORT [--rank-logs DIR] [--no-stop-on-failure] -- ARGS...")
    options, args = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
    out = {"nproc": int(nproc), "port": int(port), "cwd": os.getcwd(), "env": dict(os.environ), "argv": args}
    while options:
        option = options.pop(0)
        if option == "--rank-logs":
            out["rank_logs"] = os.path.abspath(options.pop(0))
        elif option == "--no-stop-on-failure":
            out["stop_on_failure"] = False
        else:
            raise SystemExit(f"client.py: unknown option {option}")
    return path, out


def main(argv: list[str]) -> int:
    path, job = request(argv)
    body = json.dumps(job).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [struct.pack("!Q", len(body))], [0, 1, 2])
    conn.sendall(body)

    def stop(signum, frame):
        conn.send(b"term")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    said = b""
    while not said.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            print(f"preload launcher: the job's agent at {path} vanished", file=sys.stderr)
            return GONE
        said += chunk
    return int(said.split()[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
