"""What a read without torch hands on: stand-ins for torch's dtypes become torch's own before they are sent to
another rank or put into the live optimizer (torch's pickler refuses a class that claims torch's name, and the
broadcast would fail on the first rank alone); and what the hooked collectives hold past the call."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from megatron_ucp.deepspeed.torch_files import with_torch_values
from megatron_ucp.format.lightpickle import stand_in_class
from megatron_ucp.integration import collectives


def test_stand_ins_for_torch_values_become_torchs_own_in_containers_and_objects():
    half = stand_in_class("torch", "float16")
    scaler = SimpleNamespace(dtype=half, scale=2.0**16)
    state = {"ds_config": {"dtype": half}, "scalers": [scaler], "pair": (half, 1), "kept": "float16"}
    state["self"] = state  # a cycle is walked once
    out = with_torch_values(state)
    assert out["ds_config"]["dtype"] is torch.float16
    assert out["scalers"][0].dtype is torch.float16 and out["scalers"][0].scale == 2.0**16
    assert out["pair"] == (torch.float16, 1) and out["kept"] == "float16"
    pickle.dumps({k: v for k, v in out.items() if k != "self"})


def test_a_stand_in_of_another_module_is_left_as_it_is():
    other = stand_in_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    assert with_torch_values({"cls": other})["cls"] is other


def test_an_outcome_that_cannot_be_sent_fails_on_the_deciding_rank(monkeypatch: pytest.MonkeyPatch):
    # one process: the first rank's outcome is what every rank gets; an unpicklable one arrives as a Failure
    C = collectives.Collective
    monkeypatch.setattr(C, "first", property(lambda self: True))
    monkeypatch.setattr(C, "broadcast", lambda self, outcome: outcome)
    monkeypatch.setattr(C, "count", lambda self, flag: flag)
    outcome = collectives.JOB.decide(lambda: {"fn": lambda: None})
    assert isinstance(outcome, collectives.Failure), outcome
    assert collectives.JOB.decide(lambda: {"ok": 1}) == {"ok": 1}


def test_small_collective_tensors_are_held_past_the_call_and_large_buffers_are_not():
    # the backend's thread must never free the last reference to a tally at the interpreter's exit; a module-sized
    # buffer is not held for the life of the process
    small, large = torch.zeros(4, dtype=torch.int64), torch.zeros(collectives._LEND_MAX_BYTES + 1, dtype=torch.uint8)
    collectives._lend(small, large)
    assert any(t is small for t in collectives._LENT)
    assert not any(t is large for t in collectives._LENT)


def test_what_cannot_be_set_the_usual_way_is_rebuilt_or_left_and_nothing_raises():
    import dataclasses
    from collections import namedtuple

    half = stand_in_class("torch", "float16")

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        dtype: object

    class ReadOnly:
        @property
        def dtype(self):
            return self.__dict__["dtype"]

    read_only = ReadOnly()
    read_only.__dict__["dtype"] = half
    Pair = namedtuple("Pair", "dtype n")
    device = stand_in_class("torch", "device")("cpu")
    scaler = stand_in_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")()
    scaler.__dict__["dtype"] = half  # a stand-in of another package's, holding a torch stand-in
    out = with_torch_values(
        {"frozen": Frozen(half), "ro": read_only, "pair": Pair(half, 2), "set": {half}, "dev": device, "ls": scaler}
    )
    assert out["frozen"].dtype is torch.float16 and out["ro"].dtype is torch.float16
    assert out["pair"] == Pair(torch.float16, 2) and type(out["pair"]) is Pair
    assert out["set"] == {torch.float16} and out["dev"] == torch.device("cpu")
    assert out["ls"].__dict__["dtype"] is torch.float16
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert with_torch_values(deep) is deep  # past the recursion limit: left as it is, no exception


def test_a_decision_one_rank_cannot_read_fails_every_rank(monkeypatch: pytest.MonkeyPatch):
    # this rank is not the first: what it receives names a class it cannot import
    C = collectives.Collective
    monkeypatch.setattr(C, "first", property(lambda self: False))
    monkeypatch.setattr(C, "broadcast", lambda self, payload: b"\x80\x04cno_such_mod\nX\n.")
    monkeypatch.setattr(C, "count", lambda self, flag: flag)
    outcome = collectives.JOB.decide(lambda: 1 / 0)  # never called here
    assert isinstance(outcome, collectives.Failure) and "could not be read here" in outcome.message, outcome
    # another rank's failure to read it fails this rank too, though it read it
    monkeypatch.setattr(C, "broadcast", lambda self, payload: pickle.dumps({"ok": 1}))
    monkeypatch.setattr(C, "count", lambda self, flag: 1)
    outcome = collectives.JOB.decide(lambda: None)
    assert isinstance(outcome, collectives.Failure) and "another rank could not read it" in outcome.message
