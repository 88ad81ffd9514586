"""One rank of a forked job, from the fork to its exit, as a fresh ``python -m MODULE`` or ``python SCRIPT`` would run.

The environment, working folder, ``sys.argv`` and ``sys.path[0]`` are the ones a fresh interpreter would have; the
per-process part of the test ``sitecustomize`` (when the server imported one) runs again, as it would at a fresh
start. The exit is :func:`exit_as_the_interpreter_would`.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from typing import NoReturn

STARTUP_FAILED = 70
"""Exit status of a rank that could not be set up (before its script ran)."""


def exit_as_the_interpreter_would(code: int) -> NoReturn:
    """What the interpreter does at exit, in its order: ``threading._shutdown`` (the thread pools' exit hooks, which
    tell their idle workers to leave, then the non-daemon threads joined: joining them without the hooks waits
    forever on a pool torch's compiler started), the exit handlers (megatron-ucp's end-of-run commit and wait are
    some), the streams flushed; then it leaves without the rest of interpreter finalization, where a C++ thread left
    behind once aborted a finished rank ("terminate called without an active exception", exit -6, after every rank
    had passed the final barrier)."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def status_of(exc: SystemExit) -> int:
    """``sys.exit(x)``'s exit status as the interpreter gives it (a message is printed and means 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run(argv: list[str]) -> int:
    """``argv`` as after ``python``: ``["-m", module, *args]`` or ``[script, *args]``; the exit status."""
    try:
        if argv[0] == "-m":
            module, args = argv[1], argv[2:]
            sys.argv = [module, *args]
            sys.path[0] = os.getcwd()
            _site_edits()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, args = argv[0], argv[1:]
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            _site_edits()
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return status_of(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # torch's, once a process group exists: "[rankN]: ..." lines
        return 1


def _site_edits() -> None:
    edit = getattr(sys.modules.get("sitecustomize"), "edit_rank_process", None)
    if edit is not None:
        edit()


def main(env: dict[str, str], cwd: str, argv: list[str]) -> NoReturn:
    """The rank's whole life: its own session, environment and folder, its script, its exit."""
    try:
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    except BaseException:
        os._exit(STARTUP_FAILED)
    exit_as_the_interpreter_would(run(argv))
