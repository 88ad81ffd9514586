"""The torch-free check of ``torch.save``'s form (format/torch_archive.py) never vouches for a file torch's
own zip reader rejects: mutated and truncated archives, fuzzed against ``PyTorchFileReader``."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_ucp.format.torch_archive import unproven
from megatron_ucp.format.torchload import torch_reader_problem


def _saved(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("archives")
    return [
        _saved(base / "small.pt", {"a": torch.arange(10.0), "b": [1, 2]}),
        _saved(base / "model.pt", {"module": {f"w{i}": torch.randn(7, 5).bfloat16() for i in range(6)}, "n": 3}),
    ]


def test_what_torch_save_writes_is_proven(originals) -> None:
    assert [unproven(p) for p in originals] == [None, None]


def _header_offsets(data: bytes, path: Path) -> list[int]:
    """Byte offsets in the local headers, the central directory and the trailer (not tensor bytes)."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        offsets = []
        for info in infos:
            offsets += range(info.header_offset, info.header_offset + 30 + len(info.filename))
        cd_start = min(data.rfind(b"PK\x01\x02", 0, len(data)), len(data))
        first_cd = data.find(b"PK\x01\x02")
        offsets += range(first_cd if first_cd >= 0 else cd_start, len(data))
    return offsets


def test_a_mutated_archive_is_never_vouched_for_when_torch_rejects_it(originals, tmp_path: Path) -> None:
    rng = random.Random(20261125)
    vouched = rejected = 0
    for trial in range(600):
        source = originals[trial % len(originals)]
        data = bytearray(source.read_bytes())
        kind = rng.random()
        if kind < 0.75:  # flip bytes in a header, the directory or the trailer
            for at in rng.sample(_header_offsets(bytes(data), source), rng.randint(1, 3)):
                data[at] = (data[at] + rng.randint(1, 255)) % 256
        elif kind < 0.9:
            data = data[: rng.randint(0, len(data) - 1)]
        else:
            data += bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 64)))
        path = tmp_path / f"m{trial}.pt"
        path.write_bytes(bytes(data))
        theirs = torch_reader_problem(path)
        rejected += theirs is not None
        if unproven(path) is None:
            vouched += 1
            assert theirs is None, (trial, theirs)
    assert rejected > 100 and vouched > 20, (rejected, vouched)  # both sides exercised
