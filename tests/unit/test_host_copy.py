"""The host copy an asynchronous save writes: the same tensors, storage for storage, independent of the live state."""

from __future__ import annotations

import collections
import io
from argparse import Namespace

import pytest
import torch

from megatron_ucp.integration.save.host_copy import HostBuffers, HostCopy, HostMemoryShort, WhenWritten, written_form


def _state() -> dict:
    flat = torch.arange(12, dtype=torch.float32)
    module = collections.OrderedDict(w=flat[:6].view(2, 3), b=flat[6:9])  # views of one flat buffer
    module._metadata = {"": {"version": 1}}  # what nn.Module.state_dict() attaches
    return {
        "module": module,
        "optimizer": {"state": {0: {"exp_avg": torch.ones(5, dtype=torch.bfloat16)}}, "groups": [torch.zeros(2)]},
        "args": Namespace(iteration=3, lr=0.1),
        "shapes": (torch.Size([2, 3]),),
        "step": 7,
    }


def _saved(state: dict) -> bytes:
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


def test_the_copy_holds_the_same_tensors_and_storages_and_training_may_change_the_live_ones():
    live = _state()
    copy = HostCopy(HostBuffers())
    snap = copy.of(live)
    assert torch.equal(snap["module"]["w"], live["module"]["w"]) and snap["module"]["b"].dtype == torch.float32
    # views of one storage stay views of one copied storage, at the same offsets
    assert snap["module"]["w"].untyped_storage().data_ptr() == snap["module"]["b"].untyped_storage().data_ptr()
    assert snap["module"]["b"].storage_offset() == 6
    assert snap["module"]._metadata == {"": {"version": 1}} and type(snap["module"]) is collections.OrderedDict
    assert copy.copied_bytes == 12 * 4 + 5 * 2 + 2 * 4
    # torch.save writes the same bytes for the copy as for the live state
    assert _saved(snap) == _saved(live)
    # the live state changes after the save returns: the copy does not
    live["module"]["w"].add_(100.0)
    live["optimizer"]["state"][0]["exp_avg"].zero_()
    live["args"].iteration = 4
    assert float(snap["module"]["w"][0, 0]) == 0.0 and float(snap["optimizer"]["state"][0]["exp_avg"][0]) == 1.0
    assert snap["args"].iteration == 3
    loaded = torch.load(io.BytesIO(_saved(snap)), weights_only=False)
    assert torch.equal(loaded["module"]["w"], torch.arange(6, dtype=torch.float32).view(2, 3))


def test_buffers_are_reused_by_the_next_save_of_the_same_structure():
    buffers = HostBuffers()
    first = HostCopy(buffers).of(_state())
    held = [b.data_ptr() for b in buffers.buffers]
    second = HostCopy(buffers).of(_state())
    assert [b.data_ptr() for b in buffers.buffers] == held  # no new allocation
    assert second["module"]["w"].untyped_storage().data_ptr() == first["module"]["w"].untyped_storage().data_ptr()


def test_a_buffer_that_cannot_be_had_is_said():
    class Refusing(HostBuffers):
        def take(self, position: int, nbytes: int) -> torch.Tensor:
            raise HostMemoryShort(f"cannot allocate {nbytes} bytes of pinned host memory")

    with pytest.raises(HostMemoryShort, match="cannot allocate 48 bytes"):
        HostCopy(Refusing()).of(_state())


def test_a_parameter_stays_a_parameter():
    p = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    snap = HostCopy(HostBuffers()).of({"p": p})
    assert isinstance(snap["p"], torch.nn.Parameter) and not snap["p"].requires_grad and torch.equal(snap["p"], p)


def test_a_value_computed_when_written_is_computed_from_the_copies_not_the_live_tensors():
    live = _state()
    exp_avg = live["optimizer"]["state"][0]["exp_avg"]
    live["optimizer"]["record"] = WhenWritten(lambda t, scale: float(t.float().sum()) * scale, (exp_avg, 2))
    snap = HostCopy(HostBuffers()).of(live)
    exp_avg.mul_(10)  # training goes on after the save returned
    written = written_form(snap)
    assert written["optimizer"]["record"] == 10.0  # five ones, times two: the saved values
    assert written["module"] is snap["module"]  # what holds no deferred value is not rebuilt
    assert isinstance(snap["optimizer"]["record"], WhenWritten)  # the copy itself is left as it was
    assert written_form(live)["optimizer"]["record"] == 100.0  # computed at once where nothing was copied
    with pytest.raises(TypeError, match="unresolved"):
        _saved(snap)  # never written as it is
