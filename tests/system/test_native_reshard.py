"""A DP change straight from the native rank files (resume route auto), against the universal route.

Source: the harness's session checkpoint of each optimizer class (DP=4, saved at step 2; at DP=4 the
no-weight-decay group's rank 3 holds only padding). DP 4 -> 3 and 4 -> 2 (and 4 -> 6, where the new
rank 5 holds only padding of that group) with no flag and no conversion: each rank's flat fp32 partition and every
optimizer state equal (``torch.equal``) what the
universal route gives the same rank, DeepSpeed's own ``safe_get_full_*`` agree with the partitions,
the losses continue the uninterrupted run, no ``_universal`` folder is written, and each old byte is
read by one rank. Both routes run under a recording accelerator that spells its device ``cpu:0`` to
megatron-ucp: every placement and collective of the hooks goes through it (or to the host at a listed
place). Folders whose files do not belong together: tests/system/test_mixed_up_folders.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.device_policy import device_violations
from tests.support.device_recorder import MARKED
from tests.support.elastic_support import (
    ElasticRuns,
    assert_losses_continue,
    assert_same_state,
    private_copy,
    resume,
    summary_lines,
    ucp_lines,
)

pytestmark = pytest.mark.slow

CLASSES = {"bf16": "BF16_Optimizer", "zero": "DeepSpeedZeroOptimizer"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    return ElasticRuns(tmp_path_factory.mktemp("reshard"))


CASES = {"bf16": ("bf16", {}), "zero": ("zero", {}), "zero2-hooked": ("zero", {"zero_stage": 2, "plugin": True})}
"""Sources: the stock saves of both classes, and a ZeRO-2 save made through the hooks (the harness
checkpoints other tests share)."""


def _run(ds_checkpoint, runs: ElasticRuns, case: str, dp: int, route: str):
    opt, fields = CASES[case]
    ck = ds_checkpoint(opt, 4, **fields)
    stage = {"zero_stage": fields["zero_stage"]} if "zero_stage" in fields else {}

    def make(folder: Path):
        root = private_copy(ck.root, folder / "ckpt")
        return resume(
            dp,
            opt,
            root,
            folder,
            load_tag="global_step2",
            plugin_kwargs={"resume_route": route},
            env={"UCP_HARNESS_RECORD_DEVICES": "1"},
            **stage,
        )

    return ck, runs.get(f"{case}-{dp}-{route}", make)


def _partitions(res, rank: int, suffix: str = "_loaded") -> dict:
    return torch.load(
        Path(res.dumps[f"state_step{res.loaded_step}{suffix}"]).parent / f"rank{rank}_step{res.loaded_step}{suffix}.pt",
        weights_only=False,
    )


@pytest.mark.parametrize(
    "case, dp", [("bf16", 3), ("bf16", 2), ("zero", 3), ("zero", 2), ("zero2-hooked", 3), ("bf16", 6)]
)
def test_reshard_equals_the_universal_route_rank_by_rank(ds_checkpoint, runs, case: str, dp: int) -> None:
    ck, native = _run(ds_checkpoint, runs, case, dp, "auto")
    _, universal = _run(ds_checkpoint, runs, case, dp, "universal")
    opt = CASES[case][0]
    assert native.optimizer_class == CLASSES[opt] and native.loaded_step == 2 and native.steps == [3, 4]
    lines = ucp_lines(native.log)
    assert any(f"DP changed 4 -> {dp}: resharding global_step2 from its native rank files" in x for x in lines), lines
    summary = [x for x in lines if x.startswith("megatron-ucp native reshard:")]
    assert len(summary) == 1 and f"DP 4 -> {dp}" in summary[0] and "every element placed exactly once" in summary[0]
    assert "9 params, 27 state tensors (fp32, exp_avg, exp_avg_sq, step)" in summary[0], summary
    hooked = CASES[case][1].get("plugin", False)  # saved through the hooks: the files carry their checksums
    assert ("checked against the save's partition checksums" in summary[0]) == hooked, summary
    assert not summary_lines(native.log)  # no universal load happened
    assert not any("refreshed them from the masters" in x for x in lines)  # saved weights = rounded masters
    root = Path(native.dumps["state_step2_loaded"]).parent.parent / "ckpt"
    assert not list(root.glob("*_universal")), "the native route converted something"
    for rank in range(dp):
        a, b = _partitions(native, rank), _partitions(universal, rank)
        for g, (x, y) in enumerate(zip(a["fp32"], b["fp32"], strict=True)):
            assert torch.equal(x, y), (rank, g, "fp32")
        for g, (x, y) in enumerate(zip(a["optim_state"], b["optim_state"], strict=True)):
            assert x.keys() == y.keys(), (rank, g)
            for key in x:
                same = torch.equal(x[key], y[key]) if torch.is_tensor(x[key]) else x[key] == y[key]
                assert same, (rank, g, key)
        assert a["module"].keys() == b["module"].keys()  # the weights: rebuilt from the same masters either way
        assert all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"]), rank
        assert a["param_groups"] == b["param_groups"] and a["lr_scheduler"] == b["lr_scheduler"]
        assert (a["global_steps"], a["global_samples"]) == (b["global_steps"], b["global_samples"])
    assert assert_same_state(ck.dump("state_step2"), native.dumps["state_step2_loaded"]) == 9 * 4
    assert native.losses == universal.losses
    assert_losses_continue(native, ck.loss_at)
    report, theirs = native.info["dumps"]["state_step2_loaded"], universal.info["dumps"]["state_step2_loaded"]
    assert report["safe_get_differs"] == [] and report["safe_get_unavailable"] == theirs["safe_get_unavailable"]
    for res in (native, universal):
        _assert_devices_through_the_accelerator(res, dp)
    _assert_model_states_opened_once(native, dp)


def _assert_devices_through_the_accelerator(res, dp: int) -> None:
    """What the recording accelerator saw the hooks do on every rank (tests/support/device_recorder.py):
    the accelerator was asked, the accounting all-reduce ran on its device, nothing else was placed
    anywhere but there or on the host at a listed place, no process group was made."""
    for rank in range(dp):
        events = json.loads((Path(res.dumps["state_step2_loaded"]).parent / f"devices_rank{rank}.json").read_text())
        assert device_violations(events, MARKED) == [], (rank, device_violations(events, MARKED))
        asked = [e for e in events if e["kind"] == "ask"]
        on_device = [e for e in events if e["kind"] == "collective" and e["tensors"]]
        assert asked and on_device, (rank, events)
        assert {e["name"] for e in on_device} == {"all_reduce"}, on_device


def _assert_model_states_opened_once(res, dp: int) -> None:
    """DeepSpeed never opens the model-states file (``module_read = distributed``): megatron-ucp's reader
    reads its pickle for the load (and, on the first rank, for the route decision) and each rank's 1/DP
    range of the saved weights (what each reads is measured in tests/system/test_module_read.py)."""
    for rank in range(dp):
        events = json.loads((Path(res.dumps["state_step2_loaded"]).parent / f"devices_rank{rank}.json").read_text())
        opened = [e["by"] for e in events if e["kind"] == "read" and e["path"].endswith("_model_states.pt")]
        assert opened and all(by.startswith("megatron_ucp.") for by in opened), (rank, opened)
        assert len(opened) <= 3 + (rank == 0), (rank, opened)


# ------------------------------------------------------------------------------------------------


def test_at_dp_768_sampled_ranks_copy_the_saved_values_and_the_ledger_closes(tmp_path: Path):
    """DP 768 geometry on a synthetic hooked save (most old ranks all padding): ranks of 384, 767, 1024
    and 1536 planned and copied by the hook's own code (``copy_reads``), one process playing
    each: first, middle, last real and an all-padding rank equal the synthetic values bit for bit;
    over every rank of 384 and of 1536 the ledger (against the recorded partition checksums) closes."""
    from megatron_ucp.integration.resume.native.binding import read_facts
    from megatron_ucp.integration.resume.native.reshard import OldFiles, copy_reads
    from megatron_ucp.plan.accounting import check_ledger
    from megatron_ucp.plan.geometry import at_dp
    from megatron_ucp.plan.llama_shapes import LlamaShape
    from megatron_ucp.plan.partitioned import check_live_model
    from megatron_ucp.plan.reshard import reshard_reads
    from megatron_ucp.synthetic.content import SyntheticSpec, state_range
    from megatron_ucp.synthetic.writer import write_checkpoint
    from tests.support.native_reads import open_source, source_ranks

    shape = LlamaShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=40, original_vocab=37)
    spec = SyntheticSpec(shape=shape, dp=768, record=True, iteration=7)
    tag = write_checkpoint(tmp_path, spec, progress=False).tag_dir
    rank_file = lambda r: tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"  # noqa: E731
    facts = read_facts(tag / "mp_rank_00_model_states.pt", rank_file)
    assert facts.dp_from == 768 and facts.algorithm is not None
    groups = spec.groups()
    live = [[(p.name, tuple(p.shape)) for p in g] for g in groups]
    opened = {}
    for world in (384, 767, 1024, 1536):
        geos_new = at_dp(spec.geometries(), world)
        new = check_live_model(facts.layout, live, [g.partition_size for g in geos_new], world, tag)
        assert list(new.geometries) == geos_new
        last_real = max(r for r in range(world) if geos_new[1].true_length(r) > 0)
        everyone = world in (384, 1536)
        ranks = range(world) if everyone else sorted({0, world // 2, last_real, world - 1})
        files = OldFiles.of(facts, rank_file)
        ledger = files.ledger()
        table = ledger.new_table()
        for rank in ranks:
            reads = facts.layout.reads_to(new, rank)
            assert reads == reshard_reads(spec.geometries(), world, rank)
            sources = {
                r: opened.get(r) or opened.setdefault(r, open_source(rank_file(r), r, facts, reads))
                for r in source_ranks(reads)
            }
            targets = [
                {state: torch.zeros(geo.partition_size) for state in ("fp32", *facts.states[g])}
                for g, geo in enumerate(geos_new)
            ]
            copy_reads(files, reads, sources, targets, ledger, table)
            if everyone and rank not in (0, world // 2, last_real, world - 1):
                continue
            for g, geo in enumerate(geos_new):
                start = rank * geo.partition_size
                for state, got in targets[g].items():
                    want = state_range(spec, 0, g, state, start, start + geo.partition_size)
                    assert torch.equal(got, want), (world, rank, g, state)
        if everyone:
            assert check_ledger(ledger, table) == [], world
    assert geos_new[1].true_length(1535) == 0  # the last sampled rank of 1536 holds only padding
