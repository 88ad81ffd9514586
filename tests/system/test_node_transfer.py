"""Files sent between ranks over the process group (integration/node_sends.send_files), with real torch.distributed
(gloo, three processes): many files each way between one pair, empty ones, files of many chunks with few chunks in
flight, a file that cannot be written on one rank and one that arrives with another crc32 than recorded. The
exchange always runs to its end on every rank (no rank left waiting); each rank says its own failures; what arrived
whole is in place, nothing half-written is left."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.support.dsharness import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, port: int, base: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    from megatron_ucp.integration import node_sends

    node_sends._CHUNK = 7  # many chunks per file
    node_sends._WINDOW = 2  # few in flight
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    root = Path(base)
    plan = json.loads((root / "plan.json").read_text())
    sends = [node_sends.Send(*s) for s in plan]
    failure = node_sends.send_files(sends)
    (root / f"outcome{rank}.json").write_text(json.dumps(failure))
    dist.barrier()
    dist.destroy_process_group()


def test_files_cross_between_ranks_and_every_failure_is_said_without_leaving_a_rank_waiting(tmp_path: Path) -> None:
    data = {name: os.urandom(size) for name, size in (("a", 0), ("b", 5), ("c", 23), ("d", 17), ("e", 31), ("f", 9))}
    src = {r: tmp_path / f"src{r}" for r in range(3)}
    dst = {r: tmp_path / f"dst{r}" for r in range(3)}
    for folder in (*src.values(), *dst.values()):
        folder.mkdir()
    (dst[0] / "blocked").write_text("a file where the folder should be")
    plan = []
    for name, s, d in (("a", 0, 1), ("b", 0, 1), ("c", 0, 1), ("d", 1, 0), ("e", 2, 0), ("f", 2, 1)):
        (src[s] / name).write_bytes(data[name])
        write = dst[d] / ("blocked/e" if name == "e" else name)
        crc = zlib.crc32(data[name]) ^ (1 if name == "f" else 0)  # f: recorded with another crc32
        plan.append([s, d, str(src[s] / name), str(write), len(data[name]), crc])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    mp.start_processes(_rank, args=(3, free_port(), str(tmp_path)), nprocs=3, join=True, start_method="spawn")
    outcomes = [json.loads((tmp_path / f"outcome{r}.json").read_text()) for r in range(3)]
    assert outcomes[0] is not None and "blocked/e" in outcomes[0] and "cannot write it" in outcomes[0], outcomes
    assert outcomes[1] is not None and "dst1/f: arrived from rank 2 with another crc32" in outcomes[1], outcomes
    assert outcomes[2] is None, outcomes  # the sender of both: nothing failed on its side
    for name, d in (("a", 1), ("b", 1), ("c", 1), ("d", 0)):
        assert (dst[d] / name).read_bytes() == data[name], name
    assert not (dst[1] / "f").exists()
    assert not list(tmp_path.rglob("*.partial"))
