"""One process plays DP rank ``r`` of a ``W``-rank resume from a universal folder (no collectives).

What ``integration/partition_load._load_group`` does on that rank, with its own primitives: the
rank's fragments of every parameter (its partition of each group at DP ``W``: the read plan), then
per fragment and state the memory-mapped load of the state file (``load_torch_file``), the flat
layout of the whole parameter (``state_layout``, kept vocabulary rows included), the runs
(``slice_runs`` / ``runs_between``) and the copy (``gather``) into the rank's flat partition.
and the hash of what landed (the accounting). Prints one JSON line: planning time, load time, bytes the kernel read from storage for this
process (``/proc/self/io`` ``read_bytes``: run it with the folder evicted from the page cache),
the rank's share in bytes, peak RSS, and whether every copied partition equals the synthetic
checkpoint's values at that place (``synthetic.values``: the source, independently of any file). ::

    python benchmarks/resume_probe.py UNIVERSAL_DIR --preset llama-1b --dp-from 768 --world 1024 --rank 511
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import torch  # noqa: E402

from megatron_ucp.convert.universal import read_manifest  # noqa: E402
from megatron_ucp.deepspeed.reader import load_torch_file  # noqa: E402
from megatron_ucp.format.integrity import recorded_checksums  # noqa: E402
from megatron_ucp.plan.accounting import checksum  # noqa: E402
from megatron_ucp.format import dsformat as F  # noqa: E402
from megatron_ucp.integration.state_layout import gather, state_layout, tensor_of  # noqa: E402
from megatron_ucp.plan.geometry import GroupGeometry  # noqa: E402
from megatron_ucp.plan.llama_shapes import preset  # noqa: E402
from megatron_ucp.plan.tensor_parallel import TpLayout, runs_between, slice_runs  # noqa: E402
from megatron_ucp.synthetic.values import flat_range  # noqa: E402

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def peak_rss() -> int:
    """This process's own peak resident memory (``VmHWM``; ``ru_maxrss`` would include the parent's
    at fork: Linux keeps it across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def plan_rank(groups, world: int, rank: int) -> list[tuple[GroupGeometry, list[tuple[str, tuple, int, int, int]]]]:
    """Per group: the geometry at ``world`` and (name, shape, start in parameter, numel, start in
    partition) of every fragment rank ``rank`` owns: what DeepSpeed's ``_hp_mapping`` gives each
    parameter on that rank."""
    out = []
    for params in groups:
        geo = GroupGeometry(numel=sum(p.numel for p in params), dp=world)
        size, start = geo.partition_size, rank * geo.partition_size
        fragments, offset = [], 0
        for p in params:
            lo, hi = max(offset, start), min(offset + p.numel, start + size)
            if hi > lo:
                fragments.append((p.name, p.shape, lo - offset, hi - lo, lo - start))
            offset += p.numel
        out.append((geo, fragments))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("universal", type=Path)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    zero = args.universal / F.UNIVERSAL_ZERO_DIR
    groups = preset(args.preset).param_groups()
    io0 = read_bytes()
    t0 = time.perf_counter()
    plan = plan_rank(groups, args.world, args.rank)
    t_plan = time.perf_counter() - t0
    share = 0
    exact = True
    t1 = time.perf_counter()
    sums = recorded_checksums(read_manifest(args.universal))
    algorithm = sums.algorithm if sums is not None else None
    landed = 0
    copied = []
    for g, (geo, fragments) in enumerate(plan):
        buffers = {s: torch.zeros(geo.partition_size) for s in STATES}
        share += 4 * geo.partition_size * len(STATES)
        for name, shape, lp_start, numel, hp_start in fragments:
            load_torch_file(zero / name / f"{F.STEP_STATE}.pt", mmap=False)
            for state in STATES:
                path = zero / name / f"{state}.pt"
                entry = load_torch_file(path, mmap=True)
                layout = state_layout(tensor_of(entry, path), entry, tuple(shape), name, state, path)
                runs = runs_between(slice_runs(tuple(shape), TpLayout(), 1, 0, name), lp_start, numel)
                target = buffers[state].narrow(0, hp_start, numel)
                target.copy_(gather(layout, runs))
                at = 0
                for run in runs:  # the ledger's hash of what landed, as the loader does it
                    real = max(0, min(run.length, layout.held - run.full_offset))
                    if real and algorithm:
                        landed ^= checksum(target.narrow(0, at, real), run.full_offset, algorithm)
                    at += run.length
        copied.append((g, geo, buffers))
    t_load = time.perf_counter() - t1
    io = read_bytes() - io0
    for g, geo, buffers in copied:  # the source, independently of the files: the synthetic values
        start = args.rank * geo.partition_size
        for state, got in buffers.items():
            want = flat_range(args.seed, 0, g, state, start, start + geo.partition_size, geo.numel)
            exact = exact and bool(torch.equal(got, want))
    real = sum(min(max(geo.numel - args.rank * geo.partition_size, 0), geo.partition_size) for geo, _ in plan)
    print(json.dumps({"world": args.world, "rank": args.rank, "plan_seconds": t_plan, "load_seconds": t_load,
                      "read_bytes": io, "share_bytes": share, "real_elements": real,
                      "fragments": sum(len(f) for _, f in plan),
                      "peak_rss": peak_rss(), "bit_exact": exact}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
