"""Shared runs and checks for tests/system/test_elastic_resume.py (real DeepSpeed, CPU, gloo).

The machine is small, so every DeepSpeed run is made once per session and reused by all the
tests that look at it: :class:`ElasticRuns` caches them by name. The source checkpoints come
from the harness's session cache (``ds_checkpoint``: DP=4, 4 steps, saved at steps 2 and 4, full
dumps), shared with the other test files; this module only ever writes into private copies.
"""

from __future__ import annotations

import re
import shutil
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_ucp.integration.resume.native.binding import expectation, inspect_file, read_facts, verdict
from tests.support.dsharness import TrainResult, TrainSpec, run_training

#: bf16 reduction order differs between DP sizes; everything else must match exactly.
LOSS_TOLERANCE = 1e-3
# Our own handler's format, or (a library configured the root logger first: IPEX's logging.basicConfig)
# the root handler's "%(asctime)s - %(filename)s - %(name)s - %(levelname)s - %(message)s".
UCP_LINE = re.compile(r"(?:\[megatron-ucp\] \w+ | - megatron_ucp[\w.]* - \w+ - )(.*)$")


def ucp_lines(log: str) -> list[str]:
    """megatron-ucp's log messages in a run's combined log (rank 0 logs at INFO, others warn)."""
    return [m.group(1) for line in log.splitlines() if (m := UCP_LINE.search(line))]


FALLBACK_START = "!!! FALLING BACK: "
FALLBACK_END = "(--ucp-no-fallback: stop instead)"


def fallback_announcements(log: str) -> list[str]:
    """Each fallback's announcement, from its first words to its last, and nothing else of the log: what a claim of
    "says which file and why" is checked in (the older tag's own load, logged after it, says other things)."""
    out = []
    start = log.find(FALLBACK_START)
    while start >= 0:
        end = log.find(FALLBACK_END, start)
        assert end > start, log[start : start + 3000]
        out.append(log[start : end + len(FALLBACK_END)])
        start = log.find(FALLBACK_START, end)
    return out


def summary_lines(log: str) -> list[str]:
    return [line for line in ucp_lines(log) if line.startswith("megatron-ucp universal load:")]


def assert_same_state(saved: Path, loaded: Path, skip_params: tuple[str, ...] = ()) -> int:
    """Every parameter's fp32, optimizer states and step equal, bit for bit; returns tensors compared."""
    a = torch.load(saved, weights_only=False)
    b = torch.load(loaded, weights_only=False)
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    compared = 0
    for name, states in a.items():
        if name in skip_params:
            continue
        assert states.keys() == b[name].keys(), (name, sorted(states), sorted(b[name]))
        for key, value in states.items():
            other = b[name][key]
            if torch.is_tensor(value):
                assert torch.is_tensor(other) and value.dtype == other.dtype, (name, key)
                assert torch.equal(value, other), f"{name}/{key} differs after the load"
            else:
                assert value == other, (name, key, value, other)
            compared += 1
    return compared


#: After the first resumed step (whose loss comes from the restored weights, before any update), on
#: releases whose stock BF16_Optimizer training is not DP-invariant (versions.Internals: 0.18.9).
DP_VARIANT_TOLERANCE = 5e-3


def assert_losses_continue(resumed: TrainResult, reference: Callable[[int], float]) -> None:
    from megatron_ucp.deepspeed.versions import internals

    assert resumed.steps, resumed.log[-3000:]
    variant = resumed.optimizer_class == "BF16_Optimizer" and not internals().bf16_dp_invariant
    for i, (step, loss) in enumerate(zip(resumed.steps, resumed.losses, strict=True)):
        tolerance = DP_VARIANT_TOLERANCE if variant and i > 0 else LOSS_TOLERANCE
        assert abs(loss - reference(step)) <= tolerance, (step, loss, reference(step))


class ElasticRuns:
    """Named DeepSpeed runs, each made once: ``runs.get(name, make)`` where ``make(base) -> value``."""

    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self._done: dict[str, Any] = {}
        self._lock = threading.RLock()

    def get(self, name: str, make: Callable[[Path], Any]) -> Any:
        with self._lock:
            if name not in self._done:
                folder = self.base / name
                folder.mkdir(parents=True)
                self._done[name] = make(folder)
            return self._done[name]


def resume(dp: int, optimizer: str, load_dir: Path, folder: Path, **fields: Any) -> TrainResult:
    """A plugin run that loads ``load_dir`` at ``dp`` ranks and trains to step 4, dumping after the load."""
    fields.setdefault("steps", 4)
    fields.setdefault("timeout", 600)
    spec = TrainSpec(dp=dp, optimizer=optimizer, load_dir=load_dir, dump_dir=folder / "dumps", plugin=True, **fields)
    return run_training(spec)


def private_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def flip_a_data_bit(path: Path) -> None:
    """Flip one bit inside the first tensor record of a torch zip file: ``torch.load`` still reads it
    (it checks no CRC), only a checksum can tell."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    name_len, extra_len = struct.unpack("<HH", bytes(data[info.header_offset + 26 : info.header_offset + 30]))
    data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x10
    path.write_bytes(bytes(data))


def flip_a_bit_in_the_largest_record(path: Path) -> None:
    """Flip one bit in the middle of the largest tensor record of a torch zip file (a rank file's partition):
    ``torch.load`` still reads it, only the save's checksums can tell."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", bytes(data[info.header_offset + 26 : info.header_offset + 30]))
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def rewrite_manifest_checksums(folder: Path, algorithm: str) -> None:
    """Recompute a universal folder's manifest checksums with ``algorithm``: a folder as an older
    megatron-ucp wrote it (``ucp-wsum64-v2`` before v3)."""
    import json

    from megatron_ucp.format import dsformat as F
    from megatron_ucp.plan.accounting import checksum

    path = folder / "ucp_manifest.json"
    manifest = json.loads(path.read_text())
    for key, record in manifest["checksums"]["files"].items():
        entry = torch.load(folder / F.UNIVERSAL_ZERO_DIR / f"{key}.pt", weights_only=False)
        record["sum"] = checksum(entry[F.PARAM], 0, algorithm)
        if "rows_sum" in record:
            record["rows_sum"] = checksum(entry[F.VOCAB_PADDED_ROWS], entry[F.PARAM].numel(), algorithm)
    manifest["checksums"]["algorithm"] = algorithm
    path.write_text(json.dumps(manifest))


def bind_folder(
    model_states: Path,
    rank_file: Callable[[int], Path],
    shapes: Optional[list[list[tuple[str, tuple[int, ...]]]]] = None,
) -> list[str]:
    """Every rank file of a save bound to its position and to the save, in one process, through the reader a resume
    uses: the problems a resume would name, or none. ``shapes``: the param groups, for a mixture-of-experts save
    whose model states list none (as a resume takes the job's)."""
    facts = read_facts(model_states, rank_file, live_shapes=shapes)
    seen = []
    for position in range(facts.dp_from):
        reads = facts.layout.reads_to(facts.layout, position)
        source, file_facts = inspect_file(rank_file(position), facts, expectation(facts, position, reads))
        if source is not None:
            source.close()
        seen.append(file_facts)
    return verdict(facts, seen)
