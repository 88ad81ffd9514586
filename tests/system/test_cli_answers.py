"""What the CLI answers a user: every command it suggests runs, every refusal says which tag and why, a job
already done exits 0, counts are explained, long lists are summarised, nothing is said twice.

Synthetic checkpoints (megatron_ucp.synthetic: DeepSpeed's files, no training), the CLI in process where it can
be, as a subprocess where what a user sees on the terminal is the point.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.cli import main
from megatron_ucp.format import dsformat as F

TAG = "global_step100"
SMALL = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    assert main(["synthesize", str(tmp_path / "ck"), *SMALL, "--dp", "4", "--no-progress"]) == 0
    return tmp_path / "ck"


def _suggested(text: str) -> list[str]:
    """The commands a message suggests, as the user would copy them (between backquotes)."""
    return re.findall(r"`([^`]+)`", text)


def _run_suggested(command: str) -> int:
    words = shlex.split(command)
    if words[0] == "megatron-ucp":
        return main(words[1:])
    return subprocess.run(command, shell=True).returncode  # e.g. `echo TAG > ROOT/latest`


def test_status_of_a_latest_that_names_no_tag_suggests_what_runs(root: Path, capsys):
    (root / F.LATEST).write_text("global_step999")
    capsys.readouterr()
    assert main(["status", str(root), "--no-sizes"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("NOTE:"))
    assert "global_step999" in note and "not a checkpoint" in note and "convert" not in note, note
    # the restart's fallback loads the tag that is here: --check says so, and that it resumes
    assert main(["status", str(root), "--check", "--no-sizes"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-ucp status --check: a restart falls back to {TAG} (not read yet"), err
    # a step number of a tag that is not here says nothing of what was trained
    assert f"loses what was saved after {TAG}, if anything: global_step999 is not here" in err, err
    assert f"global_step999: {root / 'global_step999'}: missing" in err, err
    (command,) = _suggested(note)
    assert _run_suggested(command) == 0
    assert (root / F.LATEST).read_text().strip() == TAG
    # now the tag exists, not converted: a restart resumes from it all the same (a DP change reads the native
    # files); what the missing twin is for is said, with the command that makes it
    assert main(["status", str(root), "--check", "--no-sizes"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"megatron-ucp status --check: a restart resumes from {TAG}"), err
    note = next(line for line in out.splitlines() if line.startswith("NOTE:"))
    assert "no complete universal checkpoint" in note and "--universal-checkpoint" in note, note
    (command,) = _suggested(note)
    assert command == f"megatron-ucp convert {root.resolve()} --tag {TAG}"
    assert _run_suggested(command + " --no-progress") == 0
    capsys.readouterr()
    assert main(["status", str(root), "--check", "--no-sizes"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"megatron-ucp status --check: a restart resumes from {TAG}") and "NOTE" not in out
    assert out.rstrip().splitlines()[-1].startswith("checked:") and "--deep" in out  # says what it read


def test_a_stale_twin_suggests_verify_and_then_force(root: Path, capsys):
    """A twin whose tag's files were written again (a re-save) is stale: status suggests reading the files first,
    then converting again; both run as printed."""
    assert main(["convert", str(root), "--no-progress"]) == 0
    rank0 = next((root / TAG).glob("*_optim_states.pt"))
    rank0.write_bytes(rank0.read_bytes())  # written again, as a re-save of the tag would
    capsys.readouterr()
    assert main(["status", str(root), "--no-sizes"]) == 0
    out = capsys.readouterr().out
    stale = next(line for line in out.splitlines() if line.strip().startswith(f"{TAG}: stale:"))
    verify, convert = _suggested(stale)
    assert verify == f"megatron-ucp verify {root.resolve()} --tag {TAG}" and convert.endswith("--force"), stale
    assert _run_suggested(verify + " --no-progress") == 0
    assert _run_suggested(convert + " --no-progress") == 0


def test_a_damaged_tag_is_not_called_stale_advice_and_the_restart_answer_follow_the_verdict(root: Path, capsys):
    """A twin whose tag lost the end of a rank file: status says the files changed and suggests verify (not a
    conversion that would fail); verify names the file and records its verdict, after which status calls the tag
    unsound and says a restart cannot resume (no older tag here), and --check exits 1."""
    assert main(["convert", str(root), "--no-progress"]) == 0
    victim = root / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 100)
    capsys.readouterr()
    assert main(["status", str(root), "--no-sizes"]) == 0
    out = capsys.readouterr().out
    stale = next(line for line in out.splitlines() if line.strip().startswith(f"{TAG}: stale:"))
    assert "re-saved, or damaged" in stale and "verify" in _suggested(stale)[0], stale
    assert not any(line.startswith("NOTE:") and "convert" in line for line in out.splitlines()), out
    assert main(["verify", str(root), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert str(victim) in captured.err and "no universal twin" not in captured.err, captured.err
    assert main(["status", str(root), "--check", "--no-sizes"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("megatron-ucp status --check: no tag here can be resumed: ") and str(victim) in err, err
    row = next(line for line in out.splitlines() if line.startswith(TAG))
    assert " unsound " in row, row


@pytest.mark.parametrize("damage", ["cut-short", "nan"])
def test_what_a_conversion_finds_in_the_tags_files_is_its_verdict(root: Path, capsys, damage: str):
    """``convert`` reads every element of the tag: a rank file that lost its end stops it (exit 2, naming the file), a
    NaN in an optimizer state is converted and said; either way what it found is the tag's verdict, so status no
    longer says a restart resumes from it unread (its load would only find the same again), and ``latest_universal``
    is not pointed at the NaN."""
    victim = root / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    if damage == "cut-short":
        with open(victim, "r+b") as fh:
            fh.truncate(victim.stat().st_size - 100)
    else:
        import torch

        states = torch.load(victim, weights_only=False)
        states["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"][0] = float("nan")
        torch.save(states, victim)
    assert main(["status", str(root), "--check", "--no-sizes"]) == 0  # nothing has read it yet
    assert "(not read yet" in capsys.readouterr().err
    assert main(["convert", str(root), "--no-progress"]) == (2 if damage == "cut-short" else 0)
    assert damage == "nan" or str(victim) in capsys.readouterr().err  # the NaN: said in the log, and below
    assert not (root / F.LATEST_UNIVERSAL).exists()
    assert main(["status", str(root), "--check", "--no-sizes"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("megatron-ucp status --check: no tag here can be resumed: ") and str(victim) in err, err
    row = next(line for line in out.splitlines() if line.startswith(TAG))
    assert " unsound " in row and "checked by megatron-ucp convert" in out, out


def test_a_sound_conversion_is_the_tags_verdict(root: Path, capsys):
    assert main(["convert", str(root), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["status", str(root), "--check", "--no-sizes"]) == 0
    assert f"a restart resumes from {TAG} (found sound)" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["empty", "tag", "parent"])
def test_status_of_a_folder_that_is_not_a_checkpoint_root_says_so_and_where_the_root_is(
    root: Path, tmp_path: Path, capsys, where: str
):
    path = {"empty": tmp_path / "empty", "tag": root / TAG, "parent": root.parent}[where]
    path.mkdir(exist_ok=True)
    capsys.readouterr()
    assert main(["status", str(path), "--no-sizes"]) == 1
    err = capsys.readouterr().err
    said = {"empty": "holds no checkpoint", "tag": "is a tag folder", "parent": "checkpoint roots under it: ck"}
    assert err.startswith("megatron-ucp status: ") and said[where] in err, err
    for command in _suggested(err):
        assert _run_suggested(command + " --no-sizes") == 0


def test_status_deep_reads_the_files_and_names_the_damaged_one(root: Path, capsys):
    assert main(["convert", str(root), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["status", str(root), "--deep", "--no-sizes"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{TAG}: native: 5 files read, sound \(\d+ elements finite\); universal: OK:", out), out
    assert "bit-exact" in out, out
    victim = root / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 100)
    assert main(["status", str(root), "--no-sizes"]) == 0
    shallow = capsys.readouterr().out
    assert "no rank file or tensor was read" in shallow  # a shallow "yes" does not claim more than it saw
    assert main(["status", str(root), "--deep", "--no-sizes", "--json"]) == 1
    out = capsys.readouterr().out
    assert str(victim) in out and "zip" in out, out


def test_verify_takes_a_root_a_native_tag_or_a_universal_folder_and_explains_its_counts(root: Path, capsys):
    assert main(["verify", str(root), "--no-progress"]) == 0  # the native tag alone, and what makes its twin
    captured = capsys.readouterr()
    assert captured.out.startswith(f"OK: {root / TAG} is sound: 5 files whole"), captured.out
    (command,) = _suggested(captured.err)
    assert _run_suggested(command + " --no-progress") == 0
    capsys.readouterr()
    for path in (root, root / TAG):
        assert main(["verify", str(path), "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert f"bit-exact against {root / TAG}" in out, out
    assert main(["verify", str(root / f"{TAG}_universal"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    counts = re.search(r"(\d+) params, (\d+) state files \((\d+) tensors, each .*; (\d+) step counters", out)
    assert counts, out
    params, files, tensors, steps = map(int, counts.groups())
    assert files == tensors + steps and steps == params, out  # Adam: fp32, exp_avg, exp_avg_sq and step


def test_inspect_summarises_long_dp_lists_and_lists_them_in_full_when_asked(capsys):
    numels = "6738149376,266240"  # an AuroraGPT-7B's two param groups
    assert main(["inspect", "--group-numels", numels, "--dp", "768"]) == 0
    short = capsys.readouterr().out
    line = next(x for x in short.splitlines() if x.startswith("stock universal loader"))
    assert len(line) < 300 and "--target-dp" in line, line
    assert main(["inspect", "--group-numels", numels, "--dp", "768", "--target-dp", "1-1024"]) == 0
    full = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stock universal loader"))
    assert len(full) > len(line) and "..." not in full
    crashes = int(re.search(r"at (\d+) of 1024 sizes", full)[1])
    listed = full.split("sizes: ", 1)[1].split(";")[0].split(", ")
    sizes = sum(int(b) - int(a) + 1 if "-" in r else 1 for r in listed for a, _, b in [r.partition("-")] if r)
    assert sizes == crashes


def test_each_outcome_is_said_once(tmp_path: Path):
    """As a user sees it (stdout and stderr of the program): the synthesized checkpoint, the pointer moved, the
    job already done, each in one line (the library's log and the CLI's summary used to say them both)."""
    cli = [sys.executable, "-m", "megatron_ucp.cli"]
    ck = str(tmp_path / "ck")
    said = {}
    for name, args in (
        ("synthesize", ["synthesize", ck, *SMALL, "--dp", "2"]),
        ("convert", ["convert", ck]),
        ("again", ["convert", ck]),
    ):
        proc = subprocess.run([*cli, *args, "--no-progress"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        said[name] = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert len([x for x in said["synthesize"] if " files, " in x and " GB in " in x]) == 1, said["synthesize"]
    assert len([x for x in said["convert"] if "latest_universal -> " in x]) == 1, said["convert"]
    assert len([x for x in said["convert"] if x.startswith("converted ")]) == 1, said["convert"]
    assert len(said["again"]) == 1 and "already a complete conversion" in said["again"][0], said["again"]
    # a damaged tag: verify names the file once (its list of problems), then one summary line
    victim = next(Path(ck).glob("global_step*/*zero_pp_rank_1_*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-100])
    proc = subprocess.run([*cli, "verify", ck, "--no-progress"], capture_output=True, text=True)
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if str(victim) in x]
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout + proc.stderr
