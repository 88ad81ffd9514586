"""The fault-injection seam: inert unless the tests' variable names this tag and node."""

from __future__ import annotations

from megatron_ucp import faults


def test_pause_is_parsed_per_tag_and_node_and_inert_otherwise(monkeypatch):
    env = {faults.PAUSE_ENV: "global_step1:3:1,global_step3:300:0"}
    assert faults.pause_seconds("global_step1", 1, env) == 3.0
    assert faults.pause_seconds("global_step3", 0, env) == 300.0
    assert faults.pause_seconds("global_step1", 0, env) == 0.0
    assert faults.pause_seconds("global_step1", 1, {}) == 0.0
    monkeypatch.delenv(faults.PAUSE_ENV, raising=False)
    sleeps = _recorded_sleeps(monkeypatch)
    faults.pause_point("unit test", "global_step1", 1)
    assert sleeps == []


def test_a_point_pauses_once(monkeypatch):
    monkeypatch.setenv(faults.PAUSE_ENV, "t-once:0.2:0,t-once:7:1")
    sleeps = _recorded_sleeps(monkeypatch)
    faults.pause_point("unit test once", "t-once", 0)
    faults.pause_point("unit test once", "t-once", 0)
    faults.pause_point("unit test once", "t-once", 1)
    faults.pause_point("another point", "t-once", 0)
    assert sleeps == [0.2, 7.0, 0.2]  # once per point, tag and node


def _recorded_sleeps(monkeypatch) -> list[float]:
    """The pauses asked of the clock, recorded instead of slept (what is checked is the decision, not the time)."""
    sleeps: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", sleeps.append)
    return sleeps
