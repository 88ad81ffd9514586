"""The trainings of the real Megatron-DeepSpeed that several modules resume, convert and compare with (the tensor- and
pipeline-parallel ones, the mixture of experts; tests/integration/test_model_parallel.py, test_megatron_deepspeed.py,
test_async_save_layouts.py): each trained once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.integration.mds import MdsModel, MdsResult, MdsRun, run_mds


@dataclass(frozen=True)
class Training:
    """One 6-iteration training, saved at iterations 2, 4 and 6 (tests resume from 4)."""

    tp: int
    pp: int
    pipeline: bool
    optimizer: str = "bf16"
    zero_stage: int = 1
    hooked: bool = True
    """Saved through the runner with ``--ucp-async-convert`` (TP layout recorded, twins converted
    as it trains); False: the script alone, as stock DeepSpeed saves."""
    untied: bool = True
    nproc: int = 4
    export_hf: bool = False
    """With ``--ucp-export-hf``: each converted tag exported as a Hugging Face model by the background converter."""


TRAININGS = {
    "tp2": Training(2, 1, False, export_hf=True),
    "pp2": Training(1, 2, True),
    "pp2-zero": Training(1, 2, True, optimizer="zero"),
    "tp2pp2": Training(2, 2, True),
    "tp2zero": Training(2, 1, False, optimizer="zero", hooked=False),
    "tp2zero2": Training(2, 1, False, optimizer="zero", zero_stage=2),
    "tied-pp2": Training(1, 2, True, untied=False),
    "tp1": Training(1, 1, False),
    "pipe-pp1": Training(1, 1, True),
}
"""``tp2zero`` trains with DeepSpeedZeroOptimizer (the ALCF default at PP=1) without the hooks, as
stock saves; ``tied-pp2`` ties the input and output embeddings (Megatron's default): the first and
last pipeline stage each hold ``tied_modules.embed``."""
SAME_PADDING = ("--make-vocab-size-divisible-by", "256")
"""Every training and resume here pads the 257-token vocabulary to 512 rows at TP=1 and at TP=2 (the
default, 128, pads to 384 at TP=1 and 512 at TP=2): with the same padded size every row's state
carries over, so a TP change is held to the uninterrupted curve. The one test that changes the
padded size says so."""


def train(mds_checkout, runs, name: str, extra_args: tuple[str, ...] = ()):
    """``name``'s training (once per session: the modules that share it find the same run), its root and result;
    ``extra_args``: more options for the runner (a run of its own, named by them)."""
    t = TRAININGS[name]

    def make(folder: Path):
        return run_mds(
            mds_checkout,
            MdsRun(
                nproc=t.nproc,
                ckpt=folder / "ckpt",
                tp=t.tp,
                pp=t.pp,
                pipeline=t.pipeline,
                train_iters=6,
                save_interval=2,
                route="runner" if t.hooked else "plain",
                optimizer=t.optimizer,
                zero_stage=t.zero_stage,
                model=MdsModel(untied=t.untied),
                extra_args=(
                    *SAME_PADDING,
                    *(("--ucp-async-convert",) if t.hooked else ()),
                    *(("--ucp-export-hf",) if t.export_hf else ()),
                    *extra_args,
                ),
            ),
        )

    key = "-".join((f"train-{name}", *(a.lstrip("-") for a in extra_args)))
    result = runs.get(key, make, shared=True)
    return runs.folder(key, shared=True) / "ckpt", result


MOE_ARGS = ["--num-experts", "4", "--moe-expert-parallel-size", "2", "--create-moe-param-group"]
MOE_ARGS += ["--disable-moe-token-dropping"]  # no token dropped: a resume continues the same curve


def moe_trained(
    mds_checkout, runs, optimizer: str = "zero", extra_args: tuple[str, ...] = ()
) -> tuple[Path, MdsResult]:
    """4 experts, EP 2, DP 4, through the runner with background conversion; DeepSpeedZeroOptimizer unless
    ``optimizer`` (BF16_Optimizer skips every MoE step of this fork on 0.16.9, without megatron-ucp too: no loss
    is ever logged; it trains on 0.19.5)."""
    name = "moe-train" if optimizer == "zero" else f"moe-train-{optimizer}"

    def train(folder: Path) -> MdsResult:
        run = MdsRun(nproc=4, ckpt=folder / "ckpt", optimizer=optimizer, train_iters=6, save_interval=3)
        run.extra_args = ["--ucp-async-convert", *MOE_ARGS, *extra_args]
        return run_mds(mds_checkout, run)

    name = "-".join((name, *(a.lstrip("-") for a in extra_args)))
    res = runs.get(name, train, shared=True)
    return runs.folder(name, shared=True) / "ckpt", res
