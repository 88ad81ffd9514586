"""A committed save's file list (every file's size and zip-directory digest) and the durable small-file write the
commit uses for it and for ``latest``: real torch files, no DeepSpeed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import osio, save_files
from megatron_ucp.format.save_files import describe, file_list_path, file_list_text, read_file_list
from megatron_ucp.format.torch_archive import directory_digest

TAG = "global_step8"
FILES = (
    "mp_rank_00_model_states.pt",
    "layer_01-model_00-model_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
)


def _save(root: Path, save_id: str = "s1") -> Path:
    """A save of three files and its list, as a commit writes it."""
    folder = root / TAG
    folder.mkdir(parents=True)
    for n, name in enumerate(FILES):
        torch.save({"w": torch.arange(100 * (n + 1), dtype=torch.float32)}, folder / name)
    listing = file_list_path(root, TAG)
    listing.parent.mkdir(parents=True)
    osio.write_durably(listing, file_list_text(folder, save_id, [describe(folder / name) for name in FILES]))
    return folder


def test_the_list_names_every_file_with_its_size_and_directory(tmp_path: Path):
    folder = _save(tmp_path)
    listed = read_file_list(tmp_path, TAG)
    assert listed.save_id == "s1" and sorted(f.path for f in listed.files) == sorted(FILES)
    for f in listed.files:
        assert f.bytes == (folder / f.path).stat().st_size and f.directory_sha256 == directory_digest(folder / f.path)
    assert save_files.problems(folder, "s1", deep=True) == []


def test_a_layer_file_missing_cut_short_or_written_over_is_named(tmp_path: Path):
    folder = _save(tmp_path)
    layer, model = folder / FILES[1], folder / FILES[0]
    size = layer.stat().st_size
    with open(layer, "r+b") as fh:
        fh.truncate(size - 10)
    found = save_files.problems(folder, "s1")
    assert found == [f"{layer}: {size - 10} bytes, its save wrote {size} (cut short? the file is not the one saved)"]
    with pytest.raises(CheckpointFormatError, match="cut short") as raised:
        save_files.check(folder, "s1")
    assert Path(raised.value.subject) == layer
    layer.unlink()
    assert save_files.problems(folder, "s1")[0] == f"{layer}: is missing (its save wrote {size} bytes there)"
    # written over with content of the same size: only the zip directory tells (the deep check, as verify runs it)
    torch.save({"w": torch.zeros(100, dtype=torch.float32)}, model)
    assert save_files.problems(folder, "s1") == [f"{layer}: is missing (its save wrote {size} bytes there)"]
    assert f"{model}: its zip directory is not the one its save wrote" in "\n".join(
        save_files.problems(folder, "s1", deep=True)
    )


def test_a_file_the_save_did_not_write_is_named_and_rank_files_are_the_loads_own(tmp_path: Path):
    folder = _save(tmp_path)
    stray = folder / "layer_07-model_00-model_states.pt"
    torch.save({}, stray)
    torch.save({}, folder / "consolidated_fp32.pt")  # the user's own file: no file of a save
    assert save_files.problems(folder, "s1") == [f"{stray}: a checkpoint file its save did not write (another save's?)"]
    (folder / FILES[2]).unlink()  # a rank file: the load's binding names it with what it finds
    assert len(save_files.problems(folder, "s1")) == 2 and len(save_files.problems(folder, "s1", rank_files=False)) == 1


def test_a_list_of_another_save_does_not_apply(tmp_path: Path):
    folder = _save(tmp_path, save_id="earlier")
    (folder / FILES[1]).unlink()
    assert save_files.problems(folder, "later") == [] and save_files.problems(folder, None) == []
    save_files.check(folder, "later")  # a tag saved again without the hooks: not judged by the earlier list


def test_a_durable_write_syncs_the_file_before_its_rename_and_the_folder_after(tmp_path: Path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    target = tmp_path / "latest"
    osio.write_durably(target, "global_step8")
    assert target.read_text() == "global_step8" and [p for p in os.listdir(tmp_path) if p != "latest"] == []
    assert len(synced) == 2 and Path(synced[0]).name.startswith(".latest.tmp-") and synced[1] == str(tmp_path)
