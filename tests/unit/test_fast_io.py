"""The converter's hot-path pieces, without DeepSpeed runs: the direct torch-file writer, the
DeepSpeed-free unpickler, and the page-release arithmetic."""

from __future__ import annotations

import pickle
import sys
import textwrap
import zipfile

import pytest
import torch

from megatron_ucp.format import lightpickle, osio
from megatron_ucp.format.torchfile import (
    FastWriterUnsupported,
    TensorSpec,
    _pickle,
    _serialization_id_of,
    matches_torch_save,
    tensor_bytes,
    write_tensor_file,
)


@pytest.mark.parametrize(
    "dtype,shape,extra",
    [
        (torch.float32, (7, 5), {"cat_dim": 0}),
        (torch.float32, (1000,), {"cat_dim": 0, "vocab_tensor": True}),
        (torch.bfloat16, (3, 64), {"cat_dim": 1, "param_n_sub_params": 2}),
        (torch.float16, (2, 3, 4), {"cat_dim": 0}),
        (torch.float32, (), {}),
    ],
)
def test_direct_writer_reproduces_torch_save_bytes(tmp_path, dtype, shape, extra):
    assert matches_torch_save()
    t = (torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32) * 0.37 - 5)[: torch.Size(shape).numel()]
    t = t.to(dtype).reshape(shape).clone()  # its own storage, exactly its size (torch.save writes whole storages)
    (tmp_path / "ref").mkdir()
    (tmp_path / "ours").mkdir()
    ref, ours = tmp_path / "ref" / "exp_avg.pt", tmp_path / "ours" / "exp_avg.pt"
    torch.save({"param": t, **extra}, ref)
    flat = t.reshape(-1)
    cut = flat.numel() // 3
    pieces = [tensor_bytes(flat[:cut]), tensor_bytes(flat[cut:])]  # two fragments, as from two ranks
    size = write_tensor_file(
        ours, {"param": TensorSpec(dtype, shape), **extra}, pieces, serialization_id=_serialization_id_of(ref)
    )
    assert ours.read_bytes() == ref.read_bytes() and size == ref.stat().st_size
    with zipfile.ZipFile(ours) as z:
        assert z.testzip() is None  # every CRC right
    for mmap in (False, True):
        back = torch.load(ours, weights_only=False, mmap=mmap)
        assert back.keys() == {"param", *extra} and back["param"].dtype == dtype
        assert torch.equal(back["param"], t)


def test_direct_writer_default_id_is_deterministic_and_loads(tmp_path):
    t = torch.randn(33, 3)
    entry = {"param": TensorSpec(t.dtype, t.shape), "cat_dim": 0}
    a, b = tmp_path / "a" / "fp32.pt", tmp_path / "b" / "fp32.pt"
    for path in (a, b):
        path.parent.mkdir()
        write_tensor_file(path, entry, [tensor_bytes(t)])
    assert a.read_bytes() == b.read_bytes()
    assert torch.equal(torch.load(a, weights_only=True)["param"], t)


def test_direct_writer_refuses_wrong_sizes_empty_tensors_and_zip64(tmp_path, monkeypatch):
    t = torch.zeros(10)
    with pytest.raises(ValueError):
        write_tensor_file(tmp_path / "x.pt", {"param": TensorSpec(t.dtype, (11,))}, [tensor_bytes(t)])
    with pytest.raises(FastWriterUnsupported):  # torch lays out an empty record differently: torch.save it
        write_tensor_file(tmp_path / "e.pt", {"param": TensorSpec(t.dtype, (0,))}, [])
    import megatron_ucp.format.torchfile as tf

    monkeypatch.setattr(tf, "_ZIP32_LIMIT", 100)
    with pytest.raises(FastWriterUnsupported):
        write_tensor_file(tmp_path / "y.pt", {"param": TensorSpec(t.dtype, t.shape)}, [tensor_bytes(t)])


def test_entry_pickle_matches_torch(tmp_path):
    t = torch.zeros(4, 2, dtype=torch.bfloat16)
    torch.save({"param": t, "cat_dim": 0}, tmp_path / "ref.pt")
    with zipfile.ZipFile(tmp_path / "ref.pt") as z:
        assert z.read("ref/data.pkl") == _pickle({"param": TensorSpec(t.dtype, t.shape), "cat_dim": 0})[0]


FAKE_MODULE = textwrap.dedent("""
    import enum
    from dataclasses import dataclass

    class Stage(int, enum.Enum):
        ONE = 1
        TWO = 2

    @dataclass
    class Address:
        numel: int
        start: int

    class Scaler:
        def __init__(self):
            self.cur_scale = 1.0
            self.dynamic = False
""")


def test_stand_ins_load_without_the_package_and_pickle_back_identically(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "things.py").write_text(FAKE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fakeds.things as real

    obj = {
        "stage": real.Stage.TWO,
        "maps": [{"w": real.Address(numel=5, start=3)}],
        "scaler": real.Scaler(),
        "cls": real.Address,
    }
    original = pickle.dumps(obj, protocol=2)
    monkeypatch.setattr(lightpickle, "_LIGHT_PREFIXES", ("fakeds",))
    for name in ("fakeds.things", "fakeds"):
        monkeypatch.delitem(sys.modules, name)

    loaded = lightpickle.Unpickler(__import__("io").BytesIO(original)).load()
    assert "fakeds" not in sys.modules  # nothing imported
    stage = loaded["stage"]
    assert lightpickle.is_stand_in(stage) and int(stage) == 2 and stage == 2 and {stage, loaded["stage"]} == {2}
    addr = loaded["maps"][0]["w"]
    assert (addr.numel, addr.start) == (5, 3)
    assert loaded["scaler"].cur_scale == 1.0 and lightpickle.needs_light_pickler()

    buf = __import__("io").BytesIO()
    lightpickle.Pickler(buf, protocol=2).dump(loaded)
    assert buf.getvalue() == original  # the same bytes the real classes pickle to

    with pytest.raises(Exception):  # the standard pickler refuses stand-ins instead of writing something else
        pickle.dumps(loaded, protocol=2)

    monkeypatch.setattr(lightpickle, "_LIGHT_PREFIXES", ())
    import fakeds.things as again  # noqa: F811

    back = pickle.loads(buf.getvalue())
    assert back["stage"] is again.Stage.TWO and back["maps"][0]["w"] == again.Address(numel=5, start=3)
    assert vars(back["scaler"]) == {"cur_scale": 1.0, "dynamic": False} and back["cls"] is again.Address


def test_done_with_never_leaves_the_mapping(monkeypatch):
    calls = []
    monkeypatch.setattr(osio, "_madvise", lambda start, end, advice: calls.append((start, end, advice)))
    page, window = osio.PAGE, osio.FAULT_AROUND
    base = 1000 * window
    bounds = (base + 3 * page + 100, base + 9 * page - 7)  # tensors of one file, not page-aligned
    osio.done_with(base + 5 * page + 10, 20, bounds)
    ((start, end, advice),) = calls
    assert advice == osio.MADV_DONTNEED
    assert start == base + 3 * page and end == base + 9 * page  # widened, then clipped to whole pages inside
    calls.clear()
    osio.done_with(base + 4 * page, 0, bounds)
    assert calls == []
