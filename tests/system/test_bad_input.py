"""Bad input to ``megatron-ucp convert``: one clear message naming the file, non-zero exit, nothing lost.

For every case: the source files are byte-for-byte unchanged, ``latest_universal`` is unchanged,
and no output or staging folder is left that could be taken for a finished conversion.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.cli import main
from megatron_ucp.format import dsformat as F
from tests.support.source_digest import source_digest, verdict_files

pytestmark = pytest.mark.slow
TAG = "global_step4"


@pytest.fixture
def root(tmp_path, ds_checkpoint):
    ck = ds_checkpoint(optimizer="bf16", dp=4).copy_to(tmp_path / "ck")
    (ck / F.LATEST_UNIVERSAL).write_text("previous_universal")
    return ck


def convert_fails(root: Path, capsys, *extra: str, expect: str, names: str) -> None:
    before = source_digest(root)
    rc = main(["convert", str(root), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc != 0
    assert expect in err and names in err, err
    assert err.strip().count("\n") == 0, f"expected one line, got:\n{err}"
    assert source_digest(root) == before
    assert [p.name for p in verdict_files(root)] in ([], [f"{TAG}.json"])  # a verdict at most
    assert (root / F.LATEST_UNIVERSAL).read_text() == "previous_universal"
    assert not (root / f"{TAG}_universal").exists()
    assert not list(root.parent.rglob("*.ucp-staging"))


def test_missing_rank_file(root, capsys):
    victim = root / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    victim.unlink()
    convert_fails(root, capsys, expect="DP ranks 2 are missing (found DP ranks 0-1, 3)", names=str(root / TAG))


def test_extra_rank_file(root, capsys):
    shutil.copy(
        root / TAG / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt",
        root / TAG / "bf16_zero_pp_rank_4_mp_rank_00_optim_states.pt",
    )
    convert_fails(root, capsys, expect="dp_world_size=4 but the folder has 5", names=F.MODEL_STATES_FILE)


def test_truncated_rank_file(root, capsys):
    victim = root / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    convert_fails(root, capsys, expect="truncated or corrupt", names=str(victim))


@pytest.mark.parametrize(
    "header",
    [
        None,  # random bytes: whatever torch or pickle makes of them
        b"\x80\x02K\x01Q.",  # a pickle whose first opcode is a persistent id: pickle's message spans two lines
    ],
    ids=["random", "persistent-id"],
)
def test_corrupt_rank_file(root, capsys, header):
    victim = root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[:64] = (header or os.urandom(64)).ljust(64, b"\0")
    victim.write_bytes(bytes(data))
    convert_fails(root, capsys, expect="truncated or corrupt", names=str(victim))


def test_files_of_mixed_dp_size(root, capsys, ds_checkpoint):
    other = ds_checkpoint(optimizer="bf16", dp=2).root
    victim = root / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(other / TAG / victim.name, victim)
    convert_fails(root, capsys, expect="written at DP=2", names=str(victim))


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    rc = main(["convert", str(tmp_path / "notes"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a DeepSpeed checkpoint" in err and str(tmp_path / "notes") in err
    rc = main(["convert", str(tmp_path / "absent"), "--no-progress"])
    assert rc == 2 and "no such file" in capsys.readouterr().err


def test_a_tag_already_converted_is_done_and_force_redoes_it(root, capsys):
    """Converting a tag whose twin is complete is a job already done: one line saying so, exit 0, nothing
    touched; ``--force`` reconverts it."""
    assert main(["convert", str(root), "--no-progress"]) == 0
    first = source_digest(root / f"{TAG}_universal")
    (root / F.LATEST_UNIVERSAL).write_text("previous_universal")
    before = source_digest(root)
    capsys.readouterr()
    rc = main(["convert", str(root), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", err
    said = out.strip().splitlines()
    assert len(said) == 1 and "already a complete conversion" in said[0] and "--force" in said[0], out
    assert f"{TAG}_universal" in said[0]
    assert source_digest(root) == before
    assert main(["convert", str(root), "--no-progress", "--force"]) == 0
    assert source_digest(root / f"{TAG}_universal").keys() == first.keys()
    assert (root / F.LATEST_UNIVERSAL).read_text() == f"{TAG}_universal"
    assert not list(root.glob(".*ucp-trash*")) and not list(root.glob(".*ucp-staging"))
    # a twin of an earlier save of the tag (a rank file written again) is not done: it needs --force
    rank0 = next((root / TAG).glob("*_optim_states.pt"))
    os.utime(rank0, ns=(rank0.stat().st_atime_ns, rank0.stat().st_mtime_ns + 10**9))
    before = source_digest(root)
    capsys.readouterr()
    assert main(["convert", str(root), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "stale" in err and "--force" in err and f"{TAG}_universal" in err, err
    assert source_digest(root) == before


def test_force_replaces_the_folder_in_one_atomic_swap(tmp_path, monkeypatch):
    """``--force`` swaps the new folder in with renameat2(RENAME_EXCHANGE): the path never goes missing."""
    from megatron_ucp.format import osio

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("A")
    (b / "x").write_text("B")
    # Linux has had renameat2(RENAME_EXCHANGE) since 3.15 (glibc 2.28) on every local file system: here the
    # exchange must happen (the two-rename fallback is for other systems, where this test has nothing to show)
    if sys.platform != "linux":
        pytest.skip("renameat2 is Linux's")
    assert osio.exchange(a, b) is True
    assert (a / "x").read_text() == "B" and (b / "x").read_text() == "A"
    with pytest.raises(FileNotFoundError):
        osio.exchange(a, tmp_path / "missing")
    calls = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda src, dst: (calls.append((str(src), str(dst))), real(src, dst))[1])
    from megatron_ucp.convert.universal import Staging

    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    staging = Staging(out, "fp", 0, 1, None, 60.0).open()
    (staging.path / "new").write_text("new")
    staging.close()
    staging.commit({"format": "test"}, force=True)
    assert (out / "new").read_text() == "new" and not (out / "old").exists()
    assert not any(dst == str(out) or src == str(out) for src, dst in calls)  # no rename of the folder itself
    assert not list(tmp_path.glob(".out.ucp-*"))


def test_unwritable_output(root, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    convert_fails(root, capsys, "--output", str(blocker / "out"), expect="does not exist", names=str(blocker))
    if os.geteuid() != 0:  # root ignores permission bits; the /proc case below covers it
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        convert_fails(root, capsys, "--output", str(ro / "out"), expect="not writable", names=str(ro))
    convert_fails(root, capsys, "--output", "/proc/ucp-test-out", expect="error", names="/proc")


def test_disk_full_mid_write(root):
    """A per-file size limit (RLIMIT_FSIZE) makes writes fail part-way, as a full disk would."""
    before = source_digest(root)
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1200, 1200)); "
        "from megatron_ucp.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "convert", str(root), "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "write failed" in proc.stderr and "File too large" in proc.stderr and "_universal" in proc.stderr
    assert source_digest(root) == before
    assert (root / F.LATEST_UNIVERSAL).read_text() == "previous_universal"
    assert not (root / f"{TAG}_universal").exists() and not list(root.glob(".*ucp-staging"))


def test_incomplete_model_parallel_folders_are_named(root, capsys):
    """TP/PP folders are converted (tests/integration/test_model_parallel.py); a model-parallel rank
    with half its files is named, not guessed around."""
    shutil.copy(root / TAG / F.MODEL_STATES_FILE, root / TAG / "mp_rank_01_model_states.pt")
    convert_fails(root, capsys, expect="no optimizer-state files of model-parallel rank 1", names=str(root / TAG))
    (root / TAG / "mp_rank_01_model_states.pt").unlink()
    first = sorted((root / TAG).glob("*_mp_rank_00_optim_states.pt"))[0]
    shutil.copy(first, root / TAG / first.name.replace("mp_rank_00", "mp_rank_01"))
    convert_fails(root, capsys, expect="mp_rank_01_model_states.pt is missing", names=str(root / TAG))
