"""A conversion checks what a save made through the hooks recorded before it writes anything: the universal
route, the background converter and ``megatron-ucp convert`` refuse, naming the file, what the native routes
refuse at load (a flipped bit in a partition, a rank file of another save, at ZeRO-3 a rank's model states of
another save).

Synthetic saves with the hooks' record (megatron_ucp.synthetic, held key for key to real saves elsewhere); the
damage is made here with the zip format alone: one bit flipped inside the largest tensor record of a rank file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_ucp.cli import main
from megatron_ucp.format import dsformat as F
from tests.support.elastic_support import flip_a_bit_in_the_largest_record

TAG = "global_step100"
SMALL = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]
STAGES = {"zero1-bf16": ["--optimizer", "bf16"], "zero3": ["--optimizer", "zero", "--zero-stage", "3"]}


def _save(root: Path, stage: str, seed: int = 0) -> Path:
    args = ["synthesize", str(root), *SMALL, "--dp", "4", *STAGES[stage], "--record", "--seed", str(seed)]
    assert main([*args, "--no-progress"]) == 0
    return root / TAG


def _rank_file(tag: Path, rank: int) -> Path:
    (found,) = tag.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return found


CASES = [(stage, damage) for stage in sorted(STAGES) for damage in ("flipped-bit", "rank-file-of-another-save")] + [
    ("zero3", "model-states-of-another-save")
]  # only ZeRO-3 saves a model-states file per rank


@pytest.mark.parametrize("stage,damage", CASES)
def test_a_conversion_refuses_what_the_save_did_not_record(tmp_path: Path, capsys, stage: str, damage: str):
    tag = _save(tmp_path / "ck", stage)
    other = _save(tmp_path / "other", stage, seed=7)
    if damage == "flipped-bit":
        culprit = _rank_file(tag, 2)
        flip_a_bit_in_the_largest_record(culprit)
        said = "differs from the checksum its save recorded"
    elif damage == "rank-file-of-another-save":
        culprit = _rank_file(tag, 1)
        shutil.copy2(_rank_file(other, 1), culprit)
        said = "from another save"
    else:
        culprit = tag / F.zero3_model_file(2, 0)
        shutil.copy2(other / F.zero3_model_file(2, 0), culprit)
        said = "of another save"
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "ck"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(culprit) in err and said in err and "nothing was written" in err, err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if "universal" in p.name) == []


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_sound_save_converts_and_says_what_it_checked(tmp_path: Path, caplog, stage: str):
    _save(tmp_path / "ck", stage)
    with caplog.at_level("INFO", logger="megatron_ucp.convert.execute"):
        assert main(["convert", str(tmp_path / "ck"), "--no-progress"]) == 0
    # 4 rank files x 2 groups (ZeRO-1/2) or 3 sub-groups x ... : every recorded partition, each state
    checked = [r.getMessage() for r in caplog.records if "match the checksums the save recorded" in r.getMessage()]
    assert len(checked) == 1 and int(checked[0].split(": ")[1].split()[0]) >= 4 * 3, checked
