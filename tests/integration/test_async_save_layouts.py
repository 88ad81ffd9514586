"""An asynchronous save writes exactly what a synchronous save writes, in every layout and with every optimizer the
fork trains, one and two saves in flight.

Each layout's training is run once with synchronous saves and again with ``--ucp-async-save`` at one and at two
saves in flight, each making at least three saves (so that the host buffers of one slot are reused by a later save,
whose storages may differ). Every file of every save of the asynchronous runs equals the synchronous run's: the same
files, each holding the same tensors in the same records of the same sizes (``state_compare.tag_differences``), the
losses are the same, and at the end ``latest`` and Megatron's tracker both name the last save.

* The harness (real DeepSpeed, CPU, gloo, DP 2; ``tracker``: Megatron's tracker written as Megatron does): ZeRO-1 with
  BF16_Optimizer and with DeepSpeedZeroOptimizer, ZeRO-2, ZeRO-3, the optimizer offloaded to the CPU, and an optimizer
  that is not Adam (NAdam: a 0-dim ``mu_product`` per partition beside its moments).
* The real Megatron-DeepSpeed (its trainings shared with test_model_parallel.py and test_megatron_deepspeed.py):
  ``GPTModelPipe`` at PP 2 (each pipeline layer in a file of its own, saved from a clone freed before the next
  one's), TP 2, TP 2 x PP 2, and a mixture of experts at EP 2 (every expert in a file of its own; the 0.16.9 run is
  the one the issue's release line trains).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ucp.format import dsformat as F
from megatron_ucp.format.save_files import read_file_list
from tests.integration.shared_runs import moe_trained, train
from tests.support.dsharness import TrainSpec, run_training
from tests.support.dsharness.checkpoints import session_cache
from tests.support.harness_layouts import HARNESS_LAYOUTS
from tests.support.state_compare import tag_differences

TRACKER = "latest_checkpointed_iteration.txt"
SAVES = (2, 3, 4)


def _same_files(mine: Path, theirs: Path, tags: list[str], alias: tuple[str, str] = ("", "")) -> None:
    for tag in tags:
        assert tag_differences(mine / tag, theirs / tag, alias) == [], tag
        listed = read_file_list(mine, tag)  # the asynchronous save's file list names every file it wrote
        assert listed is not None and sorted(f.path for f in listed.files) == sorted(
            p.name for p in (mine / tag).iterdir() if p.suffix == ".pt"
        ), tag


def _latest_and_tracker(root: Path) -> tuple[str, str]:
    return (root / F.LATEST).read_text().strip(), (root / TRACKER).read_text().strip()


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("layout", sorted(HARNESS_LAYOUTS))
def test_async_save_layouts_harness(tmp_path: Path, layout: str, in_flight: int):
    fields = {"dp": 2, "steps": 4, "save_at": SAVES, "plugin": True, "tracker": True, **HARNESS_LAYOUTS[layout]}
    sync = session_cache()(**fields)
    root = tmp_path / "ckpt"
    kwargs = {"async_save": True, "saves_in_flight": in_flight}
    res = run_training(TrainSpec(save_dir=root, plugin_kwargs=kwargs, **{**fields, "plugin": True}))
    assert res.losses == sync.result.losses and res.steps == [1, 2, 3, 4], res.log[-3000:]
    assert "copied into host memory" in res.log  # asynchronous indeed: no layout left to the synchronous save
    _same_files(root, sync.root, [f"global_step{s}" for s in SAVES])
    assert _latest_and_tracker(root) == _latest_and_tracker(sync.root) == ("global_step4", "4")


FORK_LAYOUTS = ("pp2", "tp2", "tp2pp2")


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("name", FORK_LAYOUTS)
def test_async_save_layouts_model_parallel(mds_checkout, mds_runs, name: str, in_flight: int):
    """Saved at iterations 2, 4 and 6, and 6 again at the end of training: four saves."""
    sync_root, sync = train(mds_checkout, mds_runs, name)
    args = ("--ucp-async-save", "--ucp-saves-in-flight", str(in_flight))
    root, res = train(mds_checkout, mds_runs, name, extra_args=args)
    assert res.losses == sync.losses and sorted(res.losses) == [1, 2, 3, 4, 5, 6], res.log[-3000:]
    said = "\n".join(res.ucp_lines())
    assert "global_step2 copied into host memory" in said and "global_step6 committed" in said, said[-3000:]
    alias = (str(root.parent), str(sync_root.parent))
    _same_files(root, sync_root, ["global_step2", "global_step4", "global_step6"], alias)
    assert _latest_and_tracker(root) == _latest_and_tracker(sync_root) == ("global_step6", "6")


@pytest.mark.parametrize("in_flight", [1, 2])
def test_async_save_layouts_moe(mds_checkout, mds_runs, in_flight: int):
    """4 experts at EP 2, DP 4: saved at iteration 3 and 6, and 6 again at the end of training."""
    sync_root, sync = moe_trained(mds_checkout, mds_runs)
    root, res = moe_trained(
        mds_checkout, mds_runs, extra_args=("--ucp-async-save", "--ucp-saves-in-flight", str(in_flight))
    )
    assert res.losses == sync.losses and sorted(res.losses) == [1, 2, 3, 4, 5, 6], res.log[-3000:]
    assert len(list((root / "global_step3").glob("layer_*_expert_*_mp_rank_00_model_states.pt"))) == 4
    _same_files(root, sync_root, ["global_step3", "global_step6"], (str(root.parent), str(sync_root.parent)))
    assert _latest_and_tracker(root) == _latest_and_tracker(sync_root) == ("global_step6", "6")
