"""Stock DeepSpeed's ZeRO-3 converter against megatron-ucp's on a save that has what AuroraGPT-7B has at DP 768:
several optimizer sub-groups and parameters whose slice on some ranks is all padding (the release on
``PYTHONPATH``).

::

    PYTHONPATH=.venv-ds/0.16.2 .venv/bin/python benchmarks/zero3_stock_harness.py

The harness (``tests/support/dsharness``) trains its tiny model at DP 4 with ``sub_group_size`` 50 (three
sub-groups; three parameters of 3 elements, whose rank-3 slice is padding) and dumps every parameter's fp32 and
Adam states as DeepSpeed's own gather returns them. Both converters then convert that save; each parameter's
state files are compared with the gather: equal, wrong (another length or other values) or missing. At
AuroraGPT-7B's DP 768 every norm weight (4096 elements, 6 per rank) has 85 ranks of padding, and Megatron's
default ``sub_group_size`` (1e9) gives one sub-group per param group. Writes
``benchmarks/results/zero3-stock-harness-<version>.{json,md}``. Not a test: ``tests/system/test_zero3.py``
holds ours to DeepSpeed's gather.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from megatron_ucp.convert.execute import ConvertOptions, convert  # noqa: E402
from megatron_ucp.format import dsformat as F  # noqa: E402
from tests.support.dsharness import TrainSpec, run_training  # noqa: E402
from tests.support.dsharness.stock import stock_ds_to_universal  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def compare(folder: Path, gathered: dict) -> dict:
    """Per verdict, the (parameter, state) files: equal to DeepSpeed's gather, wrong, or missing."""
    out: dict[str, list[str]] = {"equal": [], "wrong": [], "missing": []}
    for name, entry in gathered.items():
        for state in STATES:
            path = folder / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt"
            if not path.is_file():
                out["missing"].append(f"{name}/{state}")
                continue
            got = torch.load(path, weights_only=False)
            got = got[F.PARAM] if isinstance(got, dict) else got
            same = got.numel() == entry[state].numel() and torch.equal(got.reshape(-1), entry[state].reshape(-1))
            out["equal" if same else "wrong"].append(f"{name}/{state}")
    return out


def synthetic_row(work: Path, version: str) -> dict:
    """A synthetic stage-3 save of a tiny llama at DP 16 (its 8-element norm weights: 1 per rank, ranks 8-15 all
    padding, as AuroraGPT-7B's norms are from rank 683 of 768 on), written as this release saves: both
    converters against the synthetic values (the source, not a file)."""
    from megatron_ucp.plan.llama_shapes import LlamaShape
    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.stage3_content import param_range, stage3_groups
    from megatron_ucp.synthetic.writer import write_checkpoint

    shape = LlamaShape(layers=1, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=32, original_vocab=32)
    spec = SyntheticSpec(shape=shape, dp=16, optimizer="zero", zero_stage=3, ds_version=version, flavour="plain")
    tag = write_checkpoint(work / "synthetic", spec, progress=False).tag_dir
    shapes = {p.name: p.shape for g in spec.groups() for p in g}
    expected = {
        name: {state: param_range(spec, 0, name, state, 0, place.numel).view(shapes[name]) for state in STATES}
        for name, place in stage3_groups(spec).places.items()
    }
    stock = stock_ds_to_universal(tag, work / "synthetic-stock")
    ours = convert(ConvertOptions(source=tag, output=work / "synthetic-ours", progress=False))
    return {
        "dp": spec.dp,
        "files": len(expected) * len(STATES),
        "stock": {k: len(v) for k, v in compare(work / "synthetic-stock", expected).items()}
        if stock.ok
        else {"crashed": [ln for ln in stock.log.splitlines() if "Error" in ln][-1:]},
        "ours": {k: len(v) for k, v in compare(work / "synthetic-ours", expected).items()} if ours.committed else {},
    }


def main() -> int:
    import deepspeed

    version = deepspeed.__version__
    work = Path(tempfile.mkdtemp(prefix="zero3-stock-harness-"))
    try:
        res = run_training(
            TrainSpec(
                dp=4,
                optimizer="zero",
                zero_stage=3,
                steps=2,
                save_at=(2,),
                uc_info=True,
                save_dir=work / "ckpt",
                dump_dir=work / "dumps",
                extra_config={"zero_optimization": {"sub_group_size": 50}},
            )
        )
        gathered = torch.load(work / "dumps" / "state_step2.pt", weights_only=False)
        stock = stock_ds_to_universal(work / "ckpt" / "global_step2", work / "stock")
        stock_row = (
            {k: len(v) for k, v in compare(work / "stock", gathered).items()}
            if stock.ok
            else {"crashed": [ln for ln in stock.log.splitlines() if "Error" in ln][-1:]}
        )
        ours = convert(ConvertOptions(source=work / "ckpt" / "global_step2", output=work / "ours", progress=False))
        ours_row = {k: len(v) for k, v in compare(work / "ours", gathered).items()} if ours.committed else {}
        row = {
            "deepspeed": version,
            "optimizer_class": res.optimizer_class,
            "sub_groups": len({e["sub_group"] for e in gathered.values()}),
            "files": len(gathered) * len(STATES),
            "stock": stock_row,
            "ours": ours_row,
            "synthetic": synthetic_row(work, version),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"zero3-stock-harness-{version}.json").write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
