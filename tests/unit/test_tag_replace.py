"""An earlier save of a tag being saved again: moved aside whole, removed once the new save commits, put back when
it fails (real files, no DeepSpeed: the save around it is tests/system/test_fallback.py's sequence)."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.background.store import ucp_dir
from megatron_ucp.background.verdicts import VERDICTS_DIR
from megatron_ucp.integration.save.commit import REPLACED_DIR, set_aside

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


def test_a_failed_save_puts_the_earlier_one_back_and_keeps_its_own_files_aside(tmp_path: Path):
    earlier = _earlier_save(tmp_path)
    aside = set_aside(tmp_path, TAG)
    assert aside is not None and aside.folder.parent == ucp_dir(tmp_path) / REPLACED_DIR
    assert not (tmp_path / TAG).exists() and not (tmp_path / f"{TAG}_universal").exists()
    assert not (tmp_path / f"{TAG}_hf").exists() and not (ucp_dir(tmp_path) / VERDICTS_DIR / f"{TAG}.json").exists()
    # the new save (DP 3) writes part of its files, then fails
    (tmp_path / TAG).mkdir()
    (tmp_path / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"new")
    aside.put_back()
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if REPLACED_DIR not in k} == earlier
    kept = [k for k in after if REPLACED_DIR in k]
    assert kept == [
        str((aside.folder / "failed-save" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").relative_to(tmp_path))
    ]


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
    aside.put_back()
    assert {k: v for k, v in _tree(tmp_path).items() if REPLACED_DIR not in k} == earlier
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
