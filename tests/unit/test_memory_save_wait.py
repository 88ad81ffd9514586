"""What a memory save's waiters learn of its commit, which runs in the writer thread: a commit that broke off is kept
until the next memory save's agreement reads it, whoever waits first (a durable save, a load, the exit)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ucp.integration.save import memory_save
from megatron_ucp.integration.save.memory_commit import Pending, Target
from megatron_ucp.integration.save.writer import Writer


@pytest.fixture()
def state():
    memory_save._reset()
    memory_save._STATE["writer"] = Writer("test-memory-writer")
    yield memory_save._STATE
    memory_save._reset()


def _pending(tmp_path: Path, broken: bool, done: bool = True) -> Pending:
    flight = SimpleNamespace(done=threading.Event(), save=SimpleNamespace(tag="global_step3"))
    if done:
        flight.done.set()
    into = Target(tmp_path, flight=flight)  # type: ignore[arg-type]
    return Pending(3, tmp_path / "iter_0000003", tmp_path, None, False, "", into, 0.0, 0.0, broken)  # type: ignore[arg-type]


def test_a_commit_that_broke_off_is_still_known_after_another_wait(state, tmp_path: Path) -> None:
    state["pending"] = _pending(tmp_path, broken=True)
    assert memory_save.wait() is True  # a durable save's wait, say
    assert state["pending"] is None
    assert memory_save.wait() is True  # the next memory save's agreement still learns it


def test_a_commit_that_ended_well_leaves_nothing_to_report(state, tmp_path: Path) -> None:
    state["pending"] = _pending(tmp_path, broken=False)
    assert memory_save.wait() is False and memory_save.wait() is False


def test_a_commit_not_over_in_time_is_reported_and_stays_pending(state, tmp_path: Path) -> None:
    pending = _pending(tmp_path, broken=False, done=False)
    state["pending"] = pending
    assert memory_save.wait(timeout=0.01) is True
    assert state["pending"] is pending  # a later wait still waits for it
