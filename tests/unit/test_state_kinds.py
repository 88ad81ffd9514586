"""Which optimizer states a DP change can carry: one number per element of a partition, or one value per partition.

Read from a real torch file through the reader's raw loader (tensors located, not read), as the binding reads a rank
file's first group states; anything else (8-bit Adam's blockwise ``absmax``, a dict) is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ucp.deepspeed.reader import load_raw
from megatron_ucp.deepspeed.state_kinds import partition_scalars, tensor_states, unplaceable_states


def _states(tmp_path: Path, **extra) -> tuple[list[dict], list, Path]:
    path = tmp_path / "rank_file.pt"
    state = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(8), "mu_product": torch.tensor(0.81), "amsgrad": False}
    torch.save({"masters": [torch.zeros(8)], "state": [{**state, **extra}]}, path)
    raw = load_raw(path)
    return raw["state"], raw["masters"], path


def test_per_element_states_and_per_partition_scalars_are_told_apart(tmp_path: Path) -> None:
    per_group, masters, path = _states(tmp_path)
    assert unplaceable_states(per_group, masters, "param group") == ()
    assert tensor_states(per_group) == [("exp_avg",)]
    assert [name for name, _ in partition_scalars(per_group[0])] == ["amsgrad", "mu_product"]


@pytest.mark.parametrize(
    "extra, said",
    [
        (
            {"absmax1": torch.zeros(1)},
            "'absmax1' of param group 0 is 1 elements beside a partition of 8 (blockwise or per-block state)",
        ),
        (
            {"__bnb_optimizer_quant_state__": {"blocksize": 256}},
            "'__bnb_optimizer_quant_state__' of param group 0 is a dict",
        ),
    ],
)
def test_state_no_copy_can_place_is_refused_by_name(tmp_path: Path, extra: dict, said: str) -> None:
    per_group, masters, path = _states(tmp_path, **extra)
    assert unplaceable_states(per_group, masters, "param group") == (said,)
