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


def _first_param_on(tag: Path, rank: int, stage: str) -> tuple[str, int]:
    """The parameter holding the first real element of ``rank``'s partition of group 0, and that element's offset in
    the partition, from what DeepSpeed wrote and its partitioning rule alone (not the project's reader or planner):
    the parameter shapes of group 0 in order (``param_shapes``) and, at ZeRO-1/2, the partition size (the flat group
    cut into equal partitions); at ZeRO-3 each parameter cut on its own into ``ceil(n / 4)`` per rank."""
    (states_file, *_) = sorted(tag.glob("*model_states.pt"))
    numels = [
        (name, math.prod(shape))
        for name, shape in torch.load(states_file, weights_only=False)["param_shapes"][0].items()
    ]
    if stage == "zero3":
        offset = 0
        for name, n in numels:
            share = -(-n // 4)
            if n > share * rank:
                return name, offset
            offset += share
        raise AssertionError(f"rank {rank} holds no real element of group 0")
    position = _group0_state(torch.load(_rank_file(tag, rank), weights_only=False), "exp_avg_sq").numel() * rank
    for name, n in numels:
        if position < n:
            return name, 0
        position -= n
    raise AssertionError(f"rank {rank} holds no real element of group 0")


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_verify_names_a_nan_by_parameter_state_and_file(tmp_path: Path, capsys, stage: str):
    tag = _save(tmp_path / "ck", stage, record=False)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "ck"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "is sound" in out and "no recorded checksums" in out

    name, offset = _first_param_on(tag, 1, stage)
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


def _nan_in_exp_avg_sq(tag: Path, rank: int, stage: str = "zero1-bf16") -> tuple[Path, str]:
    """One NaN at the first real element of ``rank``'s ``exp_avg_sq`` (the file rewritten whole by torch.save)."""
    name, offset = _first_param_on(tag, rank, stage)
    culprit = _rank_file(tag, rank)
    sd = torch.load(culprit, weights_only=False)
    _group0_state(sd, "exp_avg_sq")[offset] = math.nan
    torch.save(sd, culprit)
    return culprit, name


def _background_verdict(root: Path) -> None:
    from megatron_ucp.background.store import ConverterSettings
    from megatron_ucp.background.trigger import trigger, wait_for_converter

    assert trigger(root, TAG, 0, 1, ConverterSettings(workers=1)).spawned
    assert wait_for_converter(root, 0, timeout=120)


def _row(root: Path):
    from megatron_ucp.background.status import root_status

    (row,) = [t for t in root_status(root, sizes=False).tags if t.tag == TAG]
    return row


def test_every_save_is_judged_in_the_background_and_status_shows_the_verdict(tmp_path: Path, capsys):
    """The background conversion's own read is the tag's verdict (one read of the files): a NaN in a master or
    state makes it unsound (converted, named, ``latest_universal`` left where it was), a sound save sound; a
    verdict on files rewritten since is outdated; ``megatron-ucp verify`` records its verdict in the same store."""
    from megatron_ucp.background.verdicts import read_verdict

    nan_root, sound_root = tmp_path / "nan", tmp_path / "sound"
    culprit, name = _nan_in_exp_avg_sq(_save(nan_root, "zero1-bf16", record=False), 1)
    tag = _save(sound_root, "zero1-bf16", record=True)
    for root in (nan_root, sound_root):
        _background_verdict(root)

    verdict = read_verdict(nan_root, TAG)
    assert verdict is not None and not verdict.sound and verdict.checked_by == "background conversion"
    assert verdict.problems == (f"{culprit}: 1 NaN and 0 Inf in 'exp_avg_sq' of parameter {name!r}",), verdict
    assert (nan_root / f"{TAG}_universal").is_dir() and not (nan_root / "latest_universal").exists()
    assert _row(nan_root).verified == "unsound" and str(culprit) in _row(nan_root).verdict

    assert read_verdict(sound_root, TAG).sound and _row(sound_root).verified == "sound"
    assert (sound_root / "latest_universal").read_text().strip() == f"{TAG}_universal"
    damaged = _rank_file(tag, 2)
    flip_a_bit_in_the_largest_record(damaged)
    assert _row(sound_root).verified == "outdated"  # judged before the file changed
    _background_verdict(sound_root)  # the next conversion of the tag refuses it, and the verdict says why
    row = _row(sound_root)
    assert row.verified == "unsound" and "differs from the checksum its save recorded" in row.verdict, row
    assert "background conversion" in row.verdict and str(damaged) in row.verdict
    capsys.readouterr()
    assert main(["verify", str(tag), "--no-progress"]) == 1
    row = _row(sound_root)
    assert row.verified == "unsound" and str(damaged) in row.verdict and "megatron-ucp verify" in row.verdict
    capsys.readouterr()
    assert main(["status", str(sound_root), "--no-sizes"]) == 0
    out = capsys.readouterr().out
    assert f"{TAG}: unsound: " in out and "verified" in out.splitlines()[1]
