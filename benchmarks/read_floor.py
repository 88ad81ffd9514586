"""The read floor of a resume: the same ranks reading the same bytes of the same cold files, and nothing else.

A native reshard's rank reads, of the old rank files, the fp32 master and every optimizer state of the ranges
its plan names (and a little metadata). The floor plans those ranges with the hooks' own planner
(:func:`megatron_ucp.integration.resume.native.binding.read_facts`, ``layout.reads_to``), outside the timing, then
starts one plain process per new rank (no torch, no DeepSpeed, no process group), lines them up on a barrier and has
each ``os.pread`` its ranges (adjacent ones merged) from the cold files. The time is the slowest rank's, between the
barrier and its last byte: what any route that reads each needed byte once cannot beat on this machine. Left out
of the floor: the model-states file and the rank files' pickle records (small), so it is a little lower than the
true floor, never higher.

    python benchmarks/read_floor.py benchmarks/.cache/m25-dp8/global_step1 --dp 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

Ranges = list[tuple[str, int, int]]
"""(file, byte offset, byte count), in file order."""


def rank_file_of(tag: Path):
    """DP rank -> its optimizer file of model-parallel rank 0, whatever the optimizer's prefix."""

    def rank_file(r: int) -> Path:
        found = sorted(tag.glob(f"*zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        if not found:
            raise FileNotFoundError(f"{tag}: no optimizer file of DP rank {r}")
        return found[0]

    return rank_file


def plan_ranges(tag: Path, dp_to: int) -> list[Ranges]:
    """Per new rank, the byte ranges of the old rank files its reshard copies (fp32 and every state)."""
    from megatron_ucp.format import dsformat as F
    from megatron_ucp.format.exact_read import file_offset
    from megatron_ucp.integration.resume.native.binding import read_facts
    from tests.support.native_reads import open_source

    rank_file = rank_file_of(tag)
    facts = read_facts(tag / F.MODEL_STATES_FILE, rank_file)
    new = facts.layout.at_dp(dp_to)
    out = []
    for rank in range(dp_to):
        reads = facts.layout.reads_to(new, rank)
        sources = {}
        ranges: Ranges = []
        for group_reads in reads:
            for read in group_reads:
                src = sources.get(read.source_rank)
                if src is None:
                    src = sources[read.source_rank] = open_source(
                        rank_file(read.source_rank), read.source_rank, facts, reads
                    )
                g = read.source_group
                for tensor in (src.fp32[g], *(src.states[g][s] for s in facts.states[g])):
                    offset = file_offset(tensor, read.source_offset)
                    if offset is None:  # a small record: read with the file's metadata, as the hooks read it
                        continue
                    ranges.append((str(src.path), offset, read.length * tensor.element_size()))
        for src in sources.values():
            src.close()
        out.append(_merged(ranges))
    return out


def _merged(ranges: Ranges) -> Ranges:
    merged: Ranges = []
    for path, offset, size in sorted(ranges):
        if merged and merged[-1][0] == path and merged[-1][1] + merged[-1][2] == offset:
            merged[-1] = (path, merged[-1][1], merged[-1][2] + size)
        else:
            merged.append((path, offset, size))
    return merged


def _io() -> dict:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {k: int(v) for k, v in fields.items()}


def _reader(ranges: Ranges, barrier, results) -> None:
    handles = {path: os.open(path, os.O_RDONLY) for path in {p for p, _, _ in ranges}}
    buffer = bytearray(max((n for _, _, n in ranges), default=0))
    view = memoryview(buffer)
    before = _io()
    barrier.wait()
    t0 = time.perf_counter()
    done = 0
    for path, offset, size in ranges:
        got = os.preadv(handles[path], [view[:size]], offset)
        if got != size:
            raise OSError(f"{path}: short read at {offset} ({got} of {size} bytes)")
        done += got
    wall = time.perf_counter() - t0
    after = _io()
    for fd in handles.values():
        os.close(fd)
    results.put(
        {
            "wall": wall,
            "bytes": done,
            "rchar": after["rchar"] - before["rchar"],
            "read_bytes": after["read_bytes"] - before["read_bytes"],
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    )


def run(plans: list[Ranges]) -> dict:
    """The ranks' reads, started together (the caller evicted the files first); the slowest rank's time."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(len(plans)), ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(ranges, barrier, results)) for ranges in plans]
    for p in procs:
        p.start()
    ranks = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a floor reader exited with {p.exitcode}")
    return {"route": "floor", "ranks": ranks, "load_s": max(r["wall"] for r in ranks)}


def main(argv: Optional[list[str]] = None) -> int:
    import bench_convert as bc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag", type=Path)
    ap.add_argument("--dp", type=int, required=True)
    args = ap.parse_args(argv)
    plans = plan_ranges(args.tag, args.dp)
    bc.evict(args.tag)
    result = run(plans)
    print(json.dumps({"load_s": result["load_s"], "bytes": sum(r["bytes"] for r in result["ranks"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
