"""A DP change straight from the native rank files (resume route auto), against the universal route.

Source: the harness's session checkpoint of each optimizer class (DP=4, saved at step 2; at DP=4 the
no-weight-decay group's rank 3 holds only padding). DP 4 -> 3 and 4 -> 2 (and 4 -> 6, where the new
rank 5 holds only padding of that group) with no flag and no conversion: each rank's flat fp32 partition and every
optimizer state equal (``torch.equal``) what the
universal route gives the same rank, DeepSpeed's own ``safe_get_full_*`` agree with the partitions,
the losses continue the uninterrupted run, no ``_universal`` folder is written, and each old byte is
read by one rank. Both routes run under a recording accelerator that spells its device ``cpu:0`` to
megatron-ucp: every placement and collective of the hooks goes through it (or to the host at a listed
place). Bad rank files stop every rank before anything is copied, naming the file.
"""

from __future__ import annotations

import json
import shutil
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
        for g, (x, y) in enumerate(zip(a["fp32"], b["fp32"])):
            assert torch.equal(x, y), (rank, g, "fp32")
        for g, (x, y) in enumerate(zip(a["optim_state"], b["optim_state"])):
            assert x.keys() == y.keys(), (rank, g)
            for key in x:
                same = torch.equal(x[key], y[key]) if torch.is_tensor(x[key]) else x[key] == y[key]
                assert same, (rank, g, key)
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
    """The reshard opens each rank's model-states file once, in DeepSpeed's load: the facts and the
    training-state checks use what it read (tests/support/device_recorder.py notes every opening).
    The first rank also reads the file's pickle, no tensor bytes, for the route decision before."""
    for rank in range(dp):
        events = json.loads((Path(res.dumps["state_step2_loaded"]).parent / f"devices_rank{rank}.json").read_text())
        opened = [e["by"] for e in events if e["kind"] == "read" and e["path"].endswith("_model_states.pt")]
        loads = [by for by in opened if by.startswith("deepspeed.")]
        assert len(loads) == 1, (rank, opened)
        assert len(opened) == 1 + (rank == 0), (rank, opened)


# ------------------------------------------------------------------------------------------------
# bad input: found before anything is copied, one error naming the file (no DeepSpeed launch needed)
# ------------------------------------------------------------------------------------------------


def _synthetic(tmp_path: Path, dp: int = 4, iteration: int = 2):
    from megatron_ucp.plan.llama_shapes import LlamaShape
    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint

    shape = LlamaShape(layers=1, hidden=8, ffn=16, heads=2, vocab=40, original_vocab=37)
    spec = SyntheticSpec(shape=shape, dp=dp, flavour="plain", iteration=iteration)
    tag = write_checkpoint(tmp_path, spec, progress=False).tag_dir
    return spec, tag, (lambda r: tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def _facts_and_plan(spec, tag, rank_file, dp_to: int = 3, rank: int = 0):
    from megatron_ucp.integration.native_reshard import check_live_model, read_facts
    from megatron_ucp.plan.geometry import GroupGeometry, at_dp
    from megatron_ucp.plan.reshard import reshard_reads

    facts = read_facts(tag / "mp_rank_00_model_states.pt", rank_file)
    groups = spec.groups()
    flats = [at_dp([GroupGeometry(sum(p.numel for p in g), spec.dp)], dp_to)[0].partition_size for g in groups]
    geos = check_live_model(
        facts, [[p.name for p in g] for g in groups], [[p.shape for p in g] for g in groups], flats, dp_to, tag
    )
    return facts, geos, reshard_reads(geos, dp_to, rank)


def test_bad_rank_files_are_named_before_anything_is_copied(tmp_path: Path):
    from megatron_ucp.errors import CheckpointFormatError, UcpError
    from megatron_ucp.integration.native_reshard import check_live_model, open_source

    spec, tag, rank_file = _synthetic(tmp_path / "a")
    facts, geos, reads = _facts_and_plan(spec, tag, rank_file)
    assert facts.dp_from == 4 and [r.source_rank for r in reads[0]] == [0, 1]
    before = {p.name: p.read_bytes() for p in tag.iterdir()}
    for r in (0, 1):
        open_source(rank_file(r), r, facts, geos, reads)  # the good files pass

    # truncated / damaged
    victim = rank_file(1)
    victim.write_bytes(before[victim.name][: len(before[victim.name]) // 2])
    with pytest.raises(CheckpointFormatError, match=str(victim)):
        open_source(victim, 1, facts, geos, reads)
    victim.write_bytes(before[victim.name])
    # another save (another step) and another DP size, copied into this folder under the right name
    _, other, other_file = _synthetic(tmp_path / "b", iteration=5)
    shutil.copyfile(other_file(1), victim)
    with pytest.raises(CheckpointFormatError, match=rf"{victim}: param group 0 is at step .*another save"):
        open_source(victim, 1, facts, geos, reads)
    _, wide, wide_file = _synthetic(tmp_path / "c", dp=8)
    shutil.copyfile(wide_file(1), victim)
    with pytest.raises(CheckpointFormatError, match=rf"{victim}: saved at DP=8, the model states say DP=4"):
        open_source(victim, 1, facts, geos, reads)
    victim.write_bytes(before[victim.name])
    # missing, and a leftover file of a save at a larger DP in the same folder
    victim.rename(tmp_path / "away")
    with pytest.raises(CheckpointFormatError, match=rf"{victim}: missing \(1 of the 4 rank files"):
        _facts_and_plan(spec, tag, rank_file)
    (tmp_path / "away").rename(victim)
    shutil.copyfile(wide_file(4), rank_file(4))
    with pytest.raises(CheckpointFormatError, match="5 rank files .* the model states say DP=4"):
        _facts_and_plan(spec, tag, rank_file)
    rank_file(4).unlink()
    # another model: the first differing parameter named
    groups = spec.groups()
    names = [[p.name for p in g] for g in groups]
    names[0][1] = "language_model.encoder.layers.0.self_attention.qkv.weight"
    with pytest.raises(UcpError, match=r"param group 0 differs from the model at position 1"):
        check_live_model(facts, names, [[p.shape for p in g] for g in groups], [0, 0], 3, tag)
    assert {p.name: p.read_bytes() for p in tag.iterdir()} == before  # nothing on disk changed


def test_a_damaged_rank_file_stops_every_rank_before_the_copy(ds_checkpoint, tmp_path: Path):
    """One rank finds the damage; every rank stops (a collective vote before any copy), the job exits
    non-zero naming the file, and nothing is written next to the checkpoint."""
    from tests.support.dsharness import TrainSpec, run_training

    ck = ds_checkpoint("bf16", 4)
    root = private_copy(ck.root, tmp_path / "ckpt")
    victim = root / "global_step2" / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:4096])
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    res = run_training(
        TrainSpec(
            dp=3,
            optimizer="bf16",
            steps=3,
            load_dir=root,
            load_tag="global_step2",
            plugin=True,
            expect_failure=True,
            timeout=600,
        )
    )
    assert res.returncode != 0 and res.losses == [], res.log[-3000:]
    assert f"{victim}: unreadable torch file" in res.log, res.log[-3000:]
    assert "found a bad rank file" in res.log  # the ranks that read only good files stopped too
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_a_flipped_bit_in_a_hooked_save_is_caught_by_its_recorded_checksums(ds_checkpoint, tmp_path: Path):
    """Saved through the hooks, each rank file records its partitions' checksums: one bit flipped in a
    tensor of an old rank file (torch.load still reads it) fails the reshard's ledger, naming the
    group and state, on every rank (the clean hooked save reshards checked against them: the
    ``zero2-hooked`` case above)."""
    import zipfile

    from tests.support.dsharness import TrainSpec, run_training

    ck = ds_checkpoint("bf16", 4, plugin=True)
    root = private_copy(ck.root, tmp_path / "ckpt")
    victim = root / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    with zipfile.ZipFile(victim) as archive:  # the first partition-sized tensor record
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 64)
    name_len, extra_len = (
        int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x10
    victim.write_bytes(bytes(data))
    res = run_training(
        TrainSpec(
            dp=3,
            optimizer="bf16",
            steps=3,
            load_dir=root,
            load_tag="global_step2",
            plugin=True,
            expect_failure=True,
            timeout=600,
        )
    )
    assert res.returncode != 0 and res.losses == [], res.log[-3000:]
    assert "native reshard is incomplete" in res.log and "do not reassemble it" in res.log, res.log[-3000:]


def test_at_dp_768_sampled_ranks_copy_the_saved_values_and_the_ledger_closes(tmp_path: Path):
    """DP 768 geometry on a synthetic hooked save (most old ranks all padding): ranks of 384, 767, 1024
    and 1536 planned and copied by the hook's own code (``copy_partitions``), one process playing
    each: first, middle, last real and an all-padding rank equal the synthetic values bit for bit;
    over every rank of 384 and of 1536 the ledger (against the recorded partition checksums) closes."""
    from megatron_ucp.integration.native_reshard import (
        check_live_model,
        copy_partitions,
        open_source,
        read_facts,
        reshard_ledger,
    )
    from megatron_ucp.plan.accounting import check_ledger
    from megatron_ucp.plan.geometry import at_dp
    from megatron_ucp.plan.llama_shapes import LlamaShape
    from megatron_ucp.plan.reshard import reshard_reads, source_ranks
    from megatron_ucp.synthetic.content import SyntheticSpec, state_range
    from megatron_ucp.synthetic.writer import write_checkpoint

    shape = LlamaShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=40, original_vocab=37)
    spec = SyntheticSpec(shape=shape, dp=768, record=True, iteration=7)
    tag = write_checkpoint(tmp_path, spec, progress=False).tag_dir
    rank_file = lambda r: tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"  # noqa: E731
    facts = read_facts(tag / "mp_rank_00_model_states.pt", rank_file)
    assert facts.dp_from == 768 and facts.algorithm is not None
    groups = spec.groups()
    names, shapes = [[p.name for p in g] for g in groups], [[p.shape for p in g] for g in groups]
    opened = {}
    for world in (384, 767, 1024, 1536):
        geos_new = at_dp(spec.geometries(), world)
        geos = check_live_model(facts, names, shapes, [g.partition_size for g in geos_new], world, tag)
        last_real = max(r for r in range(world) if geos_new[1].true_length(r) > 0)
        everyone = world in (384, 1536)
        ranks = range(world) if everyone else sorted({0, world // 2, last_real, world - 1})
        ledger = reshard_ledger(facts)
        table = ledger.new_table()
        for rank in ranks:
            reads = reshard_reads(geos, world, rank)
            sources = {
                r: opened.get(r) or opened.setdefault(r, open_source(rank_file(r), r, facts, geos, reads))
                for r in source_ranks(reads)
            }
            targets = [
                {state: torch.zeros(geo.partition_size) for state in ("fp32", *facts.states[g])}
                for g, geo in enumerate(geos_new)
            ]
            copy_partitions(facts, geos, reads, sources, rank, targets, ledger, table)
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
