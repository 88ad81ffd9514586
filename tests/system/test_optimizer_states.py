"""Optimizer state that is not one number per element, at a DP change (DP 4 -> 3).

Source: a save made through the hooks by ``torch.optim.NAdam`` (wrapped by DeepSpeed as the others are): besides
``exp_avg``/``exp_avg_sq`` (one number per element) and ``step``, it keeps ``mu_product``, a 0-dim tensor per
partition (the product of its momentum schedule, the same on every rank). Both routes carry it: every
parameter's fp32 master and per-element states bit for bit, each new partition's ``mu_product`` the saved value
(every old rank file agrees on it: the binding checks), and the losses continue the uninterrupted run. A universal
folder has one file per parameter and state, none for such a state: the converter writes it once per param group into
``zero/optimizer_state.pt`` (``ucp_partition_scalars``, every rank file agreeing), and megatron-ucp's universal load
installs it; both routes give the same partitions bit for bit, at ZeRO-1 and ZeRO-3 alike. A state no copy can place
(a dict, blockwise state) is refused by name at a DP change and left to DeepSpeed at the saved size.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.support.dsharness import TrainSpec, run_training
from tests.support.elastic_support import (
    ElasticRuns,
    assert_losses_continue,
    assert_same_state,
    private_copy,
    resume,
    ucp_lines,
)

pytestmark = pytest.mark.slow

NADAM = {"base_optimizer": "nadam", "plugin": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    return ElasticRuns(tmp_path_factory.mktemp("optimizer-states"))


SOURCES = {"bf16": ("bf16", {}), "zero3": ("zero", {"zero_stage": 3})}
"""ZeRO-1 (BF16_Optimizer: flat param groups) and ZeRO-3 (sub-groups, each parameter cut on its own)."""


@pytest.fixture(scope="module")
def source(ds_checkpoint):
    return ds_checkpoint("bf16", 4, **NADAM)


def _source(ds_checkpoint, case: str):
    optimizer, stage = SOURCES[case]
    return ds_checkpoint(optimizer, 4, **stage, **NADAM), optimizer, stage


def _partitions(res, rank: int) -> dict:
    return torch.load(Path(res.dumps["state_step2_loaded"]).parent / f"rank{rank}_step2_loaded.pt", weights_only=False)


def _resumed(ds_checkpoint, runs: ElasticRuns, case: str, route: str):
    ck, optimizer, stage = _source(ds_checkpoint, case)

    def make(folder: Path):
        root = private_copy(ck.root, folder / "ckpt")
        kwargs = {"resume_route": route}
        return resume(
            3, optimizer, root, folder, load_tag="global_step2", base_optimizer="nadam", plugin_kwargs=kwargs, **stage
        )

    return ck, runs.get(f"{case}-{route}", make)


@pytest.mark.parametrize("case", SOURCES)
@pytest.mark.parametrize("route", ["auto", "universal"])
def test_a_per_partition_scalar_is_carried_at_a_dp_change(ds_checkpoint, runs, case: str, route: str) -> None:
    ck, res = _resumed(ds_checkpoint, runs, case, route)
    assert res.loaded_step == 2 and res.steps == [3, 4], res.log[-3000:]
    what = "native reshard" if route == "auto" else "universal load"
    summary = [x for x in ucp_lines(res.log) if x.startswith(f"megatron-ucp {what}:")]
    assert len(summary) == 1 and "every element placed exactly once" in summary[0], ucp_lines(res.log)
    assert "(fp32, exp_avg, exp_avg_sq, step, mu_product)" in summary[0], summary
    saved = [torch.load(ck.dump(f"rank{r}_step2"), weights_only=False)["optim_state"] for r in range(4)]
    value = saved[0][0]["mu_product"]
    assert value.dim() == 0 and value != 1.0  # two steps in: not the value a fresh NAdam starts from
    assert all(torch.equal(state["mu_product"], value) for groups in saved for state in groups)
    for rank in range(3):
        for g, state in enumerate(_partitions(res, rank)["optim_state"]):
            assert sorted(state) == ["exp_avg", "exp_avg_sq", "mu_product", "step"], (rank, g, sorted(state))
            assert state["mu_product"].dtype == value.dtype and torch.equal(state["mu_product"], value), (rank, g)
    # per parameter: fp32, exp_avg, exp_avg_sq, step; ZeRO-3's gathered dump holds mu_product too
    per_param = 5 if case == "zero3" else 4
    assert assert_same_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"]) == 9 * per_param
    assert_losses_continue(res, ck.loss_at)
    if route == "universal":  # the same partitions, bit for bit, as the native reshard's
        _, native = _resumed(ds_checkpoint, runs, case, "auto")
        for rank in range(3):
            a, b = _partitions(native, rank), _partitions(res, rank)
            assert all(torch.equal(x, y) for x, y in zip(a["fp32"], b["fp32"], strict=True))
            for x, y in zip(a["optim_state"], b["optim_state"], strict=True):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rank


def _with_a_dict_state(source, folder: Path) -> Path:
    """The NAdam save with a dict added to every group's state in every rank file (the shape of bitsandbytes'
    per-parameter quantization state): no copy places it at another DP size."""
    root = private_copy(source.root, folder / "ckpt")
    for path in sorted((root / "global_step2").glob("*optim_states.pt")):
        sd = torch.load(path, weights_only=False)
        for state in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            state["quant_state"] = {"blocksize": 256}
        torch.save(sd, path)
    return root


@pytest.mark.parametrize("dp", [3, 4])
def test_state_no_copy_can_place_is_refused_at_a_dp_change_and_left_to_deepspeed_at_the_same_size(
    source, runs, dp: int
) -> None:
    def make(folder: Path):
        spec = TrainSpec(
            dp=dp,
            optimizer="bf16",
            steps=4,
            load_dir=_with_a_dict_state(source, folder),
            load_tag="global_step2",
            expect_failure=dp != 4,
            timeout=600,
            **NADAM,
        )
        return run_training(spec)

    res = runs.get(f"dict-state-{dp}", make)
    said = (
        "NAdam keeps optimizer state that megatron-ucp cannot place at another DP size: 'quant_state' of param group 0"
    )
    assert said in res.log, res.log[-3000:]
    if dp == 4:  # at the saved size DeepSpeed's own load reads it as it is, with one warning
        assert res.ok and res.steps == [3, 4] and res.log.count(said) == 1, res.log[-3000:]
        assert_losses_continue(res, source.loss_at)
    else:  # refused on every rank before DeepSpeed's load touched the engine
        assert res.returncode != 0 and res.losses == [], res.log[-3000:]
        sections = res.rank_logs()
        assert sorted(sections) == [0, 1, 2], res.log[-3000:]
        for rank, section in sections.items():
            # the traceback's last line (torch's error handler prefixes it with "[rankN]: ")
            raised = [
                line for line in section.splitlines() if re.match(r"(\[rank\d+\]: )?megatron_ucp\.errors\.", line)
            ]
            assert len(raised) == 1 and said in raised[0] and "nothing was loaded" in raised[0], (rank, section[-3000:])
