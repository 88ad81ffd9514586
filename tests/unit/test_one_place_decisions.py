"""Decisions the package makes in one place, asked by every caller: a file's model-parallel rank from its name, and
strictness (raise, or warn on the rank that speaks). Pure, milliseconds."""

from __future__ import annotations

import logging

import pytest

from megatron_ucp.errors import CheckpointFormatError, refuse_or_warn
from megatron_ucp.format import dsformat as F


@pytest.mark.parametrize(
    ("name", "mp"),
    [
        ("bf16_zero_pp_rank_3_mp_rank_07_optim_states.pt", 7),
        ("zero_pp_rank_12_mp_rank_02_optim_states.pt", 2),
        ("mp_rank_05_model_states.pt", 5),
        ("mp_rank_01_003_model_states.pt", 1),  # a pipeline save's (TP rank, stage)
        (F.zero3_model_file(9, 4), 4),
        ("layer_01-model_00-model_states.pt", 0),  # a pipeline layer file: not a rank's file
        ("latest", 0),
    ],
)
def test_the_model_parallel_rank_of_a_file_is_read_from_its_name(name: str, mp: int) -> None:
    assert F.mp_rank_of(name) == mp


def test_strict_raises_the_error_and_lax_warns_each_line_once_where_it_is_said(caplog) -> None:
    log = logging.getLogger("t.strict")
    error = CheckpointFormatError("f: bad", subject="f")
    with pytest.raises(CheckpointFormatError, match="f: bad"):
        refuse_or_warn(True, error, ["one", "two"], log, say=True)
    with caplog.at_level(logging.WARNING, logger="t.strict"):
        refuse_or_warn(False, error, ["one", "two"], log, say=False)  # another rank: silent
        assert caplog.records == []
        refuse_or_warn(False, error, ["one", "two"], log, say=True, then="the fp32 masters win")
    assert [r.getMessage() for r in caplog.records] == [
        "megatron-ucp (strict=False, the fp32 masters win): one",
        "megatron-ucp (strict=False, the fp32 masters win): two",
    ]
