"""The queue lock of a checkpoint root: one holder at a time, also when a dead holder's lock is broken by two
processes that judged it dead at once (threads here, each its own lock object: the file is what they share)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_ucp.background import store
from megatron_ucp.background.store import LOCK_FILE, LockBusy, QueueLock, ucp_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _dead_holders_lock(root: Path) -> Path:
    path = ucp_dir(root) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{socket.gethostname()} {_dead_pid()} 0.000\n")
    return path


def test_a_dead_holders_lock_is_broken_and_taken(tmp_path: Path):
    path = _dead_holders_lock(tmp_path)
    with QueueLock(tmp_path, timeout=5):
        assert str(__import__("os").getpid()) in path.read_text()
    assert not path.exists()


def test_a_breaker_that_judged_the_dead_holder_late_never_takes_the_lock_its_successor_holds(tmp_path, monkeypatch):
    """Breaker B judges the dead holder's lock stale, then is delayed; meanwhile C breaks it and takes the lock. B must
    not remove C's lock: two holders would both write queue.json, and one update would be lost."""
    _dead_holders_lock(tmp_path)
    real = store.osio.pid_alive
    judged, go_on = threading.Event(), threading.Event()

    def slow_judge(pid: int) -> bool:
        if threading.current_thread().name == "B" and not judged.is_set():
            alive = real(pid)
            judged.set()
            go_on.wait(10)  # B stalls right after it judged the holder dead
            return alive
        return real(pid)

    monkeypatch.setattr(store.osio, "pid_alive", slow_judge)
    outcome: dict = {}

    def breaker_b() -> None:
        try:
            with QueueLock(tmp_path, timeout=1.5):
                outcome["b"] = "held"
        except LockBusy:
            outcome["b"] = "busy"

    b = threading.Thread(target=breaker_b, name="B")
    b.start()
    assert judged.wait(10)
    with QueueLock(tmp_path, timeout=5):  # C: breaks the dead holder's lock, holds it
        go_on.set()
        b.join(10)
        assert outcome == {"b": "busy"}, outcome  # B waited for C, as any process must
    assert not (ucp_dir(tmp_path) / LOCK_FILE).exists()


def test_a_lock_broken_while_held_is_left_to_its_new_holder(tmp_path: Path):
    lock = QueueLock(tmp_path, timeout=5).__enter__()
    path = ucp_dir(tmp_path) / LOCK_FILE
    path.write_text("another-host 1 0.000 abcdef\n")  # broken as stale and taken by another process meanwhile
    lock.__exit__(None, None, None)
    assert path.read_text() == "another-host 1 0.000 abcdef\n"


@pytest.mark.parametrize("age", [0.0, 3600.0])
def test_an_abandoned_break_claim_is_removed_only_when_old(tmp_path: Path, age: float):
    import os
    import time

    _dead_holders_lock(tmp_path)
    claim = ucp_dir(tmp_path) / (LOCK_FILE + store.BREAKING)
    claim.write_text("somewhere 1 0.000 dead\n")
    os.utime(claim, (time.time() - age, time.time() - age))
    if age:
        with QueueLock(tmp_path, timeout=5):
            pass
        assert not claim.exists()
    else:
        with pytest.raises(LockBusy):
            QueueLock(tmp_path, timeout=0.3).__enter__()
        assert claim.exists()
