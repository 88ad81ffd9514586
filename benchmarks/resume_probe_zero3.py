"""One process plays DP rank ``r`` of a ``W``-rank resume of a synthetic ZeRO-3 save, from the native files or
from a universal folder (the stage-3 counterpart of ``resume_probe.py``; the same JSON keys).

``--native``: the native reshard's own code (``integration/resume/native/binding``: the facts, each old rank file the
rank reads opened and checked through its view; ``plan/reshard``: the slice reads), each slice of fp32 and
of every state copied into the rank's partitions and hashed at its position, as the hook does before its one
all-reduce. Without it: the rank's slice of every parameter's state files in the universal folder
(``state_layout`` / ``gather``, as ``partition_load`` does). Prints one JSON line: planning and load time, bytes
the kernel read from storage (``/proc/self/io``: run it with the folder evicted), the bytes the reader asked
for, the rank's share in bytes (its partitions of fp32 and the two Adam states), peak RSS, and whether every
copied element equals the synthetic values (``synthetic.stage3_content.param_range``: the source, not a file). ::

    python benchmarks/resume_probe_zero3.py TAG_DIR --native --preset llama-1b --dp 768 --world 1024 --rank 511
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402
from resume_probe import peak_rss, read_bytes  # noqa: E402

from megatron_ucp.deepspeed.reader import load_torch_file  # noqa: E402
from megatron_ucp.format import dsformat as F  # noqa: E402
from megatron_ucp.integration.resume.universal.state_layout import gather, state_layout, tensor_of  # noqa: E402
from megatron_ucp.plan.llama_shapes import preset  # noqa: E402
from megatron_ucp.plan.tensor_parallel import TpLayout, runs_between, slice_runs  # noqa: E402
from megatron_ucp.synthetic.content import SyntheticSpec  # noqa: E402
from megatron_ucp.synthetic.stage3_content import SUB_GROUP_SIZE, param_range, stage3_groups  # noqa: E402

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _spec(args) -> SyntheticSpec:
    return SyntheticSpec(
        shape=preset(args.preset), dp=args.dp, optimizer="zero", zero_stage=3, seed=args.seed, flavour=args.flavour
    )


def _exact(spec: SyntheticSpec, new, rank: int, targets: list[dict]) -> bool:
    for h, buffers in enumerate(targets):
        for run in new.runs(rank, h):
            for state, got in buffers.items():
                want = param_range(spec, 0, run.param, state, run.start, run.start + run.length)
                if not torch.equal(got[run.offset : run.offset + run.length], want):
                    return False
    return True


def native(args) -> dict:
    from megatron_ucp.integration.resume.native.binding import expectation, inspect_file, read_facts
    from megatron_ucp.integration.resume.native.reshard import OldFiles, copy_reads
    from tests.support.native_reads import source_ranks

    tag = args.folder

    def rank_file(r: int) -> Path:
        return tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"

    io0, t0 = read_bytes(), time.perf_counter()
    facts = read_facts(
        tag / F.zero3_model_file(0, 0), rank_file, per_parameter=True
    )  # the first rank's part, broadcast
    t_facts, facts_io = time.perf_counter() - t0, read_bytes() - io0
    io0, t1 = read_bytes(), time.perf_counter()
    new = facts.layout.at_dp(args.world, SUB_GROUP_SIZE)
    reads = facts.layout.reads_to(new, args.rank)
    t_plan = time.perf_counter() - t1
    t2 = time.perf_counter()
    sources = {}
    for r in source_ranks(reads):
        source, seen = inspect_file(rank_file(r), facts, expectation(facts, r, reads))
        if source is None:
            raise RuntimeError(seen.problems[0])
        sources[r] = source
    targets = [{s: torch.zeros(new.geometry(h).partition_size) for s in STATES} for h in range(len(new.sub_groups))]
    files = OldFiles.of(facts, rank_file)
    ledger = files.ledger()
    copy_reads(files, reads, sources, targets, ledger, ledger.new_table())  # the hook's copy, with its ledger
    t_load = time.perf_counter() - t2
    io = read_bytes() - io0
    asked = sum(s.reader.bytes_read for s in sources.values() if s.reader is not None)
    for s in sources.values():
        s.close()
    return {
        "route": "native",
        "facts_seconds": t_facts,
        "facts_read_bytes": facts_io,
        "plan_seconds": t_plan,
        "load_seconds": t_load,
        "read_bytes": io,
        "asked_bytes": asked,
        "old_files": len(sources),
        "reads": sum(len(g) for g in reads),
        "new": new,
        "targets": targets,
    }


def universal(args, spec: SyntheticSpec) -> dict:
    zero = args.folder / F.UNIVERSAL_ZERO_DIR
    t0 = time.perf_counter()
    new = stage3_groups(spec).at_dp(args.world, SUB_GROUP_SIZE)
    t_plan = time.perf_counter() - t0
    io0, t1 = read_bytes(), time.perf_counter()
    shapes = {p.name: p.shape for g in spec.groups() for p in g}
    targets = []
    for h in range(len(new.sub_groups)):
        buffers = {s: torch.zeros(new.geometry(h).partition_size) for s in STATES}
        for run in new.runs(args.rank, h):
            shape = tuple(shapes[run.param])
            for state, buffer in buffers.items():
                path = zero / run.param / f"{state}.pt"
                entry = load_torch_file(path, mmap=True)
                layout = state_layout(tensor_of(entry, path), entry, shape, run.param, state, path)
                runs = runs_between(slice_runs(shape, TpLayout(), 1, 0, run.param), run.start, run.length)
                buffer.narrow(0, run.offset, run.length).copy_(gather(layout, runs))
        targets.append(buffers)
    return {
        "route": "universal",
        "plan_seconds": t_plan,
        "load_seconds": time.perf_counter() - t1,
        "read_bytes": read_bytes() - io0,
        "new": new,
        "targets": targets,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the native tag folder (--native), or the universal folder")
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--dp", type=int, required=True, help="the DP size the synthetic save was written at")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flavour", default="megatron", choices=["megatron", "plain"])
    args = ap.parse_args(argv)
    spec = _spec(args)
    out = native(args) if args.native else universal(args, spec)
    new, targets = out.pop("new"), out.pop("targets")
    exact = _exact(spec, new, args.rank, targets)
    share = sum(4 * new.geometry(h).partition_size * len(STATES) for h in range(len(new.sub_groups)))
    print(
        json.dumps(
            {
                **out,
                "world": args.world,
                "rank": args.rank,
                "share_bytes": share,
                "real_elements": sum(new.true_lengths(args.rank)),
                "peak_rss": peak_rss(),
                "bit_exact": exact,
            }
        )
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
