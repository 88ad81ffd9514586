"""Reading and writing torch files without torch (torchload, rawtensor, torchfile.save_object), checked
against torch itself on real DeepSpeed checkpoints and on objects built to exercise every rule."""

from __future__ import annotations

import collections
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.writer import _descriptors_for, save_file
from megatron_ucp.deepspeed.reader import load_raw
from megatron_ucp.format import torchload
from megatron_ucp.format.lightpickle import is_stand_in
from megatron_ucp.format.rawtensor import DTYPES, RawTensor, from_torch, raw_tensors_from_torch, torch_tensors_from_raw
from megatron_ucp.format.torchfile import FastWriterUnsupported, save_object

REPO = Path(__file__).resolve().parents[2]


def assert_same(expected, got, where="obj"):
    """``got`` (RawTensors) holds what ``expected`` (torch.load's result) holds."""
    if torch.is_tensor(expected):
        assert isinstance(got, RawTensor), where
        t = got.to_torch()
        assert t.dtype == expected.dtype and t.shape == expected.shape and t.stride() == expected.stride(), where
        assert torch.equal(t, expected), where
        assert got.requires_grad == expected.requires_grad, where
    elif isinstance(expected, dict):
        assert list(expected) == list(got), where
        for k in expected:
            assert_same(expected[k], got[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(got), where
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif type(expected).__module__.split(".")[0] in ("deepspeed", "torch"):
        if not is_stand_in(got) and got != expected and hasattr(expected, "__dict__"):  # e.g. a LossScaler
            assert type(got) is type(expected), where
            assert_same(vars(expected), vars(got), f"{where}.__dict__")
        else:
            assert stands_for(got, expected), (where, got, expected)
    else:
        assert expected == got, where


def stands_for(got, expected) -> bool:
    """``got`` is ``expected`` itself (its class was importable) or a stand-in of the same global or of an
    instance of the same class built from the same arguments (torch.device('cpu'))."""
    if not is_stand_in(got):
        return got == expected
    if isinstance(got, type):  # a global such as torch.bfloat16
        return f"{got._ucp_module}.{got._ucp_name}" == str(expected)
    cls, reduced = type(expected), expected.__reduce__()
    return (type(got)._ucp_module, type(got)._ucp_name) == (cls.__module__, cls.__name__) and got._ucp_args == tuple(
        reduced[1]
    )


def checkpoint_files(tag_dir: Path) -> list[Path]:
    """The tag's .pt files; a folder without any is a broken fixture, not a pass."""
    files = sorted(p for p in tag_dir.iterdir() if p.suffix == ".pt")
    assert len(files) >= 2, f"{tag_dir}: no model and optimizer files"
    return files


@pytest.mark.parametrize("optimizer", ["bf16", "zero"])
def test_real_deepspeed_files_load_as_torch_loads_them(ds_checkpoint, optimizer):
    ck = ds_checkpoint(optimizer=optimizer, dp=4)
    for path in checkpoint_files(ck.tag_dir()):
        assert_same(torch.load(path, weights_only=False, map_location="cpu"), torchload.load(path), path.name)


@pytest.mark.parametrize("name", ["bf16_optimizer", "zero_optimizer"])
def test_old_deepspeed_files_load_as_torch_loads_them(legacy_fixture, name):
    for path in checkpoint_files(legacy_fixture(name).tag_dir):
        assert_same(torch.load(path, weights_only=False, map_location="cpu"), torchload.load(path), path.name)


def rich_object():
    base = torch.arange(40, dtype=torch.float32)
    return {
        "view": base[5:17],  # offset into a shared storage
        "same_storage": base.view(8, 5),  # the same storage again
        "strided": base.view(8, 5)[:, 1],  # non-contiguous
        "scalar": torch.tensor(3.0),
        "bf16": torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        "ints": [torch.tensor([1, -2], dtype=torch.int64), torch.tensor([True, False])],
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "meta": (torch.Size([4, 5]), torch.bfloat16, torch.device("cpu")),
        "od": collections.OrderedDict(a=1, b="x"),
        "empty": torch.empty(0),
    }


def test_views_parameters_and_torch_globals(tmp_path):
    path = tmp_path / "rich.pt"
    obj = rich_object()
    torch.save(obj, path)
    got = torchload.load(path)
    assert_same(torch.load(path, weights_only=False), got)
    assert got["view"].storage is got["same_storage"].storage  # one storage record, shared
    assert not got["strided"].is_contiguous() and got["view"].is_contiguous()
    assert float(got["scalar"]) == 3.0 and int(got["ints"][0].narrow(0, 1, 1).item()) == -2
    assert isinstance(got["meta"][0], tuple) and got["meta"][0] == (4, 5)
    assert is_stand_in(got["meta"][1]) and is_stand_in(got["meta"][2])  # the stand-ins are told apart:
    assert not stands_for(got["meta"][1], torch.float32) and not stands_for(got["meta"][2], torch.device("meta"))
    # what the loader returns pickles back (stand-ins as the torch globals they stood for)
    back = tmp_path / "back.pt"
    save_object({k: v for k, v in got.items() if k not in ("strided", "empty")}, back)
    again = torch.load(back, weights_only=False)
    assert again["meta"] == (torch.Size([4, 5]), torch.bfloat16, torch.device("cpu"))
    assert type(again["meta"][0]) is torch.Size
    for key in ("view", "same_storage", "scalar", "bf16", "param"):
        assert torch.equal(again[key], obj[key].detach()), key
    assert torch.equal(again["ints"][1], obj["ints"][1])


def test_what_only_torch_can_rebuild_is_refused_and_load_raw_falls_back(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    sparse = tmp_path / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse()}, sparse)
    attr = tmp_path / "attr.pt"
    t = torch.ones(2)
    t.note = "python attribute"
    torch.save({"t": t}, attr)
    for path in (legacy, sparse, attr):
        with pytest.raises(torchload.TorchNeeded):
            torchload.load(path)
    got = load_raw(legacy)  # through torch.load, tensors wrapped
    assert isinstance(got["a"], RawTensor) and not got["a"].storage.mapped
    assert torch.equal(got["a"].to_torch(), torch.ones(3))


def test_damaged_files_get_torch_loads_diagnosis(tmp_path):
    from megatron_ucp.errors import CheckpointFormatError

    good = tmp_path / "good.pt"
    torch.save({"a": torch.ones(1000)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:1500])
    with pytest.raises(CheckpointFormatError, match="cut.pt: unreadable torch file"):
        load_raw(cut)


def test_save_object_writes_what_torch_save_writes(tmp_path):
    g = torch.Generator().manual_seed(0)
    obj = {
        "exp_avg": torch.randn(5, 3, generator=g),
        "steps": [torch.tensor(4.0), 2],
        "half": torch.randn(7, generator=g).half(),
        "lr": 1e-3,
        "name": "w",
    }
    ref = tmp_path / "ref" / "state.pt"
    ours = tmp_path / "ours" / "state.pt"
    ref.parent.mkdir()
    ours.parent.mkdir()
    torch.save(obj, ref)
    save_object(raw_tensors_from_torch(obj), ours)
    with zipfile.ZipFile(ref) as a, zipfile.ZipFile(ours) as b:
        names = [i.filename for i in a.infolist()]
        assert names == [i.filename for i in b.infolist()]
        for name in names:
            if not name.endswith("serialization_id"):
                assert a.read(name) == b.read(name), name
        assert b.testzip() is None
    back = torch.load(ours, weights_only=True)
    assert back.keys() == obj.keys() and torch.equal(back["exp_avg"], obj["exp_avg"])
    assert torch.equal(back["steps"][0], obj["steps"][0]) and back["half"].dtype == torch.float16


def test_save_refuses_torch_tensors_and_the_converter_falls_back_to_torch_save(tmp_path):
    with pytest.raises(FastWriterUnsupported):
        save_object({"t": torch.ones(2)}, tmp_path / "x.pt")
    save_file({"t": torch.ones(2), "r": from_torch(torch.zeros(3))}, tmp_path / "y.pt")
    back = torch.load(tmp_path / "y.pt", weights_only=False)
    assert torch.equal(back["t"], torch.ones(2)) and torch.equal(back["r"], torch.zeros(3))
    save_file({"e": from_torch(torch.empty(0))}, tmp_path / "z.pt")  # empty records: torch.save
    assert torch.load(tmp_path / "z.pt", weights_only=False)["e"].numel() == 0
    assert torch.equal(torch_tensors_from_raw([from_torch(torch.ones(2))])[0], torch.ones(2))


def test_raw_tensor_views_check_their_bounds():
    t = from_torch(torch.arange(10, dtype=torch.int32))
    part = t.narrow(0, 2, 5)
    assert part.to_torch().tolist() == [2, 3, 4, 5, 6] and part.nbytes == 20
    assert bytes(part.bytes_view()) == torch.arange(2, 7, dtype=torch.int32).numpy().tobytes()
    assert part.reshape(5, 1).shape == (5, 1) and part.reshape(-1).shape == (5,)
    with pytest.raises(ValueError):
        t.narrow(0, 8, 5)
    with pytest.raises(ValueError):
        RawTensor(t.storage, 8, (5,), (1,))
    with pytest.raises(ValueError):
        t.reshape(3, 3)
    assert DTYPES["bfloat16"].itemsize == 2 and repr(DTYPES["float32"]) == "torch.float32"
    bf = from_torch(torch.tensor([1.5], dtype=torch.bfloat16))
    assert float(bf) == 1.5  # no struct code: read through torch


def test_open_file_limit_is_raised_for_many_rank_files():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        low = min(soft, 64) if hard == resource.RLIM_INFINITY or hard >= 64 else soft
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        fit = _descriptors_for(2000)
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard == resource.RLIM_INFINITY or hard >= 2256:
            assert now >= 2256 and fit >= 2000
        else:
            assert now == hard and fit == max(16, hard - 256)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_conversion_and_help_never_import_torch(tmp_path, ds_checkpoint):
    root = ds_checkpoint(optimizer="bf16", dp=4).copy_to(tmp_path / "ck")
    code = (
        "import sys\nfrom megatron_ucp.cli import main\n"
        f"rc = main(['convert', {str(root)!r}, '--no-progress', '--workers', '2'])\n"
        "assert rc == 0, rc\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'megatron'))\n"
        "assert not bad, bad\n"
        # NumPy (0.08 s to import) computes the manifest checksums as the bytes are written
        "assert 'numpy' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from megatron_ucp.convert.verify import verify_universal

    report = verify_universal(root / "global_step4_universal", source=root, progress=False)
    assert report.ok, report.problems
    code = (
        "import sys, contextlib, io\nfrom megatron_ucp.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_stand_ins_survive_the_round_trip_with_deepspeed_importable(tmp_path, ds_checkpoint):
    """The common optimizer state written without DeepSpeed loads back with DeepSpeed's real classes."""
    path = next(p for p in checkpoint_files(ds_checkpoint(optimizer="zero", dp=4).tag_dir()) if "optim" in p.name)
    code = (
        "import sys\nfrom megatron_ucp.format.torchload import load\n"
        "from megatron_ucp.format.torchfile import save_object\n"
        f"sd = load({str(path)!r})['optimizer_state_dict']\n"
        "common = {k: v for k, v in sd.items() if k in ('loss_scaler', 'zero_stage', 'ds_version', 'clip_grad')}\n"
        f"save_object(common, {str(tmp_path / 'common.pt')!r})\n"
        "assert 'deepspeed' not in sys.modules and 'torch' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import deepspeed  # noqa: F401  (the real classes)

    back = torch.load(tmp_path / "common.pt", weights_only=False)
    want = torch.load(path, weights_only=False)["optimizer_state_dict"]
    assert type(back["loss_scaler"]) is type(want["loss_scaler"])
    assert vars(back["loss_scaler"]) == vars(want["loss_scaler"])
    assert back["zero_stage"] == want["zero_stage"] and type(back["zero_stage"]) is type(want["zero_stage"])


def mapped_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (Linux smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_reading_metadata_and_steps_maps_no_tensor_bytes(tmp_path):
    """Headers, pickle and small storages (steps) are read with pread: the mapping stays cold until
    tensor bytes are copied (fault-around would otherwise map the neighbours of anything touched)."""
    path = (tmp_path / "rank.pt").resolve()
    big = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    torch.save({"state": {0: {"step": torch.tensor(5.0), "exp_avg": big}}, "fp32": [big.clone()], "n": 3}, path)
    path.read_bytes()  # in the page cache
    obj = torchload.load(path)
    step, exp_avg = obj["state"][0]["step"], obj["state"][0]["exp_avg"]
    assert float(step) == 5.0 and not step.storage.mapped and exp_avg.storage.mapped
    assert exp_avg.storage.region[0] <= exp_avg.data_ptr() < exp_avg.storage.region[1]
    assert mapped_rss_kb(path) == 0
    assert bytes(exp_avg.narrow(0, 1000, 10).bytes_view()) == big[1000:1010].numpy().tobytes()
    assert mapped_rss_kb(path) > 0


def test_zip64_records_are_found_where_their_local_headers_say(tmp_path):
    """Rank files of a 7B model at small DP exceed 4 GB: their records carry zip64 extra fields. The same
    torch file re-packed with zip64 headers on every record loads the same (and torch agrees)."""
    src = tmp_path / "small.pt"
    obj = {"a": torch.arange(50, dtype=torch.float32), "b": [torch.tensor(2.0)], "n": 1}
    torch.save(obj, src)
    packed = tmp_path / "zip64.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(packed, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            with zout.open(info.filename, "w", force_zip64=True) as out:
                out.write(zin.read(info.filename))
    data = packed.read_bytes()
    with zipfile.ZipFile(packed) as z:
        for info in z.infolist():  # local headers carry the zip64 extra field (id 0x0001)
            name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
            extra = data[info.header_offset + 30 + name_len :][:extra_len]
            assert extra[:2] == b"\x01\x00", info.filename
    got = torchload.load(packed)
    assert_same(torch.load(packed, weights_only=False), got)
    assert_same(obj, got)
