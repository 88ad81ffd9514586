"""``megatron-ucp verify`` on a native tag: is this save sound before anyone resumes from it? Every file whole, one
checkpoint of one save, every partition what a hooked save recorded, every real element of the masters and
optimizer states finite; each problem named by its file (and, for a non-finite value, by parameter and state).

Synthetic saves (megatron_ucp.synthetic, held key for key to real saves elsewhere), damaged here as a diverged
step or a file system would damage them: a NaN written into one rank file's ``exp_avg_sq`` (the file rewritten
by ``torch.save``, so that it is whole and only its values are wrong), one bit flipped in a partition.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_ucp.cli import main
from megatron_ucp.convert.execute import plan_checkpoint
from megatron_ucp.deepspeed.reader import read_checkpoint
from tests.support.elastic_support import flip_a_bit_in_the_largest_record

TAG = "global_step100"
SMALL = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]
STAGES = {"zero1-bf16": ["--optimizer", "bf16"], "zero3": ["--optimizer", "zero", "--zero-stage", "3"]}


def _save(root: Path, stage: str, record: bool) -> Path:
    args = ["synthesize", str(root), *SMALL, "--dp", "4", *STAGES[stage], "--no-progress"]
    assert main([*args, *(["--record"] if record else [])]) == 0
    return root / TAG


def _rank_file(tag: Path, rank: int) -> Path:
    (found,) = tag.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return found


def _group0_state(sd: dict, state: str) -> torch.Tensor:
    """Group 0's ``state`` tensor of a rank file, wherever its stage keeps the wrapped optimizer's state."""
    if isinstance(sd, dict):
        found = sd.get("state", {}).get(0, {}).get(state) if isinstance(sd.get("state"), dict) else None
        if torch.is_tensor(found):
            return found
        for value in sd.values():
            inner = _group0_state(value, state)
            if inner is not None:
                return inner
    return None


def _first_param_on(tag: Path, rank: int) -> tuple[str, int]:
    """The parameter holding the first real element of ``rank``'s partition of group 0, and that element's offset
    (from the conversion plan)."""
    plan = plan_checkpoint(read_checkpoint(tag))
    where = [(item.src_offset, p.name) for p in plan.params if p.group == 0 for item in p.items if item.rank == rank]
    offset, name = min(where)
    return name, offset


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_verify_names_a_nan_by_parameter_state_and_file(tmp_path: Path, capsys, stage: str):
    tag = _save(tmp_path / "ck", stage, record=False)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "ck"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "is sound" in out and "no recorded checksums" in out

    name, offset = _first_param_on(tag, 1)
    culprit = _rank_file(tag, 1)
    sd = torch.load(culprit, weights_only=False)
    target = _group0_state(sd, "exp_avg_sq")
    target[offset] = math.nan
    target[offset + 1] = math.inf
    torch.save(sd, culprit)

    assert main(["verify", str(tmp_path / "ck"), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert f"{culprit}: 1 NaN and 1 Inf in 'exp_avg_sq' of parameter {name!r}" in captured.err
    assert captured.out.startswith(f"FAILED: {tag}: 1 problem(s)")


def test_verify_checks_a_hooked_save_and_its_twin(tmp_path: Path, capsys):
    tag = _save(tmp_path / "ck", "zero1-bf16", record=True)
    assert main(["convert", str(tmp_path / "ck"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "ck"), "--tag", TAG, "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "partitions matching the checksums the save recorded" in lines[0]
    assert lines[1].startswith(f"OK: {tag.parent / (TAG + '_universal')} is bit-exact against {tag}")

    culprit = _rank_file(tag, 2)
    flip_a_bit_in_the_largest_record(culprit)
    assert main(["verify", str(tag), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert str(culprit) in err
