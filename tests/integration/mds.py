"""Drive the real Megatron-DeepSpeed (argonne-lcf fork) on the CPU for the integration tests.

::

    co = prepare_checkout(tmp)                       # copy of $MEGATRON_DEEPSPEED_DIR, built, with a corpus
    res = run_mds(co, MdsRun(nproc=4, ckpt=root, train_iters=6, save_interval=3))
    res.losses[4]                                    # Megatron's own "lm loss" of iteration 4

The snapshot is never edited: :func:`prepare_checkout` copies it into a temporary folder and
applies there the environment edits below, and only those:

* ``megatron/training.py`` imports ``megatron.model.vision.knn_monitor``, which needs torchvision;
  the torchvision wheels reachable here do not load against the CPU torch build, so the copy
  guards that one import (``compute_feature_bank = None`` when it fails). Users' environments
  have torchvision; nothing of ours depends on it.
* ``megatron/data/helpers.cpp`` is built with the checkout's own Makefile (as users do).
* a synthetic corpus is made with the checkout's own ``tools/preprocess_data.py`` and
  ``--tokenizer-type NullTokenizer`` (no tokenizer download).

The ranks get ``tests/support/site`` on ``PYTHONPATH`` (its ``sitecustomize`` stops
DeepSpeed's optional shared-memory kernel from being JIT-built; see there), ``DS_ACCELERATOR=cpu``,
``WANDB_MODE=disabled`` and one thread each. DeepSpeed is whatever the test process imports (the
Makefile's version matrix puts one release on ``PYTHONPATH``). The ranks are forked from a process that has
imported torch, DeepSpeed and transformers once for the session (``tests/support/preload``: torchrun's environment
and failure handling, each rank running the script as a fresh interpreter would); ``UCP_PRELOAD=0`` launches them
with torchrun instead, and the wrapper test through ``ezpz launch`` (``ALCF/helpers.sh``) as users do.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tests.support.preload import pool as preload_pool

SNAPSHOT_ENV = "MEGATRON_DEEPSPEED_DIR"
SITE_DIR = Path(__file__).resolve().parents[1] / "support" / "site"
REPO_ROOT = Path(__file__).resolve().parents[2]
_KNN_IMPORT = "from megatron.model.vision.knn_monitor import compute_feature_bank\n"
_KNN_GUARDED = (
    "try:  # megatron-ucp test copy: torchvision does not load here (environment edit)\n"
    "    from megatron.model.vision.knn_monitor import compute_feature_bank\n"
    "except ImportError:\n"
    "    compute_feature_bank = None\n"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"(^|\]: |\s)[A-Za-z_.]*(Error|Exception|Interrupt)\b: ")
_LOSS = re.compile(r"iteration=\s*(\d+)/\s*\d+ \|.*?\| lm loss=([0-9.eE+-]+) \|")
MDS_IMPORTS = ("transformers", "wandb", "rich")
"""What a rank of Megatron-DeepSpeed imports beside torch and DeepSpeed (its tokenizer module, its script), done once
by the preload server."""
CORPUS_TOKENS = 256
"""``--vocab-size`` of the NullTokenizer: 256 ids + end-of-document = 257, padded to 384 (128-divisible)."""


def snapshot_dir() -> Optional[Path]:
    value = os.environ.get(SNAPSHOT_ENV, "").strip()
    return Path(value).resolve() if value else None


def deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def script_imports_unedited(ds_version: str) -> bool:
    """``megatron/training.py`` imports ``deepspeed.compression.compress`` (versions.Internals)."""
    from megatron_ucp.deepspeed.versions import internals

    return internals(ds_version).ships_compression


@dataclass(frozen=True)
class Checkout:
    root: Path
    data_prefix: Path

    @property
    def entry(self) -> Path:
        return self.root / "pretrain_gpt_alcf.py"


def _guard_knn_import(root: Path) -> None:
    path = root / "megatron" / "training.py"
    text = path.read_text()
    if _KNN_IMPORT not in text:
        raise RuntimeError(f"{path}: the knn_monitor import the test guards is not there any more")
    path.write_text(text.replace(_KNN_IMPORT, _KNN_GUARDED, 1))


def _write_corpus(path: Path, docs: int = 400, seed: int = 0) -> None:
    """Arithmetic progressions mod 256: learnable, so losses move from step to step."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(docs):
            start, stride, n = rng.randrange(CORPUS_TOKENS), rng.randrange(1, 7), rng.randint(32, 200)
            fh.write(json.dumps({"text": " ".join(str((start + stride * k) % CORPUS_TOKENS) for k in range(n))}) + "\n")


def prepare_checkout(dest: Path, snapshot: Optional[Path] = None) -> Checkout:
    """A working copy of the snapshot with the documented environment edits, built, plus a corpus."""
    snapshot = snapshot or snapshot_dir()
    if snapshot is None or not (snapshot / "pretrain_gpt_alcf.py").is_file():
        raise RuntimeError(f"{SNAPSHOT_ENV}={snapshot}: not a Megatron-DeepSpeed checkout")
    root = dest / "Megatron-DeepSpeed"
    shutil.copytree(snapshot, root, ignore=shutil.ignore_patterns(".git"))
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)
    _guard_knn_import(root)
    env = rank_env()
    subprocess.run(["make"], cwd=root / "megatron" / "data", env=env, check=True, capture_output=True)
    data = dest / "data"
    data.mkdir()
    _write_corpus(data / "corpus.jsonl")
    subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(data / "corpus.jsonl"),
            "--output-prefix",
            str(data / "corpus"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(CORPUS_TOKENS),
            "--append-eod",
            "--workers",
            "1",
        ],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
    )
    co = Checkout(root=root, data_prefix=data / "corpus_text_document")
    warm_index_cache(co, dest / "warm-up")
    return co


def warm_index_cache(co: Checkout, folder: Path) -> None:
    """Build the dataset's index mappings once, with a single rank.

    On a cold cache every rank of pretrain_gpt_alcf.py builds the same ``*_idx.npy`` files at once
    (``gpt_dataset._build_index_mappings`` has no barrier) and one rank's ``np.save`` can truncate
    a file another is loading (``EOFError: No data left in file``). Every run here has the same
    samples, so they all find this cache in ``<data>/index-cache``: for the 6-iteration runs and the
    12-iteration ones (the ZeRO-3 tests), whose sample counts name other index files. Each warm-up stops
    after its first iteration (the index is built before it).
    """
    for iterations in WARMED_ITERATIONS:
        run_mds(
            co,
            MdsRun(
                nproc=1,
                ckpt=folder / f"ckpt-{iterations}",
                route="plain",
                train_iters=iterations,
                save_interval=1000,
                extra_args=["--exit-interval", "1"],
            ),
        )


WARMED_ITERATIONS = (6, 12)
"""Every ``train_iters`` the integration tests and benchmarks run with (12 samples per iteration)."""


def rank_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment of every process of a Megatron run (see the module docstring)."""
    env = dict(os.environ)
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "WANDB_MODE": "disabled",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([str(SITE_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        }
    )
    env.update(extra or {})
    return env


@dataclass
class MdsModel:
    """A llama-style model as train_aGPT_7B.sh builds it (RoPE, RMSNorm, SwiGLU, GQA, untied), tiny."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    seq: int = 32
    untied: bool = True
    """AuroraGPT unties the input and output embeddings; Megatron's default ties them (with the
    pipeline model, both the first and the last stage then hold ``tied_modules.embed``)."""

    def args(self) -> list[str]:
        return [
            "--num-layers",
            str(self.layers),
            "--hidden-size",
            str(self.hidden),
            "--num-attention-heads",
            str(self.heads),
            "--num-key-value-heads",
            str(self.kv_heads),
            "--ffn-hidden-size",
            str(self.ffn),
            "--seq-length",
            str(self.seq),
            "--max-position-embeddings",
            str(2 * self.seq),
            "--swiglu",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--normalization",
            "rmsnorm",
            "--disable-bias-linear",
            "--no-query-key-layer-scaling",
            "--use-rotary-position-embeddings",
            *(["--untie-embeddings-and-output-weights"] if self.untied else []),
        ]


def llama_shape(model: "MdsModel", vocab: int = 384, tied: Optional[bool] = None):
    """The model as a synthetic-writer shape (``megatron_ucp.plan.llama_shapes.LlamaShape``): its padded
    vocabulary (384 by Megatron's default padding of the NullTokenizer's 257 ids at TP 1), ties as the model."""
    from megatron_ucp.plan.llama_shapes import LlamaShape

    return LlamaShape(
        layers=model.layers,
        hidden=model.hidden,
        ffn=model.ffn,
        heads=model.heads,
        kv_heads=model.kv_heads,
        vocab=vocab,
        original_vocab=CORPUS_TOKENS + 1,
        tied=not model.untied if tied is None else tied,
    )


@dataclass
class MdsRun:
    """One launch of pretrain_gpt_alcf.py: ``nproc`` ranks, DP = ``nproc / (tp * pp)``.

    ``pipeline=False`` builds the non-pipeline ``GPTModel`` (``--no-pipeline-parallel``, AuroraGPT's
    choice; PP must be 1), ``True`` the pipeline model ``GPTModelPipe`` (PP >= 1).

        ``optimizer="bf16"``: BF16_Optimizer (DeepSpeed config with ``data_types.grad_accum_dtype:
        fp32``); ``"zero"``: DeepSpeedZeroOptimizer (the ALCF default at PP=1). ``route``: ``runner``
        (``-m megatron_ucp.run``), ``plain`` (the script alone) or ``script`` (the given entry
        script, e.g. a patched copy).
    """

    nproc: int
    ckpt: Path
    train_iters: int = 6
    save_interval: int = 3
    optimizer: str = "bf16"
    zero_stage: int = 1
    global_batch: int = 12
    micro_batch: int = 1
    model: MdsModel = field(default_factory=MdsModel)
    tp: int = 1
    pp: int = 1
    pipeline: bool = False
    route: str = "runner"
    entry: Optional[Path] = None
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 420
    expect_failure: bool = False
    ds_extra: dict = field(default_factory=dict)
    """Merged into the DeepSpeed config (one level deep: ``{"zero_optimization": {...}}`` adds to that section)."""


@dataclass
class MdsResult:
    returncode: int
    log: str
    losses: dict[int, float]
    wall_s: float

    def ucp_lines(self) -> list[str]:
        return [line for line in self.log.splitlines() if "megatron-ucp" in line]


def ds_config(run: MdsRun) -> dict:
    config = {
        "train_batch_size": run.global_batch,
        "train_micro_batch_size_per_gpu": run.micro_batch,
        "steps_per_print": 1000,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": run.zero_stage},
        "bf16": {"enabled": True},
        "wall_clock_breakdown": False,
    }
    if run.optimizer == "bf16":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    elif run.optimizer != "zero":
        raise ValueError(f"optimizer must be 'bf16' or 'zero', got {run.optimizer!r}")
    for key, value in run.ds_extra.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def _free_port() -> int:
    from tests.support.dsharness.launch import free_port

    return free_port()


def megatron_args(co: Checkout, run: MdsRun, config_path: Path) -> list[str]:
    return [
        *run.model.args(),
        "--micro-batch-size",
        str(run.micro_batch),
        "--global-batch-size",
        str(run.global_batch),
        "--train-iters",
        str(run.train_iters),
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "1",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--clip-grad",
        "1.0",
        "--optimizer",
        "adam",
        "--seed",
        "1234",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-masked-softmax-fusion",
        "--no-gradient-accumulation-fusion",
        "--bf16",
        "--accumulate-allreduce-grads-in-fp32",
        "--deepspeed",
        "--deepspeed_config",
        str(config_path),
        "--zero-stage",
        str(run.zero_stage),
        *([] if run.pipeline else ["--no-pipeline-parallel"]),
        "--tensor-model-parallel-size",
        str(run.tp),
        "--pipeline-model-parallel-size",
        str(run.pp),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(CORPUS_TOKENS),
        "--data-path",
        str(co.data_prefix),
        "--split",
        "990,10,0",
        "--distributed-backend",
        "gloo",
        "--log-interval",
        "1",
        "--eval-interval",
        "100000",
        "--eval-iters",
        "0",
        "--save",
        str(run.ckpt),
        "--load",
        str(run.ckpt),
        "--save-interval",
        str(run.save_interval),
        *run.extra_args,
    ]


def parse_losses(log: str) -> dict[int, float]:
    """Megatron's training_log line of each iteration: ``iteration= 4/ 6 | ... | lm loss=5.92 |``."""
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS.finditer(_ANSI.sub("", log))}


def run_mds(co: Checkout, run: MdsRun) -> MdsResult:
    """Launch with torchrun from the checkout; raise with the log tail on failure (unless expected)."""
    run.ckpt.parent.mkdir(parents=True, exist_ok=True)
    config_path = run.ckpt.parent / f"{run.ckpt.name}-ds-config-{run.optimizer}-{run.global_batch}-{run.nproc}.json"
    config_path.write_text(json.dumps(ds_config(run)))
    env = rank_env(run.env)
    port = _free_port()
    launcher = preload_pool.launch_command(env, run.nproc, port, imports=MDS_IMPORTS) or [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(run.nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    if run.route == "runner":
        target = ["-m", "megatron_ucp.integration.run", str(co.entry)]
    elif run.route == "plain":
        target = [str(co.entry)]
    elif run.route == "script":
        assert run.entry is not None, "route='script' needs entry"
        target = [str(run.entry)]
    else:
        raise ValueError(f"unknown route {run.route!r}")
    cmd = [*launcher, *target, *megatron_args(co, run, config_path)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=co.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        out, _ = proc.communicate(timeout=run.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in its own session: killing torchrun alone would leave the ranks running (a
        # hung job's ranks outliving the test); SIGTERM makes it stop them first
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        timed_out = True
    log = _ANSI.sub("", out.decode(errors="replace"))
    log_path = run.ckpt.parent / f"{run.ckpt.name}-run-{time.strftime('%H%M%S')}.log"
    log_path.write_text(log)
    if timed_out:
        raise RuntimeError(
            f"Megatron-DeepSpeed run timed out after {run.timeout:.0f} s (nproc={run.nproc}, "
            f"optimizer={run.optimizer}, "
            f"route={run.route}; its ranks stopped; full log {log_path}):\n{failure_excerpt(log)}"
        )
    result = MdsResult(
        returncode=proc.returncode, log=log, losses=parse_losses(log), wall_s=time.perf_counter() - start
    )
    if proc.returncode != 0 and not run.expect_failure:
        raise RuntimeError(
            f"Megatron-DeepSpeed run failed (exit {proc.returncode}, nproc={run.nproc}, "
            f"optimizer={run.optimizer}, route={run.route}; full log {log_path}):\n"
            f"{failure_excerpt(log)}"
        )
    return result


def failure_excerpt(log: str, chars: int = 8000) -> str:
    """Every exception line (the root cause is often on another rank than the first traceback's),
    then the end of the log."""
    errors = [line for line in log.splitlines() if _EXCEPTION_LINE.search(line)]
    unique = list(dict.fromkeys(errors))[:40]
    return "exception lines:\n" + "\n".join(unique) + "\n...\nlog tail:\n" + log[-chars:]


def point_latest_at(root: Path, tag: str) -> None:
    """Make ``latest`` (and ``latest_universal``, when the twin exists) name ``tag``: a restart from an
    earlier save, as users do after a loss spike."""
    (root / "latest").write_text(tag)
    if (root / f"{tag}_universal").is_dir():
        (root / "latest_universal").write_text(f"{tag}_universal")
