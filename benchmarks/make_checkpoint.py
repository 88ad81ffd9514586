"""Build (once) and cache real DeepSpeed ZeRO-1 bf16 checkpoints for the conversion benchmark.

Each checkpoint is a real multi-process DeepSpeed run (CPU, gloo, ``spec.dp`` processes) of the
harness's GPT-like model (Megatron-DeepSpeed parameter names, untied embeddings, RMSNorm) trained
for one step, so the Adam states are populated, and saved once. The optimizer is
DeepSpeedZeroOptimizer (bf16 + ZeRO stage 1 without fp32 gradient accumulation: the ALCF default at
PP=1), which stock ``ds_to_universal`` converts at any geometry.

Checkpoints live in ``benchmarks/.cache/<name>/`` (git-ignored) with a ``bench.json`` marker
written last; a folder without it is a failed build and is rebuilt. ::

    python benchmarks/make_checkpoint.py --list
    python benchmarks/make_checkpoint.py m100-dp8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
MARKER = "bench.json"
TAG = "global_step1"
#: Bump to invalidate every cached checkpoint (the model or the run changed).
CACHE_VERSION = 1


@dataclass(frozen=True)
class CkptSpec:
    name: str
    dp: int
    hidden: int
    num_layers: int
    vocab: int
    plugin: bool = False
    """Saved through the megatron-ucp hooks (save record, partition checksums, save identity)."""

    @property
    def params(self) -> int:
        """Parameter count of the harness model (untied embeddings, no biases, RMSNorm)."""
        h = self.hidden
        return 2 * self.vocab * h + self.num_layers * (12 * h * h + 2 * h) + h

    @property
    def largest_param(self) -> int:
        h = self.hidden
        return max(self.vocab * h, 4 * h * h)

    def describe(self) -> str:
        return (
            f"{self.params / 1e6:.1f}M params (hidden {self.hidden}, {self.num_layers} layers, vocab "
            f"{self.vocab}), DP={self.dp}"
        )


def _spec(name: str, dp: int, hidden: int, layers: int, vocab: int, plugin: bool = False) -> CkptSpec:
    return CkptSpec(name=name, dp=dp, hidden=hidden, num_layers=layers, vocab=vocab, plugin=plugin)


#: The checkpoints the benchmark knows. ``m100-dp8`` is the headline (~100M params, 1.4 GB).
SPECS = {
    s.name: s
    for s in (
        _spec("m100-dp8", 8, 768, 12, 10240),  # 100.6M params, ~1.4 GB
        _spec("m100-dp4", 4, 768, 12, 10240),  # the same model at DP 4: the resume benchmark's same-DP baseline
        _spec("m100-dp4-hooked", 4, 768, 12, 10240, plugin=True),  # saved through the hooks: same-DP checks
        _spec("m25-dp8", 8, 512, 6, 8192),  # 27.3M params: DP series and model-size series
        _spec("m25-dp16", 16, 512, 6, 8192),
        _spec("m25-dp32", 32, 512, 6, 8192),
        _spec("m50-dp8", 8, 640, 9, 10240),  # 57.4M params: model-size series
    )
}


def checkpoint_root(name: str) -> Path:
    return CACHE_DIR / name


def is_built(name: str) -> bool:
    marker = checkpoint_root(name) / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("cache_version") == CACHE_VERSION
    except ValueError:
        return False


def tag_dir(name: str) -> Path:
    return checkpoint_root(name) / TAG


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def harness_digest() -> str:
    """Digest of the harness sources a checkpoint was built with (recorded, not used to invalidate)."""
    import hashlib

    h = hashlib.sha1()
    for name in ("worker.py", "model.py", "spec.py"):
        h.update((REPO_ROOT / "tests" / "support" / "dsharness" / name).read_bytes())
    return h.hexdigest()[:12]


def build(spec: CkptSpec, timeout: float = 3600) -> Path:
    """Run the DeepSpeed job and save; returns the checkpoint root. Reuses a finished build."""
    root = checkpoint_root(spec.name)
    if is_built(spec.name):
        return root
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.dsharness import TrainSpec, run_training

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_DIR / f".{spec.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    print(f"[make_checkpoint] building {spec.name}: {spec.describe()} ({spec.dp} DeepSpeed processes) ...", flush=True)
    t0 = time.perf_counter()
    res = run_training(
        TrainSpec(
            dp=spec.dp,
            optimizer="zero",
            zero_stage=1,
            steps=1,
            save_dir=tmp / "ckpt",
            save_at=(1,),
            global_batch=spec.dp,
            hidden=spec.hidden,
            num_layers=spec.num_layers,
            vocab=spec.vocab,
            seq=8,
            uc_info=True,
            plugin=spec.plugin,
            timeout=timeout,
        )
    )
    ck = tmp / "ckpt"
    for entry in ck.iterdir():
        shutil.move(str(entry), str(tmp / entry.name))
    ck.rmdir()
    info = {
        "cache_version": CACHE_VERSION,
        **asdict(spec),
        "params": spec.params,
        "tag": TAG,
        "harness_sha1": harness_digest(),
        "optimizer_class": res.optimizer_class,
        "ds_version": res.ds_version,
        "bytes": folder_bytes(tmp / TAG),
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / MARKER).write_text(json.dumps(info, indent=1))
    os.rename(tmp, root)
    print(
        f"[make_checkpoint] {spec.name}: {info['bytes'] / 1e9:.2f} GB in {info['build_seconds']}s "
        f"({res.optimizer_class}, DeepSpeed {res.ds_version})",
        flush=True,
    )
    return root


def synthesize(src_name: str, dp: int) -> str:
    """A DP=``dp`` copy of a real checkpoint, re-partitioned without running DeepSpeed (name returned).

    For scales no machine here can run (DP=768, the AuroraGPT geometry): every rank file is rank 0's
    real file with its tensors and its per-rank records (``param_slice_mappings``, ``group_paddings``,
    ``partition_count``) replaced by what DeepSpeedZeroOptimizer 0.19.8 writes at ``dp`` ranks, in the
    source's flat order; the model-states file gets ``dp_world_size = dp``. Stock ``ds_to_universal``
    converts it like a real one (the benchmark checks our output against the source's tensors).
    """
    import deepspeed  # noqa: F401  (real DeepSpeed classes in the files we write)
    import torch
    from deepspeed.utils.tensor_fragment import fragment_address

    sys.path.insert(0, str(REPO_ROOT))
    from megatron_ucp.convert.verify import assemble_state
    from megatron_ucp.convert.writer import RankFileCache
    from megatron_ucp.deepspeed.reader import read_checkpoint
    from megatron_ucp.plan.conversion import build_plan
    from megatron_ucp.plan.geometry import GroupGeometry

    name = f"{src_name}-as-dp{dp}"
    root = checkpoint_root(name)
    if is_built(name):
        return name
    src = build(SPECS[src_name])
    tmp = CACHE_DIR / f".{name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / TAG).mkdir(parents=True)
    t0 = time.perf_counter()
    meta = read_checkpoint(src / TAG)
    plan = build_plan(meta.model.param_groups, meta.layouts)  # no vocabulary trimming: whole parameters
    cache = RankFileCache(list(meta.files.rank_files))
    first = torch.load(meta.files.rank_files[0], map_location="cpu", weights_only=False)
    osd = first["optimizer_state_dict"]
    groups = []
    for g in plan.groups:
        params = sorted((p for p in plan.params if p.group == g.index), key=lambda p: p.flat_offset)
        geo = GroupGeometry(numel=g.geometry.numel, dp=dp)
        flats = {}
        for state in g.states:
            flat = torch.zeros(geo.padded_total, dtype=torch.float32)
            offset = 0
            for p in params:
                flat[offset : offset + p.numel].copy_(assemble_state(p, state, cache).reshape(-1))
                offset += p.numel
            flats[state] = flat
        groups.append((g, params, geo, flats))
    for r in range(dp):
        sd = dict(osd)
        fp32, state, mappings, paddings = [], {}, [], []
        for g, params, geo, flats in groups:
            s = geo.partition_size
            lo, hi = r * s, (r + 1) * s
            fp32.append(flats["fp32"][lo:hi].clone())
            gstate = {"step": osd["base_optimizer_state"]["state"][g.index]["step"]}
            for st in g.states:
                if st != "fp32":
                    gstate[st] = flats[st][lo:hi].clone()
            state[g.index] = gstate
            m, offset = {}, 0
            for p in params:
                a, b = max(lo, offset), min(hi, offset + p.numel)
                if a < b:
                    m[p.name] = fragment_address(numel=b - a, start=a - lo)
                offset += p.numel
            mappings.append(m)
            paddings.append(s - geo.true_length(r))
        sd["single_partition_of_fp32_groups"] = fp32
        sd["base_optimizer_state"] = {"state": state, "param_groups": osd["base_optimizer_state"]["param_groups"]}
        sd["param_slice_mappings"] = mappings
        sd["group_paddings"] = paddings
        sd["partition_count"] = [dp] * len(groups)
        sd["param_alignment_paddings"] = [[0] * len(params) for _, params, _, _ in groups]
        out = dict(first, optimizer_state_dict=sd)
        torch.save(out, tmp / TAG / meta.files.rank_files[0].name.replace("_rank_0_", f"_rank_{r}_"))
    model = torch.load(meta.files.model_states, map_location="cpu", weights_only=False)
    model["dp_world_size"] = dp
    torch.save(model, tmp / TAG / meta.files.model_states.name)
    (tmp / "latest").write_text(TAG)
    base = info(src_name)
    data = {
        **base,
        "name": name,
        "dp": dp,
        "synthetic_from": src_name,
        "bytes": folder_bytes(tmp / TAG),
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / MARKER).write_text(json.dumps(data, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    os.rename(tmp, root)
    print(f"[make_checkpoint] {name}: synthesized {data['bytes'] / 1e9:.2f} GB in {data['build_seconds']}s", flush=True)
    return name


def info(name: str) -> dict:
    return json.loads((checkpoint_root(name) / MARKER).read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"checkpoints to build (default: all): {', '.join(SPECS)}")
    ap.add_argument("--list", action="store_true")
    ap.add_argument(
        "--synthesize",
        nargs=2,
        metavar=("SOURCE", "DP"),
        help="re-partition a built checkpoint to DP ranks without DeepSpeed (e.g. m25-dp8 768)",
    )
    args = ap.parse_args(argv)
    if args.list:
        for spec in SPECS.values():
            print(f"{spec.name:10s} {'built' if is_built(spec.name) else 'absent':6s} {spec.describe()}")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.synthesize:
        synthesize(args.synthesize[0], int(args.synthesize[1]))
        return 0
    for name in args.names or list(SPECS):
        build(SPECS[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
