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


LAYOUTS = {
    "zero1-bf16": STAGES["zero1-bf16"],
    "zero3": STAGES["zero3"],
    "zero1-tp2-pp2-tied": [*STAGES["zero1-bf16"], "--tp", "2", "--pp", "2", "--tied"],  # replicated, tied copies
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_sound_save_is_checked_as_it_is_written(tmp_path: Path, caplog, layout: str):
    """Every recorded partition matches, summed from what the writers and the replica comparison read: none
    is hashed whole (one read of the files), in one converter and in two shares of one conversion."""
    args = ["synthesize", str(tmp_path / "ck"), *SMALL, "--dp", "4", *LAYOUTS[layout], "--record", "--no-progress"]
    assert main(args) == 0
    runs = [[], ["--share", "0/2", "--attempt-id", "a"], ["--share", "1/2", "--attempt-id", "a"]]
    for n, extra in enumerate(runs):
        output = tmp_path / ("one" if n == 0 else "shared")
        caplog.clear()
        with caplog.at_level("INFO", logger="megatron_ucp.convert.execute"):
            assert main(["convert", str(tmp_path / "ck"), "--output", str(output), "--no-progress", *extra]) == 0
        said = [r.getMessage() for r in caplog.records if "match the checksums the save recorded" in r.getMessage()]
        if n == 1:  # the first share leaves the commit (and the check) to the last
            assert said == [], said
            continue
        # 4 rank files per coordinate, 2 groups (ZeRO-1/2) or the sub-groups (ZeRO-3), 3 states each
        assert len(said) == 1 and int(said[0].split(": ")[1].split()[0]) >= 4 * 3, said
        assert "(0 hashed whole," in said[0], said
