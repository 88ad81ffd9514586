"""Run ``train_scripts/train_aGPT_7B_ucp.sh`` the way an AuroraGPT user does, on one CPU node.

The chain is the real one: our wrapper -> the checkout's ``train_aGPT_7B.sh`` -> ``ALCF/helpers.sh``
(which sources ezpz's ``utils.sh``, builds the DeepSpeed config and the training arguments) ->
``ezpz launch`` -> ``mpiexec`` -> the launcher shim -> ``megatron_ucp.integration.run`` -> ``pretrain_gpt_alcf.py``.
Nothing of it is edited. What the test provides instead of a real Aurora job, all in a folder of
stand-ins first on ``PATH`` (plus one file PBS itself would have written):

* ``curl``: ``helpers.sh`` starts with ``source <(curl -L https://bit.ly/ezpz-utils)``; there is no
  network here, so the stand-in prints ``src/ezpz/bin/utils.sh`` of the ezpz snapshot (the file
  that address serves) and refuses anything else.
* a PBS job: ``qstat`` prints one running job on this host, and its node file exists where PBS
  keeps it (``/var/spool/pbs/aux/<jobid>``, created for the test and removed after); ``PBS_JOBID``,
  ``PBS_NODEFILE`` and ``PBS_O_WORKDIR`` are set as PBS sets them.
* ``nvidia-smi``: ezpz and helpers.sh count a node's accelerators with it; the stand-in reports as
  many as the job should run ranks on this CPU node (4, then 3 for the "smaller allocation").

The model and run size come from helpers.sh's own variables (``NLAYERS``, ``HIDDEN``, ...,
``TRAIN_ITERS``, ``DATA_FILE_LIST``, ``TOKENIZER_TYPE=NullTokenizer``, ``BE=gloo``); the one
argument given to the script is ``--vocab-size`` for the NullTokenizer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tests.integration.mds import CORPUS_TOKENS, REPO_ROOT, Checkout, parse_losses, rank_env

WRAPPER = REPO_ROOT / "train_scripts" / "train_aGPT_7B_ucp.sh"
PBS_AUX = Path("/var/spool/pbs/aux")


def ezpz_utils(snapshot_dir: Optional[Path] = None) -> Path:
    ezpz = snapshot_dir or Path(
        os.environ.get("EZPZ_DIR", "") or Path(os.environ["MEGATRON_DEEPSPEED_DIR"]).parent / "ezpz"
    )
    path = ezpz / "src" / "ezpz" / "bin" / "utils.sh"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ezpz's utils.sh (set EZPZ_DIR to the ezpz snapshot)")
    return path


_CURL = """#!/usr/bin/env bash
# test stand-in (no network): serve ezpz's utils.sh, which https://bit.ly/ezpz-utils points to
for a in "$@"; do case "$a" in *ezpz-utils*) exec cat "$UCP_TEST_EZPZ_UTILS";; esac; done
echo "curl stand-in: no network in this test ($*)" >&2
exit 6
"""
_QSTAT = """#!/usr/bin/env bash
# test stand-in for PBS: one running job ($UCP_TEST_JOBID) on this host
echo "Job ID          Username Queue Jobname SessID NDS TSK Memory Time  S Time"
echo "$UCP_TEST_JOBID ${USER:-root} debug train 1234 1 4 -- 01:00 R 00:00 $(hostname)/0*208"
"""
_NVIDIA_SMI = """#!/usr/bin/env bash
# test stand-in: this CPU node runs $UCP_TEST_RANKS ranks, as a node with that many accelerators would
for ((i = 0; i < ${UCP_TEST_RANKS:-4}; i++)); do echo "GPU $i: CPU rank slot (UUID: GPU-ucp-test-$i)"; done
"""


@dataclass
class AlcfJob:
    """A fake one-node PBS job around a prepared checkout; ``run(ranks)`` launches the wrapper in it."""

    checkout: Checkout
    folder: Path
    ckpt: Path
    jobid: str

    @classmethod
    def create(cls, checkout: Checkout, folder: Path) -> "AlcfJob":
        bin_dir = folder / "bin"
        bin_dir.mkdir(parents=True)
        for name, text in (("curl", _CURL), ("qstat", _QSTAT), ("nvidia-smi", _NVIDIA_SMI)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        (folder / "data-file-list.txt").write_text(f"1.0 {checkout.data_prefix} corpus\n")
        jobid = f"{os.getpid()}{len(str(folder)) % 97:02d}.ucptest"
        PBS_AUX.mkdir(parents=True, exist_ok=True)
        (PBS_AUX / jobid).write_text(subprocess.run(["hostname"], capture_output=True, text=True).stdout)
        return cls(checkout=checkout, folder=folder, ckpt=folder / "ckpt", jobid=jobid)

    def close(self) -> None:
        (PBS_AUX / self.jobid).unlink(missing_ok=True)

    def env(self, ranks: int) -> dict[str, str]:
        env = rank_env()
        env.update(
            {
                "PATH": os.pathsep.join([str(self.folder / "bin"), env["PATH"]]),
                "UCP_TEST_EZPZ_UTILS": str(ezpz_utils()),
                "UCP_TEST_JOBID": self.jobid,
                "UCP_TEST_RANKS": str(ranks),
                "PBS_JOBID": self.jobid,
                "PBS_NODEFILE": str(PBS_AUX / self.jobid),
                "PBS_O_WORKDIR": str(self.checkout.root),
                "USER": env.get("USER", "root") or "root",
                # helpers.sh's own knobs: a tiny llama on the CPU, 6 iterations, saves every 3
                "NGPU_PER_HOST": str(ranks),
                "TP": "1",
                "BE": "gloo",
                "DTYPE": "bf16",
                "ZERO_STAGE": "1",
                "OPT": "adamw",
                "NLAYERS": "2",
                "HIDDEN": "64",
                "HEADS": "4",
                "NUM_KV_HEAD": "2",
                "FFN_HIDDEN_SIZE": "128",
                "SEQ": "32",
                "MICRO_BATCH": "1",
                "TRAIN_ITERS": "6",
                "SAVE_INTERVAL": "3",
                "EVAL_INTERVAL": "1000",
                "EVAL_ITERS": "1",
                "NO_TENSORBOARD": "1",
                "NO_FLASH_ATTN": "1",
                "TOKENIZER_TYPE": "NullTokenizer",
                "DATA_FILE_LIST": str(self.folder / "data-file-list.txt"),
                "CKPT_DIR": str(self.ckpt),
                "UCP": "1",
                "PYTHON": sys.executable,
            }
        )
        return env

    def run(
        self, ranks: int, extra_env: Optional[dict[str, str]] = None, timeout: float = 420
    ) -> tuple[str, dict[int, float]]:
        """Launch the wrapper; returns (its whole output, Megatron's loss per iteration)."""
        env = self.env(ranks)
        env.update(extra_env or {})
        proc = subprocess.run(
            ["bash", str(WRAPPER), "--vocab-size", str(CORPUS_TOKENS)],
            cwd=self.checkout.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
        log = proc.stdout.decode(errors="replace")
        (self.folder / f"wrapper-{ranks}-ranks-{len(list(self.folder.glob('wrapper-*.log')))}.log").write_text(log)
        return log, parse_losses(log)


def clean_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest
