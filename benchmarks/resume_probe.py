"""One process plays DP rank ``r`` of a ``W``-rank resume, from a universal folder or from the native files.

What ``integration/resume/universal/partition_load._load_group`` does on that rank, with its own primitives: the
rank's fragments of every parameter (its partition of each group at DP ``W``: the read plan), then
per fragment and state the memory-mapped load of the state file (``load_torch_file``), the flat
layout of the whole parameter (``state_layout``, kept vocabulary rows included), the runs
(``slice_runs`` / ``runs_between``) and the copy (``gather``) into the rank's flat partition.
and the hash of what landed (the accounting). Prints one JSON line: planning time, load time, bytes the kernel read
from storage for this
process (``/proc/self/io`` ``read_bytes``: run it with the folder evicted from the page cache),
the rank's share in bytes, peak RSS, and whether every copied partition equals the synthetic
checkpoint's values at that place (``synthetic.values``: the source, independently of any file).

With ``--native`` the folder is the native tag and the rank runs the native reshard's own code
(``integration/resume/native/reshard``: the facts, the live-model check, the read plan, each old rank
file it needs opened and checked, ``copy_reads`` with the ledger), as the hook does before its
one all-reduce. With ``--experts E --ep EP`` (native only) the tag is a mixture-of-experts save: the
expert group's partitions come from the files of this rank's expert-parallel rank, over expert-DP. ::

    python benchmarks/resume_probe.py UNIVERSAL_DIR --preset llama-1b --world 1024 --rank 511
    python benchmarks/resume_probe.py TAG_DIR --native --preset llama-1b --world 1024 --rank 511
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import torch  # noqa: E402

from megatron_ucp.convert.universal import read_manifest  # noqa: E402
from megatron_ucp.deepspeed.reader import load_torch_file  # noqa: E402
from megatron_ucp.format import dsformat as F  # noqa: E402
from megatron_ucp.format.integrity import recorded_checksums  # noqa: E402
from megatron_ucp.integration.resume.universal.state_layout import gather, state_layout, tensor_of  # noqa: E402
from megatron_ucp.plan.accounting import checksum  # noqa: E402
from megatron_ucp.plan.geometry import GroupGeometry  # noqa: E402
from megatron_ucp.plan.llama_shapes import preset  # noqa: E402
from megatron_ucp.plan.tensor_parallel import TpLayout, runs_between, slice_runs  # noqa: E402
from megatron_ucp.synthetic.content import SyntheticSpec, state_range  # noqa: E402
from megatron_ucp.synthetic.optimizers import BASE_OPTIMIZERS  # noqa: E402


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


def shape_of(args):
    """The preset, with ``--experts`` per MoE layer when given."""
    shape = preset(args.preset)
    return dataclasses.replace(shape, experts=args.experts) if args.experts else shape


def exact_against_source(args, copied) -> bool:
    """Every copied partition equals the synthetic values at its place (the source, not a file)."""
    # values do not depend on DP; an expert group's are its expert-parallel rank's buffer
    source = SyntheticSpec(shape=shape_of(args), dp=args.ep, ep=args.ep, seed=args.seed, ds_version="0.19.5")
    exact = True
    for g, geo, buffers in copied:
        start = source.placement.index(g, args.rank) * geo.partition_size
        for state, got in buffers.items():
            want = state_range(source, 0, g, state, start, start + geo.partition_size, args.rank % args.ep)
            exact = exact and bool(torch.equal(got, want))
    return exact


def native(args) -> int:
    from megatron_ucp.integration.resume.native.binding import read_facts
    from megatron_ucp.integration.resume.native.reshard import OldFiles, copy_reads
    from megatron_ucp.plan.partitioned import check_live_model
    from tests.support.native_reads import open_source, source_ranks

    tag = args.folder
    groups = shape_of(args).param_groups(ep=args.ep)
    io0 = read_bytes()
    t0 = time.perf_counter()

    def rank_file(r: int) -> Path:
        return tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"

    live = [[(p.name, tuple(p.shape)) for p in g] for g in groups]  # taken where an MoE save lists no param_shapes
    facts = read_facts(tag / F.MODEL_STATES_FILE, rank_file, live_shapes=live)  # the first rank's, broadcast
    t_facts = time.perf_counter() - t0
    facts_io = read_bytes() - io0  # what only the DP group's first rank reads, once for the job
    io0 = read_bytes()
    t1 = time.perf_counter()
    sizes = [facts.layout.placement.size(g, args.world) for g in range(len(groups))]
    new = [GroupGeometry(numel=sum(p.numel for p in g), dp=size) for g, size in zip(groups, sizes)]
    live_layout = check_live_model(facts.layout, live, [g.partition_size for g in new], args.world, tag)
    reads = facts.layout.reads_to(live_layout, args.rank)
    t_plan = time.perf_counter() - t1
    t2 = time.perf_counter()
    sources = {r: open_source(rank_file(r), r, facts, reads) for r in source_ranks(reads)}
    targets = [
        {state: torch.zeros(geo.partition_size) for state in ("fp32", *facts.states[g])} for g, geo in enumerate(new)
    ]
    files = OldFiles.of(facts, rank_file)
    ledger = files.ledger()
    copy_reads(files, reads, sources, targets, ledger, ledger.new_table())
    t_load = time.perf_counter() - t2
    io = read_bytes() - io0
    copied = [(g, geo, targets[g]) for g, geo in enumerate(new)]
    exact = exact_against_source(args, copied)
    share = sum(4 * geo.partition_size * len(targets[g]) for g, geo in enumerate(new))
    real = sum(geo.true_length(facts.layout.placement.index(g, args.rank)) for g, geo in enumerate(new))
    module = module_part(args, tag, facts, new, targets) if args.module else {}
    print(
        json.dumps(
            {
                "route": "native",
                "world": args.world,
                "rank": args.rank,
                "facts_seconds": t_facts,
                "facts_read_bytes": facts_io,
                "plan_seconds": t_plan,
                "load_seconds": t_load,
                "read_bytes": io,
                "share_bytes": share,
                "real_elements": real,
                "old_files": len(sources),
                "peak_rss": peak_rss(),
                "bit_exact": exact,
                **module,
            }
        )
    )
    return 0 if exact and module.get("weights_exact", True) else 1


def module_part(args, tag: Path, facts, new: list, targets: list) -> dict:
    """What this rank reads of the model-states file with ``module_read = distributed``: its pickle (the
    lazy loader) and its partition's range of the saved weights, compared with its masters rounded (the
    proof a same-DP restart needs); bytes from storage, the weights' share."""
    from megatron_ucp.deepspeed.reader import load_raw
    from megatron_ucp.integration.resume.module_read import SavedWeights

    path = tag / F.MODEL_STATES_FILE
    io0 = read_bytes()
    load_raw(path, random_access=True)
    pickle_io = read_bytes() - io0
    io0 = read_bytes()
    t0 = time.perf_counter()
    weights = SavedWeights(path, facts.layout.shapes)
    exact = True
    share = 0
    for g, geo in enumerate(new):
        real = geo.true_length(args.rank)
        saved = torch.empty(real, dtype=torch.bfloat16)
        weights.read(g, args.rank * geo.partition_size, saved)
        exact = exact and torch.equal(saved, targets[g]["fp32"][:real].to(torch.bfloat16))
        share += 2 * real
    weights.close()
    return {
        "module_pickle_read_bytes": pickle_io,
        "module_read_bytes": read_bytes() - io0,
        "module_share_bytes": share,
        "module_file_bytes": path.stat().st_size,
        "module_seconds": time.perf_counter() - t0,
        "weights_exact": exact,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the universal folder, or with --native the native tag folder")
    ap.add_argument("--native", action="store_true", help="reshard the native rank files (no universal folder)")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--module", action="store_true", help="with --native: also the rank's part of the model states")
    ap.add_argument("--experts", type=int, default=0, help="with --native: experts per MoE layer of the save")
    ap.add_argument("--ep", type=int, default=1, help="with --experts: its expert-parallel size (kept)")
    ap.add_argument("--base-optimizer", default="adam", help="the optimizer DeepSpeed wrapped: its states")
    args = ap.parse_args(argv)
    if args.experts and (not args.native or args.module):
        ap.error("--experts: the native reshard's partitions only (no --module, no universal folder)")
    if args.native:
        return native(args)
    args.universal = args.folder
    zero = args.universal / F.UNIVERSAL_ZERO_DIR
    groups = preset(args.preset).param_groups()
    io0 = read_bytes()
    t0 = time.perf_counter()
    plan = plan_rank(groups, args.world, args.rank)
    t_plan = time.perf_counter() - t0
    share = 0
    t1 = time.perf_counter()
    sums = recorded_checksums(read_manifest(args.universal))
    algorithm = sums.algorithm if sums is not None else None
    landed = 0
    copied = []
    states = ("fp32", *BASE_OPTIMIZERS[args.base_optimizer][0])
    for g, (geo, fragments) in enumerate(plan):
        buffers = {s: torch.zeros(geo.partition_size) for s in states}
        share += 4 * geo.partition_size * len(states)
        for name, shape, lp_start, numel, hp_start in fragments:
            load_torch_file(zero / name / f"{F.STEP_STATE}.pt", mmap=False)
            for state in states:
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
    exact = exact_against_source(args, copied)
    real = sum(min(max(geo.numel - args.rank * geo.partition_size, 0), geo.partition_size) for geo, _ in plan)
    print(
        json.dumps(
            {
                "route": "universal",
                "world": args.world,
                "rank": args.rank,
                "plan_seconds": t_plan,
                "load_seconds": t_load,
                "read_bytes": io,
                "share_bytes": share,
                "real_elements": real,
                "fragments": sum(len(f) for _, f in plan),
                "peak_rss": peak_rss(),
                "bit_exact": exact,
            }
        )
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
