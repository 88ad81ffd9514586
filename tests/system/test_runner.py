"""The zero-edit runner (``python -m megatron_ucp.run``): argv/env parsing and DP-change decisions
as pure functions, then the runner driving the Megatron-DeepSpeed stand-in (megatron-core GPT +
DeepSpeed ZeRO-1 bf16, CPU, gloo) through save, a DP change and resume, configured by ``--ucp-*``
options in one run and by ``MEGATRON_UCP_*`` variables in another."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp import config as C
from megatron_ucp.config import UcpConfig
from megatron_ucp.errors import UcpError
from megatron_ucp.integration import run as R
from megatron_ucp.plan import launch as L

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "train_scripts" / "megatron_standin" / "pretrain_gpt_standin.py"
SITE = REPO / "tests" / "support" / "site"


# ================================================================================================
# argv
# ================================================================================================


def test_runner_options_are_removed_from_anywhere_in_argv():
    split = R.split_argv(
        [
            "--ucp-keep-last",
            "3",
            "train.py",
            "--num-layers",
            "2",
            "--ucp-async-convert",
            "--lr",
            "0.1",
            "--ucp-converter-workers=4",
            "--ucp-no-strict",
        ]
    )
    assert split.target == R.Target("path", "train.py")
    assert split.script_args == ("--num-layers", "2", "--lr", "0.1")
    assert split.options == (("keep_last", "3"), ("async_convert", "1"), ("converter_workers", "4"), ("strict", "0"))


def test_module_target_and_help():
    split = R.split_argv(["-m", "pkg.train", "--x", "1"])
    assert split.target == R.Target("module", "pkg.train") and split.script_args == ("--x", "1")
    assert R.split_argv(["--help"]).help and R.split_argv(["-h"]).target is None
    # --help after the script belongs to the script
    after = R.split_argv(["train.py", "--help"])
    assert not after.help and after.script_args == ("--help",)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ucp-keep-lats", "3", "t.py"], "unknown runner option '--ucp-keep-lats'"),
        (["t.py", "--ucp-keep-last"], "--ucp-keep-last needs a value"),
        (["--lr", "1", "t.py"], "unexpected '--lr' before the script"),
        (["-m"], "-m needs a module name"),
        (["t.py", "--ucp-no-strict=1"], "takes no value"),
    ],
)
def test_argv_errors_name_the_option(argv, match):
    with pytest.raises(UcpError, match=re.escape(match)):
        R.split_argv(argv)


def test_every_config_field_has_an_option_and_a_variable():
    specs = {s.name: s for s in C.option_specs()}
    for f in dataclasses.fields(UcpConfig):
        assert f.name in specs, f"UcpConfig.{f.name} has no --ucp-* option"
        assert specs[f.name].env == "MEGATRON_UCP_" + f.name.upper()
    assert specs["async_convert"].option == "--ucp-async-convert"
    assert specs["async_convert"].negative == "--ucp-no-async-convert"
    assert specs["keep_last"].kind == "optint" and specs["converter_workers"].kind == "int"
    assert {"keep_global_batch", "reseed", "dry_run"} <= {s.name for s in specs.values() if s.runner}


def test_every_option_help_is_written_once_and_names_what_the_code_accepts():
    """Each option's help is one entry of config._HELP (no fallback text), shown by ``run --help`` beside the
    default the code has; an option of fixed values names every value the config accepts (and the config
    refuses any other), and an optional number names the word the parser takes for none."""
    specs = C.option_specs()
    assert {s.name for s in specs} == set(C._HELP), "an option without its help, or help for no option"
    for name, values in (("resume_route", C.RESUME_ROUTES), ("module_read", C.MODULE_READS)):
        words = set(re.findall(r"[a-z]+", C._HELP[name]))
        assert set(values) <= words, (name, values)
        for value in values:
            assert getattr(UcpConfig(**{name: value}), name) == value
        with pytest.raises(UcpError, match=name):
            UcpConfig(**{name: "elsewhere"})
    for name, word in C.NONE_WORD.items():
        assert f"'{word}'" in C._HELP[name], (name, word)
        assert C.parse_value(next(s for s in specs if s.name == name), word, name) is None
    shown = " ".join(R.usage().split())
    defaults = {**dataclasses.asdict(UcpConfig()), **dataclasses.asdict(C.RunnerSettings())}
    for spec in specs:
        help_text = " ".join(C._HELP[spec.name].split())
        assert f"{help_text} ({spec.env}; default " in shown, spec.option
        if spec.kind in ("int", "str"):
            assert f"({spec.env}; default {defaults[spec.name]})" in shown, spec.option


# ================================================================================================
# settings: options > environment > defaults
# ================================================================================================


def test_environment_variables_build_the_config():
    env = {
        "MEGATRON_UCP_ASYNC_CONVERT": "yes",
        "MEGATRON_UCP_KEEP_LAST": "2",
        "MEGATRON_UCP_STRICT": "off",
        "MEGATRON_UCP_CONVERTER_WORKERS": "8",
        "MEGATRON_UCP_RANKS_PER_NODE": "12",
        "MEGATRON_UCP_KEEP_GLOBAL_BATCH": "0",
        "UNRELATED": "x",
    }
    config, runner, lines = C.build_settings([], env)
    assert config == UcpConfig(async_convert=True, keep_last=2, strict=False, converter_workers=8, ranks_per_node=12)
    assert runner == C.RunnerSettings(keep_global_batch=False)
    assert "async_convert=True (from MEGATRON_UCP_ASYNC_CONVERT)" in lines


def test_options_win_over_environment():
    env = {"MEGATRON_UCP_ASYNC_CONVERT": "1", "MEGATRON_UCP_KEEP_LAST": "2"}
    config, _, lines = C.build_settings([("async_convert", "0"), ("keep_last", "all"), ("keep_last", "5")], env)
    assert config.async_convert is False and config.keep_last == 5
    assert "keep_last=5 (from --ucp-keep-last)" in lines
    assert C.build_settings([("keep_last", "all")], env)[0].keep_last is None
    assert C.build_settings([("ranks_per_node", "auto")], {})[0].ranks_per_node is None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"MEGATRON_UCP_ASYNC_CONVERT": "maybe"}, "MEGATRON_UCP_ASYNC_CONVERT: expected one of"),
        ({"MEGATRON_UCP_KEEP_LAST": "three"}, "MEGATRON_UCP_KEEP_LAST: expected an integer or 'all'"),
        ({"MEGATRON_UCP_KEEP_LAST": "0"}, "keep_last must be >= 1"),
        ({"MEGATRON_UCP_CONVERTER_WORKERS": "none"}, "expected an integer, got 'none'"),
    ],
)
def test_bad_values_raise_naming_the_variable(env, match):
    with pytest.raises(UcpError, match=re.escape(match)):
        C.build_settings([], env)


@settings(deadline=None)
@given(
    async_convert=st.booleans(),
    strict=st.booleans(),
    keep_last=st.one_of(st.none(), st.integers(1, 50)),
    workers=st.integers(1, 64),
    rpn=st.one_of(st.none(), st.integers(1, 12)),
)
def test_config_env_round_trips(async_convert, strict, keep_last, workers, rpn):
    config = UcpConfig(
        async_convert=async_convert, strict=strict, keep_last=keep_last, converter_workers=workers, ranks_per_node=rpn
    )
    assert C.build_settings([], C.config_env(config))[0] == config


# ================================================================================================
# Megatron argv, world size
# ================================================================================================


def test_megatron_args_follow_argparse_last_wins():
    m = L.megatron_args(
        [
            "--load",
            "/a",
            "--load=/b",
            "--global-batch-size=3072",
            "--micro-batch-size",
            "1",
            "--tensor-model-parallel-size=2",
            "--seed",
            "7",
            "--no-load-rng",
            "--universal-checkpoint",
        ]
    )
    assert m == L.MegatronArgs(
        load="/b",
        global_batch_size=3072,
        micro_batch_size=1,
        tensor_parallel=2,
        seed=7,
        no_load_rng=True,
        universal_checkpoint=True,
    )
    with pytest.raises(UcpError, match="--global-batch-size 'x' is not an integer"):
        L.megatron_args(["--global-batch-size", "x"])


def test_world_size_and_local_size_from_launchers():
    assert L.detect_world_size({"WORLD_SIZE": "8", "PMI_SIZE": "4"}) == 8
    assert L.detect_world_size({"PMI_SIZE": "768"}) == 768  # mpiexec on Aurora (ezpz launch)
    assert L.detect_world_size({"OMPI_COMM_WORLD_SIZE": "2"}) == 2 and L.detect_world_size({}) is None
    assert L.detect_ranks_per_node({"PALS_LOCAL_SIZE": "12"}) == 12 and L.detect_ranks_per_node({}) is None
    assert L.detect_rank({"PMI_RANK": "3"}) == 3


# ================================================================================================
# the DP-change plan (pure)
# ================================================================================================

FACTS = L.CheckpointFacts(
    load_dir="/ckpt", tag="global_step100", dp_world_size=768, global_batch_size=3072, micro_batch_size=1, iteration=100
)


def plan(argv=(), facts=FACTS, world=384, config=UcpConfig(), settings=C.RunnerSettings()):
    return L.plan_launch(
        L.megatron_args(["--load", "/ckpt", "--micro-batch-size", "1", *argv]), facts, world, config, settings
    )


def test_dp_change_keeps_the_global_batch_and_reseeds():
    p = plan(["--seed", "42"])
    assert p.dp_changed and (p.dp_from, p.dp_to) == (768, 384)
    assert p.extra_args == ("--global-batch-size", "3072", "--no-load-rng")
    assert p.reseed_base == 42 and not p.warnings
    text = "\n".join(p.notes)
    assert "saved at DP=768, this job runs at DP=384" in text
    assert "keeping the checkpoint's global batch 3072 (gradient accumulation 8 x micro batch 1 x DP 384)" in text
    assert "cannot be mapped to DP=384: adding --no-load-rng" in text


def test_a_mixture_of_experts_checkpoint_reshards_a_dp_change_at_the_same_ep_and_converts_an_ep_change():
    import dataclasses

    moe = dataclasses.replace(FACTS, experts=8, ep=8)
    p = plan(["--moe-expert-parallel-size", "8"], facts=moe)
    assert (
        p.notes[1]
        == (
            "/ckpt/global_step100 is a mixture-of-experts checkpoint (8 experts per MoE layer, EP=8 kept): the "
            "elastic-resume hook reshards global_step100 from its native rank files, each expert-parallel rank's "
            "experts over expert-DP 96 -> 48 (no conversion)"
        )
        and not p.warnings
    ), (p.notes, p.warnings)
    moved = "\n".join(plan(["--moe-expert-parallel-size", "4"], facts=moe).notes)
    assert "(8 experts per MoE layer, EP 8 -> 4): the elastic-resume hook loads the universal twin" in moved, moved
    universal = "\n".join(
        plan(["--moe-expert-parallel-size", "8"], facts=moe, config=UcpConfig(resume_route="universal")).notes
    )
    assert "(8 experts per MoE layer): the elastic-resume hook loads the universal twin" in universal, universal
    left = plan(facts=dataclasses.replace(FACTS, experts=8, tp=2), world=768)  # TP 2 -> 1: left to stock
    assert (
        "with TP or PP > 1" in left.warnings[0] and "refuses ZeRO optimizer states saved at DP=768" in left.warnings[0]
    )
    facts = L.facts_from_model_states("/ckpt", "global_step3", {"dp_world_size": 4, "num_experts": [4]})
    assert facts.experts == 4 and L.facts_from_model_states("/c", "t", {"num_experts": [1]}).experts == 1


def test_an_expert_parallel_change_at_the_same_dp_keeps_the_rng_states_and_loads_the_universal_twin():
    import argparse
    import dataclasses

    saved = L.facts_from_model_states(
        "/ckpt",
        "global_step3",
        {"dp_world_size": 768, "num_experts": [8], "args": argparse.Namespace(moe_expert_parallel_size=8)},
    )
    assert saved.ep == 8
    moe = dataclasses.replace(FACTS, experts=8, ep=8)
    p = plan(["--moe-expert-parallel-size", "16"], facts=moe, world=768)
    assert p.notes == (
        "EP change: /ckpt/global_step100 was saved at EP=8 (768), this job runs at EP=16: the elastic-resume hook "
        "loads the universal twin of global_step100, every expert under its global index (converting it first if it "
        "does not exist yet)",
    )
    assert p.extra_args == () and p.reseed_base is None and not p.warnings  # the same DP: RNG states map as saved
    same = plan(["--moe-expert-parallel-size", "8"], facts=moe, world=768)
    assert same.notes == ("resuming /ckpt/global_step100 at the DP size it was saved at (768)",)
    stock = plan(["--moe-expert-parallel-size", "16"], facts=moe, world=768, config=UcpConfig(elastic_resume=False))
    assert "which are other experts" in stock.warnings[0]


def test_same_dp_changes_nothing():
    p = plan(world=768)
    assert not p.dp_changed and p.extra_args == () and p.reseed_base is None
    assert "at the DP size it was saved at (768)" in p.notes[0]


def test_pinned_global_batch_is_respected():
    same = plan(["--global-batch-size", "3072"])
    assert same.extra_args == ("--no-load-rng",) and not same.warnings
    other = plan(["--global-batch-size=1536"])
    assert other.extra_args == ("--no-load-rng",)
    assert "differs from the checkpoint's 3072" in other.warnings[0]


def test_indivisible_global_batch_is_not_forced():
    p = plan(world=576)  # 48 Aurora nodes: 3072 / 576 is not an integer
    assert p.extra_args == ("--no-load-rng",)
    assert "cannot keep the checkpoint's global batch 3072 at DP=576" in p.warnings[0]


def test_runner_settings_and_flags_turn_adjustments_off():
    p = plan(settings=C.RunnerSettings(keep_global_batch=False, reseed=False))
    assert p.extra_args == () and p.reseed_base is None and "reseed is off" in p.warnings[0]
    p = plan(["--no-load-rng"])
    assert p.extra_args == ("--global-batch-size", "3072") and p.reseed_base is None
    assert plan().reseed_base == L.MEGATRON_DEFAULT_SEED


def test_cases_where_the_runner_stays_out():
    assert plan(facts=None).extra_args == () and "nothing to adapt" in plan(facts=None).notes[0]
    assert "--finetune" in plan(["--finetune"]).notes[0] and plan(["--finetune"]).extra_args == ()
    assert "cannot tell this job's world size" in plan(world=None).warnings[0]
    none = L.plan_launch(L.MegatronArgs(), FACTS, 384, UcpConfig(), C.RunnerSettings())
    assert none.notes == ("no --load: nothing to resume",)
    unknown_dp = plan(facts=dataclasses.replace(FACTS, dp_world_size=None))
    assert unknown_dp.extra_args == () and "records no dp_world_size" in unknown_dp.warnings[0]


def test_tp_pp_changes_are_planned_like_dp_changes():
    """TP 1 -> 2 (DP 768 -> 192 on 384 ranks): Megatron must accept the new TP, RNG re-seeded, batch kept."""
    tp = plan(["--tensor-model-parallel-size", "2"])
    assert tp.extra_args == ("--universal-checkpoint", "--global-batch-size", "3072", "--no-load-rng")
    assert tp.notes[0].startswith("TP changed 1 -> 2, DP changed 768 -> 192") and tp.reseed_base is not None
    same = plan(
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        facts=dataclasses.replace(FACTS, tp=2, pp=2, dp_world_size=96),
    )
    assert same.extra_args == () and "(TP=2, PP=2, DP=96)" in same.notes[0]
    pp_only = plan(
        ["--pipeline-model-parallel-size", "2", "--universal-checkpoint"],
        facts=dataclasses.replace(FACTS, dp_world_size=192),
    )
    assert pp_only.notes[0].startswith("PP changed 1 -> 2:") and "--universal-checkpoint" not in pp_only.extra_args
    states = {"dp_world_size": 4, "checkpoint_parallel_dimensions": {"tp_degree": 2, "pp_degree": 1}}
    assert (L.facts_from_model_states("/c", "t", states).tp, L.facts_from_model_states("/c", "t", states).pp) == (2, 1)


def test_elastic_off_without_universal_checkpoint_warns():
    p = plan(config=UcpConfig(elastic_resume=False))
    assert any("DeepSpeed will refuse" in w for w in p.warnings)
    u = plan(["--universal-checkpoint"], config=UcpConfig(elastic_resume=False))
    assert not any("refuse" in w for w in u.warnings) and any("latest_universal" in n for n in u.notes)


@settings(max_examples=300, deadline=None)
@given(
    dp_from=st.integers(1, 1024),
    dp_to=st.integers(1, 1024),
    micro=st.integers(1, 8),
    batch=st.integers(1, 20000),
    pinned=st.booleans(),
    no_rng=st.booleans(),
)
def test_plan_properties(dp_from, dp_to, micro, batch, pinned, no_rng):
    facts = dataclasses.replace(FACTS, dp_world_size=dp_from, global_batch_size=batch, micro_batch_size=micro)
    argv = ["--load", "/ckpt", "--micro-batch-size", str(micro)]
    argv += ["--global-batch-size", str(batch + 1)] if pinned else []
    argv += ["--no-load-rng"] if no_rng else []
    p = L.plan_launch(L.megatron_args(argv), facts, dp_to, UcpConfig(), C.RunnerSettings())
    extra = list(p.extra_args)
    if dp_from == dp_to:
        assert extra == [] and p.reseed_base is None
        return
    if "--global-batch-size" in extra:  # only added when unpinned and exactly divisible
        assert not pinned and int(extra[extra.index("--global-batch-size") + 1]) == batch
        assert batch % (micro * dp_to) == 0
    else:
        assert pinned or batch % (micro * dp_to) != 0
    assert ("--no-load-rng" in extra) == (not no_rng) == (p.reseed_base is not None)


def test_derived_seed_is_deterministic_and_distinct():
    seeds = {L.derived_seed(1234, 100, r) for r in range(768)}
    assert len(seeds) == 768 and all(0 <= s < 2**31 for s in seeds)
    assert L.derived_seed(1234, 100, 5) == L.derived_seed(1234, 100, 5) != L.derived_seed(1234, 101, 5)


def test_alcf_batch_env_for_train_aGPT_7B():
    keep = L.alcf_batch_env(FACTS, 384, 1, 1, None, None)  # 64 -> 32 Aurora nodes
    assert keep.assignments == (("GLOBAL_BATCH", 3072), ("GRAD_ACC_STEPS", 8))
    assert L.alcf_batch_env(FACTS, 576, 1, 1, None, None).assignments == ()  # 48 nodes: 3072/576 not integral
    assert L.alcf_batch_env(FACTS, 384, 1, 1, 1536, None).assignments == ()  # the user's GLOBAL_BATCH wins
    mismatch = L.alcf_batch_env(FACTS, 384, 1, 1, None, 4)
    assert mismatch.assignments == () and "needs 8" in mismatch.messages[0]
    assert L.alcf_batch_env(None, 384, 1, 1, None, None).assignments == ()


# ================================================================================================
# reading a checkpoint's model states (tolerant of classes that cannot be imported here)
# ================================================================================================


def _write_model_states(tmp_path: Path, dp: int = 4, batch: int = 16, micro: int = 1, with_args: bool = True) -> Path:
    import torch

    root = tmp_path / "ckpt"
    (root / "global_step7").mkdir(parents=True)
    (root / "latest").write_text("global_step7")
    fake = types.ModuleType("megatron_fake_for_test")

    class ModelType:  # stands for a Megatron enum pickled inside args
        pass

    ModelType.__module__ = fake.__name__
    ModelType.__qualname__ = "ModelType"
    fake.ModelType = ModelType
    sys.modules[fake.__name__] = fake
    try:
        args = argparse.Namespace(global_batch_size=batch, micro_batch_size=micro, model_type=ModelType())
        states = {
            "dp_world_size": dp,
            "iteration": 7,
            "module": {"w": torch.zeros(2)},
            "ds_config": {"train_batch_size": batch * 2, "train_micro_batch_size_per_gpu": micro},
        }
        if with_args:
            states["args"] = args
        torch.save(states, root / "global_step7" / "mp_rank_00_model_states.pt")
    finally:
        del sys.modules[fake.__name__]
    return root


def test_read_checkpoint_facts_prefers_megatron_args(tmp_path):
    root = _write_model_states(tmp_path)
    facts = R.read_checkpoint_facts(L.MegatronArgs(load=str(root)))
    assert facts == L.CheckpointFacts(str(root), "global_step7", 4, 16, 1, 7)
    assert R.read_checkpoint_facts(L.MegatronArgs(load=str(root), load_tag="global_step9")) is None
    assert R.read_checkpoint_facts(L.MegatronArgs(load=str(tmp_path / "empty"))) is None
    # --universal-checkpoint: the tag in latest_universal only while it names the twin of latest's tag
    # (the hook's rule); before any conversion, latest's tag, whose twin the hook converts and loads
    universal = L.MegatronArgs(load=str(root), universal_checkpoint=True)
    assert R.read_checkpoint_facts(universal).tag == "global_step7"
    (root / "latest_universal").write_text("global_step9_universal")  # a newer tag than the one latest names
    assert R.read_checkpoint_facts(universal).tag == "global_step7"
    twin = root / "global_step7_universal"
    twin.mkdir()
    (twin / "mp_rank_00_model_states.pt").write_bytes(
        (root / "global_step7" / "mp_rank_00_model_states.pt").read_bytes()
    )
    (root / "latest_universal").write_text("global_step7_universal")
    assert R.read_checkpoint_facts(universal).tag == "global_step7_universal"


def test_reading_the_checkpoint_imports_no_megatron_and_the_script_folder_comes_first(tmp_path):
    """The trap of issue 'megatron-core out of the runtime': megatron-core's `megatron` namespace is
    installed here (the stand-in tests use it); unpickling Megatron's args before the script runs
    must not import it, or it shadows the checkout's own `megatron` package."""
    import torch
    from megatron.core.enums import ModelType  # megatron-core, installed in the test environment

    root = tmp_path / "ckpt"
    (root / "global_step2").mkdir(parents=True)
    (root / "latest").write_text("global_step2")
    args = argparse.Namespace(global_batch_size=8, micro_batch_size=1, model_type=ModelType.encoder_or_decoder)
    torch.save({"dp_world_size": 2, "iteration": 2, "args": args}, root / "global_step2" / "mp_rank_00_model_states.pt")
    checkout = tmp_path / "Megatron-DeepSpeed"
    (checkout / "megatron").mkdir(parents=True)
    (checkout / "megatron" / "__init__.py").write_text("def get_args():\n    return 'the checkout'\n")
    script = checkout / "pretrain.py"
    script.write_text("from megatron import get_args\nprint('script sees', get_args())\n")
    probe = (
        "import sys\n"
        "from megatron_ucp.integration import run as R\n"
        "from megatron_ucp.plan import launch as L\n"
        f"facts = R.read_checkpoint_facts(L.MegatronArgs(load={str(root)!r}))\n"
        "print('facts', facts.dp_world_size, facts.global_batch_size)\n"
        "print('megatron imported', 'megatron' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "facts 2 8" in out and "megatron imported False" in out
    # the whole runner: reads the checkpoint, then runs the script, which imports its own package
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    env = {**os.environ, "MEGATRON_UCP_ELASTIC_RESUME": "0", "MEGATRON_UCP_RECORD_TRUE_LENGTHS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.integration.run", str(script), "--load", str(root)],
        cwd=shim_dir,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "script sees the checkout" in done.stdout


def test_read_checkpoint_facts_falls_back_to_ds_config(tmp_path):
    root = _write_model_states(tmp_path, with_args=False)
    facts = R.read_checkpoint_facts(L.MegatronArgs(load=str(root)))
    assert (facts.global_batch_size, facts.micro_batch_size) == (32, 1)


# ================================================================================================
# main(): dry run, help, MEGATRON_UCP=0, and a real install + run + uninstall in-process
# ================================================================================================


def test_dry_run_prints_the_final_command_line(tmp_path, monkeypatch, capsys):
    root = _write_model_states(tmp_path, dp=4, batch=12)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MEGATRON_UCP_KEEP_LAST", "2")
    rc = R.main(["--ucp-dry-run", str(script), "--load", str(root), "--micro-batch-size", "1", "--ucp-async-convert"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["argv"] == ["--load", str(root), "--micro-batch-size", "1", "--global-batch-size", "12", "--no-load-rng"]
    assert out["config"]["async_convert"] is True and out["config"]["keep_last"] == 2
    assert (out["dp_from"], out["dp_to"], out["reseed_base"]) == (4, 3, 1234)


def test_help_lists_every_option_and_variable(capsys):
    assert R.main(["--help"]) == 0
    text = capsys.readouterr().out
    for spec in C.option_specs():
        assert spec.option in text and spec.env in text
    assert R.main([]) == 2  # no script: usage on stderr


def test_module_entry_point_and_cli_dispatch():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.integration.run", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--ucp-async-convert" in out.stdout
    from megatron_ucp.cli import main as cli_main

    assert cli_main(["run", "--help"]) == 0


def test_usage_errors_exit_2(tmp_path, capsys):
    assert R.main(["--ucp-bogus", "x.py"]) == 2
    assert R.main([str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err


def test_switch_off_runs_the_script_untouched(tmp_path, monkeypatch):
    out = tmp_path / "seen.json"
    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys, megatron_ucp\n"
        f"json.dump({{'argv': sys.argv[1:], 'installed': megatron_ucp.active_config() is not None,"
        f" 'name': __name__}}, open({str(out)!r}, 'w'))\n"
    )
    monkeypatch.setenv("MEGATRON_UCP", "0")
    assert R.main([str(script), "--lr", "1", "--ucp-async-convert"]) == 0
    assert json.loads(out.read_text()) == {"argv": ["--lr", "1"], "installed": False, "name": "__main__"}


def test_main_installs_runs_and_uninstalls(tmp_path, monkeypatch):
    """Real hooks on the installed DeepSpeed; the script sees the config and a clean argv; exit codes pass through."""
    import megatron_ucp

    out = tmp_path / "seen.json"
    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys, os, megatron_ucp\n"
        "c = megatron_ucp.active_config()\n"
        f"json.dump({{'argv': sys.argv, 'async': c.async_convert, 'keep_last': c.keep_last,"
        f" 'env': os.environ.get('MEGATRON_UCP_KEEP_LAST')}}, open({str(out)!r}, 'w'))\n"
        "sys.exit(3)\n"
    )
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("MEGATRON_UCP_KEEP_LAST", "4")
    for name in C.config_env(UcpConfig()):  # the runner exports these; keep the test process clean afterwards
        monkeypatch.setenv(name, C.config_env(UcpConfig(keep_last=4))[name])
    assert R.main([str(script), "--x", "--ucp-async-convert"]) == 3
    seen = json.loads(out.read_text())
    assert seen == {"argv": [str(script), "--x"], "async": True, "keep_last": 4, "env": "4"}
    assert megatron_ucp.active_config() is None


# ================================================================================================
# the runner driving the stand-in: save at DP=2, resume at DP=3 (options) and DP=1 (environment)
# ================================================================================================

MODEL = [
    "--num-layers",
    "1",
    "--hidden-size",
    "3",
    "--num-attention-heads",
    "1",
    "--ffn-hidden-size",
    "16",
    "--seq-length",
    "8",
    "--max-position-embeddings",
    "8",
    "--normalization",
    "rmsnorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--standin-vocab-size",
    "32",
    "--make-vocab-size-divisible-by",
    "32",
    "--micro-batch-size",
    "1",
    "--lr",
    "0.05",
    "--bf16",
    "--deepspeed",
    "--zero-stage",
    "1",
    "--train-iters",
    "4",
    "--standin-zero-optimizer",
    "BF16_Optimizer",
]
_LOSS = re.compile(r"iteration (\d+)/4 \| consumed samples (\d+) \| lm loss (\S+) .*\| dp (\d+)")


def _launch(args, nprocs, tmp, name, env=None):
    """The stand-in's ranks, with the tests' site on ``PYTHONPATH`` (tests/support/site: no shared-memory kernel
    built; in the torch 2.8 runs, IPEX first)."""
    from demo.launch import launch

    pythonpath = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p)
    result = launch(
        ["-m", "megatron_ucp.integration.run", str(STANDIN), *MODEL, *args],
        nprocs,
        tmp / "logs",
        name=name,
        env={"PYTHONPATH": pythonpath, **(env or {})},
        cwd=REPO,
        timeout=600,
    )
    text = result.output(0)
    assert result.ok, f"{name} failed {result.returncodes}:\n{result.output(result.first_failure() or 0)[-5000:]}"
    return text, {int(m.group(1)): (int(m.group(2)), float(m.group(3)), int(m.group(4))) for m in _LOSS.finditer(text)}


def test_the_runner_waits_for_the_last_saves_conversion_when_the_script_ends(tmp_path):
    """The script exits (Megatron's --exit-interval: sys.exit) while the background conversion of its
    last save still runs (the converter pauses 4 s after its first parameter): the runner waits for it
    before it uninstalls the hooks, so the job ends with the twin complete. (Uninstalling used to drop
    the end-of-run wait: only conversions quicker than the end of the script finished.)"""
    from megatron_ucp.convert.universal import universal_state
    from megatron_ucp.faults import PAUSE_ENV

    text, losses = _launch(
        [
            "--standin-grad-acc-steps",
            "3",
            "--save",
            str(tmp_path / "ckpt"),
            "--save-interval",
            "2",
            "--exit-interval",
            "2",
            "--ucp-async-convert",
        ],
        1,
        tmp_path,
        "save",
        env={PAUSE_ENV: "global_step2:4:0"},
    )
    assert sorted(losses) == [1, 2]
    assert "waiting up to" in text and "background conversions in" in text and "finished" in text, text[-3000:]
    assert universal_state(tmp_path / "ckpt" / "global_step2_universal") == "complete"


@pytest.fixture(scope="module")
def saved_at_dp2(tmp_path_factory):
    """Iterations 1-2 at DP=2 (global batch 6 = micro 1 x DP 2 x GAS 3), saved, then exit."""
    tmp = tmp_path_factory.mktemp("runner_dp2")
    text, losses = _launch(
        [
            "--standin-grad-acc-steps",
            "3",
            "--save",
            str(tmp / "ckpt"),
            "--save-interval",
            "2",
            "--exit-interval",
            "2",
            "--ucp-keep-last",
            "1",
            "--ucp-no-async-convert",
        ],
        2,
        tmp,
        "save",
    )
    assert sorted(losses) == [1, 2] and losses[2][0] == 12 and losses[2][2] == 2
    assert "megatron-ucp run: setting keep_last=1 (from --ucp-keep-last)" in text
    assert (tmp / "ckpt" / "global_step2").is_dir()
    return tmp


@pytest.mark.slow
def test_resume_at_dp3_configured_by_options(saved_at_dp2, tmp_path):
    ckpt = saved_at_dp2 / "ckpt"
    text, losses = _launch(
        [
            "--load",
            str(ckpt),
            "--save",
            str(tmp_path / "out"),
            "--save-interval",
            "4",
            "--ucp-strict",
            "--ucp-converter-workers",
            "1",
            "--ucp-no-async-convert",
        ],
        3,
        tmp_path,
        "resume3",
    )
    where = ckpt / "global_step2"
    assert f"megatron-ucp run: DP change: {where} was saved at DP=2, this job runs at DP=3" in text
    assert "keeping the checkpoint's global batch 6 (gradient accumulation 2 x micro batch 1 x DP 3)" in text
    assert "cannot be mapped to DP=3: adding --no-load-rng" in text
    assert "megatron-ucp run: re-seeded RNG after the load" in text
    # continued from iteration 2 at DP=3 with the checkpoint's global batch (the stand-in's default would be 3)
    assert {i: (c, dp) for i, (c, _, dp) in losses.items()} == {3: (18, 3), 4: (24, 3)}
    assert (tmp_path / "out" / "global_step4").is_dir()


@pytest.mark.slow
def test_resume_at_dp1_configured_by_environment(saved_at_dp2, tmp_path):
    ckpt = saved_at_dp2 / "ckpt"
    env = {
        "MEGATRON_UCP_STRICT": "1",
        "MEGATRON_UCP_ASYNC_CONVERT": "0",
        "MEGATRON_UCP_KEEP_GLOBAL_BATCH": "1",
        "MEGATRON_UCP_CONVERTER_THREADS": "1",
        "MEGATRON_UCP_KEEP_LAST": "2",
    }
    text, losses = _launch(
        ["--load", str(ckpt), "--load-tag", "global_step2", "--seed", "99"], 1, tmp_path, "resume1", env=env
    )
    assert "megatron-ucp run: setting keep_last=2 (from MEGATRON_UCP_KEEP_LAST)" in text
    assert "keeping the checkpoint's global batch 6 (gradient accumulation 6 x micro batch 1 x DP 1)" in text
    assert "sha256(seed=99, iteration=2, r)" in text
    assert {i: (c, dp) for i, (c, _, dp) in losses.items()} == {3: (18, 1), 4: (24, 1)}


@pytest.fixture()
def process_restored():
    """The runner exports its configuration into the environment (for the script's own processes) and puts the
    script's folder first on ``sys.path``: both put back after."""
    saved, path = dict(os.environ), sys.path[:]
    yield
    os.environ.clear()
    os.environ.update(saved)
    sys.path[:] = path


def _crashed_at_uninstall(monkeypatch) -> list[bool]:
    """What ``crashed()`` says when the runner uninstalls the hooks (where the exit handlers of the saves in flight
    decide whether to wait)."""
    from megatron_ucp.integration.save import async_save

    seen: list[bool] = []
    uninstall = R.megatron_ucp.uninstall

    def watched() -> None:
        seen.append(async_save.crashed())
        uninstall()

    monkeypatch.setattr(R.megatron_ucp, "uninstall", watched)
    return seen


@pytest.mark.usefixtures("process_restored")
@pytest.mark.parametrize(
    "body, raised",
    [("raise RuntimeError('a step failed')", RuntimeError), ("import sys; sys.exit(1)", None)],
    ids=["exception", "failing-exit"],
)
def test_a_script_that_fails_leaves_the_saves_in_flight_waiting_for_nobody(tmp_path, monkeypatch, body, raised):
    """The runner's uninstall comes before the interpreter's exception hook: a script that dies of an exception, or
    exits with a failing status, is said to be dying before the uninstall, so that the exit handlers of the saves in
    flight (asynchronous saves, the last memory save's commit) do not wait for peers this rank can no longer meet; a
    later run in the same process starts clean."""
    from megatron_ucp.integration.save import async_save

    seen = _crashed_at_uninstall(monkeypatch)
    script = tmp_path / "train.py"
    script.write_text(body + "\n")
    argv = [str(script), "--ucp-async-save", "--ucp-memory-save-interval", "1"]
    if raised is not None:
        with pytest.raises(raised):
            R.main(argv)
    else:
        assert R.main(argv) == 1
    assert seen == [True] and not async_save.crashed()


@pytest.mark.usefixtures("process_restored")
@pytest.mark.parametrize("body", ["pass", "import sys; sys.exit()", "import sys; sys.exit(0)"])
def test_a_script_that_ends_well_is_not_taken_for_a_crash(tmp_path, monkeypatch, body):
    """Megatron's --exit-interval ends with ``sys.exit()``: a normal end, whose saves in flight are waited for."""
    seen = _crashed_at_uninstall(monkeypatch)
    script = tmp_path / "train.py"
    script.write_text(body + "\n")
    assert R.main([str(script), "--ucp-async-save"]) == 0
    assert seen == [False]
