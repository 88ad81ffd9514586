"""``megatron-ucp convert --distributed`` with several local processes, as torchrun / mpiexec start them.

Each process converts share RANK of WORLD_SIZE of a real DeepSpeed checkpoint; exactly one commits,
every process exits with the same status, and the result is byte-identical to a single-process
conversion. A failure on one process fails all, and nothing is left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.background.verdicts import read_verdict, tag_identity
from megatron_ucp.convert.distributed import detect_launch
from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import read_manifest, staging_path
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from tests.support.ckpt_cache import built_checkpoint, copy_root
from tests.support.dsharness import REPO_ROOT, free_port


def _launch(n: int, argv, env_of, timeout: float = 180) -> list[tuple[int, str]]:
    """Start ``n`` converter processes (``argv``: a list, or a function of the rank) with per-rank environments."""
    procs = []
    for rank in range(n):
        args = argv(rank) if callable(argv) else argv
        env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
                "PMI_RANK",
                "PMI_SIZE",
                "TORCHELASTIC_USE_AGENT_STORE",
            )
        }
        env.update(env_of(rank), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT), GLOO_SOCKET_IFNAME="lo")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "megatron_ucp.cli", *args],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _pt_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted((folder / F.UNIVERSAL_ZERO_DIR).rglob("*.pt"))}


@pytest.fixture(scope="module")
def checkpoint():
    return built_checkpoint(optimizer="bf16", dp=4)


@pytest.fixture(scope="module")
def single(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "u"
    convert(ConvertOptions(source=checkpoint.root, output=out, progress=False))
    return out


def test_detect_launch_reads_torchrun_mpiexec_openmpi_and_slurm_environments(tmp_path):
    assert detect_launch({}) is None
    t = detect_launch(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": "abc",
        }
    )
    assert (t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port, t.agent_store) == (
        3,
        8,
        1,
        "h0",
        29500,
        True,
    )
    m = detect_launch({"PMI_RANK": "5", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "5", "PALS_APID": "7.0"})
    assert (m.rank, m.world_size, m.local_rank, m.master_addr, m.job_id) == (5, 24, 5, None, "PALS_APID=7.0")
    nodes = tmp_path / "nodefile"
    nodes.write_text("x4000c0s0b0n0\nx4000c0s1b0n0\nx4000c0s2b0n0\n")
    p = detect_launch(
        {"PALS_RANKID": "13", "PALS_LOCAL_SIZE": "12", "PBS_NODEFILE": str(nodes), "PBS_JOBID": "1.aurora"}
    )
    assert (p.rank, p.world_size, p.job_id) == (13, 36, "PBS_JOBID=1.aurora")
    o = detect_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (o.rank, o.world_size) == (1, 2)
    s = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "2"})
    assert (s.rank, s.world_size, s.job_id) == (0, 4, "SLURM_JOB_ID=9.2")
    with pytest.raises(UcpError):
        detect_launch({"PMI_RANK": "0"})  # no size anywhere
    with pytest.raises(UcpError):
        detect_launch({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.slow
def test_mpiexec_style_three_processes_commit_once_byte_identical(checkpoint, single, tmp_path):
    out, root = tmp_path / "u", copy_root(checkpoint.root, tmp_path / "ck")  # its verdict is written beside it
    res = _launch(
        3,
        ["convert", str(root), "--output", str(out), "--distributed", "--no-progress", "--workers", "2"],
        lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "3", "PALS_APID": f"test-{os.getpid()}"},
    )
    assert [code for code, _ in res] == [0, 0, 0], "\n".join(text[-2000:] for _, text in res)
    assert "committed by rank" in res[0][1]
    manifest = read_manifest(out)
    assert manifest["shares"] == 3
    assert _pt_files(out) == _pt_files(single)
    # every share's checksums reach the one manifest, equal to one converter's, and verify checks them
    assert manifest["checksums"] == read_manifest(single)["checksums"]
    report = verify_universal(out, source=root)
    assert report.ok and report.checksummed == len(manifest["checksums"]["files"]) > 0
    assert not staging_path(out).exists() and not list(tmp_path.glob(".*ucp-rendezvous*"))
    tag = (root / F.LATEST).read_text().strip()
    verdict = read_verdict(root, tag)  # what the conversion read is the tag's verdict, written once
    assert verdict is not None and verdict.sound and verdict.checked_by == "megatron-ucp convert", verdict
    assert verdict.applies_to(tag_identity(root / tag))


@pytest.mark.slow
def test_torchrun_style_two_processes(checkpoint, single, tmp_path):
    out = tmp_path / "u"
    port = free_port()
    res = _launch(
        2,
        ["convert", str(checkpoint.root), "--output", str(out), "--distributed", "--no-progress"],
        lambda r: {
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        },
    )
    assert [code for code, _ in res] == [0, 0], "\n".join(text[-2000:] for _, text in res)
    assert _pt_files(out) == _pt_files(single)


@pytest.mark.slow
def test_failure_on_one_process_fails_all_and_leaves_nothing(checkpoint, tmp_path):
    out = tmp_path / "u"

    argv = ["convert", str(checkpoint.root), "--output", str(out), "--distributed", "--no-progress"]
    res = _launch(
        3,
        lambda r: argv + (["--tag", "global_step999"] if r == 1 else []),  # rank 1: no such tag
        lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "3", "PALS_APID": f"fail-{os.getpid()}"},
    )
    codes = [code for code, _ in res]
    assert codes == [2, 2, 2], "\n".join(text[-2000:] for _, text in res)
    assert all("rank 1" in text and "global_step999" in text for _, text in res)
    assert not out.exists() and not staging_path(out).exists()
