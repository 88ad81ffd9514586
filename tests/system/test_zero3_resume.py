"""ZeRO-3 saved through the hooks and resumed at new DP sizes, from real DeepSpeed runs (CPU, gloo).

Sources (the harness's session checkpoints, shared with tests/system/test_zero3.py): DP 4, ``sub_group_size``
50 (three sub-groups, small parameters whose slice on rank 3 is all padding), saved at steps 2 and 4 through
the hooks and without them. From step 2:

* the save record, against the partitions each rank held in memory;
* DP 4 -> 3 (hooked, optimizer offload on) and 4 -> 6 (stock: two new ranks with no model-states file of their
  own, new padding-only slices) with no flag (the native reshard) against ``--ucp-resume-route universal``:
  every rank's partitions, states, steps, hyperparameters and bf16 weights ``torch.equal``, DeepSpeed's own
  gather equal to what was saved, the losses continuing the uninterrupted run;
* optimizer offload at stage 2 as well: both elastic loads write the engine's own host tensors and place nothing
  on the accelerator but the ledger (the recording accelerator);
* files that do not belong together, named before anything is copied; a restart at DP 4 checked against
  the save's checksums; ZeRO stage changes (1 -> 3, 3 -> 1) through the universal folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.plan.accounting import checksum
from tests.support.device_policy import device_violations
from tests.support.device_recorder import MARKED
from tests.support.dsharness.checkpoints import rank_file
from tests.support.elastic_support import (
    ElasticRuns,
    assert_losses_continue,
    flip_a_bit_in_the_largest_record,
    private_copy,
    resume,
    ucp_lines,
)

pytestmark = pytest.mark.slow

SUB_GROUPS = {"zero_optimization": {"sub_group_size": 50}}
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
ZERO3 = dict(optimizer="zero", dp=4, zero_stage=3, uc_info=True, extra_config=SUB_GROUPS)
STATES = ("fp32", "exp_avg", "exp_avg_sq")
LEDGER_PLACES = {
    "load_universal_partitions",
    "load_native_partitions",
    "total",
    "count",
}
"""Where the hooks may place a tensor on the accelerator: the ledgers and flags of the one all-reduce each."""


def _merge(*configs: dict) -> dict:
    out: dict = {}
    for config in configs:
        for key, value in config.items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    return ElasticRuns(tmp_path_factory.mktemp("zero3-resume"))


@pytest.fixture(scope="module")
def hooked(ds_checkpoint):
    return ds_checkpoint(**ZERO3, plugin=True)


@pytest.fixture(scope="module")
def stock(ds_checkpoint):
    return ds_checkpoint(**ZERO3)


def _resume(runs: ElasticRuns, name: str, ck, dp: int, route: str, stage: int = 3, extra: dict = SUB_GROUPS, **kw):
    def make(folder: Path):
        root = private_copy(ck.root, folder / "ckpt")
        return resume(
            dp,
            "zero",
            root,
            folder,
            load_tag="global_step2",
            zero_stage=stage,
            uc_info=True,
            extra_config=extra,
            plugin_kwargs={"resume_route": route},
            env={"UCP_HARNESS_RECORD_DEVICES": "1"},
            **kw,
        )

    return runs.get(name, make)


def _rank_dump(res, rank: int) -> dict:
    folder = Path(res.dumps[f"state_step{res.loaded_step}_loaded"]).parent
    return torch.load(folder / f"rank{rank}_step{res.loaded_step}_loaded.pt", weights_only=False)


def _same_full_state(saved: Path, loaded: Path) -> int:
    """Every parameter's fp32 master and optimizer states equal bit for bit, and its step (as a number),
    whatever the stages or sub-groups on either side."""
    a, b = torch.load(saved, weights_only=False), torch.load(loaded, weights_only=False)
    assert a.keys() == b.keys()
    for name in a:
        for state in STATES:
            assert torch.equal(a[name][state].float(), b[name][state].float()), (name, state)
        assert float(a[name]["step"]) == float(b[name]["step"]), name
    return len(a)


def _devices(res, dp: int, offload: bool) -> None:
    """The recording accelerator: no placement outside the policy; on the accelerator only the ledgers; with
    offload every master and state on the host, the masters the engine's own tensors."""
    folder = Path(res.dumps[f"state_step{res.loaded_step}_loaded"]).parent
    for rank in range(dp):
        events = json.loads((folder / f"devices_rank{rank}.json").read_text())
        assert device_violations(events, MARKED) == [], (rank, device_violations(events, MARKED))
        on_device = {e["function"] for e in events if e["kind"] == "place" and e["device"] == MARKED}
        assert on_device and on_device <= LEDGER_PLACES, (rank, on_device)
    for stats in res.info["load_stats"]:
        placement = stats["placement"]
        assert placement["masters_kept"] and placement["states_count"] > 0, placement
        if offload:
            assert placement["masters"] == ["cpu"] and placement["states"] == ["cpu"], placement


# ------------------------------------------------------------------------------------------------


def _deepspeed_stage3_record(shapes: list[dict], param_group_of: list[int], dp: int, rank: int):
    """What a rank holds under ZeRO-3, from DeepSpeed's rule as ``partition_parameters._partition_param`` states it
    (nothing of megatron-ucp's geometry): each parameter of ``n`` elements padded to a multiple of DP, rank ``r``
    holding ``ceil(n / DP)`` elements from ``r * ceil(n / DP)``; a sub-group's partition the concatenation of its
    parameters' slices. Returns per sub-group: the true length, each parameter's true length, and its real runs
    ``(offset in the partition, length, position of the first element in the param group)``."""
    before: dict[int, int] = {}  # elements of each param group in the sub-groups before
    out = []
    for h, group in enumerate(shapes):
        offset, lengths, runs = 0, [], []
        for shape in group.values():
            n = torch.Size(shape).numel()
            size = -(-n // dp)
            length = max(0, min(size, n - rank * size))
            lengths.append(length)
            if length:
                runs.append((offset, length, before.get(param_group_of[h], 0) + rank * size))
            offset += size
            before[param_group_of[h]] = before.get(param_group_of[h], 0) + n
        out.append((sum(lengths), lengths, runs))
    return out


def test_the_save_hook_records_each_sub_group_and_parameter(hooked):
    """Each rank file's record against the partitions that rank held in memory at the save (its dump), the
    expectation computed here from DeepSpeed's partitioning rule and the checksum primitive
    (``plan.accounting.checksum``, held to its own properties in tests/unit/test_accounting.py)."""
    tag = hooked.tag_dir(2)
    models = [torch.load(tag / F.zero3_model_file(r, 0), weights_only=False) for r in range(4)]
    save_id = models[0][F.UCP_SAVE_RECORD]["save_id"]
    assert all(m[F.UCP_SAVE_RECORD]["save_id"] == save_id for m in models)
    shapes = models[0][F.PARAM_SHAPES]
    for r in range(4):
        sd = torch.load(rank_file(tag, r), weights_only=False)[F.OPTIMIZER_STATE_DICT]
        owners = {h: g for g, group in enumerate(sd[F.OPTIMIZER_STATE_DICT][F.PARAM_GROUPS]) for h in group["params"]}
        expected = _deepspeed_stage3_record(shapes, [owners[h] for h in range(len(shapes))], 4, r)
        assert sd[F.GROUP_TRUE_LENGTHS] == [true for true, _, _ in expected]
        assert sd[F.PARAM_TRUE_LENGTHS] == [lengths for _, lengths, _ in expected]
        info = sd[F.ZERO_PARTITION_INFO]
        assert (info["zero_stage"], info["dp_size"], info["dp_rank"]) == (3, 4, r)
        assert info["partition_sizes"] == [t.numel() for t in sd[F.FP32_FLAT_GROUPS]]
        assert sd[F.UCP_SAVE_RECORD] == {"version": 1, "save_id": save_id, "dp_size": 4, "dp_rank": r}
        memory = torch.load(hooked.dump(f"rank{r}_step2"), weights_only=False)
        recorded = sd[F.ZERO_PARTITION_CHECKSUMS]
        assert recorded["algorithm"] == integrity.ALGORITHM
        assert len(recorded["groups"]) == len(expected) == len(memory["fp32"])
        for h, (true, _, runs) in enumerate(expected):
            size = memory["fp32"][h].numel()
            held = {"fp32": memory["fp32"][h]}
            held.update({k: v for k, v in memory["optim_state"][h].items() if torch.is_tensor(v) and v.numel() == size})
            held.pop("step", None)
            assert set(recorded["groups"][h]) == set(held), (r, h)
            for state, tensor in held.items():
                flat = tensor.reshape(-1)
                sums = (checksum(flat[off : off + n], position) for off, n, position in runs)
                assert recorded["groups"][h][state] == [true, integrity.combine(sums)], (r, h, state)
    last = torch.load(rank_file(tag, 3), weights_only=False)[F.OPTIMIZER_STATE_DICT]
    assert 0 in last[F.PARAM_TRUE_LENGTHS][2]  # rank 3's slice of a small parameter of sub-group 2 is padding


CASES = {"hooked-offload": ("hooked", 3, True), "stock": ("stock", 6, False)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_native_reshard_equals_the_universal_route_rank_by_rank(case, runs, hooked, stock):
    which, dp, offload = CASES[case]
    ck = hooked if which == "hooked" else stock
    extra = _merge(SUB_GROUPS, OFFLOAD) if offload else SUB_GROUPS
    native = _resume(runs, f"{case}-auto", ck, dp, "auto", extra=extra)
    universal = _resume(runs, f"{case}-universal", ck, dp, "universal", extra=extra)
    assert native.optimizer_class == "DeepSpeedZeroOptimizer_Stage3" and native.loaded_step == 2
    lines = ucp_lines(native.log)
    assert any(f"DP changed 4 -> {dp}: resharding global_step2 from its native rank files" in x for x in lines)
    summary = [x for x in lines if x.startswith("megatron-ucp native reshard:")]
    assert len(summary) == 1 and "every element placed exactly once" in summary[0], lines
    assert "9 params, 27 state tensors (fp32, exp_avg, exp_avg_sq, step)" in summary[0]
    assert ("checked against the save's partition checksums" in summary[0]) == (which == "hooked"), summary
    root = Path(native.dumps["state_step2_loaded"]).parent.parent / "ckpt"
    assert not list(root.glob("*_universal")), "the native route converted something"
    assert any(x.startswith("megatron-ucp universal load:") for x in ucp_lines(universal.log))
    for rank in range(dp):
        a, b = _rank_dump(native, rank), _rank_dump(universal, rank)
        for key in ("fp32", "bf16"):
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), (rank, key)
        for x, y in zip(a["optim_state"], b["optim_state"], strict=True):
            assert x.keys() == y.keys(), rank
            assert all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x), rank
        for key in ("param_groups", "lr_scheduler", "global_steps", "global_samples"):
            assert a[key] == b[key], (rank, key)
    assert _same_full_state(ck.dump("state_step2"), native.dumps["state_step2_loaded"]) == 9
    assert native.losses == universal.losses
    assert_losses_continue(native, ck.loss_at)
    for res in (native, universal):
        _devices(res, dp, offload)


def test_offload_loads_into_the_engines_host_tensors_at_the_flat_stages(runs, ds_checkpoint):
    """A ZeRO-2 hooked save loaded at DP 3 with the optimizer offloaded to the host (ZeRO-1 keeps its partitions
    the same way: DeepSpeedZeroOptimizer's flat partitions, at either stage)."""
    ck, stage = ds_checkpoint("zero", 4, zero_stage=2, plugin=True), 2
    native = _resume(runs, f"offload{stage}-auto", ck, 3, "auto", stage=stage, extra=OFFLOAD)
    universal = _resume(runs, f"offload{stage}-universal", ck, 3, "universal", stage=stage, extra=OFFLOAD)
    for res in (native, universal):
        assert res.optimizer_class == "DeepSpeedZeroOptimizer" and res.loaded_step == 2
        _devices(res, 3, offload=True)
    for rank in range(3):
        a, b = _rank_dump(native, rank), _rank_dump(universal, rank)
        assert all(torch.equal(x, y) for x, y in zip(a["fp32"], b["fp32"], strict=True)), rank
    assert native.losses == universal.losses
    assert_losses_continue(native, ck.loss_at)


def _folder(tmp: Path, name: str, ck) -> Path:
    return private_copy(ck.root, tmp / name)


def test_files_that_do_not_belong_together_are_named_before_anything_is_copied(tmp_path, hooked, ds_checkpoint):
    """One DP 3 launch tries each folder (every rank must fail alike, naming the culprit), then loads the save."""
    whole = ds_checkpoint("zero", 4, zero_stage=3, uc_info=True)  # one sub-group per param group (test_zero3's)
    stage1 = ds_checkpoint("zero", 4)  # a stock ZeRO-1 save (the stage-change test's)
    cases = {}

    def case(name: str, edit) -> None:
        root = _folder(tmp_path, name, hooked)
        culprit = edit(root / "global_step2")
        cases[name] = (root, culprit)

    def swap(tag: Path) -> Path:
        a, b = rank_file(tag, 1), rank_file(tag, 2)
        a.rename(tag / "tmp")
        b.rename(a)
        (tag / "tmp").rename(b)
        return a

    def another_save(tag: Path) -> Path:
        shutil.copy(rank_file(tag.parent / "global_step4", 1), rank_file(tag, 1))
        return rank_file(tag, 1)

    def missing(tag: Path) -> Path:
        rank_file(tag, 3).unlink()
        return rank_file(tag, 3)

    def missing_model_states(tag: Path) -> Path:
        (tag / F.zero3_model_file(1, 0)).unlink()
        return tag / F.zero3_model_file(1, 0)

    def other_stage(tag: Path) -> Path:
        shutil.copy(rank_file(stage1.tag_dir(2), 2), rank_file(tag, 2))
        return rank_file(tag, 2)

    def other_cut(tag: Path) -> Path:
        shutil.copy(rank_file(whole.tag_dir(2), 0), rank_file(tag, 0))
        return rank_file(tag, 0)

    def model_states_of_another_save(tag: Path) -> Path:
        shutil.copy(tag.parent / "global_step4" / F.zero3_model_file(1, 0), tag / F.zero3_model_file(1, 0))
        return tag / F.zero3_model_file(1, 0)

    def flipped_bit(tag: Path) -> Path:
        flip_a_bit_in_the_largest_record(rank_file(tag, 2))
        return rank_file(tag, 2)

    for name, edit in (
        ("swapped", swap),
        ("another-save", another_save),
        ("missing", missing),
        ("missing-model-states", missing_model_states),
        ("other-stage", other_stage),
        ("other-sub-groups", other_cut),
        ("model-states-of-another-save", model_states_of_another_save),
        # the universal route converts at load: the converter makes the same checks before it writes anything
        ("universal-another-save", another_save),
        ("universal-flipped-bit", flipped_bit),
    ):
        case(name, edit)
    good = _folder(tmp_path, "good", hooked)
    res = resume(
        3,
        "zero",
        good,
        tmp_path / "run",
        load_tag="global_step2",
        zero_stage=3,
        uc_info=True,
        extra_config=SUB_GROUPS,
        refuse=[
            {
                "name": name,
                "dir": str(root),
                "tag": "global_step2",
                **({"plugin_kwargs": {"resume_route": "universal"}} if name.startswith("universal") else {}),
            }
            for name, (root, _) in cases.items()
        ],
    )
    for name, (root, culprit) in cases.items():
        outcomes = res.refusals[name]
        assert all(o is not None for o in outcomes) and len({o[1] for o in outcomes}) == 1, (name, outcomes)
        message = outcomes[0][1]
        assert str(culprit) in message, (name, message)
        assert not list(root.glob("*_universal")), name
    assert "save record says DP rank 2 of 4" in res.refusals["swapped"][0][1]
    assert "from another save" in res.refusals["another-save"][0][1]
    assert "is missing" in res.refusals["missing"][0][1]
    assert "is missing" in res.refusals["missing-model-states"][0][1]
    assert "not a ZeRO-3 optimizer file" in res.refusals["other-stage"][0][1]
    assert "optimizer sub-groups" in res.refusals["other-sub-groups"][0][1]
    assert "of another save" in res.refusals["model-states-of-another-save"][0][1]
    assert "from another save" in res.refusals["universal-another-save"][0][1]
    assert "differs from the checksum its save recorded" in res.refusals["universal-flipped-bit"][0][1]
    assert res.loaded_step == 2
    assert_losses_continue(res, hooked.loss_at)


def _change_a_master(path: Path, sub_group: int, element: int) -> None:
    """One real fp32 master element of a ZeRO-3 rank file changed after the save (the file saved again)."""
    saved = torch.load(path, weights_only=False)
    with torch.no_grad():
        saved[F.OPTIMIZER_STATE_DICT][F.FP32_FLAT_GROUPS][sub_group][element] += 1.0
    torch.save(saved, path)


def test_a_restart_at_the_saved_dp_checks_every_partition_against_the_save(tmp_path, hooked):
    changed = _folder(tmp_path, "changed", hooked)
    _change_a_master(rank_file(changed / "global_step2", 2), 0, 0)
    good = _folder(tmp_path, "good", hooked)
    res = resume(
        4,
        "zero",
        good,
        tmp_path / "run",
        load_tag="global_step2",
        zero_stage=3,
        uc_info=True,
        extra_config=SUB_GROUPS,
        refuse=[{"name": "changed", "dir": str(changed), "tag": "global_step2"}],
    )
    outcomes = res.refusals["changed"]
    assert len({tuple(o) for o in outcomes}) == 1, outcomes
    assert str(rank_file(changed / "global_step2", 2)) in outcomes[0][1], outcomes
    assert "differs from the checksum its save recorded" in outcomes[0][1]
    lines = ucp_lines(res.log)
    assert any("DP unchanged (4): native load of global_step2" in x for x in lines), lines
    assert any("every partition checked against the save's checksums" in x for x in lines), lines
    assert res.losses == [hooked.loss_at(3), hooked.loss_at(4)]  # DeepSpeed's own load: the same run


@pytest.mark.parametrize("move", ["1 -> 3", "3 -> 1"])
def test_a_zero_stage_change_goes_through_the_universal_folder(move, runs, hooked, ds_checkpoint):
    ck, stage, dp, extra = (ds_checkpoint("zero", 4), 3, 3, SUB_GROUPS) if move == "1 -> 3" else (hooked, 1, 2, {})
    res = _resume(runs, f"stage {move}", ck, dp, "auto", stage=stage, extra=extra)
    lines = ucp_lines(res.log)
    said = "1/2 -> 3" if move == "1 -> 3" else "3 -> 1"
    assert any(f"ZeRO stage changed {said}, DP changed 4 -> {dp}: no global_step2_universal yet" in x for x in lines)
    assert any(x.startswith("megatron-ucp universal load:") and "every element placed exactly once" in x for x in lines)
    assert _same_full_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"]) == 9
    assert_losses_continue(res, ck.loss_at)


def test_our_loader_loads_stocks_stage3_folder(tmp_path, stock):
    """DeepSpeed's own ``ds_to_universal`` on a stage-3 save, loaded by the hooks at DP 3 with the explicit flag:
    no manifest checksums (accounted against the files themselves), every element back, the curve continued."""
    from tests.support.dsharness.stock import stock_ds_to_universal

    root = private_copy(stock.root, tmp_path / "ckpt")
    converted = stock_ds_to_universal(root / "global_step2", root / "global_step2_universal")
    assert converted.ok, converted.log[-2000:]
    res = resume(
        3,
        "zero",
        root,
        tmp_path / "run",
        load_tag="global_step2_universal",
        load_universal=True,
        zero_stage=3,
        uc_info=True,
        extra_config=SUB_GROUPS,
    )
    lines = ucp_lines(res.log)
    assert any("has no checksums" in x for x in lines), lines
    summary = [x for x in lines if x.startswith("megatron-ucp universal load:")]
    assert len(summary) == 1 and "every element placed exactly once" in summary[0], lines
    assert _same_full_state(stock.dump("state_step2"), res.dumps["state_step2_loaded"]) == 9
    assert_losses_continue(res, stock.loss_at)


def test_at_dp_768_sampled_ranks_of_both_routes_equal_the_saved_values(tmp_path):
    """DP 768 geometry on a synthetic hooked ZeRO-3 save (megatron_ucp.synthetic, held to real saves by
    tests/integration/test_zero3_megatron.py): ranks of 512 and 1024 planned and read by the hook's own code
    (the slice reads, each old file bound and read as a rank reads it) equal the universal folder our
    converter wrote, sliced as a rank of that size holds it, and the synthetic values, bit for bit: the first,
    a middle, the last rank holding a norm weight's elements and one whose slice of it is padding (the norm:
    8 elements, so ranks 8.. of 768 hold only its padding on the old side, and of 512 and 1024 on the new)."""
    from megatron_ucp.convert.execute import ConvertOptions, convert
    from megatron_ucp.integration.resume.native.binding import expectation, inspect_file, read_facts
    from megatron_ucp.plan.llama_shapes import LlamaShape
    from megatron_ucp.plan.param_geometry import per_parameter_reads
    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.stage3_content import SUB_GROUP_SIZE, param_range
    from megatron_ucp.synthetic.writer import write_checkpoint
    from tests.support.native_reads import source_ranks

    shape = LlamaShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=40, original_vocab=37)
    spec = SyntheticSpec(shape=shape, dp=768, optimizer="zero", zero_stage=3, record=True, iteration=7)
    tag = write_checkpoint(tmp_path, spec, progress=False).tag_dir
    out = tmp_path / "universal"
    assert convert(ConvertOptions(source=tag, output=out, progress=False)).committed
    facts = read_facts(tag / F.zero3_model_file(0, 0), lambda r: rank_file(tag, r), per_parameter=True)
    old = facts.layout
    folder = {
        (name, state): torch.load(out / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt", weights_only=False)[F.PARAM]
        for name in old.places
        for state in STATES
    }
    norm = "language_model.encoder.final_layernorm.weight"
    assert old.partition_of(norm).padding_only_ranks() == list(range(8, 768))
    sources = {}
    for world in (512, 1024):
        new = old.at_dp(world, SUB_GROUP_SIZE)
        for rank in (0, world // 2, 7, 8, world - 1):
            reads = per_parameter_reads(old, new, rank)
            for r in source_ranks(reads):
                if r not in sources:
                    source, seen = inspect_file(rank_file(tag, r), facts, expectation(facts, r, reads))
                    assert source is not None, seen.problems
                    sources[r] = source
            for h, group_reads in enumerate(reads):
                size = new.geometry(h).partition_size
                native = {state: torch.zeros(size) for state in STATES}
                for read in group_reads:
                    src = sources[read.source_rank]
                    for state, target in native.items():
                        stored = (
                            src.fp32[read.source_group] if state == "fp32" else src.states[read.source_group][state]
                        )
                        src.read_into(stored, read.source_offset, target.narrow(0, read.target_offset, read.length))
                for state in STATES:
                    universal, values = torch.zeros(size), torch.zeros(size)
                    for run in new.runs(rank, h):
                        piece = slice(run.offset, run.offset + run.length)
                        universal[piece] = folder[(run.param, state)].reshape(-1)[run.start : run.start + run.length]
                        values[piece] = param_range(spec, 0, run.param, state, run.start, run.start + run.length)
                    assert torch.equal(native[state], universal) and torch.equal(universal, values), (world, rank, h)
            held = new.partition_of(norm).true_length(rank)
            assert held == (0 if rank >= 8 else 1), (world, rank)
    for source in sources.values():
        source.close()
