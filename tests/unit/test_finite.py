"""NaN and Inf counted in fragments of every floating dtype a save holds (bf16 by its bits), nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_ucp.convert.finite import FiniteCheck, non_finite_counts
from megatron_ucp.plan.conversion import CopyItem


def _fragment(values: np.ndarray, dtype: str):
    return SimpleNamespace(dtype=SimpleNamespace(name=dtype), bytes_view=lambda: memoryview(values.tobytes()))


def _bf16(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_counts_nan_and_inf_apart(dtype: str):
    values = np.array([1.0, np.nan, -np.inf, 0.0, np.inf, -np.nan, 3.5], dtype=np.float64)
    raw = _bf16(values) if dtype == "bfloat16" else values.astype(dtype)
    assert non_finite_counts(_fragment(raw, dtype)) == (2, 2)
    assert non_finite_counts(_fragment(raw[[0, 3, 6]], dtype)) == (0, 0)


def test_integers_are_not_judged():
    assert non_finite_counts(_fragment(np.array([-1, 2**31 - 1], dtype=np.int32), "int32")) == (0, 0)


def test_findings_are_named_and_merge_across_shares():
    p = SimpleNamespace(name="w")
    items = [
        CopyItem(rank=1, src_offset=0, dst_offset=0, length=2),
        CopyItem(rank=0, src_offset=2, dst_offset=2, length=1),
    ]
    fragments = [
        _fragment(np.array([np.nan, 1.0], np.float32), "float32"),
        _fragment(np.array([np.inf], np.float32), "float32"),
    ]
    one = FiniteCheck(["r0.pt", "r1.pt"])
    one.add(p, "exp_avg", items, fragments)
    assert one.elements == 3
    assert one.problems() == [
        "r0.pt: 0 NaN and 1 Inf in 'exp_avg' of parameter 'w'",
        "r1.pt: 1 NaN and 0 Inf in 'exp_avg' of parameter 'w'",
    ]
    merged = FiniteCheck(["r0.pt", "r1.pt"]).merge([one.to_record(), None, one.to_record()])
    assert merged.problems()[1] == "r1.pt: 2 NaN and 0 Inf in 'exp_avg' of parameter 'w'"
