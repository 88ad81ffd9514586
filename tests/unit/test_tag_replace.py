"""An earlier save of a tag being saved again: moved aside whole, removed once the new save commits, put back when
it fails, and what a killed process left aside settled at the next start (real files, no DeepSpeed: the save around
it is tests/system/test_fallback.py's sequence and tests/system/test_save_faults.py's)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from megatron_ucp.background import set_aside as commit
from megatron_ucp.background.set_aside import COMMITS_DIR, REPLACED_DIR, leftovers, mark_committed, recover, set_aside
from megatron_ucp.background.store import ucp_dir
from megatron_ucp.background.verdicts import VERDICTS_DIR
from megatron_ucp.format.save_files import file_list_path

TAG = "global_step20"


def _earlier_save(root: Path) -> dict[str, bytes]:
    """A DP-4 save of TAG with its twin, export and verdict: path (relative to root) -> bytes."""
    files = {f"{TAG}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt": bytes([r]) * 8 for r in range(4)}
    files[f"{TAG}/mp_rank_00_model_states.pt"] = b"model"
    files[f"{TAG}_universal/zero/w/fp32.pt"] = b"twin"
    files[f"{TAG}_hf/config.json"] = b"{}"
    files[f".ucp/{VERDICTS_DIR}/{TAG}.json"] = b'{"sound": false}'
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_failed_save_puts_the_earlier_one_back_and_removes_its_own_files(tmp_path: Path):
    earlier = _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    assert aside is not None and aside.folder.parent == ucp_dir(tmp_path) / REPLACED_DIR
    assert not (tmp_path / TAG).exists() and not (tmp_path / f"{TAG}_universal").exists()
    assert not (tmp_path / f"{TAG}_hf").exists() and not (ucp_dir(tmp_path) / VERDICTS_DIR / f"{TAG}.json").exists()
    # the new save (DP 3) writes part of its files and its file list, then fails
    _partial_new_save(tmp_path)
    file_list_path(tmp_path, TAG).parent.mkdir(parents=True, exist_ok=True)
    file_list_path(tmp_path, TAG).write_text("{}")
    aside.put_back().join(timeout=30)
    assert _tree(tmp_path) == earlier  # the failed save's files and its list gone with the set-aside folder
    assert not list((ucp_dir(tmp_path) / REPLACED_DIR).iterdir())


def test_a_committed_save_removes_the_earlier_one(tmp_path: Path):
    _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG)
    (tmp_path / TAG).mkdir()
    (tmp_path / TAG / "mp_rank_00_model_states.pt").write_bytes(b"new")
    aside.drop().join(timeout=30)
    assert not aside.folder.exists()
    assert _tree(tmp_path) == {f"{TAG}/mp_rank_00_model_states.pt": b"new"}


def test_only_a_folder_holding_a_save_is_moved(tmp_path: Path):
    assert set_aside(tmp_path, TAG) is None  # no folder
    (tmp_path / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").mkdir(parents=True)  # a directory: no file
    assert set_aside(tmp_path, TAG) is None and (tmp_path / TAG).is_dir()


def test_latest_universal_goes_aside_with_the_twin_it_names_and_comes_back_with_it(tmp_path: Path):
    """A pointer left naming a twin moved aside would send a universal load to a folder that is not there; moved with
    it, a universal load of the new save converts it first, and a failed save puts the pointer back with its twin."""
    earlier = _earlier_save(tmp_path)
    earlier["latest_universal"] = f"{TAG}_universal".encode()
    (tmp_path / "latest_universal").write_bytes(earlier["latest_universal"])
    aside = set_aside(tmp_path, TAG)
    assert not (tmp_path / "latest_universal").exists()
    aside.put_back().join(timeout=30)
    assert _tree(tmp_path) == earlier
    aside = set_aside(tmp_path, TAG)
    aside.drop().join(timeout=30)
    assert _tree(tmp_path) == {}


def test_a_latest_universal_naming_another_twin_stays(tmp_path: Path):
    _earlier_save(tmp_path)
    (tmp_path / "latest_universal").write_text("global_step30_universal")  # a newer tag's twin
    set_aside(tmp_path, TAG).drop().join(timeout=30)
    assert _tree(tmp_path) == {"latest_universal": b"global_step30_universal"}


def test_a_refusal_naming_the_tag_folder_is_its_verdict_unless_its_files_changed_while_read(tmp_path: Path):
    """A conversion refused for the tag as a whole (its files not what the save recorded) judges it; a refusal after
    the files changed under the read (the tag saved again) says nothing of the new files."""
    from megatron_ucp.background.verdicts import read_verdict, record_refusal, tag_identity
    from megatron_ucp.errors import CheckpointFormatError

    _earlier_save(tmp_path)
    tag_dir = tmp_path / TAG
    read = tag_identity(tag_dir)
    refused = CheckpointFormatError(
        f"cannot convert {tag_dir}: its files are not what the save recorded", subject=tag_dir
    )
    assert record_refusal(tmp_path, TAG, refused, "a test", read) is not None
    assert not read_verdict(tmp_path, TAG).sound
    (tmp_path / ".ucp" / VERDICTS_DIR / f"{TAG}.json").unlink()
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"saved again")
    assert record_refusal(tmp_path, TAG, refused, "a test", read) is None and read_verdict(tmp_path, TAG) is None
    elsewhere = CheckpointFormatError("the output's disk is full", subject=tmp_path / f"{TAG}_universal")
    assert record_refusal(tmp_path, TAG, elsewhere, "a test", tag_identity(tag_dir)) is None


def _partial_new_save(root: Path, save_id: str = "new-save") -> None:
    """What a new save (DP 3) of TAG wrote before it stopped: its model states (its identity) and one rank file."""
    (root / TAG).mkdir(exist_ok=True)
    torch.save({"ucp_save_record": {"version": 1, "save_id": save_id}}, root / TAG / "mp_rank_00_model_states.pt")
    (root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"new")


def _settled(root: Path) -> list[str]:
    commit._RECOVERED.clear()
    commit._OPEN.clear()  # a new process: nothing of its own is open
    said = recover(root)
    for thread in list(__import__("threading").enumerate()):
        if thread.name != "MainThread" and thread.is_alive() and thread.daemon is False:
            thread.join(timeout=30)
    return said


def test_a_save_killed_before_its_commit_gets_the_earlier_save_back_at_the_next_start(tmp_path: Path):
    earlier = _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    _partial_new_save(tmp_path)
    (_, folder, fate) = leftovers(tmp_path)[0]
    assert folder == aside.folder and "did not commit" in fate and "puts this back" in fate
    said = _settled(tmp_path)
    assert said == [f"{TAG}: a save of it was interrupted before it committed; the earlier save of it is back"]
    assert _tree(tmp_path) == earlier and leftovers(tmp_path) == []


def test_a_kill_during_the_set_aside_itself_leaves_one_save_at_the_next_start(tmp_path: Path, monkeypatch):
    """Killed after the tag folder moved aside, before its twin and verdict followed: the new save then writes beside
    the old twin; the next start puts the folder back, and the twin and verdict (never moved) stay with it."""
    earlier = _earlier_save(tmp_path)
    real = commit.os.replace

    def killed_after_one(src, dst):
        if Path(src) == tmp_path / f"{TAG}_universal":
            raise KeyboardInterrupt  # stands for the kill: nothing after it runs
        return real(src, dst)

    monkeypatch.setattr(commit.os, "replace", killed_after_one)
    monkeypatch.setattr(commit.SetAside, "put_back", lambda self: None)  # a killed process puts nothing back
    try:
        set_aside(tmp_path, TAG, "new-save")
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    _partial_new_save(tmp_path)
    assert (tmp_path / f"{TAG}_universal").exists()  # the old twin beside the new partial save
    _settled(tmp_path)
    assert _tree(tmp_path) == earlier


def test_a_save_killed_after_its_commit_was_marked_is_completed_at_the_next_start(tmp_path: Path):
    _earlier_save(tmp_path)
    (tmp_path / "latest").write_text("global_step10")
    aside = set_aside(tmp_path, TAG, "new-save")
    _partial_new_save(tmp_path)
    mark_committed(tmp_path, TAG, "new-save", [commit.Pointer(tmp_path / "latest", TAG)], aside)  # then killed
    assert [fate for _, _, fate in leftovers(tmp_path)] == [
        "a commit cut short; the next start writes its pointers (latest, the tracker)",
        "its replacing save committed; the next start removes the earlier save",
    ]
    said = _settled(tmp_path)
    assert said == [f"{TAG}: its commit was cut short; its pointers are written"]
    assert (tmp_path / "latest").read_text() == TAG
    assert not (tmp_path / f"{TAG}_universal").exists()  # the earlier save's twin went with it
    assert (tmp_path / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == b"new"
    assert leftovers(tmp_path) == []


def test_a_marked_commit_never_moves_latest_back(tmp_path: Path):
    _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    _partial_new_save(tmp_path)
    mark_committed(tmp_path, TAG, "new-save", [commit.Pointer(tmp_path / "latest", TAG)], aside)
    (tmp_path / "latest").write_text("global_step30")  # a later save committed since
    _settled(tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step30"


def test_a_set_aside_save_is_not_put_back_over_a_save_made_since(tmp_path: Path):
    """A process that did not settle the folder (an older release) saved the tag again since: the earlier save is no
    longer needed; the save there now stays."""
    _earlier_save(tmp_path)
    set_aside(tmp_path, TAG, "killed-save")
    _partial_new_save(tmp_path, save_id="a-later-save")
    said = _settled(tmp_path)
    assert said and "saved again since" in said[0]
    assert (tmp_path / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == b"new"
    assert not (tmp_path / f"{TAG}_universal").exists() and leftovers(tmp_path) == []


def test_a_put_back_cut_short_is_finished_at_the_next_start(tmp_path: Path, monkeypatch):
    earlier = _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    _partial_new_save(tmp_path)
    real = commit.os.replace
    calls = []

    def killed_on_the_third(src, dst):
        calls.append(src)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(commit.os, "replace", killed_on_the_third)
    try:
        aside.put_back()
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(commit.os, "replace", real)
    _settled(tmp_path)
    assert _tree(tmp_path) == earlier


def test_what_an_earlier_release_set_aside_is_named_and_left(tmp_path: Path):
    old = ucp_dir(tmp_path) / REPLACED_DIR / f"{TAG}.20261201-101010.4242.abcd1234"
    (old / TAG).mkdir(parents=True)
    (old / TAG / "mp_rank_00_model_states.pt").write_bytes(b"old")
    [(tag, folder, fate)] = leftovers(tmp_path)
    assert (tag, folder) == (TAG, old) and "earlier release" in fate
    assert _settled(tmp_path) == [] and (old / TAG / "mp_rank_00_model_states.pt").exists()
    (old / "failed-save").mkdir()  # an earlier release's put-back: its failed save kept, nothing left to do
    _settled(tmp_path)
    assert not old.exists()


def test_the_aside_record_names_the_tag_and_the_save_replacing_it(tmp_path: Path):
    _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    record = json.loads((aside.folder / "aside.json").read_text())
    assert record["tag"] == TAG and record["save_id"] == "new-save" and TAG in record["moved"]
    assert not (ucp_dir(tmp_path) / COMMITS_DIR).exists()


def test_a_new_tag_killed_between_its_tracker_and_latest_gets_latest_at_the_next_start(tmp_path: Path):
    """No earlier save to set aside: the commit's record alone makes latest and Megatron's tracker agree again."""
    (tmp_path / TAG).mkdir()
    (tmp_path / "latest").write_text("global_step10")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")  # renamed before the kill; latest was not
    pointers = [
        commit.Pointer(tmp_path / "latest_checkpointed_iteration.txt", "20"),
        commit.Pointer(tmp_path / "latest", TAG),
    ]
    mark_committed(tmp_path, TAG, "new-save", pointers, None)
    assert "cut short" in leftovers(tmp_path)[0][2]
    _settled(tmp_path)
    assert (tmp_path / "latest").read_text() == TAG and leftovers(tmp_path) == []


def test_a_set_aside_of_a_live_save_on_another_host_is_left_alone(tmp_path: Path):
    """Another job (an evaluation loading from a training's folder) must not put back what a live save set aside:
    its record, touched within the last seconds by a process on another host, is left, and named."""
    earlier = _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    _partial_new_save(tmp_path)
    record = json.loads((aside.folder / "aside.json").read_text())
    (aside.folder / "aside.json").write_text(json.dumps({**record, "host": "another-node", "pid": 4242}))
    assert _settled(tmp_path) == [] and aside.folder.is_dir()
    assert "in progress (host another-node, pid 4242)" in leftovers(tmp_path)[0][2]
    old = time.time() - 3600  # its heartbeat stopped an hour ago: the save is dead, settled
    os.utime(aside.folder / "aside.json", (old, old))
    assert "the earlier save of it is back" in _settled(tmp_path)[0] and _tree(tmp_path) == earlier


def test_a_commit_whose_pointers_cannot_be_written_never_gets_its_earlier_save_back(tmp_path: Path):
    _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG, "new-save")
    _partial_new_save(tmp_path)
    nowhere = tmp_path / "no-such-folder" / "latest"
    mark_committed(tmp_path, TAG, "new-save", [commit.Pointer(nowhere, TAG)], aside)
    said = _settled(tmp_path)
    assert said and "cannot complete the commit" in said[0] and aside.folder.is_dir()
    assert (tmp_path / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == b"new"
    nowhere.parent.mkdir()
    _settled(tmp_path)  # the next start writes it, then removes the earlier save
    assert nowhere.read_text() == TAG and not aside.folder.exists() and leftovers(tmp_path) == []
