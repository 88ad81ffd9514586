"""``megatron-ucp synthesize ROOT``: write the checkpoint a DeepSpeed save of a llama shape would write.

A developer command: DP = 768 and 7B-class shapes cannot train on a workstation, but their files
can be written, and every path that reads them measured (``make bench-scale``). The writer (and
torch) is imported only when the command runs: the other commands stay torch-free.
"""

from __future__ import annotations

import argparse

from packaging.version import Version

from megatron_ucp.cli import add_shared
from megatron_ucp.deepspeed.versions import SAVED_FILES
from megatron_ucp.errors import UcpError
from megatron_ucp.plan.llama_shapes import PRESETS, LlamaShape, preset
from megatron_ucp.synthetic.optimizers import BASE_OPTIMIZERS

_SIZES = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "original_vocab")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synthesize",
        help="write a synthetic DeepSpeed checkpoint of a llama shape (developers)",
        description="Write ROOT/global_step<N> and ROOT/latest as DeepSpeed (0.16-0.19) saves a "
        "Megatron-DeepSpeed llama model at the given TP, PP and DP: the same file names, keys, flat "
        "partitions and paddings, reproducible values (the same at every DP size).",
    )
    add_shared(p, "root", "checkpoint root to write into (the tag must not exist)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named shape; the size options override it")
    for name in _SIZES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"model {name.replace('_', ' ')}")
    p.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    p.add_argument("--no-swiglu", action="store_true", help="a plain (not gated) MLP")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1; > 1 implies --pipeline)")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="the pipeline model GPTModelPipe (layer files, stage-local names) instead of GPTModel",
    )
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="a mixture-of-experts model (the fork's --num-experts, every second layer, --create-moe-param-group)",
    )
    p.add_argument("--ep", type=int, default=1, help="with --experts: the expert-parallel size (default 1)")
    p.add_argument(
        "--optimizer",
        choices=["bf16", "zero"],
        default="bf16",
        help="bf16: BF16_Optimizer; zero: DeepSpeedZeroOptimizer (default bf16)",
    )
    p.add_argument(
        "--base-optimizer",
        choices=sorted(BASE_OPTIMIZERS),
        default="adam",
        help="the optimizer DeepSpeed wraps, whose states the files hold: adam (exp_avg, exp_avg_sq), nadam "
        "(and mu_product per partition), muon (moment1, moment2, use_muon per partition), sophiag (exp_avg, "
        "hessian); default adam",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="3: every rank its own model states, each parameter partitioned on its own (with --optimizer zero)",
    )
    p.add_argument(
        "--ds-version",
        choices=sorted(SAVED_FILES),
        help="the DeepSpeed release whose files to write (default 0.19.8; with --experts the newest release whose "
        "mixture-of-experts files are on record, 0.19.5: the fork does not import 0.19.8)",
    )
    p.add_argument("--record", action="store_true", help="as saved with megatron-ucp's hooks (true lengths, ...)")
    p.add_argument(
        "--flavour",
        choices=["megatron", "plain"],
        default="megatron",
        help="megatron: Megatron-DeepSpeed's client state (default); plain: a bare DeepSpeed engine",
    )
    p.add_argument(
        "--iteration", type=int, default=100, help="the iteration saved: the tag is global_stepN (default 100)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic values (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def default_release(experts: bool) -> str:
    """0.19.8, or with experts the newest release whose mixture-of-experts files are on record."""
    if not experts:
        return "0.19.8"
    return max((v for v, facts in SAVED_FILES.items() if facts.moe is not None), key=Version)


def shape_from(args: argparse.Namespace) -> LlamaShape:
    sizes = {name: getattr(args, name) for name in _SIZES if getattr(args, name) is not None}
    base = vars(preset(args.preset)).copy() if args.preset else {}
    base.update(sizes)
    if args.tied:
        base["tied"] = True
    if args.no_swiglu:
        base["swiglu"] = False
    if args.experts:
        base["experts"] = args.experts
    missing = [n for n in ("layers", "hidden", "ffn", "heads") if n not in base]
    if missing:
        raise UcpError(f"give --preset or the sizes {', '.join('--' + m for m in missing)}")
    if "vocab" in sizes and "original_vocab" not in sizes:
        base.pop("original_vocab", None)
    return LlamaShape(**base)


def run(args: argparse.Namespace) -> int:
    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint

    spec = SyntheticSpec(
        shape=shape_from(args),
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        pipeline=args.pipeline or args.pp > 1,
        optimizer=args.optimizer,
        zero_stage=args.zero_stage,
        ds_version=args.ds_version or default_release(bool(args.experts)),
        record=args.record,
        flavour=args.flavour,
        iteration=args.iteration,
        seed=args.seed,
        ep=args.ep,
        base_optimizer=args.base_optimizer,
    )
    done = write_checkpoint(args.root, spec, progress=not args.no_progress)
    print(
        f"wrote {done.tag_dir}: {done.files} files, {done.bytes / 1e9:.2f} GB in {done.seconds:.1f} s "
        f"({spec.shape.numel() / 1e6:.1f}M parameters, {spec.layout_text()}, {spec.optimizer} around "
        f"{spec.base_optimizer}, "
        f"DeepSpeed {spec.ds_version} files{', with the save record' if spec.record else ''})"
    )
    return 0
