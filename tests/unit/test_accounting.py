"""The accounting checksum and report, without DeepSpeed or files (pure, milliseconds)."""

from __future__ import annotations

import logging
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import AccountingError
from megatron_ucp.format.integrity import MASK
from megatron_ucp.plan.accounting import (
    AccountingReport,
    Column,
    Ledger,
    Problem,
    ProblemKind,
    add_sum,
    check_folders,
    check_ledger,
    check_optimizer_states,
    checksum,
    combine,
    group_tensor_states,
    ledger_totals,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]


def _tensor(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    return torch.randint(0, 250, (n,), generator=gen).to(dtype)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 10_000), dtype=st.sampled_from(DTYPES), data=st.data())
def test_fragments_at_any_offsets_sum_to_the_full_checksum(n, seed, dtype, data):
    full = _tensor(seed, n, dtype)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=8))) | {0, n})
    pieces = [checksum(full[a:b], a) for a, b in pairwise(cuts)]
    assert combine(pieces) == checksum(full)
    assert 0 <= checksum(full) <= MASK


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 200), seed=st.integers(0, 10_000), data=st.data())
def test_moving_an_element_changes_the_checksum(n, seed, data):
    full = _tensor(seed, n, torch.float32)
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda k: k != i and not torch.equal(full[k], full[i])))
    swapped = full.clone()
    swapped[i], swapped[j] = full[j], full[i]
    assert checksum(swapped) != checksum(full)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 200), seed=st.integers(0, 10_000))
def test_a_non_trivial_permutation_changes_the_checksum(n, seed):
    full = torch.arange(n, dtype=torch.float32) + 0.5  # distinct values
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if torch.equal(perm, torch.arange(n)):
        perm = perm.roll(1)
    assert checksum(full[perm]) != checksum(full)


def test_zeros_shifted_or_missing_are_seen():
    zeros = torch.zeros(8)
    assert checksum(zeros[:4], 0) + 0 != checksum(zeros[:4], 1)  # position matters even for zeros
    assert combine([checksum(zeros[:4], 0)]) != checksum(zeros)  # a missing fragment is seen
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))  # bits, not values


def test_large_tensor_chunks_and_multidim_views():
    big = torch.randn(3, 1 << 21)  # crosses the internal chunk size
    flat = big.reshape(-1)
    half = flat.numel() // 2 + 7
    assert combine([checksum(flat[:half]), checksum(flat[half:], half)]) == checksum(big)
    assert checksum(big.t().contiguous()) != checksum(big)


def test_every_single_bit_flip_is_seen():
    full = torch.randn(64)
    bits = full.view(torch.int32)
    reference = checksum(full)
    for i in (0, 17, 63):
        for bit in range(32):
            flipped = bits.clone()
            flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
            assert checksum(flipped.view(torch.float32)) != reference, (i, bit)


def test_halves_sum_like_the_values_they_split():
    from megatron_ucp.format.integrity import join, split

    values = [MASK, MASK - 5, 1 << 63, 12345, 0]
    his, los = zip(*(split(v) for v in values))
    assert join(sum(his), sum(los)) == sum(values) & MASK


def test_negative_offset_refused():
    with pytest.raises(AccountingError):
        checksum(torch.ones(2), -1)


GROUPS = [["a.weight", "b.weight"], ["n1.weight", "n2.weight"]]
LISTING = {
    "a.weight": ("exp_avg", "exp_avg_sq", "fp32", "step"),
    "b.weight": ("exp_avg", "exp_avg_sq", "fp32", "step"),
    "n1.weight": ("exp_avg", "exp_avg_sq", "fp32", "step"),
    "n2.weight": ("exp_avg", "exp_avg_sq", "fp32", "step"),
}


def test_complete_folder_has_no_problems():
    assert check_folders(GROUPS, LISTING) == []
    assert group_tensor_states(GROUPS, LISTING) == [("exp_avg", "exp_avg_sq"), ("exp_avg", "exp_avg_sq")]


def test_folder_problems_name_parameter_and_state():
    listing = dict(LISTING)
    listing["b.weight"] = ("exp_avg", "fp32", "step")  # exp_avg_sq.pt deleted
    del listing["n2.weight"]  # parameter without folder
    listing["ghost.weight"] = ("fp32",)  # folder without parameter
    problems = check_folders(GROUPS, listing)
    kinds = {(p.kind, p.param, p.state) for p in problems}
    assert (ProblemKind.MISSING_STATE_FILE, "b.weight", "exp_avg_sq") in kinds
    assert (ProblemKind.MISSING_FOLDER, "n2.weight", None) in kinds
    assert (ProblemKind.EXTRA_FOLDER, "ghost.weight", None) in kinds
    assert len(problems) == 3
    assert "b.weight" in str(next(p for p in problems if p.kind is ProblemKind.MISSING_STATE_FILE))


def test_one_extra_state_file_is_a_stray_not_missing_everywhere_else():
    groups = [["a.weight", "b.weight", "c.weight"]]
    listing = {n: ("exp_avg", "exp_avg_sq", "fp32", "step") for n in groups[0]}
    listing["b.weight"] = listing["b.weight"] + ("momentum_buffer",)
    problems = check_folders(groups, listing)
    assert [(p.kind, p.param, p.state) for p in problems] == [
        (ProblemKind.STRAY_STATE_FILE, "b.weight", "momentum_buffer")
    ]
    assert group_tensor_states(groups, listing) == [("exp_avg", "exp_avg_sq")]


def test_missing_fp32_is_reported_even_when_no_one_has_it():
    listing = {k: tuple(s for s in v if s != "fp32") for k, v in LISTING.items()}
    problems = check_folders(GROUPS, listing)
    assert {p.param for p in problems} == set(LISTING) and {p.state for p in problems} == {"fp32"}


def test_optimizer_states_lazy_and_unused():
    expected = frozenset({"step", "exp_avg", "exp_avg_sq"})
    assert check_optimizer_states(0, ["a"], expected, {"step", "exp_avg", "exp_avg_sq"}, "AdamW") == []
    lazy = check_optimizer_states(1, ["n1", "n2"], expected, {"step", "exp_avg"}, "AdamW")
    assert [(p.kind, p.param, p.state) for p in lazy] == [(ProblemKind.NOT_RESTORED, "n1", "exp_avg_sq")]
    assert "lazily" in lazy[0].detail and "AdamW" in lazy[0].detail
    unused = check_optimizer_states(0, ["a"], expected, expected | {"momentum_buffer"}, "AdamW")
    assert [(p.kind, p.state) for p in unused] == [(ProblemKind.UNUSED_STATE, "momentum_buffer")]
    assert check_optimizer_states(0, ["a"], None, {"anything"}, "Mystery") == []


def _table(ledger: Ledger, full: dict[str, torch.Tensor], pieces: dict[str, list[tuple[int, int]]]) -> torch.Tensor:
    """Simulate the all-reduced table: each piece is one rank's fragment (start, length) of every state."""
    table = ledger.new_table()
    for param, state in ledger.rows:
        row = ledger.index(param, state)
        if state == "step":
            table[row, Column.CONSUMERS] = len(pieces[param])
            continue
        tensor = full[param]
        for start, length in pieces[param]:
            table[row, Column.CONSUMERS] += 1
            table[row, Column.LOADED_COUNT] += length
            add_sum(table, row, True, checksum(tensor[start : start + length], start))
        table[row, Column.SOURCE_COUNT] = tensor.numel()
        add_sum(table, row, False, checksum(tensor))
    return table


def test_ledger_accepts_an_exact_cover_and_reports_gaps_overlaps_and_strays():
    listing = {"w": ("exp_avg", "fp32", "step"), "n": ("exp_avg", "fp32", "step")}
    ledger = Ledger.from_listing(listing)
    full = {"w": torch.randn(10), "n": torch.randn(9)}
    good = _table(ledger, full, {"w": [(0, 4), (4, 6)], "n": [(0, 4), (4, 4), (8, 1)]})
    assert check_ledger(ledger, good) == []
    assert ledger_totals(ledger, good) == (2, 4, 38, ("fp32", "exp_avg", "step"))

    gap = _table(ledger, full, {"w": [(0, 4), (5, 5)], "n": [(0, 9)]})
    assert {(p.kind, p.param) for p in check_ledger(ledger, gap)} == {(ProblemKind.COUNT_MISMATCH, "w")}

    overlap = _table(ledger, full, {"w": [(0, 5), (4, 6)], "n": [(0, 9)]})
    assert {p.kind for p in check_ledger(ledger, overlap)} == {ProblemKind.COUNT_MISMATCH}

    shifted = good.clone()
    row = ledger.index("n", "fp32")
    shifted[row, Column.LOADED_SUM_HI] = shifted[row, Column.LOADED_SUM_LO] = 0
    add_sum(shifted, row, True, checksum(full["n"][0:8], 0))
    add_sum(shifted, row, True, checksum(full["n"][0:1], 8))
    assert [(p.kind, p.param, p.state) for p in check_ledger(ledger, shifted)] == [
        (ProblemKind.CHECKSUM_MISMATCH, "n", "fp32")
    ]

    unread = good.clone()
    unread[ledger.index("w", "exp_avg")] = 0
    unread[ledger.index("w", "step"), Column.STEP_MISMATCH] = 1
    found = {(p.kind, p.param, p.state) for p in check_ledger(ledger, unread)}
    assert found == {(ProblemKind.UNCONSUMED, "w", "exp_avg"), (ProblemKind.STEP_MISMATCH, "w", "step")}


def test_report_raises_in_strict_mode_and_warns_otherwise(caplog):
    problem = Problem(
        ProblemKind.MISSING_STATE_FILE, "b.weight", "exp_avg_sq", "zero/b.weight/exp_avg_sq.pt is missing"
    )
    report = AccountingReport(4, 12, ("fp32", "exp_avg", "exp_avg_sq", "step"), 100, 4, 2, (problem,))
    with pytest.raises(AccountingError) as info:
        report.enforce(strict=True, logger=logging.getLogger("t"))
    assert "b.weight" in str(info.value) and "exp_avg_sq" in str(info.value)
    assert info.value.subject == [problem]
    with caplog.at_level(logging.INFO, logger="t"):
        report.enforce(strict=False, logger=logging.getLogger("t"))
    assert any("exp_avg_sq" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    summary = [r.message for r in caplog.records if r.levelno == logging.INFO]
    assert len(summary) == 1 and "4 params" in summary[0] and "DP 4 -> 2" in summary[0]

    ok = AccountingReport(4, 12, ("fp32",), 100, None, 2).with_more(extras=["lr scheduler restored"], dp_from=3)
    assert "DP 3 -> 2" in ok.summary_line() and "exactly once" in ok.summary_line()
    assert ok.summary_line().endswith("lr scheduler restored")


def test_a_refusal_caused_by_the_command_line_does_not_blame_the_checkpoint():
    from megatron_ucp.plan.accounting import AccountingReport, Problem, ProblemKind

    flagged = Problem(ProblemKind.COMMAND_LINE, None, "lr_scheduler", "this run's schedule is not the checkpoint's")
    lost = Problem(ProblemKind.TRAINING_STATE, None, "lr_scheduler", "not restored: num_steps")
    report = AccountingReport(1, 1, ("fp32",), 10, 4, 3)
    with pytest.raises(AccountingError) as only_flags:
        report.with_more(problems=[flagged]).enforce(True, logging.getLogger("t"))
    assert "not at fault" in str(only_flags.value) and "reconvert" not in str(only_flags.value)
    with pytest.raises(AccountingError) as both:
        report.with_more(problems=[flagged, lost]).enforce(True, logging.getLogger("t"))
    assert "Fix or reconvert the checkpoint" in str(both.value)
